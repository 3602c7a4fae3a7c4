"""The one exception type for bad input (and the one for SIGTERM), and how untrusted text is made fit for a
terminal.

Everything a user can get wrong (a path, a trace, a shape, a name) raises `InputError` with one line that names
the argument and what was expected. It is a `ValueError`, so library callers can catch the usual type; the CLI
turns it into that one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad input: the message is one line, fit to show a user as is."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the CLI's handler. A KeyboardInterrupt, so that every cleanup written
    for Ctrl-C (temporary trace folders, half-written files, the partial-results note) runs for it too."""


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value) -> str:
    """`value` as text with every character Python deems unprintable written as a visible escape (\\x1b,
    \\u202e, ...): control characters (ESC starts ANSI/OSC sequences, a newline would split a line), bidi and
    zero-width format characters, separators, lone surrogates, private-use and unassigned code points. Text from a
    trace or a file (names, paths) can then neither restyle nor rewrite the terminal, nor break a line."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
