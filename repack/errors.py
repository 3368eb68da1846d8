"""The user-facing error types.

Every failure a user can cause (bad path, malformed checkpoint, unsupported format, tampered bundle)
is raised as :class:`RepackError` with a one-line message naming the file or tensor; the CLI turns it
into ``Error: ...`` and exit code 1. Anything else escaping is a bug. Messages speak of the library's own
arguments, never of command-line flags: the CLI adds hints about its flags where one applies.
"""


class RepackError(Exception):
    """A problem with the user's input, reported in one line."""


class OutputExists(RepackError):
    """The output folder holds a bundle that only an explicit overwrite may replace."""


class Interrupted(Exception):
    """Ctrl-C. For a convert, ``kept`` holds per output bundle ``(destination, staging folder, complete shards
    kept there, shards planned)``, for a later resume. Not a KeyboardInterrupt, so that it reaches the CLI's
    handler (Typer turns those into a silent exit code)."""

    def __init__(self, kept: list[tuple[object, object, int, int]] | None = None) -> None:
        kept = kept or []
        super().__init__(kept)
        self.kept = kept
