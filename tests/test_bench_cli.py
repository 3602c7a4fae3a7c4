"""`mlpfuse bench` end to end on the CPU through the real CLI: exit codes, files written and parseable."""

import csv
import json

import matplotlib.image
import pytest

from mlpfuse.cli import main

TINY = ["bench", "--tokens", "8,32", "--dim", "32", "--hidden", "64", "--rounds", "1", "--target-ms", "1"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("MLPFUSE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--preset", "nope"], "--preset: unknown preset 'nope'; expected one of blog, llama-8b"),
        (["--variants", "eager,fast"], "--variants: unknown variant 'fast'; expected one of eager, compile"),
        (["--workload", "attention"], "--workload: unknown value 'attention'; expected one of geglu, swiglu"),
        (["--dtype", "int8"], "--dtype: unknown value 'int8'; expected one of bf16, fp16, fp32"),
        (["--mode", "backward"], "--mode: unknown value 'backward'"),
        (["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N"),
        (["--rounds", "0"], "--rounds: expected an integer >= 1"),
        (["--precision", "fp4"], "--precision: expected fp8 (or leave it out), got 'fp4'"),
        (["--model", "llama3-8b", "--tiny", "--precision", "int8"], "--precision: expected fp8 (or leave it out)"),
    ],
)
def test_bad_input_exits_2_with_one_line(flags, expected, capsys, tmp_path):
    assert main(["bench", *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlpfuse: error: " + expected)
    assert not (tmp_path / "o").exists()  # nothing ran


def test_out_that_is_a_file_exits_2_before_measuring(tmp_path, capsys):
    (tmp_path / "o").write_text("not a folder")
    assert main([*TINY, "--device", "cpu", "--dtype", "fp32", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mlpfuse: error: --out {tmp_path / 'o'}: exists and is not a folder"]  # as profile says it
    assert not (tmp_path / "cache").exists()  # the peaks were not measured


def test_tiny_cpu_run_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # a wide terminal: the table's cells stay on one line
    out = tmp_path / "run"
    flags = ["--workload", "geglu,mlp", "--mode", "fwd,fwd+bwd", "--variants", "eager,mlpfuse-torch,eager-cudagraph",
             "--device", "cpu"]
    assert main([*TINY, *flags, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "vs best peer" in stdout and "skipped: needs CUDA" in stdout

    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * 3  # tokens × workloads × modes × variants
    assert data["meta"]["device_type"] == "cpu" and data["meta"]["peaks"]["gemm_tflops"]["fp32"] > 0
    assert data["meta"]["command"].startswith("mlpfuse bench --tokens 8,32 --dim 32 --hidden 64 --workload geglu,mlp")
    assert "--device cpu" in data["meta"]["command"]
    eager = [r for r in rows if r["variant"] == "eager"]
    assert all(r["status"] == "ok" and r["wall_us"] > 0 and r["max_rel_error"] < 1e-5 for r in eager)
    assert all(r["status"] == "skipped" for r in rows if r["variant"] == "eager-cudagraph")
    peaks = data["meta"]["peaks"]
    for r in eager:
        # the derived numbers follow from the raw ones: % of floor and speed-up by hand
        floor = max(r["flops"] / (peaks["gemm_tflops"]["fp32"] * 1e12), r["min_bytes"] / (peaks["copy_gbps"] * 1e9))
        assert r["pct_of_floor"] == pytest.approx(floor * 1e6 / r["wall_us"] * 100)
        assert r["tflops"] == pytest.approx(r["flops"] / (r["wall_us"] * 1e-6) / 1e12)
        assert r["speedup"] == pytest.approx(1.0) and r["best_peer"] == "eager"  # the only peer that ran
    fused = [r for r in rows if r["variant"] == "mlpfuse-torch"]
    assert all(r["status"] == "ok" and r["max_rel_error"] < 1e-5 for r in fused)
    for r in fused:
        twin = next(e for e in eager if e["case"] == r["case"])
        assert r["speedup"] == pytest.approx(twin["wall_us"] / r["wall_us"])
    # mlpfuse's profiler counted something per call where it ran (CPU ops on a CPU)
    assert all(r["cpu_ops"] is None or r["cpu_ops"] > 0 for r in eager)

    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert {(t["variant"], t["status"]) for t in table} == {(r["variant"], r["status"]) for r in rows}
    assert float(table[0]["flops"]) == rows[0]["flops"]

    md = (out / "results.md").read_text()
    assert md.count("\n### ") == 8 and "| eager |" in md and "measured peaks on" in md

    for name in ("speedup.png", "roofline.png"):
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    html = (out / "report.html").read_text()  # the same tables, and both plots inlined
    assert html.count('src="data:image/png;base64,') == 2 and html.count("<h4>") == 8
    assert html.count("<tr>") - html.count("<table") == len(rows) and "could not be drawn" not in html


def test_json_flag_prints_the_result(tmp_path, capsys):
    assert main([*TINY, "--variants", "eager", "--json", "--no-plots", "--no-profile", "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in printed["rows"]] == ["eager", "eager"]
    assert not (tmp_path / "speedup.png").exists()


def test_list_names_every_variant(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("blog", "decode", "eager-cudagraph", "mlpfuse-triton", "liger", "swiglu"):
        assert name in out


def test_precision_fp8_runs_bf16_and_fp8_rows_with_their_errors(tmp_path):
    """--precision fp8 without --variants: bf16's rows and the FP8 ones; on the CPU the FP8 block runs the recipe's
    reference path with FP8's error, and the CUDA-only rows are skipped with why."""
    assert main(["bench", "--precision", "fp8", "--tokens", "16", "--dim", "128", "--hidden", "256", "--workload",
                 "swiglu", "--rounds", "1", "--target-ms", "1", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "o" / "results.json").read_text())["rows"]}
    assert list(rows) == ["eager", "compile", "eager-cudagraph", "mlpfuse", "mlpfuse-cudagraph", "fp8-gemms-alone",
                          "fp8-scaled-mm-compile", "torchao-fp8", "mlpfuse-fp8", "mlpfuse-fp8-cudagraph"]
    assert rows["mlpfuse-fp8"]["status"] == "ok" and 1e-2 < rows["mlpfuse-fp8"]["max_rel_error"] < 0.12
    assert rows["eager"]["max_rel_error"] < 1e-5
    assert all(rows[v]["status"] == "skipped" for v in ("fp8-gemms-alone", "torchao-fp8", "mlpfuse-fp8-cudagraph"))
