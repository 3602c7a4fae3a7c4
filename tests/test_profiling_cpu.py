"""Capture on this machine (CPU activity) and analysis of hand-built traces with known answers."""

import gzip
import json

import pytest
import torch
from torch import nn

import mlpfuse
from mlpfuse.errors import InputError
from mlpfuse.profiling import analyze, profile


@pytest.fixture(scope="module")
def linear_profile(tmp_path_factory):
    layer = nn.Linear(32, 64, bias=True)
    x = torch.randn(8, 32)
    path = tmp_path_factory.mktemp("prof") / "linear.json.gz"
    with torch.no_grad():
        result = profile(layer, x, label="fwd", trace_path=str(path),
                         expect=["op=aten::addmm", "no-op=aten::add", "kernels=0", "gemm=1"])
    return result, path


def test_capture_writes_a_gzipped_chrome_trace_with_profiler_steps(linear_profile):
    result, path = linear_profile
    with gzip.open(path, "rt") as fh:
        trace = json.load(fh)
    steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    labels = [e for e in trace["traceEvents"] if e.get("name") == "fwd" and e.get("ph") == "X"]
    assert len(steps) == 3 and len(labels) == 3  # active=3 of steps=5
    assert trace["mlpfuse_label"] == "fwd"
    assert result.steps == 3 and result.trace_path == str(path)


def test_cpu_ops_of_nn_linear(linear_profile):
    result, _ = linear_profile
    for name in ("aten::linear", "aten::t", "aten::addmm"):
        assert result.op(name)["per_step"] == 1
    linear, addmm = result.op("aten::linear"), result.op("aten::addmm")
    assert linear["cpu_total_us"] >= addmm["cpu_total_us"]  # addmm runs inside linear
    assert linear["cpu_self_us"] < linear["cpu_total_us"]
    assert result.verdict["kind"] == "cpu-only"
    assert result.per_step["gpu_kernels"] == 0 and result.per_step["launch_calls"] == 0


def test_expectations_from_python(linear_profile):
    result, _ = linear_profile
    assert [(r.expectation, r.status) for r in result.expectations] == [
        ("op=aten::addmm", "confirmed"), ("no-op=aten::add", "confirmed"), ("kernels=0", "confirmed"),
        ("gemm=1", "broken")]
    assert [r.ok for r in result.check(["op=aten::add", "cpu-ops=999"])] == [False, False]


@pytest.mark.parametrize("bad", ["kernels", "kernels=five", "bogus=1", "op~=x", "=3"])
def test_expectation_parse_errors_before_capture(bad):
    called = []
    with pytest.raises(InputError):
        profile(lambda: called.append(1), expect=[bad])
    assert called == []


def test_schedule_arguments_are_checked():
    with pytest.raises(InputError, match="steps"):
        profile(lambda: None, steps=2)


