"""HTML tables from the analysis and diff dictionaries (their public JSON form) and a bench result.

Renderers only read: a key an older or newer analysis lacks shows as a dash, keys they do not know are ignored.
Long tables keep their first rows (the analysis orders them by time) and say how many more there are.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from mlpfuse.profiling.analysis import NA, gpu_measured
from mlpfuse.report.markup import esc, finite, num, pct, us

MAX_ROWS = 200
_DECODED_SKIP = {"family", "flags", "index", "kind", "variant", "raster", "library"}


def _get(d: Any, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict):
            return default
        d = d.get(k)
    return default if d is None else d


def _rows(items: Any) -> list:
    return [r for r in items if isinstance(r, dict)] if isinstance(items, list) else []


def table(heads: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "", total: int | None = None,
          numeric: Iterable[int] = ()) -> str:
    """Cells are HTML already (escaped by the caller). `total`: rows there were before cutting."""
    numeric = set(numeric)
    rows = list(rows)
    head = "".join(f"<th{' class=num' if i in numeric else ''}>{h}</th>" for i, h in enumerate(heads))
    body = "".join("<tr>" + "".join(f"<td{' class=num' if i in numeric else ''}>{c}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    more = ""
    if total is not None and total > len(rows):
        more = f'<p class="note">{len(rows):,} of {total:,} rows shown; the JSON has them all.</p>'
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'


def name_cell(name: Any, full_chars: int = 1000) -> str:
    """A kernel name as its compact form (ATen template names run to hundreds of characters) with the full
    name one click away."""
    from mlpfuse.profiling.render import short

    if not isinstance(name, str):
        return esc(name)
    compact = short(name, 90)
    if compact == name:
        return f'<span class="name">{esc(name)}</span>'
    return (f'<span class="name">{esc(compact)}</span><details><summary>full name</summary>'
            f'<span class="name">{esc(name, full_chars)}</span></details>')


def decoded_fields(decoded: Any) -> str:
    """`{'arch': 'sm90', 'tile': '256x128', ...}` -> 'arch=sm90 tile=256x128' (library and family shown apart)."""
    if not isinstance(decoded, dict):
        return ""
    parts = []
    for key, value in decoded.items():
        if key in _DECODED_SKIP:
            continue
        text = "+".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def decoded_by_name(data: dict) -> dict[str, str]:
    out = {}
    for k in _rows(data.get("kernels")):
        if isinstance(k.get("name"), str):
            dec = k.get("decoded")
            lib = dec.get("library") if isinstance(dec, dict) else None
            out[k["name"]] = " ".join(x for x in (lib, decoded_fields(dec)) if x)
    return out


def _short(name: Any) -> str:
    from mlpfuse.profiling.render import short

    return short(name, 90) if isinstance(name, str) else str(name)


# ---------------------------------------------------------------- verdicts


def busy_bar(busy, idle) -> str:
    """A small SVG bar: GPU busy against idle in the step's GPU window."""
    b, i = finite(busy), finite(idle)
    if b is None or i is None or b + i <= 0:
        return ""
    w = 80 * b / (b + i)
    return (f'<svg class="busybar" width="82" height="12" viewBox="0 0 82 12" role="img">'
            f"<title>GPU busy {us(b)} µs, idle {us(i)} µs</title>"
            f'<rect class="idle" x="1" y="1" width="80" height="10"/>'
            f'<rect class="busy" x="1" y="1" width="{w:.1f}" height="10"/></svg>')


def verdict_badge(kind: Any) -> str:
    k = kind if isinstance(kind, str) else "unknown"
    cls = {"compute-bound": "good", "overhead-bound": "warn", "cpu-only": "muted"}.get(k, "muted")
    return f'<span class="badge {cls}">{esc(k, 40)}</span>'


