"""Rich tables for analyses, diffs and expectation results. Renderers only read the dicts; they compute nothing.

Every string that came from a trace or a saved file (names, labels, paths, reasons) reaches the terminal as a
`Text` made by `cell`: never parsed as rich markup (`[bold]` stays literal, `oops[/]` cannot crash), and with
control characters shown as escapes, so ANSI/OSC sequences, bidi overrides or a lone surrogate in a kernel name
cannot restyle, rewrite or break the terminal.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlpfuse.errors import printable

NAME_WIDTH = 70


class _Console(Console):
    """rich exits 1 by itself when stdout's reader goes away; let the BrokenPipeError reach the CLI, which exits
    quietly with 141 as other tools do."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


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


def _row(table: Table, *values) -> None:
    table.add_row(*(v if isinstance(v, Text) else cell(v) for v in values))


def _fields(decoded: dict) -> str:
    skip = {"family", "flags", "index", "kind", "variant", "raster", "library"}
    parts = []
    for key, value in decoded.items():
        if key in skip:
            continue
        parts.append(f"{key}={'+'.join(value) if isinstance(value, list) else value}")
    return " ".join(parts)


def analysis_tables(data: dict) -> list[Table]:
    p = data["per_step"]
    head = Table(title=cell(f"Per step (average over {data['steps']} steps, {data['step_source']})"),
                 show_header=False)
    head.add_column("what")
    head.add_column("value", justify="right")
    rows = [
        ("step wall time", f"{p['step_us']:.1f} us"),
        ("GPU busy / idle", f"{p['gpu_busy_us']:.1f} / {p['gpu_idle_us']:.1f} us"),
        ("GPU kernels", f"{p['gpu_kernels']:g}"),
        ("memsets / memcpys", f"{p['gpu_memsets']:g} / {p['gpu_memcpys']:g}"),
        ("launch calls", ", ".join(f"{k} {v:g}" for k, v in p["launch_calls_by_name"].items()) or "0"),
        ("occupancy queries", f"{p['occupancy_queries']:g}"),
        ("CPU ops", f"{p['cpu_ops']:g}"),
        ("kernel families", ", ".join(f"{k} {v:g}" for k, v in p["families"].items()) or "-"),
    ]
    for what, value in rows:
        _row(head, what, value)

    kernels = Table(title="GPU kernels (per step)")
    for col, justify in (("kernel", "left"), ("family", "left"), ("/step", "right"), ("avg us", "right"),
                         ("launched by", "left"), ("decoded", "left")):
        kernels.add_column(col, justify=justify, overflow="fold")
    for k in data["kernels"]:
        _row(kernels, _name(k["name"]), k["family"], f"{k['per_step']:g}", f"{k['avg_us']:.1f}", ", ".join(k["ops"]),
             _fields(k["decoded"]))

    ops = Table(title="CPU ops (per step)")
    for col, justify in (("op", "left"), ("/step", "right"), ("total us", "right"), ("self us", "right"),
                         ("kernels", "right")):
        ops.add_column(col, justify=justify)
    n = data["steps"]
    for o in data["ops"]:
        _row(ops, _name(o["name"], 60), f"{o['per_step']:g}", f"{o['cpu_total_us'] / n:.1f}",
             f"{o['cpu_self_us'] / n:.1f}", f"{o['kernels']:g}")

    tables = [head] + ([kernels] if data["kernels"] else []) + [ops]
    if data["zero_kernel_ops"]:
        zero = Table(title="CPU ops that launched no GPU work (metadata only)")
        zero.add_column("op")
        zero.add_column("/step", justify="right")
        for z in data["zero_kernel_ops"]:
            _row(zero, z["name"], f"{z['per_step']:g}")
        tables.append(zero)
    if data["gpu_gaps"]:
        gaps = Table(title="Largest GPU idle gaps")
        for col in ("step", "at us", "idle us", "after", "before"):
            gaps.add_column(col, overflow="fold")
        for g in data["gpu_gaps"]:
            _row(gaps, g["step"], f"{g['start_us']:.1f}", f"{g['dur_us']:.1f}", _name(g["after"], 40),
                 _name(g["before"], 40))
        tables.append(gaps)
    return tables


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
    devices = ", ".join(data.get("devices") or []) or "no GPU recorded"
    console.print(Text.assemble(cell(data.get("trace", ""), style="bold"), cell(f"  ({devices})")))
    if (line := input_line(data)) is not None:
        console.print(line)
    for t in analysis_tables(data):
        console.print(t)
    console.print(verdict_line(data))


