"""mlpfuse.ops against float64 autograd of the plain, unfused PyTorch MLP.

Both backends: "torch" everywhere, "triton" through Triton's interpreter on CPU (fp32/fp16, tiny odd shapes) or on a
GPU. Every input, weight and bias gradient is checked. Before each call the allocator is handed NaN-filled blocks of
the output sizes, so an output element a kernel forgets to write tends to come back NaN.
"""

import dataclasses
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F

from mlpfuse import activations, kernels, ops
from mlpfuse.bench.variants import graphed
from mlpfuse.errors import InputError
from mlpfuse.modules import GatedMLP
from mlpfuse.ops import dispatch
import numerics
from oracle import PLAIN

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = kernels.available()
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton kernels cannot run here")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
ACTS = ["identity", *activations.NAMES]
# Relative error (Frobenius norm) allowed against float64 where no finer model applies (gradients, and values
# checked by hand below), derived in tests/numerics.py: at most 8 roundings to the dtype along a gradient's chain
# (the saved g and u, act(g), dh, act'(g), dg or du, a GEMM's output, dx's sum of two products), each amplified at
# most 2x by the activation's derivatives, and fp32 sums of up to K terms. fp32 on GPU may use tf32 unless it is
# switched off (the autouse fixture below switches it off).
K_MAX = 1024  # the longest sum the hand-checked values below run (600 tokens on the GPU)


def tol(dtype, k=K_MAX):
    return numerics.chain_tol(dtype, roundings=8, gain=2, k=k)


TOL = {dtype: tol(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}



@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    # Set and restored by hand: torch's cuBLAS flags module does not survive monkeypatch's undo.
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def kernel_calls(monkeypatch):
    """Names of the kernel modules the ops reach for (the real kernels still run)."""
    calls = []
    real = dispatch.kernel

    def recording(name):
        calls.append(name)
        return real(name)

    monkeypatch.setattr(dispatch, "kernel", recording)
    return calls


def poison(*shapes, dtype=torch.float32):
    for s in shapes:
        torch.full(s, float("nan"), dtype=dtype, device=DEVICE)


def seeded_like(t, seed):
    """Random values shaped like `t`, drawn from a per-case seed: fresh for every case, reproducible run to run
    (bf16 gradients of tiny problems sit near the bound, so an unseeded draw would make a test flaky)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)


def rel(got, want):
    got, want = got.double(), want.double().to(got.device)
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def plain_gated(act, x, wg, wu, wd, bg=None, bu=None, bd=None):
    return F.linear(PLAIN[act](F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def gated_inputs(lead, d, h, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).to(DEVICE, dtype)

    ts = [r(*lead, d), r(h, d, scale=d**-0.5), r(h, d, scale=d**-0.5), r(d, h, scale=h**-0.5)]
    return ts + ([r(h), r(h), r(d)] if bias else [None, None, None])


def run_gated(backend, act, ts, *, grad=True):
    """(output, grads) of ops.gated_mlp, and the same from the float64 plain module."""
    leaves = [t.clone().requires_grad_(grad) if t is not None else None for t in ts]
    leaves64 = [t.detach().double().requires_grad_(grad) if t is not None else None for t in ts]
    x, wg, wu, wd, bg, bu, bd = leaves
    poison((*x.shape[:-1], wd.shape[0]), (x.shape[:-1].numel(), wg.shape[0]), dtype=x.dtype)
    y = ops.gated_mlp(x, wg, wu, wd, act, bg, bu, bd, backend=backend)
    want = plain_gated(act, *leaves64)
    if not grad:
        return y, want, {}
    dy = seeded_like(want, 1000 + want.numel())
    y.backward(dy.to(y.dtype))
    want.backward(dy)
    return y, want, {n: (t.grad, t64.grad) for n, t, t64 in zip(GATED_ARGS, leaves, leaves64) if t is not None}


GATED_ARGS = ("x", "gate_weight", "up_weight", "down_weight", "gate_bias", "up_bias", "down_bias")


def assert_close_rel(got, want, dtype, what, k=K_MAX):
    assert got is not None, what
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == dtype, (what, got.dtype)
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err = rel(got, want)
    assert err <= tol(dtype, k), f"{what}: relative error {err:.2e} > {tol(dtype, k):.2e}"


def check_gated(backend, act, lead, d, h, dtype, bias, grad=True, seed=0):
    """ops.gated_mlp's output and every gradient against float64 autograd. The output is held to the roundings its
    path makes (numerics.gated_forward): h and y on the Triton backend's fused kernels, every intermediate on the
    others (eager's roundings bound the split path's too); gradients to TOL's chain."""
    ts = gated_inputs(lead, d, h, dtype, bias, seed)
    y, want, grads = run_gated(backend, act, ts, grad=grad)
    k = max(d, h, math.prod(lead))
    assert y.dtype == dtype
    rounded = numerics.FUSED if backend == "triton" else numerics.EAGER
    var = numerics.gated_forward(*ts, act, dtype, rounded)[1]
    numerics.assert_close(y, want, dtype, f"y ({backend})", k=k, var=var)
    assert len(grads) == (7 if bias else 4) or not grad
    for name, (g, w) in grads.items():
        assert_close_rel(g, w, dtype, f"grad {name}", k)
    return y


# ---- torch backend: every dtype, activation, bias ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_gated_mlp_torch_backend(dtype, act):
    for bias in (False, True):
        check_gated("torch", act, (3, 7), 12, 20, dtype, bias, seed=ACTS.index(act))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_linear_act_torch_backend(dtype, act):
    for bias in (False, True):
        check_linear_act("torch", act, (2, 5), 11, 9, dtype, bias)


def check_linear_act(backend, act, lead, k, n, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(*lead, k, generator=gen, dtype=torch.float64)
    w64 = torch.randn(n, k, generator=gen, dtype=torch.float64) * k**-0.5
    b64 = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    leaves64 = [t.clone().requires_grad_() if t is not None else None for t in (x64, w64, b64)]
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x64, w64, b64)]
    poison((*lead, n), dtype=dtype)
    y = ops.linear_act(*leaves, act, backend=backend)
    want = PLAIN[act](F.linear(*leaves64))
    assert_close_rel(y, want, dtype, "y", max(k, n, math.prod(lead)))
    dy = seeded_like(want, 2000 + seed)
    y.backward(dy.to(DEVICE, dtype))
    want.backward(dy)
    for name, t, t64 in zip(["x", "weight", "bias"], leaves, leaves64):
        if t is not None:
            assert_close_rel(t.grad, t64.grad.to(DEVICE), dtype, f"grad {name}", max(k, n, math.prod(lead)))


