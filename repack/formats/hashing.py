"""Digests by name, and source files hashed by the reads that convert does anyway: one read of the source, not two.

Files (the bundle's and the source's) and tensors are hashed with BLAKE3 (``FILE_DIGEST``, ``TENSOR_DIGEST``):
cryptographic like sha256, and about 4x faster on one core (0.15 against 0.7 CPU seconds per GB here). The
manifest names the algorithms, so bundles of older formats (sha256 files, sha256 or xxh3-128 tensors) still verify.

A pass reads tensors roughly in file order (both follow tensor names in the common layouts). Each file keeps
a digest and the offset it has reached; a read that starts there is hashed as it is read, on a thread of the
file's own; a read that starts further on first hashes the gap; one that starts before is just read (its bytes
are already hashed). :meth:`HashingReader.digests` hashes whatever no read reached, so every byte counts once
and the result is each file's digest, whatever the order of the reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from typing import Any, Callable

import blake3
import torch

from ..lane import Lane
from .checkpoint import Checkpoint
from .safetensors_io import MAP_MIN_BYTES, TensorEntry, map_chunks, map_file_chunks, map_tensor, tensor_bytes


def _xxh3_128() -> Any:
    import xxhash  # only bundles of format 3 need it

    return xxhash.xxh3_128()


# name -> (a fresh hasher with update / hexdigest, hex digits of its digest)
DIGESTS: dict[str, tuple[Callable[[], Any], int]] = {
    "blake3": (lambda: blake3.blake3(max_threads=1), 64),  # one thread: every core already has a stream of its own
    "sha256": (hashlib.sha256, 64),  # files of bundle formats 1 to 3, tensors of formats 1 and 2
    "xxh3_128": (_xxh3_128, 32),  # tensors of bundle format 3
}
FILE_DIGEST = "blake3"
TENSOR_DIGEST = "blake3"


def new_digest(algorithm: str) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) of one of :data:`DIGESTS`."""
    return DIGESTS[algorithm][0]()


def bytes_hexdigest(data: bytes, algorithm: str = FILE_DIGEST) -> str:
    digest = new_digest(algorithm)
    digest.update(data)
    return digest.hexdigest()


def file_hexdigest(path: Path, algorithm: str = FILE_DIGEST) -> str:
    """The file's digest, hashed from mappings of it a chunk at a time (no copy into the process)."""
    size = path.stat().st_size
    if size < MAP_MIN_BYTES:
        return bytes_hexdigest(path.read_bytes(), algorithm)
    digest = new_digest(algorithm)
    for chunk in map_file_chunks(path, 0, size):
        digest.update(chunk)
    return digest.hexdigest()

HASH_QUEUE_BYTES = 32 << 20  # bytes handed over but not yet hashed, per digest, before the caller waits: bounds memory


class BackgroundDigest:
    """A digest updated in order on a thread of its own, at most ``HASH_QUEUE_BYTES`` behind its caller: this moves
    it off the thread that reads or writes the same bytes (hashlib and blake3 release the GIL). Data handed to
    :meth:`update` must stay unchanged until it is hashed."""

    def __init__(self, digest: Any) -> None:
        self._digest = digest
        self._lane = Lane(HASH_QUEUE_BYTES)

    def update(self, data: bytes | memoryview) -> None:
        self._lane.submit(len(data), self._digest.update, data)

    def hexdigest(self) -> str:
        self._lane.drain()
        return self._digest.hexdigest()

    def close(self) -> None:
        self._lane.close()


@dataclass
class _FileHash:
    path: Path
    size: int
    digest: BackgroundDigest = field(default_factory=lambda: BackgroundDigest(new_digest(FILE_DIGEST)))
    position: int = 0

    def feed(self, data: bytes | memoryview) -> None:
        """Hash ``data`` (the file's next bytes) on this file's thread; ``data`` must stay unchanged meanwhile."""
        self.digest.update(data)
        self.position += len(data)

    def hash_up_to(self, offset: int) -> None:
        """Hash the bytes from the current position to ``offset`` (mapped, as tensors are)."""
        if offset > self.position:
            for chunk in map_file_chunks(self.path, self.position, offset - self.position, "bytes between tensors"):
                self.feed(chunk)

    def hexdigest(self) -> str:
        self.hash_up_to(self.size)
        digest = self.digest.hexdigest()
        self.digest.close()
        return digest


class HashingReader:
    """Reads a checkpoint's tensors and computes its shard files' digests (``FILE_DIGEST``) from the same reads."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._files = {}
        for name in checkpoint.shard_files:
            path = checkpoint.contained(name)
            self._files[path] = _FileHash(path, path.stat().st_size)

    def _at(self, entry: TensorEntry) -> _FileHash | None:
        state = self._files.get(entry.file)
        if state is None or entry.begin < state.position:
            return None  # already hashed: a plain read
        state.hash_up_to(entry.begin)
        return state

    def read(self, entry: TensorEntry) -> torch.Tensor:
        state = self._at(entry)
        tensor = map_tensor(entry)
        if state is not None:
            state.feed(tensor_bytes(tensor))
        return tensor

    def chunks(self, entry: TensorEntry) -> Iterator[bytes]:
        state = self._at(entry)
        for chunk in map_chunks(entry):
            if state is not None:
                state.feed(chunk)
            yield chunk

    def digests(self) -> dict[str, str]:
        """Each shard file's digest (hashing the parts no read reached)."""
        return {name: self._files[self.checkpoint.contained(name)].hexdigest() for name in self.checkpoint.shard_files}

    def close(self) -> None:
        for state in self._files.values():
            state.digest.close()
