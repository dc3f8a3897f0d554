"""Errors a user can cause and fix. The CLIs print them as one line and exit with code 2."""

import contextlib
import os
import re
import sys


class UserError(Exception):
    """A mistake in input, data, workdir or environment that the user can fix."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's first non-empty line, for a one-line message: the type's name when the
    exception says nothing (the libraries megajax wraps raise multi-line and empty ones)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]


# tensorstore ("... [os_error_code='28']") and safetensors ("... (os error 28)") raise their own
# exception types for a failed read or write, naming the operating system's reason in the text.
_OS_ERROR_CODE = re.compile(r"os[ _]error(?:_code=)?\s*'?(\d+)")


def os_error_code(e: BaseException) -> int | None:
    """The operating system's error number behind `e`: an OSError's own, or the one a library
    names in its message; None if there is none."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    found = _OS_ERROR_CODE.search(str(e))
    return int(found.group(1)) if found else None


def exit_now(line: str, status: int):
    """Print `line` on stderr and end the process at once (os._exit), unwinding nothing: for a
    signal handler, where an exception is unreliable (Python may run the handler inside a
    weakref callback or finaliser, which swallows it; unwinding while JAX's runtime threads start
    crashed the interpreter at exit, SIGSEGV in CI), and for a peer's death in a multi-process
    run, where the normal exit's shutdown barrier would wait for the dead process."""
    print(line, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):  # stdout may be a closed pipe
        sys.stdout.flush()
    os._exit(status)
