"""Untrusted safetensors files: header parsing with full validation, and per-tensor reads.

The header is parsed here, with what a reader of files from the internet needs before touching data:
a bounded header length (checked against the file's real size before it is read), strict UTF-8 JSON
without duplicate keys, known dtypes, integer shapes whose byte size is computed with an early stop (a
shape like ``[2**40, 2**40]`` is rejected, never multiplied out or allocated), offsets inside the file,
sizes consistent with dtype x shape, no overlaps. Tensors are then read one at a time with plain file
reads, so memory is bounded by the largest tensor, never by the file. Messages quote names and values
shortened, so a hostile header cannot produce a huge or multi-line error.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..errors import RepackError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
COPY_CHUNK = 4 << 20  # large enough for full-speed reads and hashing, small enough to keep in flight on every thread


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype, shape and absolute byte range."""

    file: Path
    name: str
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
HEADER_KEYS = {"dtype", "shape", "data_offsets"}


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: hostile names and shapes stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _bounded_nbytes(shape: tuple[int, ...], itemsize: int, limit: int) -> int | None:
    """``numel(shape) * itemsize``, or None as soon as it exceeds ``limit`` (no huge products computed)."""
    if 0 in shape:
        return 0
    total = itemsize
    for dim in shape:
        total *= dim
        if total > limit:
            return None
    return total


def _raw_header(file: Path) -> tuple[int, int, object]:
    """(file size, header length, decoded header JSON); the length is bounded before anything is read."""
    try:
        with open(file, "rb") as handle:
            size = file.stat().st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise RepackError(f"{file.name}: not a valid safetensors file ({size} bytes, too small for a header)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:
                raise RepackError(
                    f"{file.name}: not a valid safetensors file (header length {header_len} bytes exceeds the "
                    f"{MAX_HEADER_BYTES}-byte limit)"
                )
            if 8 + header_len > size:
                raise RepackError(
                    f"{file.name}: header length {header_len} bytes runs past the end of the file ({size} bytes); "
                    "the file is truncated or corrupt"
                )
            raw = handle.read(header_len)
    except OSError as exc:
        raise RepackError(f"{file.name}: cannot read ({exc.strerror or type(exc).__name__})") from None
    if len(raw) != header_len:
        raise RepackError(f"{file.name}: the header is truncated (file changed while reading?)")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise RepackError(f"{file.name}: the header lists {short_repr(exc.args[0])} more than once") from None
    except UnicodeDecodeError:
        raise RepackError(f"{file.name}: not a valid safetensors file (header is not UTF-8)") from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise RepackError(f"{file.name}: not a valid safetensors file (header is not JSON: {reason})") from None
    return size, header_len, header


def _entry(file: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    where = f"{file.name}: tensor {short_repr(name)}"
    if not isinstance(info, dict) or not HEADER_KEYS <= set(info):
        raise RepackError(f"{where} must be an object with keys dtype, shape, data_offsets, got {short_repr(info)}")
    dtype_name = info["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise RepackError(f"{where} has unsupported dtype {short_repr(dtype_name)}")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RepackError(f"{where} has an invalid shape {short_repr(shape)}")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise RepackError(f"{where} has invalid data_offsets {short_repr(offsets)}")
    begin, end = offsets
    if begin > end or data_start + end > size:
        raise RepackError(
            f"{where} spans bytes [{short_repr(begin, 24)}, {short_repr(end, 24)}) of the data, past the end of the file "
            f"({size} bytes) or reversed; the file is truncated or corrupt"
        )
    expected = _bounded_nbytes(tuple(shape), DTYPES[dtype_name].itemsize, size)
    if expected is None:
        raise RepackError(f"{where}: {dtype_name} {short_repr(shape)} is larger than the whole file ({size} bytes)")
    if end - begin != expected:
        raise RepackError(
            f"{where} spans bytes [{begin}, {end}) ({end - begin} bytes) but {dtype_name} {short_repr(shape)} "
            f"needs {expected}"
        )
    return TensorEntry(file, name, dtype_name, tuple(shape), data_start + begin, data_start + end)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and validate ``file``'s header; every offset is checked against the file's real size."""
    size, header_len, header = _raw_header(file)
    if not isinstance(header, dict):
        raise RepackError(f"{file.name}: not a valid safetensors file (header is a JSON {type(header).__name__})")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RepackError(f"{file.name}: __metadata__ must map names to strings")
    data_start = 8 + header_len
    entries = {
        name: _entry(file, name, info, data_start, size) for name, info in header.items() if name != "__metadata__"
    }
    _check_no_overlap(file, entries)
    return entries


def _check_no_overlap(file: Path, entries: dict[str, TensorEntry]) -> None:
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.begin)
    for before, after in zip(ordered, ordered[1:]):
        if after.begin < before.end:
            raise RepackError(f"{file.name}: tensors {short_repr(before.name)} and {short_repr(after.name)} overlap")


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor into a fresh, writable CPU tensor (allocator-aligned, as kernels expect)."""
    flat = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin)
        if entry.nbytes and handle.readinto(flat.numpy()) != entry.nbytes:
            raise RepackError(f"{entry.file.name}: tensor {entry.name!r} is truncated")
    return flat.view(entry.dtype).reshape(entry.shape)


def read_rows(entry: TensorEntry, first: int, last: int) -> torch.Tensor:
    """Rows ``[first, last)`` of the tensor's first dimension, read into fresh memory: a slice of a large tensor
    (a chunk of a FusedMoE layer's experts) without mapping, or holding, the rest of it."""
    rows = entry.shape[0] if entry.shape else 0
    if not 0 <= first <= last <= rows:
        raise RepackError(f"{entry.file.name}: rows [{first}, {last}) of tensor {entry.name!r} are outside its {rows}")
    row = entry.nbytes // rows if rows else 0
    flat = torch.empty((last - first) * row, dtype=torch.uint8)
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin + first * row)
        if flat.numel() and handle.readinto(flat.numpy()) != flat.numel():
            raise RepackError(f"{entry.file.name}: tensor {entry.name!r} is truncated")
    return flat.view(entry.dtype).reshape(last - first, *entry.shape[1:])


def iter_raw_chunks(entry: TensorEntry) -> Iterator[bytes]:
    """The tensor's bytes in bounded chunks, for byte-identical copies and hashing."""
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin)
        remaining = entry.nbytes
        while remaining:
            chunk = handle.read(min(COPY_CHUNK, remaining))
            if not chunk:
                raise RepackError(f"{entry.file.name}: tensor {entry.name!r} is truncated")
            remaining -= len(chunk)
            yield chunk


