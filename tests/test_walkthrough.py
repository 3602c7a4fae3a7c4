"""`mlpfuse walkthrough` end to end on CPU: every case profiled (or recorded as not run, with a reason), the
results folder complete, and the walkthrough's CPU-side facts visible in its own output files."""

import json
import os
from html import escape

import pytest

from mlpfuse import workloads
from mlpfuse.cli import main


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("walkthrough")
    before = torch.get_num_threads()
    assert main(["walkthrough", "--device", "cpu", "--out", str(out), "--steps", "3", "--threads", "1"]) == 0
    assert torch.get_num_threads() == before  # the pinned thread count is the run's only
    with open(out / "summary.json") as fh:
        return out, json.load(fh)


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
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--steps", "3"]) == 0
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
