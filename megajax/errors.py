"""Errors a user can cause and fix. The CLIs print them as one line and exit with code 2."""


class UserError(Exception):
    """A mistake in input, data, workdir or environment that the user can fix."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first non-empty line, for a one-line message: the type's name when the
    exception says nothing (the libraries megajax wraps raise multi-line and empty ones)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]