# ---- triton backend (interpreter on CPU: fp32 / fp16 only) -----------------------------------------------------


@needs_triton
@pytest.mark.parametrize("act", ACTS)
def test_gated_mlp_triton_training(act):
    # Odd sizes everywhere: partial tiles in M, K and N.
    bias = ACTS.index(act) % 2 == 1
    check_gated("triton", act, (67,), 19, 37, torch.float32, bias, seed=ACTS.index(act))


@needs_triton
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_gated_mlp_triton_fp16(act):
    check_gated("triton", act, (3, 23), 24, 33, torch.float16, True)


@needs_triton
@pytest.mark.parametrize("form", ["split", "fused"])
def test_gated_mlp_triton_glu_backward_forms(monkeypatch, form):
    # Both forms of the GLU backward (cuBLAS dh + one pass, or the dh GEMM's epilogue) give every gradient,
    # biases included, against the fp64 autograd oracle.
    monkeypatch.setattr(dispatch, "GLU_BACKWARD", form)
    check_gated("triton", "gelu_tanh", (2, 21), 19, 37, torch.float32, True)
    check_gated("triton", "silu", (13,), 24, 33, torch.float16, True, seed=3)


@needs_triton
@pytest.mark.parametrize("gate_first", [True, False])
def test_gated_mlp_triton_training_on_packed_weights(gate_first):
    # Gate and up as the two row halves of one packed weight (PackedGatedMLP's layout, and the reverse order): every
    # gradient, the packed weight's included, against fp64 autograd.
    x, wg, wu, wd, bg, bu, bd = gated_inputs((31,), 20, 36, torch.float32, True, seed=21)
    packed = torch.cat([wg, wu] if gate_first else [wu, wg]).requires_grad_()
    packed64 = packed.detach().double().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (x, wd, bg, bu, bd)]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    outs = []
    for w, (xx, wdd, bgg, buu, bdd), fn in ((packed, leaves, None), (packed64, leaves64, plain_gated)):
        g_w, u_w = (w[:36], w[36:]) if gate_first else (w[36:], w[:36])
        if fn is None:
            y = ops.gated_mlp(xx, g_w, u_w, wdd, "gelu_tanh", bgg, buu, bdd, backend="triton")
        else:
            y = fn("gelu_tanh", xx, g_w, u_w, wdd, bgg, buu, bdd)
        y.backward(seeded_like(y.double(), 77).to(y.dtype))  # one fp64 draw for both
        outs.append([y, w.grad, *(t.grad for t in (xx, wdd, bgg, buu, bdd))])
    for name, got, want in zip(["y", "packed", "x", "down", "gate_bias", "up_bias", "down_bias"], *outs):
        assert_close_rel(got, want, torch.float32, name)


@needs_triton
def test_triton_backward_op_passes_opcheck():
    # The registered backward op must give distinct, non-aliasing outputs that match its fake implementation
    # (opcheck: schema, fake tensors, autograd registration).
    from torch.library import opcheck

    x, wg, wu, wd, bg, bu, _ = gated_inputs((6,), 8, 12, torch.float32, True, seed=5)
    _, h, g, u = torch.ops.mlpfuse.gated_mlp_train(x, wg, wu, wd, bg, bu, None, "silu", "triton", True)
    dy = seeded_like(torch.empty(6, 8), 9).to(DEVICE)
    args = (dy, x, wg, wu, wd, bg, bu, g, u, h, "silu", "triton", False, True, True, True, True, True)
    grads = torch.ops.mlpfuse.gated_mlp_backward(*args)
    assert grads[1].untyped_storage().data_ptr() != grads[2].untyped_storage().data_ptr()
    opcheck(torch.ops.mlpfuse.gated_mlp_backward.default, args, test_utils=("test_schema", "test_faketensor"))


@needs_triton
@pytest.mark.parametrize("form", ["split", "fused"])
def test_gated_mlp_triton_recompute_matches_saved(monkeypatch, kernel_calls, form):
    # Without saved pre-activations (no h either) both backward forms rebuild h for dWd.
    monkeypatch.setattr(dispatch, "SAVE_PREACT", False)
    monkeypatch.setattr(dispatch, "GLU_BACKWARD", form)
    check_gated("triton", "gelu", (9,), 17, 29, torch.float32, True)
    # Recomputing g and u runs the gated GEMM again in the backward.
    assert kernel_calls.count("gated_gemm") == 2 and "glu_backward" in kernel_calls


@needs_triton
def test_training_never_takes_the_decode_kernel(kernel_calls):
    check_gated("triton", "silu", (4,), 16, 24, torch.float32, False)
    assert "decode_mlp" not in kernel_calls and "glu_backward" in kernel_calls


@needs_triton
def test_the_bare_inference_op_under_autograd_recomputes_for_its_backward(kernel_calls):
    # mlpfuse::gated_mlp computes inference (it may take the decode kernel: the caller decided no gradient is
    # needed); called directly under autograd, its backward recomputes g and u, so the gradients stay right.
    ts = gated_inputs((4,), 16, 24, torch.float32, False)[:4]
    leaves = [t.clone().requires_grad_() for t in ts]
    leaves64 = [t.detach().double().requires_grad_() for t in ts]
    y = torch.ops.mlpfuse.gated_mlp(*leaves, None, None, None, "silu", "triton")
    want = F.linear(F.silu(F.linear(leaves64[0], leaves64[1])) * F.linear(leaves64[0], leaves64[2]), leaves64[3])
    assert_close_rel(y, want, torch.float32, "y")
    dy = seeded_like(want, 7)
    y.backward(dy.to(y.dtype))
    want.backward(dy)
    for name, a, b in zip(("x", "gate_weight", "up_weight", "down_weight"), leaves, leaves64):
        assert_close_rel(a.grad, b.grad, torch.float32, f"grad {name}")
    if dispatch.decode_max_m() >= 4:
        assert kernel_calls[0] == "decode_mlp"


