"""Errors a user can cause and fix. The CLIs print them as one line and exit with code 2."""


class UserError(Exception):
    """A mistake in input, data, workdir or environment that the user can fix."""
