"""Writing a bench result: results.json (everything), results.csv (one flat row per case × variant),
results.md (the tables the README shows) and the terminal table. Files are replaced atomically (mlpfuse._io), so
a reader, or another run writing the same folder, never sees half a file.

JSON schema: {"meta": {command, timestamp, device, torch, cuda, triton, liger_kernel, mlpfuse, python,
peaks: {device, gemm_tflops: {dtype: TFLOP/s}, copy_gbps, how}, settings, notes}, "rows": [row, ...]}; a row has
the case (workload, activation, tokens, dim, hidden, dtype, mode, case), variant, peer, status (ok | wrong |
skipped | error), error, max_rel_error and errors (per output vs fp64), tolerance, gpu_us, gpu_spread_pct,
wall_us, wall_spread_pct, kernels, launches, memsets, memcpys, cpu_ops (per call), peak_mem_mb, resident_mb,
setup_ms, first_call_ms, compile_ms (what a variant pays once: setup + first call − a steady call; the tables
call it "one-time ms"), flops, min_bytes, intensity, floor_us, tflops, gbps, pct_of_floor, vs_best_peer (time
ratio to best_peer, < 1 is faster; GPU time, wall time on a CPU), vs_best_peer_wall (wall time against
best_peer_wall), speedup and speedup_wall (their inverses, > 1 is faster: kept for readers of older results),
vs_gemms (time over the `gemms-alone` row's: the block's projections alone; 1.00 = the activation is free).
Times are µs (ms where named), memory MiB, rates TFLOP/s and GB/s (1e9 bytes).

Every ratio mlpfuse prints is a time ratio, < 1 = faster, and says so in its column header.
"""

from __future__ import annotations

import csv
import json
import math
from itertools import groupby
from pathlib import Path

from mlpfuse._io import atomic_open, atomic_write_text
from mlpfuse.bench.sweep import BenchResult

CSV_FIELDS = (
    "workload activation tokens dim hidden dtype mode variant peer floor status error max_rel_error tolerance gpu_us "
    "gpu_spread_pct wall_us wall_spread_pct kernels launches memsets memcpys cpu_ops peak_mem_mb resident_mb "
    "setup_ms first_call_ms compile_ms flops min_bytes intensity floor_us tflops gbps pct_of_floor vs_best_peer "
    "best_peer vs_best_peer_wall best_peer_wall speedup speedup_wall vs_gemms"
).split()