@needs_triton
@pytest.mark.parametrize("m", [1, 5, 64])
def test_gated_mlp_triton_inference_small_batches(m, kernel_calls):
    with torch.no_grad():
        check_gated("triton", "gelu_tanh", (m,), 24, 40, torch.float32, m % 2 == 1, grad=False)
    if dispatch.decode_max_m() >= m:
        assert kernel_calls == ["decode_mlp"]


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
def test_auto_split_path_between_decode_and_gated_sizes(monkeypatch, kernel_calls, bias):
    # A large layer past the decode sizes and below gated_large_min_m tokens: cuBLAS's GEMMs around the Triton GLU pass,
    # against fp64; the module's call plan takes the same path.
    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "DECODE_LARGE_LAYER", 1)
    m = dispatch.cutovers(torch.device(DEVICE)).decode_large_max_m + 7
    with torch.no_grad():
        check_gated("auto", "silu", (m,), 16, 24, torch.float32, bias, grad=False, seed=5)
    assert kernel_calls == ["glu"]
    kernel_calls.clear()
    block = GatedMLP(16, 24, "silu", bias=bias).to(DEVICE)
    x = torch.randn(1, m, 16, device=DEVICE)
    with torch.no_grad():
        first = block(x)
        y = block(x)  # through the GLU pass's launch plan, held by the module's call plan
    assert set(kernel_calls) == {"glu"}
    (entry,) = block._plan.entries.values()
    assert entry.path == dispatch.SPLIT and entry.held
    torch.testing.assert_close(y, first, rtol=0, atol=0)
    want = plain_gated("silu", x.double(), *(t.double() if t is not None else None for t in (
        block.gate_proj.weight, block.up_proj.weight, block.down_proj.weight, block.gate_proj.bias,
        block.up_proj.bias, block.down_proj.bias)))
    assert rel(y, want) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
def test_auto_trains_large_layers_on_the_split_path_at_few_tokens(monkeypatch, kernel_calls, bias):
    # Training a large layer below gated_large_min_m tokens: cuBLAS's GEMMs around the Triton GLU pass and the Triton
    # GLU-backward pass, against fp64; the module's call plan takes the same path, holds both passes' launch plans
    # after the first step and gives the same bits on the next.
    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "DECODE_LARGE_LAYER", 1)
    check_gated("auto", "gelu_tanh", (2, 21), 16, 24, torch.float32, bias, seed=9)
    assert kernel_calls == ["glu", "glu_backward"]
    block = GatedMLP(16, 24, "gelu_tanh", bias=bias).to(DEVICE)
    x = torch.randn(3, 7, 16, device=DEVICE, requires_grad=True)
    dy = seeded_like(torch.empty(3, 7, 16), 10).to(DEVICE)
    steps = []
    for _ in range(2):
        for t in (x, *block.parameters()):
            t.grad = None
        y = block(x)
        assert type(y.grad_fn).__name__ == "_EagerTrainingBackward"
        y.backward(dy)
        steps.append([y.detach(), x.grad, *(p.grad for p in block.parameters())])
    (entry,) = block._plan.entries.values()
    assert entry.path == dispatch.SPLIT and entry.grad and entry.held and entry.held_backward
    names = ["y", "x", *(n for n, _ in block.named_parameters())]
    for name, first, second in zip(names, *steps):
        # Bias gradients are fp32 atomic sums: their order (last bits) may vary on a GPU.
        exact = {} if name.endswith("bias") else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(second, first, **exact, msg=name)
    params64 = [p.detach().double().requires_grad_() for p in block.parameters()]
    x64 = x.detach().double().requires_grad_()
    named = dict(zip((n for n, _ in block.named_parameters()), params64))
    want = plain_gated("gelu_tanh", x64, named["gate_proj.weight"], named["up_proj.weight"],
                       named["down_proj.weight"], named.get("gate_proj.bias"), named.get("up_proj.bias"),
                       named.get("down_proj.bias"))
    want.backward(dy.double())
    assert rel(steps[1][0], want) < TOL[torch.float32]
    for got, t64 in zip(steps[1][1:], [x64, *params64]):
        assert rel(got, t64.grad) < TOL[torch.float32]


@needs_triton
def test_gated_mlp_triton_inference_large_batch(kernel_calls):
    with torch.no_grad():
        check_gated("triton", "relu2", (2, 41), 20, 24, torch.float16, True, grad=False)
    assert kernel_calls == ["gated_gemm"]


@needs_triton
@pytest.mark.parametrize("act", ACTS)
def test_linear_act_triton(act):
    check_linear_act("triton", act, (3, 13), 21, 35, torch.float32, ACTS.index(act) % 2 == 0)


@needs_triton
def test_linear_act_triton_fp16(kernel_calls):
    check_linear_act("triton", "gelu", (45,), 16, 24, torch.float16, True)
    assert kernel_calls == ["gemm_act"]