def test_a_plain_torch_profiler_trace_is_one_window_unless_a_label_is_chosen(tmp_path):
    """A trace written by anyone's torch.profiler without a schedule: no ProfilerStep spans, so the whole trace is
    one window; the record_function spans become steps only when named."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, b)  # outside the labelled spans: only the whole-trace window holds it
        for _ in range(4):
            with record_function("my-iter"):
                torch.mm(a, b).relu()
    path = tmp_path / "plain.json"
    prof.export_chrome_trace(str(path))
    whole = analyze(str(path))
    assert whole.steps == 1 and whole.data["step_source_kind"] == "whole-trace"
    assert whole.op("aten::mm")["per_step"] == 5 and whole.op("aten::relu")["per_step"] == 4
    chosen = analyze(str(path), label="my-iter")
    assert chosen.steps == 4 and chosen.data["step_source"] == "label 'my-iter'"
    assert chosen.op("aten::mm")["per_step"] == 1 and chosen.op("aten::relu")["per_step"] == 1


def test_top_level_api_is_lazy_and_complete():
    assert mlpfuse.profile is profile and mlpfuse.analyze is analyze
    assert callable(mlpfuse.diff)


def _synthetic():
    """One step, one thread: op A (0-100) contains op B (10-40) which launches k1 at 12; A launches k2 at 50;
    op C (60-70) launches nothing. k1 runs 200-260, k2 250-300 (overlapping), memset 400-410."""
    X = lambda cat, name, ts, dur, **args: {"ph": "X", "cat": cat, "name": name, "pid": 1,
                                             "tid": 1 if cat not in ("kernel", "gpu_memset") else 7,
                                             "ts": ts, "dur": dur, "args": args}
    return {"traceEvents": [
        X("user_annotation", "ProfilerStep#7", 0, 500),
        X("cpu_op", "A", 1, 99), X("cpu_op", "B", 10, 30), X("cpu_op", "C", 60, 10),
        X("cuda_runtime", "cudaLaunchKernel", 12, 5, correlation=1),
        X("cuda_driver", "cuLaunchKernelEx", 50, 5, correlation=2),
        X("cuda_runtime", "cudaMemsetAsync", 52, 1, correlation=3),
        X("cuda_runtime", "cudaOccupancyMaxActiveBlocksPerMultiprocessor", 48, 1),
        X("kernel", "nvjet_sm90_tst_128x128_64x4_1x1_h_bz_TNT", 200, 60, correlation=1),
        X("kernel", "triton_poi_fused_add_0", 250, 50, correlation=2),
        X("gpu_memset", "Memset (Device)", 400, 10, correlation=3),
    ]}


def test_synthetic_trace_attribution_idle_and_counts():
    a = analyze(_synthetic())
    p = a.per_step
    assert (p["gpu_kernels"], p["gpu_memsets"], p["launch_calls"], p["occupancy_queries"]) == (2, 1, 2, 1)
    assert p["launch_calls_by_name"] == {"cudaLaunchKernel": 1, "cuLaunchKernelEx": 1}
    assert a.data["kernels_by_op"] == {"B": {"nvjet_sm90_tst_128x128_64x4_1x1_h_bz_TNT": 1},
                                       "A": {"triton_poi_fused_add_0": 1, "Memset (Device)": 1}}
    assert [z["name"] for z in a.data["zero_kernel_ops"]] == ["C"]
    # busy = [200, 300] + [400, 410] = 110; window = step 0..500
    assert p["gpu_busy_us"] == pytest.approx(110) and p["gpu_idle_us"] == pytest.approx(390)
    gaps = [(g["start_us"], g["dur_us"]) for g in a.data["gpu_gaps"]]
    assert gaps == [(0, 200), (300, 100), (410, 90)]
    assert a.op("A")["cpu_self_us"] == pytest.approx(99 - 30 - 10)
    assert (a.op("A")["kernels"], a.op("A")["gpu_activities"], a.op("B")["kernels"]) == (1, 2, 1)
    assert a.verdict["kind"] == "overhead-bound" and a.verdict["gpu_busy_share"] == pytest.approx(110 / 500)


def test_fused_module_calls_are_named_ops_in_the_trace(tmp_path):
    # Eager calls of the modules skip the dispatcher, so without a span of their own their kernels would be
    # attributed to whatever op encloses them; under the profiler each call is a mlpfuse:: CPU op around its work.
    import torch

    import mlpfuse
    from mlpfuse.profiling import trace as trace_mod

    gated = mlpfuse.GatedMLP(8, 16, activation="silu", backend="torch")
    linear = mlpfuse.FusedLinear(8, 16, activation="gelu", backend="torch")
    x = torch.randn(4, 8, requires_grad=True)
    path = tmp_path / "t.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (gated(x).sum() + linear(x).sum()).backward()
    prof.export_chrome_trace(str(path))
    ops = trace_mod.load(path).cpu_ops
    spans = {name: [e for e in ops if e.name == name] for name in ("mlpfuse::gated_mlp", "mlpfuse::linear_act")}
    for name, found in spans.items():
        assert len(found) == 1, name
        inner = [e for e in ops if e.name == "aten::linear" and found[0].ts <= e.ts and e.end <= found[0].end]
        assert len(inner) == (3 if name.endswith("gated_mlp") else 1), name  # the work it ran sits inside it
    before = len(ops)
    gated(x)  # profiler off: nothing is recorded, and the call still works
    assert before == len(trace_mod.load(path).cpu_ops)
