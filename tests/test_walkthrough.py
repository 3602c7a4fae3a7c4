"""`mlpfuse walkthrough` end to end on CPU: every case profiled (or recorded as not run, with a reason), the
results folder complete, and the walkthrough's CPU-side facts visible in its own output files."""

import json
import os
from html import escape

import pytest

from cli_run import assert_one_error_line, close, run_cli, table
from mlpfuse import workloads
from mlpfuse.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The walkthrough as a user runs it: the console script, its output a pipe."""
    out = tmp_path_factory.mktemp("walkthrough")
    proc = run_cli("walkthrough", "--device", "cpu", "--out", out, "--steps", "3", "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "summary.json") as fh:
        return out, json.load(fh), proc


@pytest.fixture(scope="module")
def results(run):
    return run[:2]


def test_piped_output_carries_each_case_whole(run):
    out, summary, proc = run
    # Each case's section starts with its rule line; its CPU op table holds what its saved analysis holds.
    sections = {line.split(":")[0].removeprefix("── "): i for i, line in enumerate(proc.stdout.splitlines())
                if line.startswith("── ")}
    lines = proc.stdout.splitlines()
    for case in summary["cases"]:
        start = sections[case]
        end = min([i for i in sections.values() if i > start] + [len(lines)])
        data = json.loads((out / f"{case}.analysis.json").read_text())
        ops = table("\n".join(lines[start:end]), "CPU ops (per step)").dicts()
        assert len(ops) == len(data["ops"])
        for row, o in zip(ops, data["ops"]):
            assert row["op"] == o["name"] and close(row["total us"], o["cpu_total_us"] / data["steps"], 1)
    assert "Traceback" not in proc.stderr


def test_analyze_reads_the_walkthroughs_own_folder(run):
    out, summary, _ = run
    proc = run_cli("analyze", out)
    assert proc.returncode == 0, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1
    for case in summary["cases"]:
        assert f"{case}.analysis.json" in skipped[0]
        assert f"{out / case}.pt.trace.json.gz  (no GPU recorded)" in proc.stdout
    assert "summary.json" in skipped[0]
    data = json.loads(run_cli("analyze", out, "--json").stdout)
    assert data["schema"] == "mlpfuse.folder/1" and "summary.json" in data["skipped"]
    by_trace = {os.path.basename(t["trace"]): t for t in data["traces"]}
    assert set(by_trace) == {f"{case}.pt.trace.json.gz" for case in summary["cases"]}
    for case, saved in summary["cases"].items():  # the same analysis the walkthrough saved
        again = by_trace[f"{case}.pt.trace.json.gz"]
        assert [o["name"] for o in again["ops"]] == [o["name"] for o in saved["ops"]]
        assert again["per_step"]["step_us"] == pytest.approx(saved["per_step"]["step_us"])
    assert "separate runs" in assert_one_error_line(run_cli("diff", out))


def test_results_folder_has_traces_analyses_and_summary(results):
    out, summary = results
    files = set(os.listdir(out))
    assert {"summary.md", "summary.json"} <= files
    for case in summary["cases"]:
        assert f"{case}.pt.trace.json.gz" in files and f"{case}.analysis.json" in files
    run = set(summary["cases"]) | set(summary["failed"])
    assert run == {"linear-eager", "linear-compile", "geglu-mlp-eager", "geglu-mlp-compile", "linear-mlpfuse",
                   "geglu-mlp-mlpfuse"}
    for reason in summary["failed"].values():
        assert reason and "\n" not in reason


def test_cpu_walkthrough_facts(results):
    _, summary = results
    cases = summary["cases"]
    eager = {o["name"] for o in cases["linear-eager"]["ops"]}
    assert {"aten::linear", "aten::t", "aten::addmm"} <= eager
    assert all(c["verdict"]["kind"] == "cpu-only" and c["steps"] == 1 for c in cases.values())
    if "linear-compile" in cases:  # torch.compile needs a C++ compiler on CPU
        d = summary["diffs"]["linear-eager -> linear-compile"]
        assert "aten::t" in {o["name"] for o in d["ops_removed"]}
    mlp = {o["name"]: o["per_step"] for o in cases["geglu-mlp-eager"]["ops"]}
    assert mlp["aten::linear"] == 3 and mlp["aten::gelu"] == 1 and mlp["aten::mul"] == 1


def test_report_html_has_every_case(results):
    out, summary = results
    html = (out / "report.html").read_text()
    assert "could not be drawn" not in html and "No GPU in this run" in html
    for case in summary["cases"]:
        assert f"{case}.pt.trace.json.gz" in html and 'data-step="ProfilerStep#' in html
    for reason in summary["failed"].values():
        assert f"Not run: {escape(reason)}" in html
    assert html.count('class="timeline"') == len(summary["cases"])
    for title in summary["diffs"]:
        assert title.replace(">", "&gt;") in html


def test_summary_md_names_every_case(results):
    out, summary = results
    text = (out / "summary.md").read_text()
    for case in (*summary["cases"], *summary["failed"]):
        assert f"| {case} |" in text


def test_summary_md_says_what_a_cpu_run_shows_and_lists_diffs_both_ways(results):
    out, summary = results
    text = (out / "summary.md").read_text()
    assert "cannot show the kernel story" in text and "needs CUDA" in text and "pinned to 1" in text
    assert summary["threads"] == 1
    sections = text.split("\n## ")[1:]
    for section in sections:  # no heading without content
        heading, _, body = section.partition("\n")
        assert body.strip(), heading
    for title, d in summary["diffs"].items():
        body = next(s for s in sections if s.startswith(f"diff {title}\n"))
        for o in d["ops_removed"]:
            assert f"`{o['name']}`" in body.split("CPU ops gone:")[1].split("\n")[0]
        for o in d["ops_added"]:
            assert f"`{o['name']}`" in body.split("CPU ops new:")[1].split("\n")[0]
    if "linear-eager -> linear-compile" in summary["diffs"]:  # torch.compile needs a C++ compiler on CPU
        assert summary["diffs"]["linear-eager -> linear-compile"]["ops_added"]  # Dynamo's own ops are new in B


def test_threads_must_be_positive(tmp_path, capsys):
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_unavailable_variant_is_recorded_not_fatal(tmp_path, monkeypatch):
    # A real registry entry whose availability check fails the way a missing fused module would.
    broken = workloads.Variant("mlpfuse", "fused", workloads.VARIANTS["mlpfuse"].wrap,
                               lambda: (False, "mlpfuse.modules cannot be imported (ImportError: test)"))
    monkeypatch.setitem(workloads.VARIANTS, "mlpfuse", broken)
    monkeypatch.setattr("mlpfuse.walkthrough.CASES", [("linear-eager", "linear", "eager"),
                                                     ("linear-mlpfuse", "linear", "mlpfuse")])
    import torch

    before = torch.get_num_threads()
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--steps", "3"]) == 0
    assert torch.get_num_threads() == before  # the pinned thread count is the run's only
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["cases"]) == ["linear-eager"]
    assert "cannot be imported" in summary["failed"]["linear-mlpfuse"]


def test_walkthrough_ends_with_a_patched_model_layer(results):
    pytest.importorskip("transformers")
    out, summary = results
    keys = [k for k in summary["diffs"] if k.endswith(": eager -> mlpfuse.patch")]
    assert keys == ["llama3-8b (tiny), 1 layer 1x64 float32: eager -> mlpfuse.patch"]
    d = summary["diffs"][keys[0]]
    assert "mlpfuse::gated_mlp" in {o["name"] for o in d["ops_added"]}  # the layer's MLP, now one op
    assert f"## diff {keys[0]}" in (out / "summary.md").read_text()
    assert {"model-eager.pt.trace.json.gz", "model-mlpfuse.pt.trace.json.gz"} <= set(os.listdir(out / "model"))