# ---- layout and edge cases, both backends ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_views(backend):
    ts = gated_inputs((2, 3, 5), 16, 24, torch.float32, True)
    y = check_gated(backend, "silu", (2, 3, 5), 16, 24, torch.float32, True)
    assert y.shape == (2, 3, 5, 16)
    x1 = ts[0][0, 0, 0]  # a single token, 1-D
    with torch.no_grad():
        y1 = ops.gated_mlp(x1, *ts[1:4], "silu", *ts[4:], backend=backend)
    assert y1.shape == (16,)
    assert rel(y1, plain_gated("silu", *[t.double() for t in (x1, *ts[1:])])) < TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    d, h = 16, 24
    x, wg, wu, wd, bg, bu, bd = gated_inputs((40,), d, h, torch.float32, True)
    big = torch.randn(40, 3 * d, dtype=torch.float32, device=DEVICE)
    big[:, ::3] = x
    xs = big[:, ::3]  # stride 3 along features
    wgt = wg.t().contiguous().t()  # column-major weights
    packed = torch.cat([wu, wu]).clone()
    wus = packed[h:]  # a view into packed storage
    wdt = torch.empty(h, d, device=DEVICE).t().copy_(wd)
    assert not xs.is_contiguous() and not wgt.is_contiguous() and not wdt.is_contiguous()
    leaves = [t.requires_grad_() for t in (xs, wgt, wus, wdt)]
    y = ops.gated_mlp(*leaves, "gelu", bg, bu, bd, backend=backend)
    want = plain_gated("gelu", *[t.double() for t in (x, wg, wu, wd, bg, bu, bd)])
    assert rel(y, want) < TOL[torch.float32]
    y.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
    # A transposed token-major x ([features, tokens] storage).
    xt = x.t().contiguous().t()
    with torch.no_grad():
        assert rel(ops.gated_mlp(xt, wg, wu, wd, "gelu", bg, bu, bd, backend=backend), want) < TOL[torch.float32]
        assert rel(ops.linear_act(xs, wgt, bg, "gelu", backend=backend), F.gelu(F.linear(x, wg, bg)).double()) < TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_empty_batch(backend, lead):
    x, wg, wu, wd, bg, bu, bd = (t.requires_grad_() for t in gated_inputs(lead, 8, 12, torch.float32, True))
    y = ops.gated_mlp(x, wg, wu, wd, "silu", bg, bu, bd, backend=backend)
    assert y.shape == (*lead, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for t in (wg, wu, wd, bg, bu, bd):
        assert torch.equal(t.grad, torch.zeros_like(t))
    z = ops.linear_act(x.detach(), wg.detach(), bg.detach(), "relu", backend=backend)
    assert z.shape == (*lead, 12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", ACTS)
def test_nan_in_nan_out(backend, act):
    x, wg, wu, wd, bg, bu, bd = gated_inputs((6,), 8, 12, torch.float32, True)
    x[2, 3] = float("nan")
    with torch.no_grad():
        y = ops.gated_mlp(x, wg, wu, wd, act, bg, bu, bd, backend=backend)
        z = ops.linear_act(x, wg, bg, act, backend=backend)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3, 4, 5]]).any()
    assert torch.isnan(z[2]).all() and not torch.isnan(z[[0, 1, 3, 4, 5]]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weights_and_frozen_input(backend):
    ts = gated_inputs((9,), 8, 12, torch.float32, True)
    x = ts[0].clone().requires_grad_()
    y = ops.gated_mlp(x, *ts[1:4], "gelu_tanh", *ts[4:], backend=backend)  # weights frozen (LoRA-style)
    y.sum().backward()
    xd = x.detach().double().requires_grad_()
    plain_gated("gelu_tanh", xd, *[t.double() for t in ts[1:]]).sum().backward()
    assert rel(x.grad, xd.grad) < TOL[torch.float32]
    wd = ts[3].clone().requires_grad_()  # only one weight trains
    ops.gated_mlp(ts[0], ts[1], ts[2], wd, "gelu_tanh", *ts[4:], backend=backend).sum().backward()
    wd64 = ts[3].double().requires_grad_()
    plain_gated("gelu_tanh", *[t.double() for t in ts[:3]], wd64, *[t.double() for t in ts[4:]]).sum().backward()
    assert rel(wd.grad, wd64.grad) < TOL[torch.float32]


def test_aliases_give_the_same_op():
    ts = gated_inputs((5,), 8, 12, torch.float64, False)
    for alias, name in (("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"), ("swish", "silu"), ("SiLU", "silu"), (None, "identity")):
        got = ops.gated_mlp(*ts[:4], alias, backend="torch")
        assert torch.equal(got, ops.gated_mlp(*ts[:4], name, backend="torch")), alias
        assert torch.equal(ops.linear_act(ts[0], ts[1], None, alias, backend="torch"),
                           ops.linear_act(ts[0], ts[1], None, name, backend="torch")), alias


# ---- backend choice ---------------------------------------------------------------------------------------------


def test_env_var_selects_backend(monkeypatch, kernel_calls):
    ts = gated_inputs((4,), 8, 12, torch.float32, False)
    monkeypatch.setenv("MLPFUSE_BACKEND", "torch")
    ops.gated_mlp(*ts[:4])
    assert kernel_calls == []
    monkeypatch.setenv("MLPFUSE_BACKEND", "nonsense")
    with pytest.raises(InputError, match="MLPFUSE_BACKEND"):
        ops.gated_mlp(*ts[:4])
    # An explicit argument wins over the environment.
    ops.gated_mlp(*ts[:4], backend="torch")
    if TRITON:
        monkeypatch.setenv("MLPFUSE_BACKEND", "triton")
        with torch.no_grad():
            ops.linear_act(ts[0], ts[1], None, "relu")
        assert kernel_calls == ["gemm_act"]


def test_auto_uses_torch_off_gpu():
    x = torch.randn(4096, 64)
    assert dispatch.gated_mlp_path("auto", x, 64, training=False) == dispatch.TORCH
    assert dispatch.gated_mlp_path("auto", x, 64, training=True) == dispatch.TORCH
    assert dispatch.linear_act_path("auto", x, 64, activations.GELU) == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_backend_without_a_device_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ts = gated_inputs((4,), 8, 12, torch.float32, False)
    with pytest.raises(InputError, match="backend.*triton"):
        ops.gated_mlp(*ts[:4], backend="triton")
    with pytest.raises(InputError, match="backend.*triton"):
        ops.linear_act(ts[0], ts[1], backend="triton")


def test_triton_backend_rejects_float64():
    ts = gated_inputs((4,), 8, 12, torch.float64, False)
    with pytest.raises(InputError, match="backend.*float64"):
        ops.gated_mlp(*ts[:4], backend="triton")


# ---- bad input: one InputError (a ValueError) naming the argument ----------------------------------------------


def _bad_gated_calls():
    x, wg, wu, wd, bg, bu, bd = gated_inputs((4,), 8, 12, torch.float32, True)
    return [
        ("x", lambda: ops.gated_mlp(x[:, :5], wg, wu, wd)),
        ("x", lambda: ops.gated_mlp(torch.tensor(1.0), wg, wu, wd)),
        ("x", lambda: ops.gated_mlp(x.int(), wg.int(), wu.int(), wd.int())),
        ("x", lambda: ops.gated_mlp([1.0] * 8, wg, wu, wd)),
        ("gate_weight", lambda: ops.gated_mlp(x, wg[0], wu, wd)),
        ("up_weight", lambda: ops.gated_mlp(x, wg, wu[:5], wd)),
        ("down_weight", lambda: ops.gated_mlp(x, wg, wu, wd.t())),
        ("gate_bias", lambda: ops.gated_mlp(x, wg, wu, wd, gate_bias=bd)),
        ("up_bias", lambda: ops.gated_mlp(x, wg, wu, wd, up_bias=bu[None])),
        ("down_bias", lambda: ops.gated_mlp(x, wg, wu, wd, down_bias=bg)),
        ("up_weight", lambda: ops.gated_mlp(x, wg, wu.half(), wd)),
        ("gate_weight", lambda: ops.gated_mlp(x.double(), wg, wu, wd)),
        ("down_bias", lambda: ops.gated_mlp(x, wg, wu, wd, down_bias=bd.double())),
        ("down_weight", lambda: ops.gated_mlp(x, wg, wu, wd.to("meta"))),
        ("activation", lambda: ops.gated_mlp(x, wg, wu, wd, "gelu_fast")),
        ("backend", lambda: ops.gated_mlp(x, wg, wu, wd, backend="cudnn")),
        ("weight", lambda: ops.linear_act(x, wg[0])),
        ("x", lambda: ops.linear_act(x, wd)),
        ("bias", lambda: ops.linear_act(x, wg, bd)),
        ("bias", lambda: ops.linear_act(x, wg, bg.half())),
        ("activation", lambda: ops.linear_act(x, wg, None, "tanh")),
        ("backend", lambda: ops.linear_act(x, wg, backend="Triton2")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_gated_calls())))
