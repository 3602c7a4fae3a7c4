"""The one exception type for bad input, and how untrusted text is made fit for a terminal.

Everything a user can get wrong (a path, a trace, a shape, a name) raises `InputError` with one line that names
the argument and what was expected. It is a `ValueError`, so library callers can catch the usual type; the CLI
turns it into that one line on stderr and exit code 2.
"""

import re

# C0 and C1 controls (ESC starts ANSI/OSC sequences; newlines would split a line), DEL, bidi controls and
# zero-width characters (they reorder or hide text), line/paragraph separators, BOM, and lone surrogates
# (unencodable).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]")


class InputError(ValueError):
    """Bad input: the message is one line, fit to show a user as is."""


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value) -> str:
    """`value` as text with every unprintable character written as a visible \\xNN / \\uNNNN escape: text from a
    trace or a file (names, paths) can then neither restyle nor rewrite the terminal, nor break a line."""
    text = value if isinstance(value, str) else str(value)
    return text if text.isprintable() else _UNPRINTABLE.sub(_escape, text)
