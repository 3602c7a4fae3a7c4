"""The rich consoles every command prints through.

On a terminal rich fits tables to the window. Anything else (a pipe, a file, `| cat`, `| grep`) has no width to fit,
and rich's fallback of 80 columns (or $COLUMNS) wraps cells over several lines, folds numbers and cuts names. There
the console is given room for any row, so each table row stays one line with every number and name whole; tables
check `unlimited(console.width)` to leave kernel names unshortened too.
"""

from __future__ import annotations

import sys

from rich.console import Console as _RichConsole
from rich.text import Text

from mlpfuse.errors import printable

# Wider than any row: rich sizes a table to its content when that fits, so nothing is padded to this width.
PIPE_WIDTH = 1 << 20
RULE_WIDTH = 100  # a rule's length off a terminal, where the console's own width means nothing


def unlimited(width: int) -> bool:
    """True for a console off a terminal: cells and names print whole."""
    return width >= PIPE_WIDTH


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _TrimmedLines:
    """A stream whose lines lose their trailing spaces. Off a terminal rich still pads a table's title, and a
    cell's last column, to the table's width: hundreds of blanks after a title over a wide table."""

    def __init__(self, stream):
        self._stream = stream
        self._partial = ""

    def write(self, text: str) -> int:
        head, newline, self._partial = (self._partial + text).rpartition("\n")
        if newline:
            self._stream.write("\n".join(line.rstrip(" ") for line in head.split("\n")) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._stream.write(self._partial)
            self._partial = ""
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


class Console(_RichConsole):
    """A rich Console for stdout (or stderr) that prints unwrapped rows off a terminal. rich exits 1 by itself when
    stdout's reader goes away; here the BrokenPipeError reaches the CLI, which exits quietly with 141 as other tools
    do."""

    def __init__(self, stderr: bool = False, **kwargs):
        # Decided by the stream itself, not by rich's terminal test: FORCE_COLOR (common in CI) makes rich treat a
        # pipe as a terminal of 80 columns.
        stream = kwargs.get("file") or (sys.stderr if stderr else sys.stdout)
        if "width" not in kwargs and not _isatty(stream):
            kwargs["width"] = PIPE_WIDTH
            kwargs["file"] = _TrimmedLines(stream)
        super().__init__(stderr=stderr, **kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError

    def rule(self, title="", **kwargs) -> None:
        # A title is text, never markup: `linear [eager] batch=256` keeps its `[eager]`.
        title = printable(title) if isinstance(title, str) else title
        if not unlimited(self.width):
            return super().rule(Text(title) if isinstance(title, str) else title, **kwargs)
        head = f"── {title} " if title else ""
        self.print(Text(head + "─" * max(3, RULE_WIDTH - len(head)), style="rule.line"))