def test_bad_input_names_the_argument(case):
    argument, call = _bad_gated_calls()[case]
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, InputError)
    message = str(info.value)
    assert message.startswith(f"{argument}:"), message
    assert "\n" not in message


def test_bad_input_through_the_registered_op():
    x, wg, wu, wd, *_ = gated_inputs((4,), 8, 12, torch.float32, False)
    with pytest.raises(InputError, match="^up_weight:"):
        torch.ops.mlpfuse.gated_mlp(x, wg, wu[:3], wd, None, None, None, "silu", "torch")
    with pytest.raises(InputError, match="^activation:"):
        torch.ops.mlpfuse.linear_act(x, wg, None, "nope", "torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_cuda_mix():
    x, wg, wu, wd, *_ = gated_inputs((4,), 8, 12, torch.float32, False)
    with pytest.raises(InputError, match="^up_weight: expected a tensor on cuda"):
        ops.gated_mlp(x, wg, wu.cpu(), wd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_auto_backend(dtype):
    for lead in ((8,), (600,)):
        check_gated("auto", "gelu_tanh", lead, 64, 96, dtype, True)
        with torch.no_grad():
            check_gated("auto", "silu", lead, 64, 96, dtype, False, grad=False)
        check_linear_act("auto", "gelu_tanh", lead, 64, 96, dtype, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_follows_allow_tf32():
    # With TF32 allowed, fp32 results carry tf32's ~1e-3 error; with it off they are IEEE-exact to ~1e-6.
    ts = gated_inputs((256,), 512, 512, torch.float32, False)
    want = plain_gated("gelu", *[t.double() for t in ts[:4]])
    errs = {}
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32  # the autouse fixture restores it
        with torch.no_grad():
            errs[tf32] = rel(ops.gated_mlp(*ts[:4], "gelu", backend="triton"), want)
    assert errs[False] < 1e-5 < errs[True], errs


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_fast_path_equals_the_registered_op(backend):
    ts = gated_inputs((5,), 8, 12, torch.float32, True)
    with torch.no_grad():
        direct = ops.gated_mlp(*ts[:4], "silu", *ts[4:], backend=backend)
        via_op = torch.ops.mlpfuse.gated_mlp(*ts, "silu", backend)
        assert torch.equal(direct, via_op)
        assert torch.equal(ops.linear_act(ts[0], ts[1], ts[4], "gelu", backend=backend),
                           torch.ops.mlpfuse.linear_act(ts[0], ts[1], ts[4], "gelu", backend))


def test_autocast_runs_in_the_autocast_dtype():
    # fp32 master weights under autocast: computed in bf16 like nn.Linear would be, gradients back in fp32.
    ts = [t.requires_grad_() for t in gated_inputs((6,), 16, 24, torch.float32, False)[:4]]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = ops.gated_mlp(*ts, "silu", backend="torch")
        z = ops.linear_act(ts[0], ts[1], None, "gelu", backend="torch")
        ref = torch.nn.functional.linear(ts[0], ts[1])
    assert y.dtype == z.dtype == ref.dtype == torch.bfloat16
    assert rel(y, plain_gated("silu", *[t.detach().double() for t in ts])) < TOL[torch.bfloat16]
    y.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in ts)


@needs_triton
def test_eager_training_skips_the_custom_op_machinery_with_identical_gradients():
    # Plain eager training on the kernel path runs an autograd.Function (host cost); the registered op (what
    # compile/export record) must give the same values and gradients.
    ts = gated_inputs((5, 3), 12, 20, torch.float32, True, seed=11)
    results = []
    for via_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in ts]
        if via_op:
            y = torch.ops.mlpfuse.gated_mlp_train(*leaves, "silu", "triton", True)[0]
        else:
            y = ops.gated_mlp(leaves[0], *leaves[1:4], "silu", *leaves[4:], backend="triton")
            assert type(y.grad_fn).__name__ == "_EagerTrainingBackward"
        y.backward(seeded_like(y, 5))
        results.append([y.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    x, w, b = (t.clone().requires_grad_() for t in ts[:1] + [ts[1], ts[4]])
    z = ops.linear_act(x, w, b, "gelu", backend="triton")
    assert type(z.grad_fn).__name__ == "_EagerTrainingBackward"


def _fused_training_backend(monkeypatch, path):
    """The backend argument that trains a small problem on `path`: "triton" (the gated GEMM), or "auto" with the
    kernels allowed and every layer counted large (the SPLIT path)."""
    if path == dispatch.SPLIT:
        monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
        monkeypatch.setattr(dispatch, "DECODE_LARGE_LAYER", 1)
        return "auto"
    return "triton"


@needs_triton
@pytest.mark.parametrize("path", [dispatch.GATED, dispatch.SPLIT])
@pytest.mark.parametrize("bias", [False, True])
def test_eager_training_overwrites_saved_preact_and_a_second_backward_recomputes(monkeypatch, bias, path):
    # The first backward writes dg and du over the saved g and u and releases them before it returns (no reference
    # survives it: weakrefs die); a second backward through the same graph (retain_graph=True) must not read them as
    # g and u: it recomputes, and both give the fp64 gradients.
    backend = _fused_training_backend(monkeypatch, path)
    ts = gated_inputs((9, 2), 12, 20, torch.float32, bias, seed=13)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in ts]
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    y = ops.gated_mlp(leaves[0], *leaves[1:4], "silu", *leaves[4:], backend=backend)
    assert type(y.grad_fn).__name__ == "_EagerTrainingBackward"
    x64, wg64, wu64, wd64, bg64, bu64, bd64 = leaves64
    g64, u64 = F.linear(x64, wg64, bg64), F.linear(x64, wu64, bu64)
    want = F.linear(F.silu(g64) * u64, wd64, bd64)
    dy = seeded_like(want, 7)
    dh64 = dy.reshape(-1, 12) @ wd64.detach()
    g2, u2 = g64.detach().reshape(-1, 20), u64.detach().reshape(-1, 20)
    dg64 = dh64 * u2 * torch.sigmoid(g2) * (1 + g2 * (1 - torch.sigmoid(g2)))
    du64 = dh64 * F.silu(g2)
    want.backward(dy)
    saved = list(y.grad_fn.held)
    assert rel(saved[0], g2) < TOL[torch.float32] and rel(saved[1], u2) < TOL[torch.float32]
    released = [weakref.ref(t) for t in saved]
    seen = []

    def spy(grad):  # runs once the fused backward has returned x's gradient
        seen.extend(t.clone() for t in saved)
        saved.clear()

    leaves[0].register_hook(spy)
    grads = []
    for _ in range(2):
        for t in leaves:
            if t is not None:
                t.grad = None
        y.backward(dy.float().to(DEVICE), retain_graph=True)
        grads.append([t.grad.clone() for t in leaves if t is not None])
        if len(grads) == 1:
            assert rel(seen[0], dg64) < TOL[torch.float32] and rel(seen[1], du64) < TOL[torch.float32]  # overwritten in place
            gc.collect()
            assert y.grad_fn.held is None and all(r() is None for r in released)
    for first, second, t64 in zip(*grads, [t for t in leaves64 if t is not None]):
        assert rel(first, t64.grad) < TOL[torch.float32] and rel(second, t64.grad) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("path", [dispatch.GATED, dispatch.SPLIT])
def test_eager_training_under_saved_tensor_hooks_saves_g_and_u_through_them(monkeypatch, path):
    # Activation checkpointing and offloading manage what a backward keeps through saved-tensor hooks: g and u must
    # pass through them (kept on ctx, a checkpointed layer's g and u would live from its forward to its backward),
    # and a checkpointed block's gradients are still the fp64 ones.
    from torch.utils.checkpoint import checkpoint

    backend = _fused_training_backend(monkeypatch, path)
    ts = gated_inputs((9, 2), 12, 20, torch.float32, False, seed=5)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in ts]
    x64, wg64, wu64, wd64 = [t.detach().double().requires_grad_() for t in leaves[:4]]
    g64, u64 = F.linear(x64, wg64), F.linear(x64, wu64)
    want = F.linear(F.silu(g64) * u64, wd64)
    dy = seeded_like(want, 3)
    want.backward(dy)

    def block(*args):
        return ops.gated_mlp(args[0], *args[1:4], "silu", *leaves[4:], backend=backend)

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = block(*leaves[:4])
    assert type(y.grad_fn).__name__ == "_EagerTrainingBackward" and y.grad_fn.held is None
    kept = [t for t in packed if t.shape == (18, 20)]
    assert len(kept) == 2
    assert rel(kept[0], g64.detach().reshape(18, 20)) < TOL[torch.float32]
    assert rel(kept[1], u64.detach().reshape(18, 20)) < TOL[torch.float32]
    y.backward(dy.float().to(DEVICE))
    hooked = [t.grad.clone() for t in leaves[:4]]
    for t in leaves[:4]:
        t.grad = None
    checkpoint(block, *leaves[:4], use_reentrant=False).backward(dy.float().to(DEVICE))
    for got, again, t64 in zip(hooked, [t.grad for t in leaves[:4]], (x64, wg64, wu64, wd64)):
        assert rel(got, t64.grad) < TOL[torch.float32] and rel(again, t64.grad) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("path", [dispatch.GATED, dispatch.SPLIT])
def test_eager_training_backward_releases_h_and_du_after_their_last_reader(monkeypatch, path):
    # The backward's peak is set by what is still alive during its last GEMMs: h (rebuilt over dh) must be gone once
    # dWd = dyᵀ·h ran, du once dWu ran (calls past MERGED_DW_MAX_M tokens; shorter ones: the next test). The real
    # kernels run; spies record which buffers are alive at each GEMM.
    backend = _fused_training_backend(monkeypatch, path)
    monkeypatch.setattr(dispatch, "MERGED_DW_MAX_M", 0)
    ts = gated_inputs((16,), 12, 20, torch.float32, False, seed=21)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in ts]
    split = dispatch.kernel("glu_backward").glu_backward_split
    alive = {}

    def split_spy(*args, **kwargs):
        out = split(*args, **kwargs)
        alive["h"], alive["du"] = weakref.ref(out[2]), weakref.ref(kwargs["out"][1])
        return out

    events = []
    mm = torch.Tensor.mm

    def mm_spy(a, b):
        events.append({k: r() is not None for k, r in alive.items()})
        return mm(a, b)

    y = ops.gated_mlp(leaves[0], *leaves[1:4], "silu", *leaves[4:], backend=backend)
    assert type(y.grad_fn).__name__ == "_EagerTrainingBackward"
    dy = seeded_like(y, 3)
    monkeypatch.setattr(dispatch.kernel("glu_backward"), "glu_backward_split", split_spy)
    monkeypatch.setattr(torch.Tensor, "mm", mm_spy)
    y.backward(dy)
    monkeypatch.undo()
    # dh = dy·Wd (before the pass), dWd = dyᵀ·h, dx = dg·Wg (+ du·Wu in place), dWu = duᵀ·x, dWg = dgᵀ·x.
    assert events == [{}, {"h": True, "du": True}, {"h": False, "du": True}, {"h": False, "du": True},
                      {"h": False, "du": False}]
    x64, wg64, wu64, wd64 = [t.detach().double().requires_grad_() for t in leaves[:4]]
    F.linear(F.silu(F.linear(x64, wg64)) * F.linear(x64, wu64), wd64).backward(dy.double())
    for t, t64 in zip(leaves[:4], (x64, wg64, wu64, wd64)):
        assert rel(t.grad, t64.grad) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
