"""The ``nvfp4-repack`` commands' Typer app and its one error handler (thin commands over the library).

Errors the user can cause are :class:`~repack.errors.RepackError`: printed as one ``Error: ...`` line on
stderr, exit code 1. Usage errors exit 2. Anything else is a bug: one line too, with the traceback shown
only when ``NVFP4_REPACK_DEBUG=1``. Output whose reader went away (``| head``) ends quietly with exit code 141, as
a shell reports a tool that SIGPIPE ended (Typer and rich would exit 1 without a word).
"""

from __future__ import annotations

import os
import sys
import traceback

from typing import Annotated

import typer

from .. import __version__
from ..errors import Interrupted, OutputExists, RepackError
from . import INTERRUPTED, INTERRUPTED_EXIT, PIPE_CLOSED_EXIT, closed_output, commands
from .commands import count, printable

ERROR_LIMIT = 2000  # characters: an error is one line, whatever a hostile name holds

DEBUG = os.environ.get("NVFP4_REPACK_DEBUG", "") not in ("", "0")

HELP_OPTIONS = ["-h", "--help"]

app = typer.Typer(
    name="nvfp4-repack",
    help="Repack NVFP4 checkpoints (ModelOpt, compressed-tensors) into serving kernels' runtime layouts, offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP_OPTIONS},
)


def _show_version(value: bool) -> None:
    if value:
        print(f"nvfp4-repack {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", metavar="", is_eager=True, callback=_show_version, help="Print the version.")
    ] = False,
) -> None:
    """Repack NVFP4 checkpoints (ModelOpt, compressed-tensors) into serving kernels' runtime layouts, offline."""


commands.register(app)


def _quiet_flags(command, info_name: str) -> None:
    """Show flags as flags in --help (Typer labels them ``<bool>``, as if they took a value)."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    with typer.Context(command, info_name=info_name, help_option_names=HELP_OPTIONS) as ctx:
        help_option = command.get_help_option(ctx)
        if help_option is not None:
            help_option.metavar = ""
    for name, sub in getattr(command, "commands", {}).items():
        _quiet_flags(sub, name)


def _report_interrupt(exc: BaseException) -> int:
    """One line on stderr; for a convert, what it kept and how to resume; exit code 130."""
    line = INTERRUPTED
    if isinstance(exc, Interrupted) and exc.kept:
        parts = [f"{done} of {count(total, 'shard')} of {out} kept" if staging else
                 f"nothing of {out} kept (--resume does not cover --tp conversions: run the command again)"
                 for out, staging, done, total in exc.kept]
        resume = ("; run the same command with --resume to continue (without it, the next convert removes them)"
                  if any(s for _, s, _, _ in exc.kept) else "")
        line = f"Interrupted: {'; '.join(parts)}{resume}"
    print(printable(line, ERROR_LIMIT), file=sys.stderr)
    return INTERRUPTED_EXIT


def run_app(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (0 ok, 1 bad input, 2 usage, 130 interrupted)."""
    command = typer.main.get_command(app)
    _quiet_flags(command, "nvfp4-repack")
    try:
        result = command.main(args=argv, prog_name="nvfp4-repack", standalone_mode=False)
        if result == INTERRUPTED_EXIT:  # Typer's silent answer to a Ctrl-C outside the commands (parsing, --help);
            return _report_interrupt(KeyboardInterrupt())  # no command of ours returns 130
        return result if isinstance(result, int) else 0
    except RepackError as exc:
        hint = " (pass --overwrite to replace it)" if isinstance(exc, OutputExists) else ""
        print(f"Error: {printable(f'{exc}{hint}', ERROR_LIMIT)}", file=sys.stderr)
        return 1
    except typer.Exit as exc:
        return _report_interrupt(KeyboardInterrupt()) if exc.exit_code == INTERRUPTED_EXIT else exc.exit_code
    except (Interrupted, typer.Abort, KeyboardInterrupt) as exc:
        return _report_interrupt(exc)
    except SystemExit as exc:  # Typer's answer to a BrokenPipeError anywhere below it: exit 1, not a word
        if closed_output():
            return PIPE_CLOSED_EXIT
        raise
    except OSError as exc:  # files, permissions, disk space: the environment, reported like bad input
        if isinstance(exc, BrokenPipeError) and closed_output():
            return PIPE_CLOSED_EXIT
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"Error: {printable(where + (exc.strerror or str(exc)), ERROR_LIMIT)}", file=sys.stderr)
        return 1
    except Exception as exc:
        if _is_usage_error(exc):  # one line too, naming the help to read
            ctx = getattr(exc, "ctx", None)
            where = f" (see '{ctx.command_path} -h')" if getattr(ctx, "command_path", None) else ""
            print(f"Error: {printable(f'{exc.format_message()}{where}', ERROR_LIMIT)}", file=sys.stderr)  # type: ignore[attr-defined]
            return int(exc.exit_code)  # type: ignore[attr-defined]
        # A bug: still one line unless debugging.
        if DEBUG:
            traceback.print_exc()
        print(f"Error: internal error: {type(exc).__name__}: {printable(exc, ERROR_LIMIT)} "
              "(set NVFP4_REPACK_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


def _is_usage_error(exc: Exception) -> bool:
    """Click's usage errors; Typer >= 0.26 bundles Click privately, so match by behaviour, not by class."""
    return callable(getattr(exc, "format_message", None)) and isinstance(getattr(exc, "exit_code", None), int)
