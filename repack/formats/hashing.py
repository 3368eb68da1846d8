"""Source files hashed by the reads that convert does anyway: one read of the source, not two.

A pass reads tensors roughly in file order (both follow tensor names in the common layouts). Each file keeps
a sha256 and the offset it has reached; a read that starts there is hashed as it is read, on a thread of the
file's own; a read that starts further on first hashes the gap; one that starts before is just read (its bytes
are already hashed). :meth:`HashingReader.digests` hashes whatever no read reached, so every byte counts once
and the result is each file's sha256, whatever the order of the reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..lane import Lane
from .checkpoint import Checkpoint
from .safetensors_io import TensorEntry, map_chunks, map_tensor, tensor_bytes

HASH_QUEUE_BYTES = 32 << 20  # bytes handed over but not yet hashed, per digest, before the caller waits: bounds memory


class BackgroundDigest:
    """A digest updated in order on a thread of its own, at most ``HASH_QUEUE_BYTES`` behind its caller: sha256
    is the costliest step of a pass, and this moves it off the thread that reads or writes the same bytes
    (hashlib releases the GIL). Data handed to :meth:`update` must stay unchanged until it is hashed."""

    def __init__(self, digest: "hashlib._Hash") -> None:
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
    digest: BackgroundDigest = field(default_factory=lambda: BackgroundDigest(hashlib.sha256()))
    position: int = 0

    def feed(self, data: bytes | memoryview) -> None:
        """Hash ``data`` (the file's next bytes) on this file's thread; ``data`` must stay unchanged meanwhile."""
        self.digest.update(data)
        self.position += len(data)

    def hash_up_to(self, offset: int) -> None:
        """Hash the bytes from the current position to ``offset`` (mapped, as tensors are)."""
        if offset > self.position:
            gap = TensorEntry(self.path, "(bytes between tensors)", "U8", (offset - self.position,), self.position, offset)
            for chunk in map_chunks(gap):
                self.feed(chunk)

    def hexdigest(self) -> str:
        self.hash_up_to(self.size)
        digest = self.digest.hexdigest()
        self.digest.close()
        return digest


class HashingReader:
    """Reads a checkpoint's tensors and computes its shard files' sha256 from the same reads."""

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
        """Each shard file's sha256 (hashing the parts no read reached)."""
        return {name: self._files[self.checkpoint.contained(name)].hexdigest() for name in self.checkpoint.shard_files}

    def close(self) -> None:
        for state in self._files.values():
            state.digest.close()
