"""Entry point of the converts that tests/test_atomicity.py kills: forked from a preloaded forkserver.

Kept apart from the test module so a forked child imports almost nothing before it starts converting.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path


def child(argv: list[str], step: int | None, fallback: bool) -> None:
    """Run the CLI; optionally SIGKILL this process at install step ``step`` (see ``install_faults``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    if step is not None or fallback:
        install_faults(step, fallback)
    from repack.cli import main

    os._exit(main(argv))


def install_faults(step: int | None, fallback: bool) -> None:
    """Kill points right before and right after every fsync, rename, exchange and deletion of the writer's
    install; ``fallback``: behave as if renameat2 were unavailable (other systems, some file systems)."""
    from repack.bundle import writer

    calls = iter(range(1_000_000))

    def point() -> None:
        if next(calls) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn):
        def wrapped(*args, **kwargs):
            point()
            result = fn(*args, **kwargs)
            point()
            return result

        return wrapped

    writer._renameat2 = wrap((lambda src, dst, flags: False) if fallback else writer._renameat2)
    writer._sync_tree = wrap(writer._sync_tree)
    writer._fsync = wrap(writer._fsync)
    faulty_shutil = type(sys)("faulty_shutil")
    faulty_shutil.rmtree = wrap(shutil.rmtree)
    writer.shutil = faulty_shutil
    Path.rename = wrap(Path.rename)
