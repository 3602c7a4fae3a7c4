"""The agreement check flags real wrong computations; failing variants become rows; the reference is right."""

import math

import numpy as np
import pytest
import torch

from mlpfuse.bench import roofline, sweep
from mlpfuse.bench.presets import Case
from mlpfuse.bench.variants import VARIANTS, Variant, as_step, make_problem, reference

CPU = torch.device("cpu")
PEAKS = roofline.Peaks("test-cpu", {"fp32": 0.1, "fp16": 0.1, "bf16": 0.1}, 10.0)
FAST = sweep.Settings(rounds=1, target_ms=1.0, warmup=1, profile=False)


def _run(cases, variants):
    return {(r["case"], r["variant"]): r for r in sweep.run(cases, variants, CPU, PEAKS, FAST).rows}


def _swapped_build(problem):
    """act(up(x)) * gate(x): a real, plausible bug (gate and up weights swapped)."""
    p = problem.params
    act = torch.nn.functional.gelu

    def forward(x):
        return (act(x @ p["up_weight"].T, approximate="tanh") * (x @ p["gate_weight"].T)) @ p["down_weight"].T

    return as_step(forward, problem)


def _detached_up_build(problem):
    """A forward that is exactly right whose backward is wrong: no gradient flows through the up branch."""
    p = problem.params
    act = torch.nn.functional.gelu

    def forward(x):
        up = (x @ p["up_weight"].T).detach()
        return (act(x @ p["gate_weight"].T, approximate="tanh") * up) @ p["down_weight"].T

    def build_step():
        step = as_step(forward, problem)

        def with_zero_grad():
            # autograd.grad refuses an input it cannot reach; a buggy implementation returns zeros instead
            y = forward(problem.x)
            wrt = [problem.x, *problem.params.values()]
            grads = torch.autograd.grad(y, wrt, problem.dy, allow_unused=True)
            return (y, *(torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)))

        return with_zero_grad if problem.train else step

    return build_step()


def _exploding_build(problem):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nsecond line of detail")


def test_wrong_forward_is_flagged_and_not_timed():
    case = Case("geglu", "gelu_tanh", 16, 32, 48, "fp32", "fwd")
    wrong = Variant("swapped", _swapped_build)
    rows = _run([case], [VARIANTS["eager"], wrong])
    bad, good = rows[(case.label, "swapped")], rows[(case.label, "eager")]
    assert good["status"] == "ok" and good["max_rel_error"] < 1e-5 and good["wall_us"] > 0
    assert bad["status"] == "wrong"
    assert bad["error"].startswith("y rel. error")
    assert bad["max_rel_error"] > 0.05
    assert bad["wall_us"] is None and bad["gpu_us"] is None and bad["speedup"] is None


def test_wrong_gradient_is_flagged_although_forward_is_right():
    fwd = Case("geglu", "gelu_tanh", 16, 32, 48, "fp32", "fwd")
    train = Case("geglu", "gelu_tanh", 16, 32, 48, "fp32", "fwd+bwd")
    v = Variant("detached-up", _detached_up_build)
    rows = _run([fwd, train], [VARIANTS["eager"], v])
    assert rows[(fwd.label, "detached-up")]["status"] == "ok"
    bad = rows[(train.label, "detached-up")]
    assert bad["status"] == "wrong"
    assert bad["errors"]["y"] < 1e-5
    assert bad["errors"]["dup_weight"] == pytest.approx(1.0)  # all zeros: the whole norm is missing
    assert bad["errors"]["dx"] > 0.05
    assert rows[(train.label, "eager")]["status"] == "ok"


def test_nan_output_is_wrong():
    case = Case("linear", "relu", 8, 16, 24, "fp32", "fwd")

    def build(problem):
        def step():
            y = torch.relu(problem.x @ problem.params["weight"].T + problem.params["bias"])
            y[0, 0] = float("nan")
            return y

        return step

    row = _run([case], [VARIANTS["eager"], Variant("nan", build)])[(case.label, "nan")]
    assert row["status"] == "wrong" and math.isinf(row["max_rel_error"])


def test_a_failing_variant_is_recorded_and_the_sweep_goes_on():
    cases = [Case("swiglu", "silu", t, 16, 32, "fp32", "fwd") for t in (4, 8)]
    rows = _run(cases, [Variant("boom", _exploding_build, peer=True), VARIANTS["eager"], VARIANTS["liger"]])
    for case in cases:
        boom = rows[(case.label, "boom")]
        assert boom["status"] == "error"
        assert boom["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
        assert rows[(case.label, "eager")]["status"] == "ok"
        assert rows[(case.label, "eager")]["best_peer_wall"] == "eager"  # the failed peer is no best peer
        assert rows[(case.label, "liger")]["status"] == "skipped"
        assert rows[(case.label, "liger")]["error"].startswith("skipped:")


@pytest.mark.parametrize("workload, activation", [("geglu", "gelu_tanh"), ("swiglu", "silu"), ("mlp", "gelu"),
                                                  ("linear", "relu2")])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_eager_agrees_with_reference_everywhere(workload, activation, mode):
    case = Case(workload, activation, 8, 16, 24, "fp32", mode)
    row = _run([case], [VARIANTS["eager"]])[(case.label, "eager")]
    assert row["status"] == "ok", row["error"]
    grads = {"dx", *(f"d{k}" for k in make_problem(case, CPU).params)}
    assert set(row["errors"]) == ({"y"} if mode == "fwd" else {"y", *grads})
    assert row["max_rel_error"] < 1e-5


def test_reference_matches_numpy_float64():
    """The fp64 reference against an independent numpy evaluation of the GeGLU formula."""
    case = Case("geglu", "gelu_tanh", 5, 7, 11, "fp32", "fwd")
    problem = make_problem(case, CPU, seed=3)
    x = problem.x.detach().double().numpy()
    g, u, w = (problem.params[k].detach().double().numpy() for k in ("gate_weight", "up_weight", "down_weight"))
    a = x @ g.T
    gelu = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))
    expected = (gelu * (x @ u.T)) @ w.T
    np.testing.assert_allclose(reference(problem)[0].numpy(), expected, rtol=1e-12, atol=1e-12)


