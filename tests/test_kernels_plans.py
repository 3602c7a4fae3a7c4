"""The gated GEMM's per-layout plans: a repeated call skips the checks and decisions, and a plan never serves a tensor
it was not built for (other strides, dtype, alignment, biases, weights freed and their memory reused).

Through Triton's interpreter on CPU (fp32/fp16), every result against a float64 reference. Plans are kept on CUDA
too; there the same code path runs with the compiled kernel's direct launch.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import numerics
from mlpfuse.kernels import available

pytestmark = [pytest.mark.skipif(not available(), reason="Triton kernels cannot run here"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

if available():
    from mlpfuse import activations as A
    from mlpfuse.kernels import gated_gemm as GG

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = "silu"


@pytest.fixture(autouse=True)
def _fresh_plans():
    GG._plans.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
    GG._plans.clear()


def ref(x, wg, wu, bg=None, bu=None):
    x, wg, wu = x.double(), wg.double(), wu.double()
    g = x @ wg.T + (0 if bg is None else bg.double())
    u = x @ wu.T + (0 if bu is None else bu.double())
    return F.silu(g) * u


def check(x, wg, wu, bg=None, bu=None):
    """The gated GEMM's h within one rounding to x's dtype of the float64 value (tests/numerics.py)."""
    h = GG.gated_gemm(x, wg, wu, bg, bu, activation=A.get(ACT).id, allow_tf32=False)
    assert h.dtype == x.dtype
    numerics.assert_close(h, ref(x, wg, wu, bg, bu), x.dtype, "h", k=x.shape[1])


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def test_repeated_call_reuses_one_plan():
    x, wg, wu = rand(20, 24), rand(40, 24, seed=1), rand(40, 24, seed=2)
    check(x, wg, wu)
    assert len(GG._plans) == 1
    check(rand(20, 24, seed=3), wg, wu)  # new x, same layout: the same plan
    assert len(GG._plans) == 1


def test_plan_never_serves_another_layout():
    wg, wu = rand(40, 24, seed=1), rand(40, 24, seed=2)
    check(rand(20, 24), wg, wu)
    cases = [
        ("rows", rand(33, 24, seed=4), wg, wu),
        ("column-major x", rand(24, 20, seed=5).t(), wg, wu),
        ("misaligned x", rand(21, 24, seed=6).flatten()[2:2 + 20 * 24].view(20, 24), wg, wu),
        ("transposed weight", rand(20, 24, seed=7), rand(24, 40, seed=8).t(), wu),
        ("fp16", rand(20, 24, dtype=torch.float16), wg.half(), wu.half()),
    ]
    for i, (what, x, g, u) in enumerate(cases):
        check(x, g, u)
        assert len(GG._plans) == i + 2, what


def test_biases_are_part_of_the_plan():
    x, wg, wu = rand(20, 24), rand(40, 24, seed=1), rand(40, 24, seed=2)
    bg, bu = rand(40, seed=3), rand(40, seed=4)
    check(x, wg, wu)
    check(x, wg, wu, bg, None)
    check(x, wg, wu, None, bu)
    check(x, wg, wu, bg, bu)
    check(x, wg, wu, rand(40, seed=5), rand(40, seed=6))  # other bias tensors: their own values are read
    assert len(GG._plans) == 5


def test_weights_freed_and_memory_reused_get_their_own_values():
    x = rand(20, 24)
    for seed in range(4):
        # Each pair is freed before the next is allocated, so the allocator may hand out the same addresses.
        wg, wu = rand(40, 24, seed=10 + seed), rand(40, 24, seed=20 + seed)
        check(x, wg, wu)
        del wg, wu


def test_plans_keep_no_tensor_alive():
    x, wg = rand(20, 24), rand(40, 24, seed=1)
    wu = rand(40, 24, seed=2)
    check(x, wg, wu)
    refs = [weakref.ref(t) for t in (x, wg, wu)]
    del x, wg, wu
    gc.collect()
    assert len(GG._plans) == 1 and all(r() is None for r in refs)


def test_new_inputs_at_a_reused_address_are_read_again():
    # x's address recurs when each input is freed before the next is made: a plan that remembered anything about
    # the memory at that address beyond its layout would return the old values.
    wg, wu = rand(40, 24, seed=1), rand(40, 24, seed=2)
    for seed in range(5):
        x = rand(20, 24, seed=40 + seed)
        check(x, wg, wu)
        del x
    assert len(GG._plans) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct C launch exists for compiled kernels only")
def test_cuda_plans_launch_directly():
    x, wg, wu = rand(256, 64, dtype=torch.float16), rand(128, 64, dtype=torch.float16, seed=1), \
        rand(128, 64, dtype=torch.float16, seed=2)
    check(x, wg, wu)
    (plan,) = GG._plans.values()
    assert plan.raw is not None  # the fast path is what the other CUDA tests above exercised
    check(rand(256, 64, dtype=torch.float16, seed=3), wg, wu)
    from mlpfuse.kernels import gemm_act as GA

    GA._plans.clear()
    check_linear(x, wg, rand(128, dtype=torch.float16, seed=4))
    (plan,) = GA._plans.values()
    assert plan.raw is not None
    check_linear(rand(256, 64, dtype=torch.float16, seed=5), wg, None)
    GA._plans.clear()


# GEMM + activation keeps plans the same way.


def check_linear(x, w, b=None, save=False):
    from mlpfuse.kernels import gemm_act as GA

    out = GA.gemm_act(x, w, b, activation=A.get("gelu_tanh").id, save_preact=save, allow_tf32=False)
    z = x.double() @ w.double().T + (0 if b is None else b.double())
    want = F.gelu(z, approximate="tanh")
    y, zz = out if save else (out, None)
    for got, ref_ in ((y, want),) + (((zz, z),) if save else ()):
        assert got.dtype == x.dtype
        numerics.assert_close(got, ref_, x.dtype, "gemm_act", k=x.shape[1])


def test_gemm_act_plans_serve_only_their_layout():
    from mlpfuse.kernels import gemm_act as GA

    GA._plans.clear()
    w, b = rand(40, 24, seed=1), rand(40, seed=2)
    check_linear(rand(20, 24), w, b)
    check_linear(rand(20, 24, seed=3), w, b)  # a hit: new x, same layout
    assert len(GA._plans) == 1
    cases = [
        ("no bias", rand(20, 24), w, None, False),
        ("saving z", rand(20, 24), w, b, True),
        ("rows", rand(33, 24, seed=4), w, b, False),
        ("column-major x", rand(24, 20, seed=5).t(), w, b, False),
        ("misaligned x", rand(21, 24, seed=6).flatten()[2:2 + 20 * 24].view(20, 24), w, b, False),
        ("transposed weight", rand(20, 24, seed=7), rand(24, 40, seed=8).t(), b, False),
        ("other bias", rand(20, 24), w, rand(40, seed=9), False),
        ("fp16", rand(20, 24, dtype=torch.float16), w.half(), b.half(), False),
    ]
    for i, (what, x, ww, bb, save) in enumerate(cases):
        check_linear(x, ww, bb, save=save)
        assert len(GA._plans) == i + 2, what
    for seed in range(3):  # weights freed and their memory handed out again: their own values are read
        ww, bb = rand(40, 24, seed=50 + seed), rand(40, seed=60 + seed)
        check_linear(rand(20, 24), ww, bb)
        del ww, bb
    refs = [weakref.ref(t) for t in (w, b)]
    del w, b, cases
    gc.collect()
    assert all(r() is None for r in refs)  # plans keep no tensor alive
    GA._plans.clear()
