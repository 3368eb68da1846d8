"""The one user-facing error type.

Every failure a user can cause (bad path, malformed checkpoint, unsupported format, tampered bundle)
is raised as :class:`RepackError` with a one-line message naming the file or tensor; the CLI turns it
into ``Error: ...`` and exit code 1. Anything else escaping is a bug.
"""


class RepackError(Exception):
    """A problem with the user's input, reported in one line."""
