"""Every module path called again and again with the same layout, with and without biases, against float64.

A module keeps what its first call decided for a layout (its call plan, the kernels' launch plans) and later calls
skip straight to the kernels; a result that is right once and wrong on the second call (a bias left out of a reused
launch, a stale output) is what these tests are for. Each module is built over a plain PyTorch module (sharing its
Parameters: `from_module`, or `mlpfuse.patch` on a holder), whose float64 copy is the oracle; every call gets fresh
input of the same layout, and the output, dx and every parameter's gradient are checked on each call.

Backends: torch everywhere; triton through Triton's interpreter on CPU (fp32/fp16: it mis-computes bf16 dots) or
on a GPU; and `auto` made to choose as it does on a Hopper GPU, so that its decode, split and gated paths run here.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import mlpfuse
import numerics
from dist_cases import DIM, FAMILIES, HIDDEN, LlamaMLP, Phi3MLP, _sequential
from mlpfuse import MLP, FusedLinear, GatedMLP
from mlpfuse.kernels import available
from mlpfuse.modules import PackedGatedMLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CALLS = 3

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Triton's interpreter under numpy 2


def _gated(bias, backend):
    src = LlamaMLP(bias)
    return GatedMLP.from_module(src, backend=backend), src, src


def _packed(bias, backend):
    src = Phi3MLP(bias)
    m = GatedMLP.from_module(src, backend=backend)
    assert isinstance(m, PackedGatedMLP)
    return m, src, src


def _fused_linear(bias, backend):
    seq = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=bias), nn.GELU(approximate="tanh"))
    return FusedLinear.from_module(seq[0], "gelu_tanh", backend), seq, seq


def _mlp(bias, backend):
    seq = _sequential(bias)
    return MLP.from_module(seq[0], seq[2], activation="gelu_tanh", backend=backend), seq, seq


def _patched(family):
    def build(bias, backend):
        holder = nn.Sequential(FAMILIES[family](bias)).eval()  # T5's dropout sits inside the fusion: off
        source = copy.deepcopy(holder)  # unpatched; the patched holder keeps the same Parameter objects
        report = mlpfuse.patch(holder, backend=backend)
        assert len(report.swapped) == 1, report
        names = {id(p): n for n, p in holder.named_parameters()}
        assert set(names.values()) == {n for n, _ in source.named_parameters()}
        return holder, holder, source
    return build


CASES = {"GatedMLP": _gated, "PackedGatedMLP": _packed, "FusedLinear": _fused_linear, "MLP": _mlp,
         **{f"patched {family}": _patched(family) for family in FAMILIES}}
GATED_CASES = ("GatedMLP", "PackedGatedMLP", "patched llama", "patched phi3", "patched falcon-h1")
# Where `auto` has paths to choose between: the gated layouts, and linear+activation (BERT's erf GELU it leaves to
# cuBLAS, so there is nothing to patch).
AUTO_CASES = ("GatedMLP", "PackedGatedMLP", "patched llama", "FusedLinear", "MLP", "patched gpt2")
TRITON = available()
# The modules in every dtype; the patched blocks, which hand the same call plans their children's parameters, in one
# dtype per backend (the interpreter is slow).
RUNS = [(case, backend, dtype) for case in CASES for backend, dtype in (
    ("torch", torch.float32), ("torch", torch.float16), ("triton", torch.float32), ("triton", torch.float16))
    if (backend, dtype) in (("torch", torch.float32), ("triton", torch.float16)) or not case.startswith("patched")
    if backend == "torch" or TRITON]


def build(case, bias, dtype, backend):
    """(module under test, {parameter: name in the oracle}, float64 oracle)."""
    torch.manual_seed(7)
    module, named, source = CASES[case](bias, backend)
    module.to(DEVICE, dtype).eval()
    oracle = copy.deepcopy(source).to("cpu", torch.float64).eval()
    names = {p: n for n, p in named.named_parameters()}
    assert set(module.parameters()) <= set(names), "the module does not share the source's Parameters"
    return module, names, oracle


def fresh(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE, dtype)


def tol(dtype, roundings, rows):
    # At most eager's roundings per output (g, u, act(g), h, y; patched two-layer blocks fewer) or a gradient's chain,
    # amplified up to 2x by the activation's derivative; fp32 sums over the widest dimension.
    return numerics.chain_tol(dtype, roundings=roundings, gain=2, k=max(DIM, HIDDEN, rows))


def check(got, want, dtype, roundings, rows, what):
    assert got is not None and got.shape == want.shape and got.dtype == dtype, what
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err <= tol(dtype, roundings, rows), f"{what}: relative error {err:.3g} > {tol(dtype, roundings, rows):.3g}"


def call_repeatedly(module, names, oracle, shape, dtype, grad, seed):
    """CALLS calls of one layout, fresh values each time, each against the oracle."""
    params = dict(oracle.named_parameters())
    rows = math.prod(shape[:-1])
    for i in range(CALLS):
        x = fresh(shape, dtype, seed + i).requires_grad_(grad)
        x64 = x.detach().cpu().double().requires_grad_(grad)
        what = f"call {i + 1} of {tuple(shape)}{' with grad' if grad else ''}"
        for p in (*module.parameters(), *params.values()):
            p.grad = None
        with torch.set_grad_enabled(grad):
            y, want = module(x), oracle(x64)
        check(y, want.detach(), dtype, 5, rows, f"{what}: y")
        if not grad:
            continue
        dy = fresh(want.shape, torch.float64, seed + 100 + i)
        y.backward(dy.to(DEVICE, dtype))
        want.backward(dy.cpu())
        check(x.grad, x64.grad, dtype, 8, rows, f"{what}: dx")
        for p in module.parameters():
            check(p.grad, params[names[p]].grad, dtype, 8, rows, f"{what}: grad {names[p]}")


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("case, backend, dtype", RUNS, ids=lambda v: str(v).replace("torch.", ""))
def test_repeated_calls_match_float64(case, backend, dtype, bias):
    module, names, oracle = build(case, bias, dtype, backend)
    with torch.no_grad():
        # A few tokens (the decode kernels on the triton backend) and past them (the gated GEMM), 3-D.
        for seed, shape in ((10, (5, DIM)), (20, (3, 23, DIM))):
            call_repeatedly(module, names, oracle, shape, dtype, False, seed)
    call_repeatedly(module, names, oracle, (3, 23, DIM), dtype, True, 30)


@pytest.fixture
def auto_as_on_a_gpu(monkeypatch):
    """`auto` choosing as on a Hopper GPU, for any dtype and device, with these small layers counted large (so that
    the split path runs between the decode and gated sizes) and linear+activation fused at any size; on CPU the
    kernels then run in Triton's interpreter."""
    from mlpfuse.ops import dispatch

    monkeypatch.setattr(dispatch, "_auto_may_use", lambda device, dtype, module: True)
    monkeypatch.setattr(dispatch, "tuned_card", lambda device: True)  # the CPU stands in for a measured card
    monkeypatch.setattr(dispatch, "DECODE_LARGE_LAYER", 1)
    cut = dataclasses.replace(dispatch.cutovers(torch.device(DEVICE)), linear_act_min_work=0, split_min_layer=1)
    monkeypatch.setattr(dispatch, "cutovers", lambda device: cut)
    return dispatch


@pytest.mark.skipif(not TRITON, reason="Triton kernels cannot run here")
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("case", AUTO_CASES)
def test_repeated_calls_on_every_auto_path(auto_as_on_a_gpu, case, bias):
    dispatch = auto_as_on_a_gpu
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    module, names, oracle = build(case, bias, dtype, "auto")
    cut = dispatch.cutovers(torch.device(DEVICE))
    sizes = {dispatch.DECODE: 5, dispatch.SPLIT: cut.decode_large_max_m + 7, dispatch.GATED: cut.gated_large_min_m + 5}
    if case in GATED_CASES:  # the sizes are what they claim: each takes its path
        for path, rows in sizes.items():
            assert dispatch.gated_mlp_path("auto", torch.empty(rows, DIM), HIDDEN, False) == path
    with torch.no_grad():
        for seed, rows in enumerate(sizes.values()):
            call_repeatedly(module, names, oracle, (rows, DIM), dtype, False, 40 + 10 * seed)
    for seed, rows in enumerate((sizes[dispatch.SPLIT], sizes[dispatch.GATED])):  # training has no decode path
        call_repeatedly(module, names, oracle, (rows, DIM), dtype, True, 80 + 10 * seed)
