"""PNG charts of a bench result: each variant's time ratio to the best peer against tokens (speedup.png; < 1 is
faster, as in every table), and each variant on this device's roofline."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window, works headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from mlpfuse._io import atomic_open  # noqa: E402
from mlpfuse.bench.outputs import vs_best  # noqa: E402
from mlpfuse.bench.sweep import BenchResult  # noqa: E402

_MARKERS = "osD^vP*Xh<>"
_RATIO_LABEL = "time / best peer's ({metric}; < 1 faster)"


def _save(fig, path: Path) -> None:
    """Write the PNG atomically and close the figure (also when writing fails)."""
    try:
        with atomic_open(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=110)
    finally:
        plt.close(fig)


def _legend_beside(ax) -> None:
    """The legend right of the axes, where it covers no point or bar."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _ok(rows):
    return [r for r in rows if r["status"] == "ok"]


def _style(variants: list[str]) -> dict[str, dict]:
    cmap = plt.get_cmap("tab10")
    return {v: {"color": cmap(i % 10), "marker": _MARKERS[i % len(_MARKERS)]} for i, v in enumerate(variants)}


def _variants(rows) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["variant"] not in seen:
            seen.append(r["variant"])
    return seen


def speedup_plot(result: BenchResult, path: Path) -> Path | None:
    """One panel per (workload, shape without tokens, dtype, mode): time over the best peer's against tokens."""
    rows = [r for r in _ok(result.rows) if vs_best(r)]
    if not rows:
        return None
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["activation"], r["dim"], r["hidden"], r["dtype"], r["mode"]), []).append(r)
    style = _style(_variants(result.rows))
    if all(len({r["tokens"] for r in grows}) == 1 for grows in groups.values()):
        return _speedup_bars(result, rows, style, path)
    n = len(groups)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    metric = "GPU time" if result.meta.get("device_type") == "cuda" else "wall time"
    for ax, (key, grows) in zip(axes.flat, groups.items()):
        for variant in _variants(grows):
            pts = sorted((r["tokens"], vs_best(r)) for r in grows if r["variant"] == variant)
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=variant, linestyle="-" if len(xs) > 1 else "none", **style[variant])
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["tokens"] for r in grows}))  # the measured token counts, nothing in between
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens")
        ax.set_ylabel(_RATIO_LABEL.format(metric=metric))
        wl, act, d, h, dt, md = key
        ax.set_title(f"{wl}[{act}] D={d} H={h} {dt} {md}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"mlpfuse bench on {result.meta['device']}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return path


def _speedup_bars(result: BenchResult, rows, style, path: Path) -> Path:
    """No token sweep to draw a line along: one group of bars per case instead."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = _variants(rows)
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases) * max(1, len(variants) / 4)) + 2.0, 4.5))
    for i, v in enumerate(variants):
        xs, ys = [], []
        for j, case in enumerate(cases):
            row = next((r for r in rows if r["case"] == case and r["variant"] == v), None)
            if row:
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                ys.append(vs_best(row))
        ax.bar(xs, ys, width=width, label=v, color=style[v]["color"])
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=7, rotation=15, ha="right")
    metric = "GPU time" if result.meta.get("device_type") == "cuda" else "wall time"
    ax.set_ylabel(_RATIO_LABEL.format(metric=metric))
    ax.set_title(f"mlpfuse bench on {result.meta['device']}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    _legend_beside(ax)
    fig.tight_layout()
    _save(fig, path)
    return path


def fusion_labels(rows) -> list[tuple[float, float, str]]:
    """(intensity, TFLOP/s, text) beside each mlpfuse point of a case with a `gemms-alone` row: its time over the
    projections' alone (1.00× = the activation, its traffic and launches are free)."""
    return [(r["intensity"], r["tflops"], f"{r['vs_gemms']:.2f}× GEMMs") for r in rows
            if not r["peer"] and not r.get("floor") and r.get("vs_gemms") and r.get("tflops")]


def roofline_plot(result: BenchResult, path: Path) -> Path | None:
    """Arithmetic intensity (FLOPs / min bytes) vs achieved TFLOP/s, under the measured compute and memory roofs."""
    rows = [r for r in _ok(result.rows) if r.get("tflops")]
    if not rows:
        return None
    peaks = result.meta["peaks"]
    bw_tbs = peaks["copy_gbps"] / 1e3
    style = _style(_variants(result.rows))
    fig, ax = plt.subplots(figsize=(10.5, 5.5))
    lo = min(r["intensity"] for r in rows) / 4
    hi = max(max(r["intensity"] for r in rows) * 4, 10.0)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for i, (dtype, tflops) in enumerate(sorted(peaks["gemm_tflops"].items())):
        if not any(r["dtype"] == dtype for r in rows):
            continue
        label = f"roof: {dtype} GEMM {tflops:.3g} TFLOP/s, copy {bw_tbs:.3g} TB/s"
        roof = [min(tflops, x * bw_tbs) for x in xs]
        ax.plot(xs, roof, color="black", linewidth=1.2 - 0.3 * i, linestyle=["-", "--", ":"][i % 3], label=label)
    labelled = set()
    for r in rows:
        v = r["variant"]
        ax.scatter(r["intensity"], r["tflops"], label=None if v in labelled else v, s=28, alpha=0.85,
                   color=style[v]["color"], marker=style[v]["marker"])
        labelled.add(v)
    for x, y, text in fusion_labels(rows):
        ax.annotate(text, (x, y), xytext=(5, -9), textcoords="offset points", fontsize=7, color="dimgray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("arithmetic intensity (FLOP per byte of minimal traffic)")
    ax.set_ylabel("achieved TFLOP/s")
    metric = "GPU time" if result.meta.get("device_type") == "cuda" else "wall time"
    ax.set_title(f"Roofline on {result.meta['device']} ({metric})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _legend_beside(ax)  # inside, the roof labels are long enough to hide the points they explain
    fig.tight_layout()
    _save(fig, path)
    return path
