"""Writing a model-lab result: results.json (everything), results.csv (one row per case × variant), results.md (a
table per case) and the terminal tables. Files are replaced atomically, as the other bench outputs are.

Row fields: model, model_type, weights, layers, mode, batch, seq, new_tokens, case, variant, dtype, status (ok |
skipped | error | wrong), error, time_ms (GPU time per call for prefill, decode-step and train on CUDA, else wall
time; decode: the host's wall ms per generated token), spread_pct, rounds, time_rounds_ms (each round's value),
wall_ms, unit, gpu_busy_ms (decode on CUDA: the GPU's busy ms per token, profiled), do_bench_ms (decode-step on CUDA:
the same graph replay under triton.testing.do_bench), full_logits_ms (prefill of a causal LM returning every
position's logits; time_ms keeps only the last, as generate does) — each of these three with its _spread_pct and
_rounds_ms —, peak_mem_mb (CUDA: the peak above what was allocated before the call, the weights' gradients freed
first), first_call_ms (compilation included; decode-step: building, compiling and capturing the step), rel_err
(last-position logits against the fp32 run, relative Frobenius), err_vs_eager, logits_vs_eager (relative difference
from eager's logits on the same input), vs_eager (time ratio, < 1 is faster), vs_eager_paired and
vs_eager_paired_range (the median, min and max over rounds of each round's time over eager's in the same round),
vs_compile, mem_vs_eager,
mem_vs_compile, patched (blocks mlpfuse swapped), floor_mb, floor_ms, of_floor (decode-step: the bytes the step
must read — every weight once, the whole static KV cache — that many at the device's measured copy rate, and that
time over the step's: the fraction of the bandwidth floor reached).
"""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

from mlpfuse._io import atomic_write_text
from mlpfuse.bench import outputs
from mlpfuse.bench.outputs import to_json, write_json  # noqa: F401 - same JSON layout as the block benchmarks
from mlpfuse.bench.sweep import BenchResult

CSV_FIELDS = (
    "model layers mode batch seq new_tokens variant dtype status error time_ms unit spread_pct rounds wall_ms "
    "gpu_busy_ms gpu_busy_spread_pct do_bench_ms do_bench_spread_pct full_logits_ms full_logits_spread_pct "
    "peak_mem_mb first_call_ms rel_err err_vs_eager logits_vs_eager vs_eager vs_eager_paired vs_compile mem_vs_eager "
    "mem_vs_compile patched floor_mb floor_ms of_floor"
).split()


def write_csv(result: BenchResult, path: Path) -> Path:
    return outputs.write_csv(result, path, CSV_FIELDS)


