"""Untrusted safetensors files: header parsing with full validation, and per-tensor reads.

The header is parsed by huggingface_hub (which bounds its length); this module adds what a reader of
files from the internet needs before touching data: offsets inside the file, sizes consistent with
dtype x shape, no overlaps, known dtypes. Tensors are then read one at a time with plain file reads,
so memory is bounded by the largest tensor, never by the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import torch
from huggingface_hub import parse_local_safetensors_file_metadata

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
COPY_CHUNK = 16 << 20


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


def _validated_shape(file: Path, name: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RepackError(f"{file.name}: tensor {name!r} has an invalid shape {shape!r}")
    return tuple(shape)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and validate ``file``'s header; every offset is checked against the file's real size."""
    try:
        size = file.stat().st_size
        meta = parse_local_safetensors_file_metadata(file)
    except RepackError:
        raise
    except Exception as exc:  # the parser raises several types for malformed headers
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RepackError(f"{file.name}: not a valid safetensors file ({first_line})") from None
    with open(file, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in meta.tensors.items():
        if info.dtype not in DTYPES:
            raise RepackError(f"{file.name}: tensor {name!r} has unsupported dtype {info.dtype!r}")
        shape = _validated_shape(file, name, info.shape)
        offsets = info.data_offsets
        if not (isinstance(offsets, (list, tuple)) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise RepackError(f"{file.name}: tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        numel = 1
        for dim in shape:
            numel *= dim
        expected = numel * DTYPES[info.dtype].itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise RepackError(
                f"{file.name}: tensor {name!r} spans bytes [{begin}, {end}) but {info.dtype} {list(shape)} "
                f"needs {expected}"
            )
        if data_start + end > size:
            raise RepackError(
                f"{file.name}: tensor {name!r} ends at byte {data_start + end} past the end of the file "
                f"({size} bytes); the file is truncated or corrupt"
            )
        entries[name] = TensorEntry(file, name, info.dtype, shape, data_start + begin, data_start + end)
    _check_no_overlap(file, entries)
    return entries


def _check_no_overlap(file: Path, entries: dict[str, TensorEntry]) -> None:
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.begin)
    for before, after in zip(ordered, ordered[1:]):
        if after.begin < before.end:
            raise RepackError(f"{file.name}: tensors {before.name!r} and {after.name!r} overlap")


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor into a fresh, writable CPU tensor (allocator-aligned, as kernels expect)."""
    flat = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb") as handle:
        handle.seek(entry.begin)
        if entry.nbytes and handle.readinto(flat.numpy()) != entry.nbytes:
            raise RepackError(f"{entry.file.name}: tensor {entry.name!r} is truncated")
    return flat.view(entry.dtype).reshape(entry.shape)


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(COPY_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's raw little-endian bytes without copying (contiguous CPU tensors)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def write_stream(handle: BinaryIO, chunks: Iterator[bytes | memoryview]) -> str:
    """Write chunks, returning their sha256."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
        handle.write(chunk)
    return digest.hexdigest()