def test_short_eager_training_computes_both_weight_gradients_in_one_gemm(monkeypatch, bias):
    """Up to MERGED_DW_MAX_M tokens the gated path keeps g and u in one allocation and the backward computes dWg
    and dWu with one batched GEMM over dg and du (written over them); every gradient against fp64 autograd. The
    registered op (what torch.compile records) keeps them apart: its outputs must not alias."""
    from mlpfuse.kernels.pairs import stacked

    backend = _fused_training_backend(monkeypatch, dispatch.GATED)
    ts = gated_inputs((3, 7), 12, 20, torch.float32, bias, seed=8)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in ts]
    calls = []
    bmm = torch.bmm

    def bmm_spy(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return bmm(a, b)

    y = ops.gated_mlp(leaves[0], *leaves[1:4], "gelu_tanh", *leaves[4:], backend=backend)
    assert type(y.grad_fn).__name__ == "_EagerTrainingBackward"
    g, u = y.grad_fn.held
    assert stacked(g, u) is not None  # one allocation
    del g, u
    dy = seeded_like(y, 4)
    monkeypatch.setattr(torch, "bmm", bmm_spy)
    y.backward(dy)
    monkeypatch.undo()
    assert calls == [((2, 20, 21), (2, 21, 12))]
    x64, wg64, wu64, wd64 = [t.detach().double().requires_grad_() for t in leaves[:4]]
    b64 = [t.detach().double().requires_grad_() if t is not None else None for t in leaves[4:]]
    plain_gated("gelu_tanh", x64, wg64, wu64, wd64, *b64).backward(dy.double())
    for t, t64 in zip(leaves, (x64, wg64, wu64, wd64, *b64)):
        if t is not None:
            assert rel(t.grad, t64.grad) < TOL[torch.float32]
    # Past the threshold: g and u apart (du can go before dWg's output is allocated) and two GEMMs.
    monkeypatch.setattr(dispatch, "MERGED_DW_MAX_M", 20)
    y = ops.gated_mlp(leaves[0], *leaves[1:4], "gelu_tanh", *leaves[4:], backend=backend)
    assert stacked(*y.grad_fn.held) is None
    calls.clear()
    monkeypatch.setattr(torch, "bmm", bmm_spy)
    y.backward(dy)
    assert calls == []
    # The registered training op never pairs g and u.
    _, _, g, u = torch.ops.mlpfuse.gated_mlp_train(*(t.detach() if t is not None else None for t in leaves),
                                                   "gelu_tanh", "triton", True)
    assert stacked(g, u) is None


def test_eager_training_on_the_torch_path_is_plain_autograd():
    # The torch path under autograd is eager PyTorch: autograd's own nodes, and the same gradients as the
    # registered op's hand-written backward.
    ts = gated_inputs((4, 3), 12, 20, torch.float64, True, seed=12)
    grads = []
    for via_op in (False, True):
        leaves = [t.clone().requires_grad_() for t in ts]
        if via_op:
            y = torch.ops.mlpfuse.gated_mlp_train(*leaves, "gelu_tanh", "torch", True)[0]
        else:
            y = ops.gated_mlp(leaves[0], *leaves[1:4], "gelu_tanh", *leaves[4:], backend="torch")
            assert "mlpfuse" not in type(y.grad_fn).__name__ and "Eager" not in type(y.grad_fn).__name__
        y.backward(seeded_like(y, 6))
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_auto_reads_the_cut_overs_of_the_card(monkeypatch):
    # The cut-overs are data per card (kernels.configs.CARDS): a card whose measurements put them elsewhere moves
    # `auto`'s choice with them, and a device with no entry (here the CPU) gets the defaults.
    from mlpfuse.kernels import configs

    assert dispatch.cutovers(torch.device("cpu")) is configs.DEFAULT_CUTOVERS
    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "tuned_card", lambda device: True)
    monkeypatch.setattr(dispatch, "decode_max_m", lambda: 64)
    other = configs.Cutovers(decode_large_max_m=4, gated_large_min_m=200, linear_act_min_work=1.0)
    monkeypatch.setattr(dispatch, "cutovers", lambda device: other)
    big = 14336
    path = lambda m, training=False: dispatch.gated_mlp_path("auto", torch.empty(m, 4096), big, training)  # noqa: E731
    assert [path(4), path(5), path(199), path(200)] == [dispatch.DECODE, dispatch.SPLIT, dispatch.SPLIT,
                                                        dispatch.GATED]
    assert [path(199, True), path(200, True)] == [dispatch.SPLIT, dispatch.GATED]
    # Below split_min_layer a large layer goes from the decode kernels straight to the gated GEMM.
    monkeypatch.setattr(dispatch, "cutovers", lambda device: dataclasses.replace(other, split_min_layer=4096 * big + 1))
    assert [path(4), path(5), path(199, True), path(200)] == [dispatch.DECODE, dispatch.GATED, dispatch.GATED,
                                                              dispatch.GATED]
    monkeypatch.setattr(dispatch, "eager_math", lambda backend, act: False)
    x = torch.empty(1, 1)
    assert dispatch.linear_act_path("auto", x, 1, activations.GELU_TANH) == "triton"  # 1 multiply-add is enough