MAP_MIN_BYTES = 1 << 20  # smaller reads are copied: a mapping's setup costs more than the copy


def _map_range(file: Path, begin: int, nbytes: int, what: str) -> memoryview:
    """Bytes ``[begin, begin + nbytes)`` of ``file``, mapped copy-on-write (writes never reach the file).

    A mapping is released when the last view of it goes. The file must keep its size meanwhile: it is checked
    here, and a file truncated under a live mapping ends the process with SIGBUS (a checkpoint being
    rewritten while it is converted)."""
    with open(file, "rb") as handle:
        if os.fstat(handle.fileno()).st_size < begin + nbytes:
            raise RepackError(f"{file.name}: {what} is truncated (file changed while reading?)")
        start = begin - begin % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(handle.fileno(), begin + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
    return memoryview(mapping)[begin - start :]


def map_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor, its memory mapped from the file instead of copied (reads below ``MAP_MIN_BYTES`` are copied).

    A read copies every byte from the page cache into freshly faulted memory, about as much CPU as sha256 of
    the same bytes; a mapping costs neither. Its data is only as aligned as its offset in the file: code that
    views it as wider words makes an aligned copy first (``targets.layout.aligned``)."""
    if entry.nbytes < MAP_MIN_BYTES:
        return read_tensor(entry)
    flat = torch.frombuffer(_map_range(entry.file, entry.begin, entry.nbytes, f"tensor {entry.name!r}"),
                            dtype=torch.uint8)
    return flat.view(entry.dtype).reshape(entry.shape)


def map_chunks(entry: TensorEntry, chunk: int = COPY_CHUNK) -> Iterator[memoryview | bytes]:
    """The tensor's bytes in chunks, each mapped on its own (so memory holds only the chunks still in use)."""
    if entry.nbytes < MAP_MIN_BYTES:
        yield from iter_raw_chunks(entry)
        return
    yield from map_file_chunks(entry.file, entry.begin, entry.nbytes, f"tensor {entry.name!r}", chunk)


def map_file_chunks(file: Path, begin: int, nbytes: int, what: str = "the file",
                    chunk: int = COPY_CHUNK) -> Iterator[memoryview]:
    """Bytes ``[begin, begin + nbytes)`` of ``file`` in mapped chunks (for hashing whole files)."""
    for offset in range(0, nbytes, chunk):
        yield _map_range(file, begin + offset, min(chunk, nbytes - offset), what)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw little-endian bytes without copying (contiguous CPU tensors)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element torch calls contiguous under another stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy())
