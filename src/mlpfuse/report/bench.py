"""The bench lab's part of a page: what was run, the plots (inlined as data: URIs), one table per case.

The bench hands over its header lines and table columns (`mlpfuse.bench.outputs.page_layout`: the same as its
results.md), so the page and the Markdown agree and the report knows nothing of how a sweep is laid out.
"""

from __future__ import annotations

import base64
import os
from itertools import groupby

from mlpfuse.report.markup import esc

MAX_PLOT_BYTES = 4 << 20
_PNG = b"\x89PNG\r\n\x1a\n"


def plot_img(path: str | os.PathLike, alt: str) -> str:
    """An <img> holding the PNG itself, or a line saying why it is not there."""
    name = os.path.basename(os.fspath(path))
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PLOT_BYTES + 1)
    except OSError as exc:
        return f'<p class="missing">{esc(name)}: not found ({esc(exc.strerror or exc, 120)}).</p>'
    if len(data) > MAX_PLOT_BYTES:
        return f'<p class="missing">{esc(name)}: over {MAX_PLOT_BYTES >> 20} MiB, not inlined.</p>'
    if not data.startswith(_PNG):
        return f'<p class="missing">{esc(name)}: not a PNG file, not shown.</p>'
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return f'<figure><img src="{uri}" alt="{esc(alt)}"><figcaption>{esc(name)}</figcaption></figure>'


def bench_section(header: dict, rows: list[dict], plots: list[str], columns, caption) -> str:
    """`header`: what was run (command, timestamp, versions, peaks, method, notes; {} for none); `columns(rows)` and
    `caption(rows)` lay out one case's table."""
    parts = []
    if header:
        parts.append(f"<p>Command: <code>{esc(header.get('command'), 600)}</code><br>"
                     f"{esc(header.get('timestamp'), 60)}; {esc(header.get('versions'), 400)}</p>")
        if header.get("peaks") is not None:
            parts.append(f"<p>{esc(header['peaks'], 600)}</p>")
        else:
            parts.append('<p class="missing">No measured peaks in this result.</p>')
        parts.append(f'<p class="note">{esc(header.get("method"), 1200)}</p>')
        for note in header.get("notes") or []:
            parts.append(f'<p class="note">Note: {esc(note, 600)}</p>')
    if plots:
        parts.append('<div class="plots">' + "".join(plot_img(p, "bench plot") for p in plots) + "</div>")
    else:
        parts.append('<p class="note">No plots (none written, or no variant ran: --no-plots, or no timing '
                     "to plot).</p>")
    if not rows:
        parts.append('<p class="missing">No result rows.</p>')
    for _, group in groupby(rows, key=lambda r: r.get("case")):
        group = list(group)
        try:
            cols = columns(group)
            title = caption(group)
            body = "".join("<tr>" + "".join(f"<td>{esc(fn(r), 400)}</td>" for _, fn in cols) + "</tr>"
                           for r in group)
        except (KeyError, TypeError, ValueError) as exc:  # a row written by another version of the lab
            parts.append(f'<p class="missing">Case {esc(group[0].get("case"), 200)}: rows not readable as a '
                         f"bench table ({esc(type(exc).__name__)}: {esc(exc, 200)}).</p>")
            continue
        heads = "".join(f"<th>{esc(h, 40)}</th>" for h, _ in cols)
        parts.append(f"<h4>{esc(title, 400)}</h4><table class=\"bench\"><thead><tr>{heads}</tr></thead>"
                     f"<tbody>{body}</tbody></table>")
    return "".join(parts)
