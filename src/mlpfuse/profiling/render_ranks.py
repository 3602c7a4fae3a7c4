"""Rich tables for `analyze DIR` (per-rank traces of one run). Reads the RankAnalysis dict; computes nothing."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from mlpfuse.profiling.render import WIDE, _Console, _namer, _row, cell, print_analysis, titled


def _pct(share) -> str:
    return "-" if share is None else f"{share:.0%}"


def _us(value: float) -> str:
    return f"{value:.0f}" if value >= 1000 else f"{value:.1f}"


def rank_table(data: dict, width: int = WIDE) -> Table:
    t = titled(f"Per rank, per step ({len(data['per_rank'])} of world_size {data['world_size']}); comm: "
               f"communication kernels, busy: GPU busy, overlap: comm time overlapped by compute", width,
               box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "steps", "step us", "busy us", "kernels", "comm", "comm us", "comm %", "overlap"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in data["per_rank"]:
        _row(t, str(r["rank"]), str(r["steps"]), _us(r["step_us"]), _us(r["gpu_busy_us"]), f"{r['gpu_kernels']:g}",
             f"{r['comm_kernels']:g}", _us(r["comm_us"]), _pct(r["comm_share"]), _pct(r["overlap_share"]))
    m = data["merged"]
    t.add_section()
    _row(t, "all", "", _us(m["step_us"]), _us(m["gpu_busy_us"]), f"{m['gpu_kernels']:g}", f"{m['comm_kernels']:g}",
         _us(m["comm_us"]), _pct(m["comm_share"]), _pct(m["overlap_share"]))
    return t


def comm_table(data: dict, width: int = WIDE) -> Table:
    name = _namer(width)
    t = Table(title="Communication kernels (all ranks)")
    for col, justify in (("kernel", "left"), ("ranks", "right"), ("count", "right"), ("total us", "right")):
        t.add_column(col, justify=justify, overflow="fold")
    for k in data["merged"]["communication_kernels"]:
        _row(t, name(k["name"]), str(k["ranks"]), str(k["count"]), _us(k["total_us"]))
    return t


def skew_line(data: dict):
    s = data["skew"]
    ratio = "-" if s["ratio"] is None else f"{s['ratio']:.3f}x"
    text = (f"rank skew: slowest rank {s['slowest_rank']} ({s['slowest_step_us']:.1f} us/step) vs fastest rank "
            f"{s['fastest_rank']} ({s['fastest_step_us']:.1f}); {s['skew_us']:.1f} us per step on average, "
            f"{ratio} (matched by {s['matched_by']})")
    worst = s.get("worst_step")
    if worst:
        text += (f"; worst {worst['step']}: rank {worst['slowest_rank']} {worst['slowest_us']:.1f} us vs rank "
                 f"{worst['fastest_rank']} {worst['fastest_us']:.1f} us")
    return cell(text)


def print_ranks(data: dict, console: Console | None = None) -> None:
    console = console or _Console()
    console.print(cell(data["directory"], style="bold"))
    console.print(rank_table(data, console.width))
    if data["merged"]["communication_kernels"]:
        console.print(comm_table(data, console.width))
    console.print(skew_line(data))


def print_folder(data: dict, console: Console | None = None) -> None:
    """One of mlpfuse's own results folders: each trace's analysis in turn."""
    console = console or _Console()
    n = len(data["traces"])
    console.print(cell(f"{data['directory']}: {n} trace{'s' if n > 1 else ''} of separate runs (no ranks), each "
                       f"analysed on its own", style="bold"))
    for trace in data["traces"]:
        console.rule()
        print_analysis(trace, console)
