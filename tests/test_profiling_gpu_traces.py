"""The walkthrough's facts, read from real traces captured on an NVIDIA H200 with mlpfuse's own capture code
(tests/fixtures/traces/README.md has the command). Each fact is checked through `analyze` / `diff`, and the
counts are cross-checked against a raw reading of the JSON that shares no code with mlpfuse.profiling."""

import gzip
import json
import os

import pytest

from mlpfuse.profiling import analyze, diff
from mlpfuse.profiling.kernel_names import decode

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "traces")


def fixture(name):
    return os.path.join(HERE, f"{name}.json.gz")


def raw(name):
    with gzip.open(fixture(name), "rt") as fh:
        return json.load(fh)["traceEvents"]


def raw_kernels_per_step(name):
    """Independent oracle: kernel events launched inside ProfilerStep spans, divided by the number of steps."""
    events = raw(name)
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    names = []
    for e in events:
        if e.get("cat") == "kernel":
            ts = launch_ts[e["args"]["correlation"]]
            if any(s["ts"] <= ts <= s["ts"] + s["dur"] for s in steps):
                names.append(e["name"])
    return names, len(steps)


@pytest.fixture(scope="module")
def an():
    return {n: analyze(fixture(n)) for n in ("linear_eager", "linear_compile", "geglu_eager", "geglu_compile")}


def test_fixtures_are_small_real_gpu_traces():
    for name in ("linear_eager", "linear_compile", "geglu_eager", "geglu_compile"):
        assert os.path.getsize(fixture(name)) < 300_000
        with gzip.open(fixture(name), "rt") as fh:
            assert "H200" in json.load(fh)["deviceProperties"][0]["name"]


@pytest.mark.parametrize("name", ["linear_eager", "linear_compile", "geglu_eager", "geglu_compile"])
def test_kernel_counts_match_a_raw_reading(an, name):
    names, steps = raw_kernels_per_step(name)
    a = an[name]
    assert a.steps == steps == 3
    assert a.per_step["gpu_kernels"] == len(names) / steps
    assert {k["name"] for k in a.kernels if k["family"] not in ("memset", "copy")} == set(names)


def test_linear_eager_is_one_bias_gemm_and_t_launches_nothing(an):
    a = an["linear_eager"]
    assert a.per_step["gpu_kernels"] == 1
    assert a.per_step["families"]["gemm"] == 1
    (gemm,) = a.kernel_names("gemm")
    assert "bias" in gemm and decode(gemm).fields["epilogue"] == ["bias"]
    # the GEMM is attributed to aten::addmm through the launch's correlation id
    assert gemm in a.data["kernels_by_op"]["aten::addmm"]
    addmm = a.op("aten::addmm")
    assert addmm["kernels"] == 1 and addmm["gpu_activities"] == 2  # the GEMM and a memset
    assert a.op("aten::t")["kernels"] == 0
    assert "aten::t" in {z["name"] for z in a.data["zero_kernel_ops"]}
    assert a.op("aten::add") is None
    assert [r.ok for r in a.check(["kernels=1", "gemm=1", "no-op=aten::add", "op=aten::addmm", "kernel~=bias"])] \
        == [True] * 5


def test_linear_compiled_keeps_the_same_kernel_and_drops_the_view_ops(an):
    eager, compiled = an["linear_eager"], an["linear_compile"]
    assert compiled.kernel_names("gemm") == eager.kernel_names("gemm")
    d = diff(fixture("linear_eager"), fixture("linear_compile"))
    assert d.kernels_removed == [] and d.kernels_added == []
    assert {"aten::t", "aten::transpose", "aten::linear"} <= {o["name"] for o in d.to_dict()["ops_removed"]}


def test_geglu_eager_is_three_gemms_and_two_elementwise(an):
    a = an["geglu_eager"]
    assert a.per_step["gpu_kernels"] == 5
    assert a.per_step["families"]["gemm"] == 3
    assert a.per_step["families"]["elementwise"] == 2
    assert a.per_step["gpu_memsets"] == 2  # counted apart from kernels
    functors = {decode(n).fields["op"] for n in a.kernel_names("elementwise")}
    assert functors == {"GeluCUDAKernelImpl", "MulFunctor"}
    by_op = a.data["kernels_by_op"]
    assert set(by_op["aten::gelu"]) == {n for n in a.kernel_names("elementwise") if "Gelu" in n}


def test_geglu_compiled_keeps_the_gemm_names_and_fuses_gelu_mul(an):
    eager, compiled = an["geglu_eager"], an["geglu_compile"]
    assert compiled.per_step["families"]["gemm"] == 3
    assert set(compiled.kernel_names("gemm")) == set(eager.kernel_names("gemm"))
    (fused,) = compiled.kernel_names("triton_pointwise")
    assert compiled.per_step["families"]["triton_pointwise"] == 1
    assert {"gelu", "mul"} <= set(decode(fused).fields["fused_ops"])
    assert "elementwise" not in compiled.per_step["families"]