def verdict_table(variants: list) -> str:
    """One row per variant (a failed one says why); the reasons follow as a list."""
    heads = ["variant", "verdict", "kernels/step", "launches/step", "GPU busy µs", "GPU idle µs", "GPU busy",
             "host µs/step", "in launch calls µs", "CPU ops/step"]
    rows, reasons = [], []
    for v in variants:
        name = f'<a href="#{v.anchor}">{esc(v.name, 120)}</a>'
        if v.analysis is None:
            rows.append([name, '<span class="badge bad">not run</span>'] + ["–"] * 8)
            reasons.append(f"<li><b>{esc(v.name, 120)}</b>: {esc(v.error or 'no analysis', 600)}</li>")
            continue
        p = _get(v.analysis, "per_step", default={})
        verdict = _get(v.analysis, "verdict", default={})
        gpu, launches = gpu_measured(v.analysis)
        busy, idle = p.get("gpu_busy_us"), p.get("gpu_idle_us")
        gpu_cells = ([num(p.get("gpu_kernels")), num(p.get("launch_calls")) if launches else NA, us(busy), us(idle),
                      busy_bar(busy, idle) + " " + pct(verdict.get("gpu_busy_share"))] if gpu else
                     [NA, num(p.get("launch_calls")) if launches else NA, NA, NA, NA])
        rows.append([name, verdict_badge(verdict.get("kind")), *gpu_cells, us(p.get("step_us")),
                     us(p.get("launch_cpu_us")) if launches else NA, num(p.get("cpu_ops"))])
        about = f" ({esc(v.about, 200)})" if v.about else ""
        reasons.append(f"<li><b>{esc(v.name, 120)}</b>{about}: {esc(verdict.get('reason', ''), 600)}</li>")
    return (table(heads, rows, "verdicts", numeric=(2, 3, 4, 5, 7, 8, 9))
            + f'<ul class="reasons">{"".join(reasons)}</ul>')


# ---------------------------------------------------------------- one analysis


def per_step_table(data: dict) -> str:
    p = _get(data, "per_step", default={})
    launches = ", ".join(f"{esc(k, 60)} {num(v)}" for k, v in _get(p, "launch_calls_by_name", default={}).items())
    families = ", ".join(f"{esc(k, 40)} {num(v)}" for k, v in _get(p, "families", default={}).items())
    gpu, launched = gpu_measured(data)
    rows = [
        ("steps", f"{num(data.get('steps'))} ({esc(data.get('step_source', '–'), 120)})"),
        ("step wall time (host)", f"{us(p.get('step_us'))} µs"),
        ("GPU busy / idle / window", f"{us(p.get('gpu_busy_us'))} / {us(p.get('gpu_idle_us'))} / "
                                     f"{us(p.get('gpu_window_us'))} µs" if gpu else NA),
        ("GPU kernels / memsets / memcpys", f"{num(p.get('gpu_kernels'))} / {num(p.get('gpu_memsets'))} / "
                                            f"{num(p.get('gpu_memcpys'))}" if gpu else NA),
        ("launch calls", launches or "0" if launched else NA),
        ("CPU time in launch calls", f"{us(p.get('launch_cpu_us'))} µs" if launched else NA),
        ("occupancy queries", num(p.get("occupancy_queries")) if launched else NA),
        ("CPU ops", num(p.get("cpu_ops"))),
        ("kernel families", families or "–" if gpu else NA),
    ]
    return table(["per step (average)", ""], rows, "kv")


def kernel_table(data: dict) -> str:
    kernels = _rows(data.get("kernels"))
    rows = []
    for k in kernels[:MAX_ROWS]:
        dec = k.get("decoded")
        lib = dec.get("library") if isinstance(dec, dict) else None
        ops = ", ".join(esc(o, 80) for o in list(_get(k, "ops", default={}))[:6])
        rows.append([name_cell(k.get("name")), esc(k.get("family"), 40),
                     esc(lib or "", 40), num(k.get("per_step")), us(k.get("avg_us")), us(k.get("min_us")),
                     us(k.get("max_us")), ops, f'<span class="decoded">{esc(decoded_fields(dec), 400)}</span>'])
    if not rows:
        return '<p class="missing">No GPU kernels in the steps.</p>'
    return table(["kernel", "family", "library", "/step", "avg µs", "min µs", "max µs", "launched by", "decoded"],
                 rows, "kernels", total=len(kernels), numeric=(3, 4, 5, 6))


def op_table(data: dict) -> str:
    ops = _rows(data.get("ops"))
    n = finite(data.get("steps")) or 1.0
    rows = []
    for o in ops[:MAX_ROWS]:
        total, own = finite(o.get("cpu_total_us")), finite(o.get("cpu_self_us"))
        names = "<br>".join(esc(_short(k), 100) for k in list(_get(o, "kernel_names", default={}))[:4])
        rows.append([f'<span class="name">{esc(o.get("name"))}</span>', num(o.get("per_step")),
                     us(None if total is None else total / n), us(None if own is None else own / n),
                     num(o.get("kernels")), names])
    if not rows:
        return '<p class="missing">No CPU ops in the steps.</p>'
    return table(["op", "/step", "CPU µs /step", "self µs /step", "kernels /step", "kernels it launched"], rows,
                 "ops", total=len(ops), numeric=(1, 2, 3, 4))


def zero_kernel_table(data: dict) -> str:
    zero = _rows(data.get("zero_kernel_ops"))
    if not zero:
        return ""
    rows = [[esc(z.get("name")), num(z.get("per_step"))] for z in zero[:MAX_ROWS]]
    return table(["op that launched no GPU work (metadata only)", "/step"], rows, "zero", total=len(zero),
                 numeric=(1,))


