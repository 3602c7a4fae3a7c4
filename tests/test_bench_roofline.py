"""Roofline arithmetic against hand counts, torch's own FLOP counter, and the floors DESIGN.md lists for the H200."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mlpfuse.bench import roofline
from mlpfuse.bench.presets import Case
from mlpfuse.bench.variants import eager_module, make_problem


def test_gated_counts_by_hand():
    m, d, h = 8192, 768, 3072
    case = Case("geglu", "gelu_tanh", m, d, h, "bf16", "fwd")
    # three GEMMs (gate, up: M×D·D×H; down: M×H·H×D), 2 FLOPs per multiply-add
    assert roofline.flops(case) == 3 * (2 * m * d * h)
    # x read once, three D×H weights read once, y written once; 2 bytes each
    assert roofline.min_bytes(case) == 2 * (m * d + 3 * d * h + m * d)
    train = Case("geglu", "gelu_tanh", m, d, h, "bf16", "fwd+bwd")
    assert roofline.flops(train) == 3 * roofline.flops(case)
    # + dy read, dx and three dW written
    assert roofline.min_bytes(train) == 2 * (4 * m * d + 6 * d * h)


def test_mlp_and_linear_counts_by_hand():
    m, d, h = 64, 96, 160
    mlp = Case("mlp", "gelu", m, d, h, "fp32", "fwd")
    assert roofline.flops(mlp) == 2 * (2 * m * d * h)
    assert roofline.min_bytes(mlp) == 4 * (m * d + d * h + h + h * d + d + m * d)
    lin = Case("linear", "relu", m, d, h, "fp16", "fwd+bwd")
    assert roofline.flops(lin) == 3 * 2 * m * d * h
    fwd = m * d + h * d + h + m * h
    assert roofline.min_bytes(lin) == 2 * (fwd + m * h + m * d + h * d + h)
    assert roofline.intensity(lin) == roofline.flops(lin) / roofline.min_bytes(lin)


@pytest.mark.parametrize("workload", ["geglu", "mlp", "linear"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_flops_match_torch_flop_counter(workload, mode):
    """torch's FlopCounterMode counts the GEMMs the eager module really runs (including dX/dW in backward)."""
    case = Case(workload, "gelu_tanh", 24, 40, 56, "fp32", mode)
    problem = make_problem(case, torch.device("cpu"))
    module = eager_module(problem)
    with FlopCounterMode(display=False) as counter:
        y = module(problem.x)
        if mode == "fwd+bwd":
            y.backward(problem.dy)  # dX and dW of every GEMM, as autograd.grad in the bench computes them
    assert roofline.flops(case) == counter.get_total_flops()


def test_floors_of_design_table():
    """DESIGN.md's H200 table: floors of 171, 83, 3.4 and 512 µs at 680 TFLOP/s and 4.25 TB/s."""
    peaks = roofline.Peaks("H200", {"bf16": 680.0}, 4250.0)
    blog = Case("geglu", "gelu_tanh", 8192, 768, 3072, "bf16", "fwd")
    assert peaks.floor_us(blog) == pytest.approx(171, abs=0.5)
    assert peaks.compute_us(blog) > peaks.memory_us(blog)  # compute-bound
    decode = Case("geglu", "gelu_tanh", 16, 4096, 14336, "bf16", "fwd")
    assert peaks.floor_us(decode) == pytest.approx(83, abs=0.5)
    assert peaks.memory_us(decode) > peaks.compute_us(decode)  # weight-bandwidth-bound
    small = Case("geglu", "gelu_tanh", 64, 768, 3072, "bf16", "fwd")
    assert peaks.floor_us(small) == pytest.approx(3.4, abs=0.05)
    train = Case("geglu", "gelu_tanh", 8192, 768, 3072, "bf16", "fwd+bwd")
    assert peaks.floor_us(train) == pytest.approx(512, abs=1)


def test_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = torch.device("cpu")
    peaks = roofline.load_peaks(cpu, ["fp32"])
    path = roofline.cache_path(cpu)
    assert path.parent == tmp_path / "mlpfuse" and path.exists()
    assert peaks.gemm_tflops["fp32"] > 0 and peaks.copy_gbps > 0
    # A planted value proves the second call reads the cache instead of measuring again...
    data = json.loads(path.read_text())
    data["copy_gbps"] = 12345.0
    path.write_text(json.dumps(data))
    assert roofline.load_peaks(cpu, ["fp32"]).copy_gbps == 12345.0
    # ...a dtype not in the cache is measured and added, the others kept...
    data["gemm_tflops"] = {"bf16": 777.0}
    path.write_text(json.dumps(data))
    more = roofline.load_peaks(cpu, ["fp32"])
    assert more.copy_gbps == 12345.0 and more.gemm_tflops["bf16"] == 777.0 and more.gemm_tflops["fp32"] > 0
    assert set(json.loads(path.read_text())["gemm_tflops"]) == {"bf16", "fp32"}
    # ...and remeasure replaces everything.
    assert roofline.load_peaks(cpu, ["fp32"], remeasure=True).copy_gbps != 12345.0
