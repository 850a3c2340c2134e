"""Errors a user can cause and fix.

Everything a user can get wrong (a bad option, a missing package, an unknown model) raises
`SpecdraftError` with a message that says what to change. Surfaces print the message and
exit non-zero without a traceback; anything else is a bug and keeps its traceback.
"""


class SpecdraftError(Exception):
    """A user-facing error: the message says what went wrong and what to change."""