def _clean(value):
    """JSON has no Infinity/NaN: a non-finite float (an infinite error) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def to_json(result: BenchResult) -> str:
    return json.dumps(_clean({"meta": result.meta, "rows": result.rows}), indent=2)


def write_json(result: BenchResult, path: Path) -> Path:
    atomic_write_text(path, to_json(result) + "\n")
    return path


def write_csv(result: BenchResult, path: Path, fields: list[str] = CSV_FIELDS) -> Path:
    """One CSV row per result row, the `fields` columns (absent values empty)."""
    with atomic_open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in fields})
    return path


# --- formatting shared by the Markdown and the terminal tables -------------------------------------------------


def _num(value, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def _rate(value) -> str:
    """Three significant digits without exponents: 512, 43.2, 0.0712."""
    if value is None:
        return "–"
    return f"{value:.0f}" if value >= 100 else (f"{value:.1f}" if value >= 1 else f"{value:.3g}")


def _time(us, spread) -> str:
    if us is None:
        return "–"
    return f"{us:.1f} ±{spread:.1f}%" if spread is not None else f"{us:.1f}"


def ratio(value) -> str:
    return "–" if value is None else f"{value:.3f}×"


# The one convention of every table: a time (or memory) over the reference's, < 1 is faster (smaller).
TIME_RATIO = "(time ratio, <1 faster)"


def vs_best(row: dict, suffix: str = ""):
    """The time ratio to the best peer; rows written before it was recorded carry only the speed-up."""
    if "vs_best_peer" + suffix in row:
        return row["vs_best_peer" + suffix]
    up = row.get("speedup" + suffix)
    return 1 / up if up else None


def versions_line(meta: dict, extra: tuple[str, ...] = ()) -> str:
    """`torch 2.13, CUDA none, Triton 3.6, liger-kernel not installed, mlpfuse 0.1.0`: a missing piece named as
    such, never a blank."""
    parts = [("torch", meta.get("torch"), "not installed"), ("CUDA", meta.get("cuda"), "none"),
             ("Triton", meta.get("triton"), "not installed")]
    parts += [(name, meta.get(name), "not installed") for name in extra]
    parts += [("liger-kernel", meta.get("liger_kernel"), "not installed"), ("mlpfuse", meta.get("mlpfuse"), "–")]
    return ", ".join(f"{name} {value or missing}" for name, value, missing in parts)


def method_line(meta: dict) -> str:
    """How the times were taken, as this run took them (no CUDA events or L2 flushes on a CPU run)."""
    settings = meta.get("settings") if isinstance(meta.get("settings"), dict) else {}
    text = f"{settings.get('rounds', '–')} interleaved rounds; "
    if meta.get("device_type") == "cuda" and settings.get("gpu_time"):
        text += f"GPU time: {settings['gpu_time']}; "
    elif meta.get("device_type") is not None:
        text += "no GPU time (a CPU run): every time is wall time; "
    return text + f"wall: {settings.get('wall_time', '–')}."


def _status(row: dict) -> str:
    if row["status"] == "ok":
        return "ok" if not row.get("error") else f"ok ({row['error']})"
    if row["status"] == "skipped":
        return row["error"] or "skipped"
    return f"{row['status']}: {row['error']}"


TABLE_COLUMNS = (
    ("variant", lambda r: r["variant"] + ("" if r["peer"] else " (floor)" if r.get("floor") else " *")),
    ("GPU µs", lambda r: _time(r["gpu_us"], r["gpu_spread_pct"])),
    ("wall µs/call", lambda r: _time(r["wall_us"], r["wall_spread_pct"])),
    (f"vs best peer {TIME_RATIO}", lambda r: ratio(vs_best(r))),
    (f"wall vs best peer {TIME_RATIO}", lambda r: ratio(vs_best(r, "_wall"))),
    ("vs GEMMs alone", lambda r: ratio(r.get("vs_gemms"))),
    ("kernels", lambda r: _num(r["kernels"], "{:g}")),
    ("launches", lambda r: _num(r["launches"], "{:g}")),
    ("CPU ops", lambda r: _num(r["cpu_ops"], "{:g}") if r["gpu_us"] is None else "–"),
    ("TFLOP/s", lambda r: _rate(r["tflops"])),
    ("GB/s", lambda r: _rate(r["gbps"])),
    ("% floor", lambda r: _num(r["pct_of_floor"], "{:.0f}%")),
    ("peak MiB", lambda r: _num(r["peak_mem_mb"])),
    ("1st call ms", lambda r: _num(r["first_call_ms"])),
    ("one-time ms", lambda r: _num(r["compile_ms"])),
    ("rel. err", lambda r: _num(r["max_rel_error"], "{:.1e}")),
    ("status", _status),
)


def table_columns(rows: list[dict]):
    """The table's columns minus those empty in every row (GPU time on a CPU, counts without the profiler)."""
    no_gpu = all(r["gpu_us"] is None for r in rows)
    # Without a GPU the headline ratio already is the wall-time one, and kernels/launches are all zero.
    hidden = (f"wall vs best peer {TIME_RATIO}", "kernels", "launches") if no_gpu else ()
    return [
        (h, fn)
        for h, fn in TABLE_COLUMNS
        if h in ("variant", "status") or (h not in hidden and any(fn(r) != "–" for r in rows))
    ]


def _cases(result: BenchResult):
    return groupby(result.rows, key=lambda r: r["case"])