def gaps_table(data: dict) -> str:
    gaps = _rows(data.get("gpu_gaps"))
    if not gaps:
        return ""
    rows = [[esc(g.get("step"), 80), us(g.get("start_us")), us(g.get("dur_us")), esc(_short(g.get("after")), 120),
             esc(_short(g.get("before")), 120)] for g in gaps[:MAX_ROWS]]
    return table(["step", "at µs", "GPU idle µs", "after", "before"], rows, "gaps", numeric=(1, 2))


def input_notes(data: dict) -> str:
    """What reading the trace left out or repaired."""
    parts = []
    for word, key in (("skipped as malformed", "skipped_events"), ("repaired", "repaired_events")):
        counts = _get(data, key, default={})
        if isinstance(counts, dict) and counts:
            total = sum(v for v in counts.values() if isinstance(v, int))
            reasons = ", ".join(f"{esc(r, 120)}: {num(c)}" for r, c in list(counts.items())[:20])
            parts.append(f"{total:,} events {word} ({reasons})")
    return f'<p class="warn">Trace input: {"; ".join(parts)}.</p>' if parts else ""


# ---------------------------------------------------------------- diffs


def _diff_kernel_rows(d: dict) -> tuple[list, int]:
    rows = []
    n = 0
    for key, change in (("kernels_removed", "removed"), ("kernels_added", "added"), ("kernels_unchanged", "same")):
        for k in _rows(d.get(key)):
            n += 1
            if len(rows) >= MAX_ROWS:
                continue
            per, avg = k.get("per_step"), k.get("avg_us")
            if change == "same":
                a_per, b_per = _get(per, "a"), _get(per, "b")
                a_us, b_us = _get(avg, "a"), _get(avg, "b")
            elif change == "removed":
                a_per, b_per, a_us, b_us = per, None, avg, None
            else:
                a_per, b_per, a_us, b_us = None, per, None, avg
            rows.append([f'<span class="badge {change}">{change}</span>', name_cell(k.get("name")),
                         esc(k.get("family"), 40),
                         num(a_per), num(b_per), us(a_us), us(b_us)])
    return rows, n


def diff_tables(d: dict) -> str:
    out = []
    rows, n = _diff_kernel_rows(d)
    out.append("<h4>Kernels, A → B (byte-identical names)</h4>")
    out.append(table(["change", "kernel", "family", "A /step", "B /step", "A avg µs", "B avg µs"], rows, "diff",
                     total=n, numeric=(3, 4, 5, 6)) if rows else '<p class="missing">No kernels on either side.</p>')
    per = _get(d, "per_step", default={})
    a, b, delta = _get(per, "a", default={}), _get(per, "b", default={}), _get(per, "delta", default={})
    prow = []
    for key in a:
        fmt: Callable = us if key.endswith("_us") else num
        dv = finite(delta.get(key))
        prow.append([esc(key, 60), fmt(a.get(key)), fmt(b.get(key)),
                     ("+" if dv is not None and dv > 0 else "") + fmt(dv)])
    if prow:
        out.append("<h4>Per step</h4>" + table(["", "A", "B", "B − A"], prow, "kv", numeric=(1, 2, 3)))
    ops = [['<span class="badge removed">gone in B</span>', esc(o.get("name")), num(o.get("per_step"))]
           for o in _rows(d.get("ops_removed"))]
    ops += [['<span class="badge added">new in B</span>', esc(o.get("name")), num(o.get("per_step"))]
            for o in _rows(d.get("ops_added"))]
    if ops:
        out.append("<h4>CPU ops</h4>" + table(["change", "op", "/step"], ops[:MAX_ROWS], "diff-ops",
                                              total=len(ops), numeric=(2,)))
    by_op = _get(d, "kernels_by_op", default={})
    brow = []
    for side in ("a", "b"):
        for op, ks in list(_get(by_op, side, default={}).items()):
            if isinstance(ks, dict):
                brow.append([side.upper(), esc(op, 120),
                             "; ".join(f"{esc(_short(k), 120)} ×{num(c)}" for k, c in list(ks.items())[:12])])
    if brow:
        out.append("<details><summary>Kernels by the CPU op that launched them</summary>"
                   + table(["side", "op", "kernels (count over all steps)"], brow[:MAX_ROWS], "by-op",
                           total=len(brow)) + "</details>")
    verdict = _get(d, "verdict", default={})
    out.append(f"<p>Verdict: A {verdict_badge(verdict.get('a'))}, B {verdict_badge(verdict.get('b'))}</p>")
    return "".join(out)
