"""Text that reaches the page: escaped, visible and bounded.

Every string from a trace or a saved file (kernel and op names, paths, reasons) goes through `esc`: characters
Python deems unprintable become visible escapes first (a bidi override cannot reorder what the reader sees, a NUL
or a lone surrogate cannot break the document), then `& < > " '` become entities, so a kernel named
`<script>alert(1)</script>` is text in a table cell, never markup. Long names are cut, with the cut said.
"""

from __future__ import annotations

import html
import math
import re

from mlpfuse.errors import printable

NAME_CHARS = 240  # names in tables; the analysis JSON keeps them whole
TITLE_CHARS = 120  # names in SVG tooltips, of which a timeline may hold thousands
_CLASS = re.compile(r"[^a-z0-9_-]+")


def cut(text: str, limit: int | None) -> str:
    if limit is not None and len(text) > limit:
        return text[: max(limit - 1, 1)] + "…"
    return text


def esc(value, limit: int | None = NAME_CHARS) -> str:
    """Any value as HTML text (and attribute) content: printable, cut to `limit` characters, entity-escaped.

    A name made of `&` or `"` grows six-fold when escaped; past twice the limit it is cut further, so the bytes a
    name takes on the page stay bounded too."""
    text = cut(printable("" if value is None else value), limit)
    out = html.escape(text, quote=True)
    if limit is not None and len(out) > 2 * limit:
        kept, size = [], 0
        for ch in text:
            piece = html.escape(ch, quote=True)
            size += len(piece)
            if size > 2 * limit - 1:
                break
            kept.append(piece)
        out = "".join(kept) + "…"
    return out


def css_class(word: str) -> str:
    """A class-name token from a word such as a kernel family (the family names are mlpfuse's own; this keeps a
    changed vocabulary from ever writing something that is not a token)."""
    return _CLASS.sub("_", str(word).lower())[:40] or "none"


def finite(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def us(value, digits: int = 1) -> str:
    """Microseconds for a cell: one decimal, thousands separated; a missing or non-finite value is a dash."""
    v = finite(value)
    return "–" if v is None else f"{v:,.{digits}f}"


def num(value) -> str:
    """A count (often a per-step average): 5, 2.5, 0.333."""
    v = finite(value)
    if v is None:
        return "–"
    return f"{v:,.0f}" if v == int(v) else f"{v:,.3g}"


def pct(share) -> str:
    v = finite(share)
    return "–" if v is None else f"{100 * v:.0f}%"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"
