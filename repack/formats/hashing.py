"""Source files hashed by the reads that convert does anyway: one read of the source, not two.

A pass reads tensors roughly in file order (both follow tensor names in the common layouts). Each file keeps
a sha256 and the offset it has reached; a read that starts there is hashed as it is read, on a thread of the
file's own; a read that starts further on first hashes the gap; one that starts before is just read (its bytes
are already hashed). :meth:`HashingReader.digests` hashes whatever no read reached, so every byte counts once
and the result is each file's sha256, whatever the order of the reads.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import Checkpoint
from .safetensors_io import COPY_CHUNK, TensorEntry, iter_raw_chunks, read_tensor, tensor_bytes

HASH_QUEUE_BYTES = 32 << 20  # bytes read but not yet hashed, per file, before a read waits: bounds memory


@dataclass
class _FileHash:
    path: Path
    size: int
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    position: int = 0
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    queued: list[tuple[Future, int]] = field(default_factory=list)

    def feed(self, data: bytes | memoryview) -> None:
        """Hash ``data`` (the file's next bytes) on this file's thread; ``data`` must stay unchanged meanwhile."""
        while self.queued and sum(n for _, n in self.queued) + len(data) > HASH_QUEUE_BYTES:
            self.queued.pop(0)[0].result()
        self.queued.append((self.pool.submit(self.digest.update, data), len(data)))
        self.position += len(data)

    def hash_up_to(self, offset: int) -> None:
        """Read and hash the bytes from the current position to ``offset``."""
        with open(self.path, "rb") as handle:
            handle.seek(self.position)
            while self.position < offset:
                chunk = handle.read(min(COPY_CHUNK, offset - self.position))
                if not chunk:
                    raise OSError(f"{self.path.name}: file shrank while reading")
                self.feed(chunk)

    def hexdigest(self) -> str:
        self.hash_up_to(self.size)
        for future, _ in self.queued:
            future.result()
        self.pool.shutdown()
        return self.digest.hexdigest()


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
        tensor = read_tensor(entry)
        if state is not None:
            state.feed(tensor_bytes(tensor))
        return tensor

    def chunks(self, entry: TensorEntry) -> Iterator[bytes]:
        state = self._at(entry)
        for chunk in iter_raw_chunks(entry):
            if state is not None:
                state.feed(chunk)
            yield chunk

    def digests(self) -> dict[str, str]:
        """Each shard file's sha256 (hashing the parts no read reached)."""
        return {name: self._files[self.checkpoint.contained(name)].hexdigest() for name in self.checkpoint.shard_files}

    def close(self) -> None:
        for state in self._files.values():
            state.pool.shutdown(wait=True, cancel_futures=True)
