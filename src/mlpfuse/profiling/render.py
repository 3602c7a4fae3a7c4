"""Rich tables for analyses, diffs and expectation results. Renderers only read the dicts; they compute nothing."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

NAME_WIDTH = 70


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
    head = Table(title=f"Per step (average over {data['steps']} steps, {data['step_source']})", show_header=False)
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
        head.add_row(what, value)

    kernels = Table(title="GPU kernels (per step)")
    for col, justify in (("kernel", "left"), ("family", "left"), ("/step", "right"), ("avg us", "right"),
                         ("launched by", "left"), ("decoded", "left")):
        kernels.add_column(col, justify=justify, overflow="fold")
    for k in data["kernels"]:
        kernels.add_row(short(k["name"]), k["family"], f"{k['per_step']:g}", f"{k['avg_us']:.1f}",
                        ", ".join(k["ops"]), _fields(k["decoded"]))

    ops = Table(title="CPU ops (per step)")
    for col, justify in (("op", "left"), ("/step", "right"), ("total us", "right"), ("self us", "right"),
                         ("kernels", "right")):
        ops.add_column(col, justify=justify)
    n = data["steps"]
    for o in data["ops"]:
        ops.add_row(short(o["name"], 60), f"{o['per_step']:g}", f"{o['cpu_total_us'] / n:.1f}",
                    f"{o['cpu_self_us'] / n:.1f}", f"{o['kernels']:g}")

    tables = [head] + ([kernels] if data["kernels"] else []) + [ops]
    if data["zero_kernel_ops"]:
        zero = Table(title="CPU ops that launched no GPU work (metadata only)")
        zero.add_column("op")
        zero.add_column("/step", justify="right")
        for z in data["zero_kernel_ops"]:
            zero.add_row(z["name"], f"{z['per_step']:g}")
        tables.append(zero)
    if data["gpu_gaps"]:
        gaps = Table(title="Largest GPU idle gaps")
        for col in ("step", "at us", "idle us", "after", "before"):
            gaps.add_column(col, overflow="fold")
        for g in data["gpu_gaps"]:
            gaps.add_row(g["step"], f"{g['start_us']:.1f}", f"{g['dur_us']:.1f}", short(g["after"], 40),
                         short(g["before"], 40))
        tables.append(gaps)
    return tables


def verdict_line(data: dict) -> str:
    v = data["verdict"]
    return f"verdict: {v['kind']} — {v['reason']}"


def print_analysis(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    devices = ", ".join(data.get("devices") or []) or "no GPU recorded"
    console.print(f"[bold]{data.get('trace', '')}[/bold]  ({devices})")
    for t in analysis_tables(data):
        console.print(t)
    console.print(verdict_line(data))


def diff_tables(data: dict) -> list[Table]:
    kernels = Table(title="Kernels: A -> B (byte-identical names)")
    for col, justify in (("change", "left"), ("kernel", "left"), ("family", "left"), ("A /step", "right"),
                         ("B /step", "right"), ("A avg us", "right"), ("B avg us", "right")):
        kernels.add_column(col, justify=justify, overflow="fold")
    for k in data["kernels_removed"]:
        kernels.add_row("[red]removed[/red]", short(k["name"]), k["family"], f"{k['per_step']:g}", "-",
                        f"{k['avg_us']:.1f}", "-")
    for k in data["kernels_added"]:
        kernels.add_row("[green]added[/green]", short(k["name"]), k["family"], "-", f"{k['per_step']:g}", "-",
                        f"{k['avg_us']:.1f}")
    for k in data["kernels_unchanged"]:
        kernels.add_row("same", short(k["name"]), k["family"], f"{k['per_step']['a']:g}", f"{k['per_step']['b']:g}",
                        f"{k['avg_us']['a']:.1f}", f"{k['avg_us']['b']:.1f}")

    per = Table(title="Per step")
    for col in ("", "A", "B", "B - A"):
        per.add_column(col, justify="right" if col else "left")
    a, b, d = data["per_step"]["a"], data["per_step"]["b"], data["per_step"]["delta"]
    for key in a:
        fmt = "{:.1f}" if key.endswith("_us") else "{:g}"
        per.add_row(key, fmt.format(a[key]), fmt.format(b[key]), ("+" if d[key] > 0 else "") + fmt.format(d[key]))

    ops = Table(title="CPU ops")
    ops.add_column("change")
    ops.add_column("op")
    ops.add_column("/step", justify="right")
    for o in data["ops_removed"]:
        ops.add_row("[red]gone in B[/red]", short(o["name"], 60), f"{o['per_step']:g}")
    for o in data["ops_added"]:
        ops.add_row("[green]new in B[/green]", short(o["name"], 60), f"{o['per_step']:g}")

    by_op = Table(title="Kernels by the CPU op that launched them")
    by_op.add_column("side")
    by_op.add_column("op")
    by_op.add_column("kernels (count over all steps)", overflow="fold")
    for side in ("a", "b"):
        for op, ks in data["kernels_by_op"][side].items():
            by_op.add_row(side.upper(), short(op, 50), "; ".join(f"{short(k, 60)} x{c}" for k, c in ks.items()))
    return [t for t in (kernels, per, ops, by_op) if t.row_count]


def print_diff(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"A = {data['a']}\nB = {data['b']}")
    for t in diff_tables(data):
        console.print(t)
    console.print(f"verdict: A {data['verdict']['a']}, B {data['verdict']['b']}")


def print_expectations(results, console: Console | None = None) -> None:
    console = console or Console()
    for r in results:
        style = "green" if r.ok else "red"
        console.print(f"[{style}]{r.status:9}[/{style}] {r.expectation}  (actual: {r.actual})")
