"""The ``nvfp4-repack`` entry point, kept import-free so that Ctrl-C at any moment is one line.

The console script imports this module and then calls :func:`run`; a KeyboardInterrupt raised by an import
outside :func:`main`'s ``try`` would print a traceback. So the commands (:mod:`.app`: Typer, rich) are imported
inside it, and torch only inside the commands that touch tensors: ``--help``, ``--version`` and ``targets`` never
load it.
"""

from __future__ import annotations

import gc
import sys

INTERRUPTED = "Interrupted."
INTERRUPTED_EXIT = 130


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 1 bad input, 2 usage, 130 interrupted)."""
    try:
        from .app import run_app

        return run_app(argv)
    except KeyboardInterrupt:  # while importing: the commands handle their own
        print(INTERRUPTED, file=sys.stderr)
        return INTERRUPTED_EXIT


def run() -> None:
    code = main()
    gc.freeze()  # the interpreter's teardown would otherwise collect every object torch made: ~0.7 CPU s per command
    sys.exit(code)
