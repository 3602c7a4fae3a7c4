"""Rich tables for analyses, diffs and expectation results. Renderers only read the dicts; they compute nothing.

Every string that came from a trace or a saved file (names, labels, paths, reasons) reaches the terminal as a
`Text` made by `cell`: never parsed as rich markup (`[bold]` stays literal, `oops[/]` cannot crash), and with
control characters shown as escapes, so ANSI/OSC sequences, bidi overrides or a lone surrogate in a kernel name
cannot restyle, rewrite or break the terminal.
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlpfuse._console import Console as _Console
from mlpfuse._console import unlimited
from mlpfuse.errors import printable
from mlpfuse.profiling.analysis import NA, gpu_measured

NAME_WIDTH = 70


def cell(value, style: str = "") -> Text:
    return Text(printable(value), style=style)


def short(name: str, width: int = NAME_WIDTH) -> str:
    """Keep kernel names readable: ATen template names run to hundreds of characters, and their first 70 say
    nothing; show those as `kernel<functor> dtype` (the JSON keeps every name in full)."""
    if len(name) <= width:
        return name
    from mlpfuse.profiling.kernel_names import decode

    d = decode(name)
    if d.library == "aten" and "op" in d.fields:
        compact = f"{d.fields['kernel']}<{d.fields['op']}>" + (f" {d.fields['dtype']}" if "dtype" in d.fields else "")
        if len(compact) <= width:
            return compact
    return name[: width - 1] + "…"


def _name(name: str, width: int = NAME_WIDTH) -> Text:
    return cell(short(name, width))


def _namer(width: int):
    """Names for tables printed `width` wide: shortened on a terminal, whole off it (a pipe or a file), where two
    kernels whose names differ only past the cut must stay two different rows."""
    whole = unlimited(width)
    return lambda name, limit=NAME_WIDTH: name if whole else short(name, limit)


def titled(title, width: int, **options) -> Table:
    """A table whose title, off a terminal, stays on one line however narrow the table (rich wraps a title to the
    table's width)."""
    title = title if isinstance(title, Text) else cell(title)
    if unlimited(width):
        title.no_wrap, title.overflow = True, "ignore"
    return Table(title=title, **options)


def _row(table: Table, *values) -> None:
    table.add_row(*(v if isinstance(v, Text) else cell(v) for v in values))


# Below this console width the kernel table leaves out its `decoded` column (the JSON keeps it).
WIDE = 120


def _fields(decoded: dict) -> str:
    skip = {"family", "flags", "index", "kind", "variant", "raster", "library"}
    parts = []
    for key, value in decoded.items():
        if key in skip:
            continue
        parts.append(f"{key}={'+'.join(value) if isinstance(value, list) else value}")
    return " ".join(parts)


def _fit(title, columns, rows, width: int) -> Table:
    """A table whose every cell stays on one line, within `width` where it can. Columns are (header, justify,
    narrowest): a column with a narrowest width is flexible (names); the flexible ones share what the others
    leave, and a cell longer than its column ends in an ellipsis instead of wrapping into what would read as
    further rows."""
    rows = [[v if isinstance(v, Text) else cell(v) for v in row] for row in rows]
    natural = [max([len(header)] + [row[i].cell_len for row in rows]) for i, (header, _, _) in enumerate(columns)]
    flexible = [i for i, c in enumerate(columns) if c[2] is not None]
    room = width - sum(w for i, w in enumerate(natural) if i not in flexible) - 3 * len(columns) - 1
    wanted = sum(natural[i] for i in flexible)
    widths = list(natural)
    if flexible and wanted > room:
        # Narrow columns first, each at most an even share of what is left: a short column (a family, an op name)
        # stays whole and the long kernel names take the rest, instead of every column losing the same fraction.
        left, pending = room, sorted(flexible, key=lambda i: natural[i])
        while pending:
            i = pending.pop(0)
            widths[i] = min(natural[i], max(columns[i][2], left // (len(pending) + 1)))
            left -= widths[i]
            _keep_apart([row[i] for row in rows], widths[i])
    # Off a terminal a row can be hundreds of characters wide: a title centred over it would start far right.
    table = titled(title, width, title_justify="left" if unlimited(width) else "center")
    for (header, justify, narrowest), w in zip(columns, widths):
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis",
                         max_width=w if narrowest is not None else None)
    for row in rows:
        table.add_row(*row)
    return table


def _keep_apart(cells: list[Text], width: int) -> None:
    """Cells that would read alike once cut to `width` with an ellipsis at the end are cut in the middle instead,
    in place: two ATen kernels stay `vectorized_e…ulFunctor> bf16` and `vectorized_e…elImpl> bf16`, not twice
    `vectorized_elementwise…`."""
    if width < 5:
        return
    seen: dict[str, set[str]] = {}
    for c in cells:
        if c.cell_len > width:
            seen.setdefault(c.plain[: width - 1], set()).add(c.plain)
    head = (width - 1) // 2
    tail = width - 1 - head
    for c in cells:
        if c.cell_len > width and len(seen[c.plain[: width - 1]]) > 1:
            text = c.plain
            c.truncate(0)
            c.append(text[:head] + "…" + text[-tail:])


def steps_line(data: dict) -> Text:
    """Where the steps came from and which were left out of the averages."""
    kind = data.get("step_source_kind")
    n, found = data["steps"], data.get("steps_found", data["steps"])
    if kind == "whole-trace":
        text = "steps: the whole trace as one window"
        if data.get("step_source_reason") != "chosen":
            text += " (no ProfilerStep#N spans; --label NAME or --steps-from choose others)"
    elif kind == "label":
        why = data.get("step_source_reason") or ""
        text = (f"steps: {found} span{'' if found == 1 else 's'} of label {data.get('step_label')!r}"
                + (f" ({why})" if why else ""))
    elif kind:
        text = f"steps: {found} ProfilerStep#N spans"
    else:  # an analysis saved before the step source was recorded
        text = f"steps: {n} ({data['step_source']})"
    left = data.get("steps_left_out") or []
    if left:
        names = ", ".join(s["name"] for s in left[:5]) + (", ..." if len(left) > 5 else "")
        text += f"; {n} averaged, left out of the averages: {names} ({left[0]['reason']})"
    return cell(text)


def analysis_tables(data: dict, width: int = WIDE) -> list[Table]:
    p = data["per_step"]
    head = titled(f"Per step (average over {data['steps']} steps, {data['step_source']})", width,
                 show_header=False)
    head.add_column("what", no_wrap=True)
    head.add_column("value")
    window = p["gpu_window_us"]
    share = f" ({p['gpu_busy_us'] / window:.0%} busy)" if window > 0 and p["gpu_busy_us"] else ""
    gpu, launches = gpu_measured(data)
    rows = [
        ("step wall time", f"{p['step_us']:.1f} us"),
        ("GPU window", f"{window:.1f} us" if gpu else NA),
        ("GPU busy / idle", f"{p['gpu_busy_us']:.1f} / {p['gpu_idle_us']:.1f} us{share}" if gpu else NA),
        ("GPU work starts", _after_step(p) if gpu else NA),
        ("GPU kernels", f"{p['gpu_kernels']:g}" if gpu else NA),
        ("memsets / memcpys", f"{p['gpu_memsets']:g} / {p['gpu_memcpys']:g}" if gpu else NA),
        ("launch calls", ", ".join(f"{k} {v:g}" for k, v in p["launch_calls_by_name"].items()) or "0"
         if launches else NA),
        ("occupancy queries", f"{p['occupancy_queries']:g}" if launches else NA),
        ("CPU ops", f"{p['cpu_ops']:g}"),
        ("kernel families", ", ".join(f"{k} {v:g}" for k, v in p["families"].items()) or "-" if gpu else NA),
    ]
    for what, value in rows:
        if value is not None:
            _row(head, what, value)

    wide = width >= WIDE
    name = _namer(width)
    kernels = _fit("GPU kernels (per step)",
                   [("kernel", "left", 20), ("family", "left", 6), ("/step", "right", None),
                    ("avg us", "right", None), ("launched by", "left", 8)] + ([("decoded", "left", 10)] * wide),
                   [[name(k["name"]), k["family"], f"{k['per_step']:g}", f"{k['avg_us']:.1f}", ", ".join(k["ops"])]
                    + ([_fields(k["decoded"])] * wide) for k in data["kernels"]], width)
    n = data["steps"]
    ops = _fit("CPU ops (per step)", [("op", "left", 20), ("/step", "right", None), ("total us", "right", None),
                                      ("self us", "right", None), ("kernels", "right", None)],
               [[name(o["name"], 60), f"{o['per_step']:g}", f"{o['cpu_total_us'] / n:.1f}",
                 f"{o['cpu_self_us'] / n:.1f}", f"{o['kernels']:g}"] for o in data["ops"]], width)
    tables = [head] + ([kernels] if data["kernels"] else []) + [ops]
    if data["zero_kernel_ops"]:
        tables.append(_fit("CPU ops that launched no GPU work (metadata only)",
                           [("op", "left", 20), ("/step", "right", None)],
                           [[z["name"], f"{z['per_step']:g}"] for z in data["zero_kernel_ops"]], width))
    if data["gpu_gaps"]:
        tables.append(_fit("Largest GPU idle gaps",
                           [("step", "left", 8), ("at us", "right", None), ("idle us", "right", None),
                            ("after", "left", 12), ("before", "left", 12)],
                           [[g["step"], f"{g['start_us']:.1f}", f"{g['dur_us']:.1f}", name(g["after"], 40),
                             name(g["before"], 40)] for g in data["gpu_gaps"]], width))
    return tables


def _after_step(p: dict) -> str | None:
    """When a step's GPU work starts, and how long launches wait in the GPU queue (None for the whole trace)."""
    ahead, queue, steps = p.get("cpu_ahead_us"), p.get("launch_to_start_us"), p.get("cpu_ahead_steps")
    if ahead is None:
        return None
    text = f"{ahead:.1f} us after the step's CPU start"
    if queue is not None:
        text += f"; launches wait {queue:.1f} us" + (f" ({steps:.2f} steps)" if steps is not None else "")
    return text


def verdict_line(data: dict) -> Text:
    v = data["verdict"]
    return cell(f"verdict: {v['kind']} — {v['reason']}")


def input_line(data: dict) -> Text | None:
    """What reading the trace left out or fixed (malformed, duplicate or oversized events), when anything."""
    parts = []
    for word, counts in (("skipped", data.get("skipped_events")), ("repaired", data.get("repaired_events"))):
        if counts:
            total = sum(counts.values())
            reasons = ", ".join(f"{reason}: {n}" for reason, n in counts.items())
            parts.append(f"{total} event{'' if total == 1 else 's'} {word} ({reasons})")
    return cell(f"trace input: {'; '.join(parts)}", style="yellow") if parts else None


def print_analysis(data: dict, console: Console | None = None) -> None:
    console = console or _Console()
    counts = Counter(data.get("devices") or [])
    devices = ", ".join(f"{n} x {d}" if n > 1 else d for d, n in counts.items()) or "no GPU recorded"
    console.print(Text.assemble(cell(data.get("trace", ""), style="bold"), cell(f"  ({devices})")))
    if (line := input_line(data)) is not None:
        console.print(line)
    console.print(steps_line(data))
    for t in analysis_tables(data, console.width):
        console.print(t)
    if data.get("modules"):
        from mlpfuse.profiling.modules import render as render_modules

        for line in render_modules(data["modules"]):
            console.print(cell(line))
    console.print(verdict_line(data))


def diff_tables(data: dict, width: int = WIDE) -> list[Table]:
    removed, added, gone, new = (cell(w, style) for w, style in (("removed", "red"), ("added", "green"),
                                                                 ("gone in B", "red"), ("new in B", "green")))
    name = _namer(width)
    rows = [[removed, name(k["name"]), k["family"], f"{k['per_step']:g}", "-", f"{k['avg_us']:.1f}", "-"]
            for k in data["kernels_removed"]]
    rows += [[added, name(k["name"]), k["family"], "-", f"{k['per_step']:g}", "-", f"{k['avg_us']:.1f}"]
             for k in data["kernels_added"]]
    rows += [["same", name(k["name"]), k["family"], f"{k['per_step']['a']:g}", f"{k['per_step']['b']:g}",
              f"{k['avg_us']['a']:.1f}", f"{k['avg_us']['b']:.1f}"] for k in data["kernels_unchanged"]]
    kernels = _fit("Kernels: A -> B (byte-identical names)",
                   [("change", "left", None), ("kernel", "left", 16), ("family", "left", 6),
                    ("A/step", "right", None), ("B/step", "right", None), ("A us", "right", None),
                    ("B us", "right", None)], rows, width)

    per = Table(title="Per step")
    for col in ("", "A", "B", "B - A"):
        per.add_column(col, justify="right" if col else "left")
    a, b, d = data["per_step"]["a"], data["per_step"]["b"], data["per_step"]["delta"]
    for key in a:
        fmt = "{:.1f}" if key.endswith("_us") else "{:g}"
        _row(per, key, fmt.format(a[key]), fmt.format(b[key]), ("+" if d[key] > 0 else "") + fmt.format(d[key]))

    ops = _fit("CPU ops: A -> B", [("change", "left", None), ("op", "left", 20), ("/step", "right", None)],
               [[gone, name(o["name"], 60), f"{o['per_step']:g}"] for o in data["ops_removed"]]
               + [[new, name(o["name"], 60), f"{o['per_step']:g}"] for o in data["ops_added"]], width)

    by_op = _fit("Kernels by the CPU op that launched them",
                 [("side", "left", None), ("op", "left", 12), ("kernels (count over all steps)", "left", 20)],
                 [[side.upper(), name(op, 50), "; ".join(f"{name(k, 60)} x{c}" for k, c in ks.items())]
                  for side in ("a", "b") for op, ks in data["kernels_by_op"][side].items()], width)
    return [t for t in (kernels, per, ops, by_op) if t.row_count]


def print_diff(data: dict, console: Console | None = None) -> None:
    console = console or _Console()
    console.print(cell(f"A = {data['a']}"))
    console.print(cell(f"B = {data['b']}"))
    for side in ("a", "b"):
        if (line := input_line({k: data.get(k, {}).get(side) for k in ("skipped_events", "repaired_events")})):
            console.print(Text.assemble(f"{side.upper()}: ", line))
    for t in diff_tables(data, console.width):
        console.print(t)
    console.print(cell(f"verdict: A {data['verdict']['a']}, B {data['verdict']['b']}"))


def print_expectations(results, console: Console | None = None) -> None:
    console = console or _Console()
    for r in results:
        status = cell(f"{r.status:9}", style="green" if r.ok else "red")
        console.print(Text.assemble(status, cell(f" {r.expectation}  (actual: {r.actual})")))
