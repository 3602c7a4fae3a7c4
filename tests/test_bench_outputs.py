"""Result files from a real (tiny, CPU) run: JSON round-trips, CSV and Markdown hold the same rows, PNGs open."""

import csv
import functools
import json

import matplotlib.image
import pytest
import torch

from mlpfuse.bench import outputs, plots, roofline, sweep
from mlpfuse.bench.presets import Case
from mlpfuse.bench.variants import VARIANTS, Variant


def _nan_build(problem):
    def step():
        return torch.full((problem.case.tokens, problem.case.dim), float("nan"))

    return step


@functools.lru_cache(maxsize=1)
def _result():
    """One tiny CPU sweep, shared: the tests below only read it."""
    cases = [Case("swiglu", "silu", 8, 16, 32, "fp32", "fwd"), Case("mlp", "relu", 8, 16, 32, "fp32", "fwd+bwd")]
    variants = [VARIANTS["eager"], VARIANTS["mlpfuse-torch"], Variant("all-nan", _nan_build), VARIANTS["liger"]]
    peaks = roofline.Peaks("test-cpu", {"fp32": 0.05}, 10.0)
    settings = sweep.Settings(rounds=2, target_ms=1.0, warmup=1, profile=False)
    return sweep.run(cases, variants, torch.device("cpu"), peaks, settings, command="mlpfuse bench --test")


