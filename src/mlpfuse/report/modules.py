"""The module view in the report (the analysis's `modules` block, profiling/modules.py): a collapsible tree of GPU
time by module path, the roofline of the costliest calls, the fusions the step suggests, and the colour of each
module kind that the timeline's module row uses."""

from __future__ import annotations

import zlib

from mlpfuse.report.markup import esc, pct, us
from mlpfuse.report.tables import name_cell, table

COLOUR_DEPTH = 4  # module paths are coloured by their first parts, layers folded: model.layers.*.mlp


def colour_key(path: str | None) -> str | None:
    """The part of a module path the timeline colours by ('model.layers.7.mlp.down_proj' -> 'model.layers.*.mlp')."""
    if path is None:
        return None
    parts = ["*" if p.isdigit() else p for p in path.split(".")] if path else []
    return ".".join(parts[:COLOUR_DEPTH]) or "(root)"


def colour(key: str) -> str:
    """A fixed colour per module kind: the same kind gets the same colour on every page."""
    hue = zlib.crc32(key.encode("utf-8", "replace")) % 360
    return f"hsl({hue},62%,58%)"


def _tree(view: dict) -> str:
    """Nested <details>, one per module kind (rows sorted by path, so a parent comes before its children)."""
    n = view.get("steps", 1)
    out, depth_open = [], 0
    for row in view.get("kinds", []):
        depth = row["depth"]
        while depth_open >= depth + 1:
            out.append("</details>")
            depth_open -= 1
        ops = ", ".join(f"{esc(o['op'], 60)} {us(o['gpu_us'] / n)} µs" for o in row.get("ops", [])[:4])
        summary = (f"<code>{esc(row['module'], 200)}</code> — {us(row['gpu_us'] / n)} µs/step, "
                   f"{pct(row['share'])}, {row['kernels'] / n:,.1f} kernels/step"
                   + (f' <span class="sub">own ops: {ops}</span>' if ops else ""))
        out.append(f'<details class="module"{" open" if depth <= 2 else ""}><summary>{summary}</summary>')
        depth_open = depth + 1
    out.extend("</details>" for _ in range(depth_open))
    return "".join(out)


def _roofline(view: dict, limit: int = 40) -> str:
    roof = view.get("roofline") or {}
    rows = roof.get("rows") or []
    if not rows:
        return ""
    floor = roof.get("floor_us_per_step")
    head = (f"<p>Calls whose op and input shapes the trace recorded: {pct(roof.get('costed_share', 0))} of kernel "
            f"time, {roof.get('bytes_per_step', 0) / 1e6:,.1f} MB per step"
            + (f"; at the card's measured copy bandwidth that is a floor of {us(floor)} µs per step." if floor else
               "; no measured peaks for this card (<code>mlpfuse bench</code> measures and caches them).") + "</p>")

    def rate(v, share):
        return "–" if v is None else f"{v:,.0f}" + (f" ({pct(share)})" if share is not None else "")

    cells = [[esc(r["module"], 120), esc(r["op"], 60), esc(r["inputs"], 120), name_cell(r["kernel"]),
              us(r["us_per_call"]), f"{r['calls']:,.3g}", rate(r["gbps"], r["of_bandwidth"]),
              rate(r["tflops"], r["of_compute"])] for r in rows[:limit]]
    return head + table(["module", "op", "inputs", "kernel", "µs/call", "calls/step", "GB/s (of peak)",
                         "TFLOP/s (of peak)"], cells, "roofline", total=len(rows), numeric=(4, 5, 6, 7))


def _fusions(view: dict) -> str:
    found = view.get("fusions") or []
    if not found:
        return ""
    cells = [[esc(f["module"], 120), f"{f['runs']:,.3g}", f"{f['kernels']:,.3g}", us(f["gpu_us"]),
              f"{f['bytes_saved'] / 1e6:,.2f} of {f['bytes'] / 1e6:,.2f}", esc(", ".join(f["ops"][:5]), 200),
              esc(f["mlpfuse"], 300)] for f in found[:30]]
    return ("<p>Runs of three or more memory-bound kernels in one module: each pass reads and writes the tensor "
            "again; one fused kernel would move about the largest pass's bytes once.</p>"
            + table(["module", "runs/step", "kernels/step", "µs/step", "MB saved/step", "ops", "mlpfuse"], cells,
                    "fusions", total=len(found), numeric=(1, 2, 3, 4)))


def section(view: dict) -> str:
    """The module view's HTML: what was attributed, the tree, the roofline, the fusions."""
    n = view.get("steps", 1)
    missing = "".join(f"<li>{u['kernels'] / n:,.1f} kernels, {us(u['gpu_us'] / n)} µs per step: "
                      f"{esc(u['reason'], 300)}</li>" for u in view.get("unattributed", []))
    between = view.get("between") or {}
    by_position = (f"<p>{between['kernels'] / n:,.1f} kernels ({us(between['gpu_us'] / n)} µs per step) have no "
                   "counterpart in the map (a compiled graph's fused kernels) and are counted to the module holding "
                   "the matched kernels on both sides.</p>" if between.get("kernels") else "")
    replays = (f", {view['replays']} graph replays with {us(view['replay_idle_us'] / n)} µs per step idle between "
               "their kernels" if view.get("replays") else "")
    return ("<h3>GPU time by module</h3>"
            f"<p>{pct(view['attributed_share'])} of {us(view['kernel_us'] / n)} µs of kernels per step attributed to "
            f"a module{replays}.</p>{by_position}"
            + (f"<ul>{missing}</ul>" if missing else "") + _tree(view)
            + ("<h3>Roofline per call</h3>" + _roofline(view) if (view.get("roofline") or {}).get("rows") else "")
            + ("<h3>Fusions this step suggests</h3>" + _fusions(view) if view.get("fusions") else ""))
