"""Work queued on a thread of its own, bounded in bytes: how every stage of a pass overlaps with the others."""

from __future__ import annotations

import ctypes
import os
import sys
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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes: blocks up to it come from malloc's heaps
TRIM_THRESHOLD = 64 << 20  # free memory a heap keeps (for the next chunks) before it is given back


def reuse_freed_blocks() -> None:
    """From now on in this process, glibc's malloc serves blocks up to 32 MB from its heaps and keeps freed memory
    for reuse. A pass allocates and frees a chunk's tensors (about 16 MB each) again and again; by default glibc
    maps each block above its adaptive threshold afresh and unmaps it when freed, so the kernel faults and zeroes
    every page of every chunk: a third of a 4 GB MoE convert's system time (docs/benchmarks.md). No-op without
    glibc, and where the user set either threshold (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``)."""
    if not sys.platform.startswith("linux") or {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
