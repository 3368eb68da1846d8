"""Streaming safetensors writer and the all-or-nothing output folder.

Each shard's header is known from the plan, so tensors are written one at a time as they are produced:
memory holds one layer, never a shard or the model. Output goes to a hidden temporary folder beside the
destination and is renamed into place only once complete, so a crash or a kill leaves the destination
either absent or whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import RepackError
from .plan import PlannedTensor

ChunkSource = Callable[[PlannedTensor], Iterable[bytes | memoryview]]


def safetensors_header(tensors: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus JSON header, space-padded to 8-byte alignment as safetensors does."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": tensor.dtype_name,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def write_shard(path: Path, tensors: list[PlannedTensor], chunks: ChunkSource) -> tuple[dict[str, str], str]:
    """Write one shard; returns each tensor's sha256 and the file's sha256."""
    file_digest = hashlib.sha256()
    tensor_digests: dict[str, str] = {}
    with open(path, "wb") as handle:
        head = safetensors_header(tensors, {"format": "pt"})
        handle.write(head)
        file_digest.update(head)
        for tensor in tensors:
            digest, written = hashlib.sha256(), 0
            for chunk in chunks(tensor):
                digest.update(chunk)
                file_digest.update(chunk)
                handle.write(chunk)
                written += len(chunk)
            if written != tensor.nbytes:
                raise RepackError(f"{tensor.name}: produced {written} bytes, planned {tensor.nbytes} (internal error)")
            tensor_digests[tensor.name] = digest.hexdigest()
        handle.flush()
        os.fsync(handle.fileno())
    return tensor_digests, file_digest.hexdigest()


def write_json(path: Path, data: object) -> str:
    """Write JSON and return the sha256 of the bytes written."""
    text = (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()
    path.write_bytes(text)
    return hashlib.sha256(text).hexdigest()


def check_destination(out: Path, overwrite: bool, protected: Iterable[Path] = ()) -> None:
    """Refuse to replace an existing ``out`` without ``overwrite``, and never replace an input folder."""
    resolved = out.resolve()
    for path in protected:
        keep = path.resolve()
        if resolved == keep or keep.is_relative_to(resolved):
            raise RepackError(f"{out}: the output folder would replace the input {path}; choose another -o")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise RepackError(f"{out}: already exists (pass --overwrite to replace it)")
        if not out.is_dir() or out.is_symlink():
            raise RepackError(f"{out}: exists and is not a folder; refusing to replace it")
    if not out.parent.is_dir():
        raise RepackError(f"{out.parent}: output's parent folder does not exist")


@contextlib.contextmanager
def staged_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it atomically becomes ``out``, on failure it is removed."""
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        if out.exists() and overwrite:
            retired = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(retired)
            staging.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            if out.exists():
                raise RepackError(f"{out}: appeared while converting; left untouched")
            staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
