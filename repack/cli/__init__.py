"""The ``nvfp4-repack`` entry point, kept import-free so that Ctrl-C at any moment of the tool's own code is one line.

The console script imports this module and then calls :func:`run`. Its first statements install a SIGINT handler
that prints the one line and exits 130 at once: nothing is written before :func:`main` runs, and a
KeyboardInterrupt raised outside :func:`main`'s ``try`` (between this import and the call, or after it returns)
would print a traceback. :func:`main` hands Ctrl-C back to Python's KeyboardInterrupt, which the commands handle
(a convert finishes its queued writes and keeps them for ``--resume``). The commands (:mod:`.app`: Typer, rich) are
imported inside it, and torch only inside the commands that touch tensors: ``--help``, ``--version`` and
``targets`` never load it. Before this module runs, the interpreter's own start (site-packages, the console
script's first lines) is CPython's: a Ctrl-C there gets CPython's answer (docs/usage.md).
"""

from __future__ import annotations

import os
import signal

INTERRUPTED = "Interrupted."
INTERRUPTED_EXIT = 130
PIPE_CLOSED_EXIT = 128 + signal.SIGPIPE  # 141: what a shell reports for a tool whose output's reader went away


def _exit_interrupted(signum: int, frame: object) -> None:
    """SIGINT outside :func:`main`: the one line, exit code 130, without unwinding (nothing to clean up there)."""
    os.write(2, f"{INTERRUPTED}\n".encode())
    os._exit(INTERRUPTED_EXIT)


def _set_sigint(handler: object, unless: object = None) -> None:
    """Install ``handler`` for SIGINT if the current one is Python's default (or ``unless``, ours); from another
    thread, or where SIGINT was set otherwise (ignored by a shell's background job, a host program's), leave it."""
    try:
        if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, unless):
            signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


_set_sigint(_exit_interrupted)  # the tool's first statement that runs: from here on, Ctrl-C is one line and 130

import gc  # noqa: E402  (after the handler: each statement before it is a moment a Ctrl-C would print a traceback)
import sys  # noqa: E402


def _identity(file: int | str) -> tuple[int, int] | None:
    """A descriptor's or a path's file, as (device, inode)."""
    try:
        stat = os.stat(file)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


_OUTPUTS: dict[int, tuple[int, int] | None] = {}  # stdout's and stderr's files when main() started


def closed_output() -> bool:
    """Whether stdout or stderr is a pipe nobody reads any more (``nvfp4-repack targets | head -1``); if so, such
    streams now write to /dev/null, so that nothing (rich, Typer, the interpreter's exit) reports it again. One that
    rich already pointed at /dev/null (its own answer: exit 1 without a word) counts too."""
    import select  # built in: nothing to load

    null = _identity(os.devnull)
    closed = []
    for fd in (1, 2):
        if _identity(fd) == null != _OUTPUTS.get(fd, null):
            closed.append(fd)  # rich's doing
            continue
        try:
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            if any(events & select.POLLERR for _, events in poll.poll(0)):  # a pipe's write end without a reader
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)
                closed.append(fd)
        except (OSError, ValueError, AttributeError):  # not pollable here: not a pipe we can tell about
            pass
    return bool(closed)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 1 bad input, 2 usage, 130 interrupted, 141 output's reader
    gone)."""
    _OUTPUTS.update({fd: _identity(fd) for fd in (1, 2)})
    try:
        _set_sigint(signal.default_int_handler, unless=_exit_interrupted)  # KeyboardInterrupt: the commands' to handle
        from .app import run_app

        return run_app(argv)
    except KeyboardInterrupt:  # while importing: the commands handle their own
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_EXIT


def run() -> None:
    code = main()
    for stream in (sys.stdout, sys.stderr):  # what the command printed is out before a Ctrl-C could _exit
        try:
            stream.flush()
        except BrokenPipeError:  # ``| head`` read what it wanted: quiet, with the pipe's exit code
            if closed_output():
                code = code or PIPE_CLOSED_EXIT
        except (OSError, ValueError):  # another stream problem: the interpreter's exit reports it as before
            pass
    _set_sigint(_exit_interrupted)  # the exit's own work (joining threads, teardown): still one line and 130
    gc.freeze()  # the interpreter's teardown would otherwise collect every object torch made: ~0.7 CPU s per command
    sys.exit(code)