def test_files_are_written_and_parse(tmp_path):
    result = _result()
    assert len(result.rows) == 8
    data = json.loads(outputs.write_json(result, tmp_path / "r.json").read_text())  # strict JSON: no NaN/Infinity
    assert data["meta"]["command"] == "mlpfuse bench --test"
    assert data["meta"]["peaks"]["gemm_tflops"] == {"fp32": 0.05}
    nan_rows = [r for r in data["rows"] if r["variant"] == "all-nan"]
    assert [r["status"] for r in nan_rows] == ["wrong", "wrong"]
    assert all(r["max_rel_error"] is None for r in nan_rows)  # infinite error, written as null
    assert {r["status"] for r in data["rows"] if r["variant"] == "liger"} == {"skipped"}

    outputs.write_csv(result, tmp_path / "r.csv")
    with (tmp_path / "r.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(t["variant"], t["status"]) for t in table] == [(r["variant"], r["status"]) for r in result.rows]
    ok = [t for t in table if t["status"] == "ok"]
    assert ok and all(float(t["wall_us"]) > 0 and float(t["pct_of_floor"]) > 0 for t in ok)

    md = outputs.write_markdown(result, tmp_path / "r.md").read_text()
    sections = md.split("\n### ")[1:]
    assert len(sections) == 2
    for section in sections:
        lines = [ln for ln in section.splitlines() if ln.startswith("|")]
        header, rule, *body = lines
        assert len(body) == 4
        assert all(ln.count("|") == header.count("|") for ln in body)  # no cell broke the table
    assert "swiglu 8x16x32 fp32 fwd" in md and "skipped: needs CUDA" in md
    assert "measured peaks on test-cpu" in md


@pytest.mark.slow
def test_plots_for_a_sweep_and_for_single_shapes(tmp_path):
    result = _result()
    # one token count per shape: speed-ups drawn as bars
    for path in (plots.speedup_plot(result, tmp_path / "bars.png"), plots.roofline_plot(result, tmp_path / "roof.png")):
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and min(image.shape[:2]) > 200
    # a token sweep: lines
    cases = [Case("geglu", "gelu_tanh", t, 16, 32, "fp32", "fwd") for t in (4, 16, 64)]
    peaks = roofline.Peaks("test-cpu", {"fp32": 0.05}, 10.0)
    sweep_result = sweep.run(cases, [VARIANTS["eager"], VARIANTS["mlpfuse-torch"]], torch.device("cpu"), peaks,
                             sweep.Settings(rounds=1, target_ms=1.0, warmup=1, profile=False))
    image = matplotlib.image.imread(plots.speedup_plot(sweep_result, tmp_path / "lines.png"))
    assert image.ndim == 3 and min(image.shape[:2]) > 200


def test_every_ratio_is_a_time_ratio_and_says_so(tmp_path):
    result = _result()
    for r in result.rows:
        if r["status"] != "ok":
            continue
        best = min((p for p in result.rows if p["case"] == r["case"] and p["peer"] and p["status"] == "ok"),
                   key=lambda p: p["wall_us"])
        assert r["vs_best_peer"] == r["vs_best_peer_wall"] == r["wall_us"] / best["wall_us"]  # a CPU run: wall
        assert r["speedup"] * r["vs_best_peer"] == pytest.approx(1.0)  # the old key: its inverse, still written
    md = outputs.markdown(result)
    header = next(line for line in md.splitlines() if line.startswith("| variant |"))
    ratios = [h.strip() for h in header.split("|") if " vs " in h]
    assert ratios and all(h.endswith("(time ratio, <1 faster)") for h in ratios)
    row = next(line for line in md.splitlines() if line.startswith("| mlpfuse-torch * |"))
    cell = row.split("|")[header.split("|").index(f" {ratios[0]} ")].strip()
    first = next(r for r in result.rows if r["variant"] == "mlpfuse-torch")
    assert cell == f"{first['vs_best_peer']:.3f}×"
    # an older results.json, with the speed-up only, reads the same in the tables
    old = {k: v for k, v in first.items() if not k.startswith("vs_best_peer")}
    fn = dict(outputs.TABLE_COLUMNS)[ratios[0]]
    assert fn(old) == f"{1 / first['speedup']:.3f}×"


def test_a_cpu_result_names_what_it_lacks_and_how_it_was_timed():
    meta = _result().meta
    md = outputs.markdown(_result())
    assert "CUDA none" in md and ("liger-kernel not installed" in md) == (meta["liger_kernel"] is None)
    assert "CUDA ," not in md and "None" not in md.split("###")[0]
    assert "CUDA events" not in md and "L2" not in md and "no GPU time (a CPU run)" in md
    assert "one-time ms" in md and "compile ms" not in md
    from mlpfuse.report.bench import bench_section

    page = bench_section(rows=_result().rows, plots=[], **outputs.page_layout(meta))  # report.html's header too
    assert "CUDA none" in page and "CUDA ," not in page and "liger-kernel ," not in page
    assert "CUDA events" not in page and "L2" not in page and "no GPU time (a CPU run)" in page


def test_roofline_legend_covers_no_point(tmp_path, monkeypatch):
    result = _result()
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    plots.roofline_plot(result, tmp_path / "roof.png")
    plots.speedup_plot(result, tmp_path / "bars.png")
    for fig in figures:
        fig.canvas.draw()
        [ax] = fig.axes
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent())  # beside the axes: nothing drawn there is hidden
        assert legend.x1 <= fig.bbox.x1 + 1  # and inside the picture


def test_roofline_names_each_fused_point_against_the_gemms_alone(tmp_path, monkeypatch):
    cases = [Case("swiglu", "silu", 16, 16, 32, "fp32", "fwd")]
    peaks = roofline.Peaks("test-cpu", {"fp32": 0.05}, 10.0)
    result = sweep.run(cases, [VARIANTS["eager"], VARIANTS["gemms-alone"], VARIANTS["mlpfuse-torch"]],
                       torch.device("cpu"), peaks, sweep.Settings(rounds=1, target_ms=1.0, warmup=1, profile=False))
    by = {r["variant"]: r for r in result.rows}
    fused = by["mlpfuse-torch"]
    assert fused["vs_gemms"] == pytest.approx(fused["wall_us"] / by["gemms-alone"]["wall_us"])
    labels = plots.fusion_labels([r for r in result.rows if r["status"] == "ok"])
    assert labels == [(fused["intensity"], fused["tflops"], f"{fused['vs_gemms']:.2f}× GEMMs")]
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    plots.roofline_plot(result, tmp_path / "roof.png")
    [ax] = figures[0].axes
    assert [t.get_text() for t in ax.texts] == [labels[0][2]]