def case_caption(rows: list[dict]) -> str:
    r = rows[0]
    floor = next((x["floor_us"] for x in rows if x.get("floor_us")), None)
    where = f"floor {floor:.1f} µs" if floor else "floor –"
    return (
        f"{r['case']} — {r['flops'] / 1e9:.2f} GFLOP, {r['min_bytes'] / 1e6:.1f} MB min traffic, "
        f"{r['intensity']:.0f} FLOP/B, {where}"
    )


def peaks_line(meta: dict) -> str:
    p = meta["peaks"]
    gemm = ", ".join(f"{dt} GEMM {v:.3g} TFLOP/s" for dt, v in p["gemm_tflops"].items())
    return f"measured peaks on {p['device']}: {gemm}; copy {p['copy_gbps']:.4g} GB/s"


RATIO_NOTE = ("`*` = mlpfuse; (floor) = the block's GEMMs alone, no activation: vs GEMMs alone is a variant's time "
              "over it (1.00× = the activation, its memory traffic and launches are free). Ratios are a variant's "
              "time over the best peer's (eager, torch.compile, Liger, eager in a CUDA graph) in the same run: < 1 is "
              "faster. % floor = max(FLOPs/peak, min bytes/bandwidth) / "
              "time. one-time ms = setup + first call − a steady call: compilation, autotuning, graph capture and "
              "kernel JIT where a variant has them, else first-call allocation and warm-up.")


def page_layout(meta: dict) -> dict:
    """What report.html shows of a sweep (as `report.Bench(rows=..., plots=..., **page_layout(meta))`): the header
    and table columns of results.md, handed to the report, which renders them without knowing the sweep."""
    try:
        peaks = peaks_line(meta)
    except (KeyError, TypeError, AttributeError, ValueError):
        peaks = None
    header = {"command": meta.get("command"), "timestamp": meta.get("timestamp"), "versions": versions_line(meta),
              "peaks": peaks, "method": method_line(meta) + " " + RATIO_NOTE, "notes": list(meta.get("notes") or [])}
    return {"header": header, "columns": table_columns, "caption": case_caption}


def markdown(result: BenchResult) -> str:
    meta = result.meta
    lines = [
        f"# mlpfuse bench — {meta['device']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"{meta['timestamp']}; {versions_line(meta)}  ",
        peaks_line(meta) + "  ",
        method_line(meta) + " " + RATIO_NOTE,
    ]
    for note in meta.get("notes", []):
        lines.append(f"\nNote: {note}")
    for _, group in _cases(result):
        rows = list(group)
        columns = table_columns(rows)
        heads = [h for h, _ in columns]
        lines += ["", f"### {case_caption(rows)}", "", "| " + " | ".join(heads) + " |"]
        lines.append("|" + "|".join("---" for _ in heads) + "|")
        for r in rows:
            cells = [fn(r).replace("|", "\\|") for _, fn in columns]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(result: BenchResult, path: Path) -> Path:
    atomic_write_text(path, markdown(result))
    return path


def print_table(result: BenchResult, console) -> None:
    from rich.table import Table

    from mlpfuse._console import unlimited

    status_width = None if unlimited(console.width) else 60  # off a terminal every cell prints whole
    console.print(peaks_line(result.meta))
    for _, group in _cases(result):
        rows = list(group)
        columns = table_columns(rows)
        table = Table(title=case_caption(rows), title_justify="left", show_lines=False)
        for head, _ in columns:
            table.add_column(head, overflow="fold", max_width=status_width if head == "status" else None)
        for r in rows:
            style = {"wrong": "red", "error": "red", "skipped": "dim"}.get(r["status"])
            if r["status"] == "ok" and (vs_best(r) or 2.0) <= 1.0 and not r["peer"] and not r.get("floor"):
                style = "green"
            table.add_row(*(fn(r) for _, fn in columns), style=style)
        console.print(table)