def test_auto_decode_cutover_depends_on_layer_size(monkeypatch):
    # The measured cut-over: large layers leave the decode path above decode_large_max_m tokens, small ones keep it.
    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "tuned_card", lambda device: True)
    monkeypatch.setattr(dispatch, "decode_max_m", lambda: 64)
    big, small = 4096 * 14336 // 4096, 3072
    cut = dispatch.cutovers(torch.device("cpu"))
    at_most, gated_from = cut.decode_large_max_m, cut.gated_large_min_m
    assert dispatch.gated_mlp_path("auto", torch.empty(at_most, 4096), big, False) == dispatch.DECODE
    # Past the decode sizes on a large layer: cuBLAS + the GLU pass until the gated GEMM wins there.
    assert dispatch.gated_mlp_path("auto", torch.empty(at_most + 1, 4096), big, False) == dispatch.SPLIT
    assert dispatch.gated_mlp_path("auto", torch.empty(gated_from - 1, 4096), big, False) \
        == dispatch.SPLIT
    assert dispatch.gated_mlp_path("auto", torch.empty(gated_from, 4096), big, False) \
        == dispatch.GATED
    assert dispatch.gated_mlp_path("auto", torch.empty(64, 768), small, False) == dispatch.DECODE
    assert dispatch.gated_mlp_path("auto", torch.empty(65, 768), small, False) == dispatch.GATED
    # Training takes the forward's path without the decode kernels: on large layers the SPLIT path below
    # gated_large_min_m tokens, the gated GEMM from there, and on small layers the gated GEMM at any size.
    for m in (1, at_most + 1, gated_from - 1):
        assert dispatch.gated_mlp_path("auto", torch.empty(m, 4096), big, True) == dispatch.SPLIT
    for m in (gated_from, 8192):
        assert dispatch.gated_mlp_path("auto", torch.empty(m, 4096), big, True) == dispatch.GATED
    for m in (1, 64, 65, 4096, 8192):
        assert dispatch.gated_mlp_path("auto", torch.empty(m, 768), small, True) == dispatch.GATED
    monkeypatch.setattr(dispatch, "GATED_TRAINING", False)  # the switch off: training on eager's kernels
    assert dispatch.gated_mlp_path("auto", torch.empty(64, 768), small, True) == dispatch.TORCH
    assert dispatch.gated_mlp_path("auto", torch.empty(64, 4096), big, True) == dispatch.TORCH
    assert dispatch.gated_mlp_path("auto", torch.empty(64, 4096), big, False) == dispatch.SPLIT
    # A card with no tuned rows keeps cuBLAS's GEMMs wherever the gated GEMM would run; the decode kernels stay.
    monkeypatch.setattr(dispatch, "GATED_TRAINING", True)
    monkeypatch.setattr(dispatch, "tuned_card", lambda device: False)
    for m, d, h, training in ((8192, 4096, big, False), (4096, 768, small, False), (8192, 4096, big, True)):
        assert dispatch.gated_mlp_path("auto", torch.empty(m, d), h, training) == dispatch.SPLIT
    assert dispatch.gated_mlp_path("auto", torch.empty(1, 4096), big, False) == dispatch.DECODE
    assert dispatch.gated_mlp_path("triton", torch.empty(8192, 4096), big, False) == dispatch.GATED


