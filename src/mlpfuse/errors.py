"""The one exception type for bad input.

Everything a user can get wrong (a path, a trace, a shape, a name) raises `InputError` with one line that names
the argument and what was expected. It is a `ValueError`, so library callers can catch the usual type; the CLI
turns it into that one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad input: the message is one line, fit to show a user as is."""