def diff_tables(data: dict) -> list[Table]:
    removed, added, gone, new = (cell(w, style) for w, style in (("removed", "red"), ("added", "green"),
                                                                 ("gone in B", "red"), ("new in B", "green")))
    kernels = Table(title="Kernels: A -> B (byte-identical names)")
    for col, justify in (("change", "left"), ("kernel", "left"), ("family", "left"), ("A /step", "right"),
                         ("B /step", "right"), ("A avg us", "right"), ("B avg us", "right")):
        kernels.add_column(col, justify=justify, overflow="fold")
    for k in data["kernels_removed"]:
        _row(kernels, removed, _name(k["name"]), k["family"], f"{k['per_step']:g}", "-", f"{k['avg_us']:.1f}", "-")
    for k in data["kernels_added"]:
        _row(kernels, added, _name(k["name"]), k["family"], "-", f"{k['per_step']:g}", "-", f"{k['avg_us']:.1f}")
    for k in data["kernels_unchanged"]:
        _row(kernels, "same", _name(k["name"]), k["family"], f"{k['per_step']['a']:g}", f"{k['per_step']['b']:g}",
             f"{k['avg_us']['a']:.1f}", f"{k['avg_us']['b']:.1f}")

    per = Table(title="Per step")
    for col in ("", "A", "B", "B - A"):
        per.add_column(col, justify="right" if col else "left")
    a, b, d = data["per_step"]["a"], data["per_step"]["b"], data["per_step"]["delta"]
    for key in a:
        fmt = "{:.1f}" if key.endswith("_us") else "{:g}"
        _row(per, key, fmt.format(a[key]), fmt.format(b[key]), ("+" if d[key] > 0 else "") + fmt.format(d[key]))

    ops = Table(title="CPU ops")
    ops.add_column("change")
    ops.add_column("op")
    ops.add_column("/step", justify="right")
    for o in data["ops_removed"]:
        _row(ops, gone, _name(o["name"], 60), f"{o['per_step']:g}")
    for o in data["ops_added"]:
        _row(ops, new, _name(o["name"], 60), f"{o['per_step']:g}")

    by_op = Table(title="Kernels by the CPU op that launched them")
    by_op.add_column("side")
    by_op.add_column("op")
    by_op.add_column("kernels (count over all steps)", overflow="fold")
    for side in ("a", "b"):
        for op, ks in data["kernels_by_op"][side].items():
            _row(by_op, side.upper(), _name(op, 50), "; ".join(f"{short(k, 60)} x{c}" for k, c in ks.items()))
    return [t for t in (kernels, per, ops, by_op) if t.row_count]


def print_diff(data: dict, console: Console | None = None) -> None:
    console = console or _Console()
    console.print(cell(f"A = {data['a']}"))
    console.print(cell(f"B = {data['b']}"))
    for side in ("a", "b"):
        if (line := input_line({k: data.get(k, {}).get(side) for k in ("skipped_events", "repaired_events")})):
            console.print(Text.assemble(f"{side.upper()}: ", line))
    for t in diff_tables(data):
        console.print(t)
    console.print(cell(f"verdict: A {data['verdict']['a']}, B {data['verdict']['b']}"))


def print_expectations(results, console: Console | None = None) -> None:
    console = console or _Console()
    for r in results:
        status = cell(f"{r.status:9}", style="green" if r.ok else "red")
        console.print(Text.assemble(status, cell(f" {r.expectation}  (actual: {r.actual})")))