def test_diff_eager_to_compiled_lists_exactly_the_fusion(an):
    d = diff(fixture("geglu_eager"), fixture("geglu_compile")).to_dict()
    eager = an["geglu_eager"]
    assert {k["name"] for k in d["kernels_removed"]} == set(eager.kernel_names("elementwise"))
    assert [k["name"] for k in d["kernels_added"]] == an["geglu_compile"].kernel_names("triton_pointwise")
    unchanged = {k["name"] for k in d["kernels_unchanged"] if k["family"] == "gemm"}
    assert unchanged == set(eager.kernel_names("gemm"))
    assert d["per_step"]["a"]["gpu_kernels"] == 5 and d["per_step"]["b"]["gpu_kernels"] == 4
    assert {"aten::t", "aten::gelu", "aten::mul"} <= {o["name"] for o in d["ops_removed"]}
    # grouped by launching op: the fused kernel is launched by its own Inductor op in B
    fused = d["kernels_added"][0]["name"]
    assert d["kernels_by_op"]["b"][fused] == {fused: 3}


def test_gpu_busy_is_the_union_of_gpu_intervals(an):
    """Oracle: merge kernel + memset intervals of each step by hand."""
    events = raw("geglu_eager")
    steps = sorted((e for e in events if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    busy = []
    for s in steps:
        iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memset")
                    and s["ts"] <= launch_ts[e["args"]["correlation"]] <= s["ts"] + s["dur"])
        total, cur = 0.0, None
        for a, b in iv:
            if cur is None or a > cur[1]:
                total += (cur[1] - cur[0]) if cur else 0.0
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        busy.append(total + cur[1] - cur[0])
    a = an["geglu_eager"]
    assert a.per_step["gpu_busy_us"] == pytest.approx(sum(busy) / len(busy), rel=1e-9)
    assert a.per_step["gpu_idle_us"] == pytest.approx(a.per_step["gpu_window_us"] - a.per_step["gpu_busy_us"])
    assert all(g["dur_us"] > 0 for g in a.data["gpu_gaps"])


def test_verdict_states_its_numbers(an):
    for a in an.values():
        v = a.verdict
        assert v["kind"] in ("compute-bound", "overhead-bound")
        share = a.per_step["gpu_busy_us"] / a.per_step["gpu_window_us"]
        assert v["gpu_busy_share"] == pytest.approx(share)
        assert (v["kind"] == "compute-bound") == (share >= v["threshold"])
        assert f"{share:.0%}" in v["reason"]


def test_training_trace_decodes_backward_kernels():
    a = analyze(fixture("geglu_eager_train"))
    layouts = {decode(n).fields.get("layout") for n in a.kernel_names("gemm")}
    assert {"TNT", "NNT", "NTT"} <= layouts  # forward and the two backward GEMM layouts
    assert a.per_step["gpu_memcpys"] == 1
    assert any(decode(n).fields.get("op") == "GeluBackwardCUDAKernelImpl" for n in a.kernel_names("elementwise"))


def test_cli_text_output_shows_the_story(capsys, monkeypatch):
    from mlpfuse.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["analyze", fixture("linear_eager")]) == 0
    out = capsys.readouterr().out
    assert "epilogue=bias" in out and "aten::addmm" in out and "verdict: overhead-bound" in out
    assert main(["diff", fixture("geglu_eager"), fixture("geglu_compile")]) == 0
    out = capsys.readouterr().out
    removed = [k["name"] for k in diff(fixture("geglu_eager"), fixture("geglu_compile")).to_dict()["kernels_removed"]]
    assert len(removed) == 2
    # Captured output is no terminal: the two elementwise kernels print under their whole names.
    for text in ("removed", *removed, "added", "triton_poi_fused__unsafe_view_gelu_mul_0", "gone in B", "aten::t"):
        assert text in out, text


def test_terminal_tables_show_aten_kernels_in_short():
    import io

    from rich.console import Console

    from mlpfuse.profiling import render

    buf = io.StringIO()
    render.print_diff(diff(fixture("geglu_eager"), fixture("geglu_compile")).to_dict(), Console(file=buf, width=200))
    out = buf.getvalue()
    for text in ("vectorized_elementwise_kernel<GeluCUDAKernelImpl> bf16",
                 "vectorized_elementwise_kernel<MulFunctor> bf16"):
        assert text in out, text
    # On a narrow terminal names are cut, but two that differ only past the cut still read as two
    buf = io.StringIO()
    render.print_diff(diff(fixture("geglu_eager"), fixture("geglu_compile")).to_dict(), Console(file=buf, width=80))
    removed = [line.split("│")[2].strip() for line in buf.getvalue().splitlines() if line.startswith("│ removed")]
    assert len(removed) == len(set(removed)) == 2 and all("…" in name for name in removed)
    assert max(len(line) for line in buf.getvalue().splitlines()) <= 80