def test_variants_share_weights_and_inputs():
    """Every variant's modules hold the problem's own tensors, not copies."""
    from mlpfuse.bench.variants import eager_module

    problem = make_problem(Case("mlp", "gelu", 4, 8, 12, "fp32", "fwd"), CPU)
    module = eager_module(problem)
    assert module.fc1.weight is problem.params["fc1_weight"]
    assert module.fc2.bias is problem.params["fc2_bias"]


@pytest.mark.parametrize("workload, activation, cls", [("geglu", "gelu_tanh", "GatedMLP"), ("mlp", "gelu", "MLP"),
                                                       ("linear", "relu2", "FusedLinear")])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_mlpfuse_variants_time_the_drop_in_module_over_the_problems_own_weights(workload, activation, cls, mode,
                                                                              monkeypatch):
    """Module against module: the mlpfuse rows run GatedMLP / MLP / FusedLinear.forward (with its call plan), as a
    user's swapped-in model does, on the problem's parameters; and they agree with the fp64 reference."""
    from mlpfuse import modules

    calls = []
    real = getattr(modules, cls).forward

    def counted(self, x):
        calls.append(type(self).__name__)
        return real(self, x)

    monkeypatch.setattr(getattr(modules, cls), "forward", counted)
    case = Case(workload, activation, 8, 16, 24, "fp32", mode)
    row = _run([case], [VARIANTS["mlpfuse-torch"]])[(case.label, "mlpfuse-torch")]
    assert row["status"] == "ok", row["error"]
    assert row["max_rel_error"] < 1e-5
    assert calls and set(calls) == {cls}
    if mode == "fwd+bwd":  # gradients of the problem's own tensors: the module holds them, not copies
        assert set(row["errors"]) == {"y", "dx", *(f"d{k}" for k in make_problem(case, CPU).params)}


def _fp8_swapped_build(problem):
    """The FP8 block with gate and up weights swapped: a bug the FP8 tolerance must still catch."""
    from mlpfuse import modules

    p = problem.params
    lin = lambda w: torch.nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)  # noqa: E731
    g, u, d = lin(p["up_weight"]), lin(p["gate_weight"]), lin(p["down_weight"])
    for m, w in ((g, p["up_weight"]), (u, p["gate_weight"]), (d, p["down_weight"])):
        m.weight.copy_(w.detach())
    return as_step(modules.GatedMLP.from_linears(g, u, d, problem.case.activation).to_fp8(), problem)


def test_fp8_rows_are_checked_at_the_fp8_tolerance_and_still_catch_a_swapped_operand():
    """mlpfuse-fp8 on the CPU (the recipe's reference path): its error is FP8's (far above fp32's tolerance, under
    FP8's), the same block with gate and up swapped is flagged, and the CUDA-only FP8 rows say why they skip."""
    case = Case("swiglu", "silu", 32, 256, 512, "fp32", "fwd")
    names = ["eager", "mlpfuse-fp8", "fp8-gemms-alone", "fp8-scaled-mm-compile", "torchao-fp8"]
    rows = _run([case], [VARIANTS[n] for n in names] + [Variant("fp8-swapped", _fp8_swapped_build, fp8=True)])
    fp8, eager = rows[(case.label, "mlpfuse-fp8")], rows[(case.label, "eager")]
    assert eager["status"] == "ok" and eager["tolerance"] == 5e-3
    assert fp8["status"] == "ok" and fp8["tolerance"] == 0.12 and 5e-3 < fp8["max_rel_error"] < 0.12
    assert rows[(case.label, "fp8-swapped")]["status"] == "wrong"
    for name in names[2:]:
        assert rows[(case.label, name)]["status"] == "skipped" and "CUDA" in rows[(case.label, name)]["error"]


def test_fp8_rows_skip_training_and_two_layer_mlps():
    rows = _run([Case("swiglu", "silu", 8, 128, 256, "fp32", "fwd+bwd"), Case("mlp", "gelu", 8, 128, 256, "fp32",
                                                                             "fwd")], [VARIANTS["mlpfuse-fp8"]])
    reasons = sorted(r["error"] for r in rows.values())
    assert all(r["status"] == "skipped" for r in rows.values())
    assert "inference only" in reasons[0] + reasons[1] and "gated MLP" in reasons[0] + reasons[1]