def _num(value, fmt="{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def _status(row) -> str:
    if row["status"] == "ok":
        return f"ok ({row['error']})" if row["error"] else "ok"
    return row["error"] if row["status"] == "skipped" else f"{row['status']}: {row['error']}"


def _timed(row, field: str, modes: tuple[str, ...], gpu_only: bool = True) -> str:
    """A second timing beside `time`, with its spread; n/a where it needs a GPU and this run had none."""
    if row["mode"] not in modes or row["status"] != "ok":
        return "–"
    if row[field] is None:
        return "n/a" if gpu_only else "–"
    base = field[:-3]
    return f"{row[field]:.3f} ±{row[base + '_spread_pct']:.1f}%"


def _paired(row) -> str:
    if row.get("vs_eager_paired") is None or row["variant"] == "eager":
        return "–"
    lo, hi = row["vs_eager_paired_range"]
    return f"{row['vs_eager_paired']:.3f} ({lo:.3f}–{hi:.3f})"


COLUMNS = (
    ("variant", lambda r: r["variant"] + (" *" if r["variant"].startswith("mlpfuse") else "")),
    ("time", lambda r: "–" if r["time_ms"] is None else f"{r['time_ms']:.3f} {r['unit']} ±{r['spread_pct']:.1f}%"),
    ("GPU busy ms/token", lambda r: _timed(r, "gpu_busy_ms", ("decode",))),
    ("do_bench ms", lambda r: _timed(r, "do_bench_ms", ("decode-step",))),
    ("bytes MiB", lambda r: _num(r.get("floor_mb"), "{:.4g}")),
    ("floor ms (bytes at copy rate)", lambda r: _num(r.get("floor_ms"), "{:.4g}")),
    ("% of floor", lambda r: _num(None if r.get("of_floor") is None else 100 * r["of_floor"], "{:.3g}%")),
    ("full logits ms", lambda r: _timed(r, "full_logits_ms", ("prefill",), gpu_only=False)),
    (f"vs eager {outputs.TIME_RATIO}", lambda r: outputs.ratio(r["vs_eager"])),
    ("vs eager per round (median, min–max)", _paired),
    (f"vs compile {outputs.TIME_RATIO}", lambda r: outputs.ratio(r["vs_compile"])),
    ("peak MiB", lambda r: _num(r["peak_mem_mb"], "{:.0f}")),
    ("mem vs eager (<1 smaller)", lambda r: outputs.ratio(r["mem_vs_eager"])),
    ("mem vs compile (<1 smaller)", lambda r: outputs.ratio(r.get("mem_vs_compile"))),
    ("logits rel. err vs fp32", lambda r: _num(r["rel_err"], "{:.2e}")),
    ("err vs eager (<1 smaller)", lambda r: outputs.ratio(r["err_vs_eager"])),
    ("logits diff vs eager", lambda r: _num(r["logits_vs_eager"], "{:.2e}")),
    ("1st call s", lambda r: _num(None if r["first_call_ms"] is None else r["first_call_ms"] / 1e3, "{:.1f}")),
    ("status", _status),
)


def table_columns(rows):
    return [(h, fn) for h, fn in COLUMNS if h in ("variant", "status") or any(fn(r) != "–" for r in rows)]


def case_caption(rows) -> str:
    r = rows[0]
    new = f", {r['new_tokens']} new tokens" if r["mode"] == "decode" else ""
    return f"{r['model']} — {r['mode']} {r['batch']}x{r['seq']}{new}, {r['dtype']}"


def markdown(result: BenchResult) -> str:
    meta, lab = result.meta, result.meta["lab"]
    on_gpu = meta.get("device_type") == "cuda"
    lines = [
        f"# mlpfuse model lab — {meta['device']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"{meta['timestamp']}; {outputs.versions_line(meta, ('transformers',))}  ",
        f"Model: {lab['model']} ({lab['layers']} layers, weights: {lab['weights']}), {lab['dtype']}, dropout off; "
        f"mlpfuse backend {lab['backend']}; compile backend {lab['compile_backend']}.  ",
        f"{lab['rounds']} interleaved rounds, median with spread (max − min) / median (results.json keeps every "
        "round). prefill: a no_grad forward keeping the last position's logits (`logits_to_keep=1`, what generate "
        "runs), and beside it the forward returning every position's logits; train: forward, loss and backward "
        "(all gradients); decode: greedy generate, (T(N+1 tokens) − T(1)) / N per token of host wall time"
        + (", and the GPU's busy time per token from a profile of the same calls" if on_gpu else "")
        + " — plain generate for the eager variants, a static cache with transformers' CompileConfig for "
        "the compile variants; decode-step: one decode step with a static cache at a fixed position, the "
        "same prompt and token for every variant, compiled with fullgraph=True for the compile variants, "
        + ("replayed from a CUDA graph (CUDA events, and triton.testing.do_bench of the same replay as a second "
           "harness). Times are GPU time (CUDA events) for prefill, decode-step and train, host wall time for "
           "decode. " if on_gpu else "called as is. Times are wall time (a CPU run); n/a: not measurable on a CPU. ")
        + "Ratios are a variant's time (memory, error) over eager's or compile's: < 1 is faster (smaller). "
        "`*` = mlpfuse.",
    ]
    for note in meta.get("notes", []):
        lines.append(f"\nNote: {note}")
    for _, group in groupby(result.rows, key=lambda r: r["case"]):
        rows = list(group)
        cols = table_columns(rows)
        lines += ["", f"### {case_caption(rows)}", "", "| " + " | ".join(h for h, _ in cols) + " |",
                  "|" + "|".join("---" for _ in cols) + "|"]
        for r in rows:
            lines.append("| " + " | ".join(fn(r).replace("|", "\\|") for _, fn in cols) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(result: BenchResult, path: Path) -> Path:
    atomic_write_text(path, markdown(result))
    return path


def print_tables(result: BenchResult, console) -> None:
    from rich.table import Table
    from rich.text import Text

    from mlpfuse._console import unlimited
    from mlpfuse.errors import printable

    status_width = None if unlimited(console.width) else 60  # off a terminal every cell prints whole
    for _, group in groupby(result.rows, key=lambda r: r["case"]):
        rows = list(group)
        cols = table_columns(rows)
        # The model's label is a folder's name: any text, shown literally with its control characters escaped.
        table = Table(title=Text(printable(case_caption(rows))), title_justify="left")
        for head, _ in cols:
            table.add_column(head, overflow="fold", max_width=status_width if head == "status" else None)
        for r in rows:
            style = {"wrong": "red", "error": "red", "skipped": "dim"}.get(r["status"])
            table.add_row(*(Text(printable(fn(r))) for _, fn in cols), style=style)
        console.print(table)
