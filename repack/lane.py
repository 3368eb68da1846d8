"""Work queued on a thread of its own, bounded in bytes: how every stage of a pass overlaps with the others."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

LANE_BYTES = 16 << 20  # produced bytes a lane may queue (beyond one tensor) before the pass waits: bounds memory


class Lane:
    """Work run in order on a thread of its own (a bundle's transforms, its writes, a digest). ``submit`` waits while
    more than ``limit`` bytes are queued, so no stage gets more than that ahead of the next one."""

    def __init__(self, limit: int = LANE_BYTES) -> None:
        self._pool = ThreadPoolExecutor(1)
        self._queue: deque[tuple[Future, int]] = deque()
        self._queued = 0
        self._limit = limit

    def submit(self, nbytes: int, fn: Callable, *args) -> None:
        while self._queue and self._queued + nbytes > self._limit:
            self._wait_oldest()
        self._queue.append((self._pool.submit(fn, *args), nbytes))
        self._queued += nbytes

    def _wait_oldest(self) -> None:
        future, nbytes = self._queue.popleft()
        self._queued -= nbytes
        future.result()

    def drain(self) -> None:
        while self._queue:
            self._wait_oldest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch ops single-threaded meanwhile, for work that keeps every core busy with threads of its own (a
    convert's reading, transforms, writes and hashing; verify's hashing beside its layer checks): torch's
    intra-op workers competing with those threads spin-wait, and a transform took 3-4x longer so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

