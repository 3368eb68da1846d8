"""The ``nvfp4-repack`` command: thin Typer commands over the library, one error handler.

Errors the user can cause are :class:`~repack.errors.RepackError`: printed as one ``Error: ...`` line on
stderr, exit code 1. Usage errors exit 2. Anything else is a bug: one line too, with the traceback shown
only when ``NVFP4_REPACK_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys
import traceback

import typer

from ..errors import RepackError
from . import commands
from .commands import printable

ERROR_LIMIT = 2000  # characters: an error is one line, whatever a hostile name holds

DEBUG = os.environ.get("NVFP4_REPACK_DEBUG", "") not in ("", "0")

app = typer.Typer(
    name="nvfp4-repack",
    help="Repack NVFP4 checkpoints (ModelOpt, compressed-tensors) into serving kernels' runtime layouts, offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
commands.register(app)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 1 bad input, 2 usage)."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="nvfp4-repack", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except RepackError as exc:
        print(f"Error: {printable(exc, ERROR_LIMIT)}", file=sys.stderr)
        return 1
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        print("Interrupted.", file=sys.stderr)
        return 130
    except OSError as exc:  # files, permissions, disk space: the environment, reported like bad input
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"Error: {printable(where + (exc.strerror or str(exc)), ERROR_LIMIT)}", file=sys.stderr)
        return 1
    except Exception as exc:
        if _is_usage_error(exc):
            exc.show()  # type: ignore[attr-defined]
            return int(exc.exit_code)  # type: ignore[attr-defined]
        # A bug: still one line unless debugging.
        if DEBUG:
            traceback.print_exc()
        print(f"Error: internal error: {type(exc).__name__}: {printable(exc, ERROR_LIMIT)} "
              "(set NVFP4_REPACK_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


def _is_usage_error(exc: Exception) -> bool:
    """Click's usage errors; Typer >= 0.26 bundles Click privately, so match by behaviour, not by class."""
    return callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int)


def run() -> None:
    sys.exit(main())