def test_auto_fuses_linear_act_only_for_the_measured_activation(monkeypatch):
    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "tuned_card", lambda device: True)
    x = torch.empty(8192, 768)
    assert dispatch.linear_act_path("auto", x, 3072, activations.GELU_TANH) == "triton"
    assert dispatch.linear_act_path("auto", x, 3072, activations.GELU) == "torch"  # erf GELU: addmm + GELU wins
    assert dispatch.linear_act_path("auto", x, 3072, activations.IDENTITY) == "torch"
    assert dispatch.linear_act_path("auto", torch.empty(128, 768), 3072, activations.GELU_TANH) == "torch"


@pytest.mark.skipif(not (TRITON and torch.cuda.is_available()), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("bias", [False, True])
def test_triton_training_step_replays_in_a_cuda_graph(bias):
    # Forward + backward on the Triton path captured once, replayed on new input data: the same values and
    # gradients as the step run eagerly (the cached launches, TMA descriptors and bias-sum atomics all capture).
    ts = gated_inputs((96,), 64, 160, torch.bfloat16, bias, seed=31)
    x = ts[0].clone().requires_grad_()
    params = [t.clone().requires_grad_() if t is not None else None for t in ts[1:]]
    wrt = [x, *(p for p in params if p is not None)]
    dy = seeded_like(torch.empty(96, 64), 32).to(DEVICE, torch.bfloat16)

    def step():
        y = ops.gated_mlp(x, *params[:3], "gelu_tanh", *params[3:], backend="triton")
        return (y, *torch.autograd.grad(y, wrt, dy))

    replay = graphed(step, warmup=2)
    for seed in (33, 34):
        with torch.no_grad():
            x.copy_(seeded_like(x.float(), seed).to(x.dtype))
        static = replay()
        want = step()
        for got, ref in zip(static, want):
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
        y64 = plain_gated("gelu_tanh", *[t.detach().double() if t is not None else None for t in [x, *params]])
        assert rel(static[0], y64) < TOL[torch.bfloat16]


@pytest.mark.skipif(not (TRITON and torch.cuda.is_available()), reason="CUDA graphs need a GPU")
def test_auto_split_training_step_replays_in_a_cuda_graph_with_its_passes_built_inside(kernel_calls):
    # `auto` trains a large layer at a few dozen tokens on the SPLIT path, in eager mode and under capture alike. The
    # GLU passes' compiled kernels and launch plans are dropped after the warm-up, so they are built and loaded inside
    # the capture; the replay on new data gives the eager step's values and gradients.
    from mlpfuse.kernels import glu, glu_backward

    ts = gated_inputs((48,), 4096, 4096, torch.bfloat16, True, seed=41)
    leaves = [t.clone().requires_grad_() for t in ts]
    dy = seeded_like(torch.empty(48, 4096), 42).to(DEVICE, torch.bfloat16)

    def step():
        y = ops.gated_mlp(leaves[0], *leaves[1:4], "silu", *leaves[4:])
        return (y, *torch.autograd.grad(y, leaves, dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    assert kernel_calls == ["glu", "glu_backward"] * 2
    for launcher in (glu._launch_kernel, glu_backward._launch_pointwise_kernel):
        launcher.clear()
        launcher.kernel.device_caches.clear()
    glu._plans.clear()
    glu_backward._pointwise_plans.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        leaves[0].copy_(seeded_like(leaves[0], 43))
    graph.replay()
    want = step()
    for got, ref in zip(static, want):
        assert rel(got, ref) < TOL[torch.bfloat16]
