"""The GEMM-epilogue kernels (gated_gemm, gemm_act, matmul_glu_backward) against float64 references.

On a machine without CUDA these run through Triton's interpreter (tests/conftest.py turns it on), fp32 with tf32 off
and fp16 only (the interpreter mis-computes bf16 dots). Shapes are tiny and odd so that every tile edge is masked.
Outputs are pre-filled with NaN and handed in through `out=`, so an element the kernel forgets to write fails the test.
Both operand paths run: TMA descriptors (the interpreter emulates them) and plain pointer loads, and for the gated
GEMM h written through a TMA store (the H100's rows for GeGLU on large layers and long calls on small ones).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import numerics
from conftest import HAS_CUDA
from mlpfuse import activations as A
from mlpfuse.kernels import available

pytestmark = [
    pytest.mark.skipif(not available(), reason="Triton kernels cannot run here"),
    # Triton's interpreter converts loop bounds with a NumPy call that NumPy deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

if available():
    from mlpfuse.kernels.configs import KernelConfig
    from mlpfuse.kernels.gated_gemm import gated_gemm
    from mlpfuse.kernels.gemm_act import gemm_act
    from mlpfuse.kernels.glu_backward import matmul_glu_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACTS = [a for a in A.NAMES] + ["identity"]
# Small tiles: several tiles per output and ragged edges even at these sizes (the persistent loop then also runs).
TILES = {
    "tma": KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4),
    "pointer": KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4, tma=False),
    "tma_store": KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4, tma_store=True),  # gated: h via TMA
    "prefetch": KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4, prefetch=True),  # glu_bwd only
}


@pytest.fixture(autouse=True)
def _quiet_overflow():
    # exp() of large arguments overflows to inf inside tanh/sigmoid, which is the intended saturation.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def randn(*shape, dtype, scale=1.0, gen):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype)


def poisoned(*shape, dtype, n):
    return tuple(torch.full(shape, float("nan"), device=DEVICE, dtype=dtype) for _ in range(n))


def assert_close(out, ref, dtype, what, k=1):
    """`out` within one rounding to `dtype` of the float64 `ref`, computed in fp32 over sums of `k` terms (the
    error bound is derived in tests/numerics.py)."""
    numerics.assert_close(out, ref, dtype, what, k=k)


def gated_ref(x, wg, wu, bg, bu, act):
    g = x.double() @ wg.double().T + (bg.double() if bg is not None else 0)
    u = x.double() @ wu.double().T + (bu.double() if bu is not None else 0)
    return act.forward(g) * u, g, u


@pytest.mark.parametrize("path", ["tma", "pointer", "tma_store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ACTS)
def test_gated_gemm_every_activation(act_name, dtype, path):
    gen = torch.Generator().manual_seed(hash((act_name, str(dtype), path)) % 2**31)
    act = A.get(act_name)
    M, N, K = 33, 24, 40  # ragged in M and N against 16-wide tiles
    x = randn(M, K, dtype=dtype, gen=gen)
    packed = randn(2 * N, K, dtype=dtype, scale=K**-0.5, gen=gen)  # gate_up packed: the weights are views
    wg, wu = packed[:N], packed[N:]
    bg, bu = randn(N, dtype=dtype, gen=gen), randn(N, dtype=dtype, gen=gen)
    out = poisoned(M, N, dtype=dtype, n=3)
    h, g, u = gated_gemm(x, wg, wu, bg, bu, activation=act.id, save_preact=True, allow_tf32=False, out=out,
                         config=TILES[path])
    assert h is out[0] and g is out[1] and u is out[2]
    hr, gr, ur = gated_ref(x, wg, wu, bg, bu, act)
    assert_close(h, hr, dtype, "h", k=K)
    assert_close(g, gr, dtype, "g", k=K)
    assert_close(u, ur, dtype, "u", k=K)


@pytest.mark.parametrize("path", ["tma", "pointer", "tma_store"])
@pytest.mark.parametrize("bias", ["none", "gate", "up", "both"])
@pytest.mark.parametrize("M,N,K", [(1, 7, 16), (7, 33, 24), (100, 20, 8)])
def test_gated_gemm_shapes_and_biases(M, N, K, bias, path):
    gen = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    dtype, act = torch.float32, A.get("gelu_tanh")
    x = randn(M, K, dtype=dtype, gen=gen)
    wg, wu = randn(N, K, dtype=dtype, gen=gen), randn(N, K, dtype=dtype, gen=gen)  # separate allocations
    bg = randn(N, dtype=dtype, gen=gen) if bias in ("gate", "both") else None
    bu = randn(N, dtype=dtype, gen=gen) if bias in ("up", "both") else None
    (out,) = poisoned(M, N, dtype=dtype, n=1)
    h = gated_gemm(x, wg, wu, bg, bu, activation=act.id, allow_tf32=False, out=out, config=TILES[path])
    assert_close(h, gated_ref(x, wg, wu, bg, bu, act)[0], dtype, "h", k=K)


def test_gated_gemm_up_before_gate_in_memory():
    # Gate given as the second half of a packed weight: the paired descriptor must hand the halves back swapped.
    gen = torch.Generator().manual_seed(7)
    dtype, act = torch.float16, A.get("silu")
    x = randn(20, 32, dtype=dtype, gen=gen)
    packed = randn(2 * 24, 32, dtype=dtype, scale=0.2, gen=gen)
    wg, wu = packed[24:], packed[:24]
    (out,) = poisoned(20, 24, dtype=dtype, n=1)
    h = gated_gemm(x, wg, wu, activation=act.id, out=out, config=TILES["tma"])
    assert_close(h, gated_ref(x, wg, wu, None, None, act)[0], dtype, "h", k=32)


def test_gated_gemm_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(3)
    dtype, act = torch.float32, A.get("relu2")
    M, N, K = 19, 21, 13
    x = randn(K, M, dtype=dtype, gen=gen).T  # transposed view: unit stride along M, pointer path
    wg = randn(K, N, dtype=dtype, gen=gen).T
    wu = randn(N, 2 * K, dtype=dtype, gen=gen)[:, ::2]  # every other column: stride 2 along K
    (out,) = poisoned(M, N, dtype=dtype, n=1)
    h = gated_gemm(x, wg, wu, activation=act.id, allow_tf32=False, out=out)
    assert_close(h, gated_ref(x, wg, wu, None, None, act)[0], dtype, "h", k=K)
    # the default launch (no out=) agrees with the reference as well
    assert_close(gated_gemm(x, wg, wu, activation=act.id, allow_tf32=False), gated_ref(x, wg, wu, None, None, act)[0],
                 dtype, "h default", k=K)


@pytest.mark.parametrize("path", ["tma", "pointer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ACTS)
def test_gemm_act(act_name, dtype, path):
    gen = torch.Generator().manual_seed(hash((act_name, str(dtype), path, "a")) % 2**31)
    act = A.get(act_name)
    M, N, K = 21, 35, 24
    x = randn(M, K, dtype=dtype, gen=gen)
    w = randn(N, K, dtype=dtype, scale=K**-0.5, gen=gen)
    b = randn(N, dtype=dtype, gen=gen)
    out = poisoned(M, N, dtype=dtype, n=2)
    y, z = gemm_act(x, w, b, activation=act.id, save_preact=True, allow_tf32=False, out=out, config=TILES[path])
    zr = x.double() @ w.double().T + b.double()
    assert_close(z, zr, dtype, "z", k=K)
    assert_close(y, act.forward(zr), dtype, "y", k=K)
    (out1,) = poisoned(M, N, dtype=dtype, n=1)
    y1 = gemm_act(x, w, None, activation=act.id, allow_tf32=False, out=out1, config=TILES[path])
    assert_close(y1, act.forward(x.double() @ w.double().T), dtype, "y without bias", k=K)


@pytest.mark.parametrize("path", ["tma", "pointer", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ACTS)
def test_glu_backward(act_name, dtype, path):
    gen = torch.Generator().manual_seed(hash((act_name, str(dtype), path, "b")) % 2**31)
    act = A.get(act_name)
    M, D, N = 23, 24, 40  # N*2 bytes is 16-aligned for fp16, so the TMA path really runs
    dy = randn(M, D, dtype=dtype, gen=gen)
    wd = randn(D, N, dtype=dtype, scale=D**-0.5, gen=gen)
    g, u = randn(M, N, dtype=dtype, gen=gen), randn(M, N, dtype=dtype, gen=gen)
    out = poisoned(M, N, dtype=dtype, n=3)
    dg, du, h = matmul_glu_backward(dy, wd, g, u, activation=act.id, allow_tf32=False, out=out, config=TILES[path])
    dh, gd, ud = dy.double() @ wd.double(), g.double(), u.double()
    assert_close(dg, dh * ud * act.grad(gd), dtype, "dg", k=D)
    assert_close(du, dh * act.forward(gd), dtype, "du", k=D)
    assert_close(h, act.forward(gd) * ud, dtype, "h")


@pytest.mark.parametrize("path", ["tma", "prefetch"])
def test_glu_backward_over_g_and_u_without_h(path):
    """want_h=False (the forward saved h): dg and du written over g and u themselves, h neither computed nor
    returned, and nothing else in the buffers touched."""
    gen = torch.Generator().manual_seed(5)
    dtype, act = torch.float16, A.get("gelu_tanh")
    M, D, N = 21, 24, 40
    dy = randn(M, D, dtype=dtype, gen=gen)
    wd = randn(D, N, dtype=dtype, scale=D**-0.5, gen=gen)
    g, u = randn(M, N, dtype=dtype, gen=gen), randn(M, N, dtype=dtype, gen=gen)
    dh, gd, ud = dy.double() @ wd.double(), g.double(), u.double()
    dg, du, h = matmul_glu_backward(dy, wd, g, u, activation=act.id, allow_tf32=False, out=(g, u, None),
                                    want_h=False, config=TILES[path])
    assert h is None and dg is g and du is u
    assert_close(dg, dh * ud * act.grad(gd), dtype, "dg", k=D)
    assert_close(du, dh * act.forward(gd), dtype, "du", k=D)


def test_glu_backward_non_contiguous():
    gen = torch.Generator().manual_seed(11)
    dtype, act = torch.float32, A.get("gelu")
    M, D, N = 17, 9, 22
    dy = randn(D, M, dtype=dtype, gen=gen).T
    wd = randn(N, D, dtype=dtype, gen=gen).T  # [D, N] with unit stride along D
    g = randn(N, M, dtype=dtype, gen=gen).T
    u = randn(M, 2 * N, dtype=dtype, gen=gen)[:, N:]
    out = poisoned(M, N, dtype=dtype, n=3)
    dg, du, h = matmul_glu_backward(dy, wd, g, u, activation=act.id, allow_tf32=False, out=out)
    dh, gd, ud = dy.double() @ wd.double(), g.double(), u.double()
    assert_close(dg, dh * ud * act.grad(gd), dtype, "dg", k=D)
    assert_close(du, dh * act.forward(gd), dtype, "du", k=D)
    assert_close(h, act.forward(gd) * ud, dtype, "h")


def test_empty_m_returns_empties():
    x = torch.empty(0, 16, device=DEVICE)
    w = torch.randn(8, 16, device=DEVICE)
    h, g, u = gated_gemm(x, w, w, activation=A.SILU, save_preact=True)
    assert h.shape == g.shape == u.shape == (0, 8)
    assert gemm_act(x, w, activation=A.RELU).shape == (0, 8)
    dg, du, hh = matmul_glu_backward(x, torch.randn(16, 8, device=DEVICE), torch.empty(0, 8, device=DEVICE),
                                     torch.empty(0, 8, device=DEVICE), activation=A.SILU)
    assert dg.shape == du.shape == hh.shape == (0, 8)


@pytest.mark.parametrize("path", ["tma", "pointer"])
def test_nan_in_nan_out(path):
    gen = torch.Generator().manual_seed(5)
    x = randn(20, 16, dtype=torch.float32, gen=gen)
    w = randn(2 * 24, 16, dtype=torch.float32, gen=gen)
    x[4, 3] = float("nan")
    for name in ("relu", "gelu_tanh"):  # relu must not clamp NaN to 0
        act = A.get(name)
        h = gated_gemm(x, w[:24], w[24:], activation=act.id, allow_tf32=False, config=TILES[path])
        assert torch.isnan(h[4]).all() and not torch.isnan(h[torch.arange(20) != 4]).any()
        y = gemm_act(x, w[:24], activation=act.id, allow_tf32=False, config=TILES[path])
        assert torch.isnan(y[4]).all() and not torch.isnan(y[torch.arange(20) != 4]).any()


def test_bad_shapes_raise_value_error():
    x = torch.randn(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="w_gate"):
        gated_gemm(x, torch.randn(8, 15, device=DEVICE), torch.randn(8, 15, device=DEVICE), activation=A.SILU)
    with pytest.raises(ValueError, match="b_up"):
        gated_gemm(x, torch.randn(8, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE),
                   b_up=torch.randn(9, device=DEVICE), activation=A.SILU)
    with pytest.raises(ValueError, match="out"):
        gemm_act(x, torch.randn(8, 16, device=DEVICE), activation=A.SILU, out=torch.empty(4, 9, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ACTS)
def test_glu_backward_pointwise(act_name, dtype):
    from mlpfuse.kernels.glu_backward import glu_backward_pointwise

    gen = torch.Generator().manual_seed(hash((act_name, str(dtype), "p")) % 2**31)
    act = A.get(act_name)
    M, N = 19, 37
    dh = randn(N, M, dtype=dtype, gen=gen).T  # transposed view: strides are honoured
    g, u = randn(M, N, dtype=dtype, gen=gen), randn(M, N, dtype=dtype, gen=gen)
    out = poisoned(M, N, dtype=dtype, n=2)
    dg, du = glu_backward_pointwise(dh, g, u, activation=act.id, out=out)
    dhd, gd, ud = dh.double(), g.double(), u.double()
    assert_close(dg, dhd * ud * act.grad(gd), dtype, "dg")
    assert_close(du, dhd * act.forward(gd), dtype, "du")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ["gelu_tanh", "silu", "relu2"])
def test_glu_backward_split(act_name, dtype):
    # The training path's pass after cuBLAS's dh: dg, du, h and the bias gradients (fp32 column sums), with rows
    # spread over several programs so the per-program sums meet in the atomics.
    from mlpfuse.kernels.glu_backward import glu_backward_split

    gen = torch.Generator().manual_seed(7 + ACTS.index(act_name))
    act = A.get(act_name)
    M, N = 45, 37
    dh, g, u = (randn(M, N, dtype=dtype, gen=gen) for _ in range(3))
    dg, du, h, dbg, dbu = glu_backward_split(dh, g, u, activation=act.id, want_h=True, bias_sums=True)
    dhd, gd, ud = dh.double(), g.double(), u.double()
    dg_ref, du_ref = dhd * ud * act.grad(gd), dhd * act.forward(gd)
    assert_close(dg, dg_ref, dtype, "dg")
    assert_close(du, du_ref, dtype, "du")
    assert_close(h, act.forward(gd) * ud, dtype, "h")
    assert dbg.dtype == dbu.dtype == torch.float32
    assert_close(dbg, dg_ref.sum(0), torch.float32, "dgate_bias", k=M)
    assert_close(dbu, du_ref.sum(0), torch.float32, "dup_bias", k=M)
    # Without the extras nothing else is computed.
    assert glu_backward_split(dh, g, u, activation=act.id)[2:] == (None, None, None)


@pytest.mark.parametrize("rows", [64, 16, "small"])
def test_glu_backward_split_gpu_tiles(rows):
    # The tiles a GPU picks by row count (kernels/glu_backward._pointwise_tile), run through the interpreter: full
    # and partial row blocks, strips past N, bias sums from several programs.
    from mlpfuse.kernels import glu_backward as GB

    bm, bn, _, warps = GB._POINTWISE_TILE
    tile = GB._POINTWISE_TILE_SMALL if rows == "small" else (bm, bn, rows, warps)
    gen = torch.Generator().manual_seed(17)
    act = A.get("silu")
    M, N = 83, 300
    dh, g, u = (randn(M, N, dtype=torch.float32, gen=gen) for _ in range(3))
    dg, du, h, dbg, dbu = GB.glu_backward_split(dh, g, u, activation=act.id, want_h=True, bias_sums=True,
                                                out=poisoned(M, N, dtype=torch.float32, n=2), tile=tile)
    dhd, gd, ud = dh.double(), g.double(), u.double()
    dg_ref, du_ref = dhd * ud * act.grad(gd), dhd * act.forward(gd)
    for got, want, what in ((dg, dg_ref, "dg"), (du, du_ref, "du"), (h, act.forward(gd) * ud, "h"),
                            (dbg, dg_ref.sum(0), "dgate_bias"), (dbu, du_ref.sum(0), "dup_bias")):
        assert_close(got, want, torch.float32, what, k=M)


def test_glu_backward_cached_plan_serves_only_the_layout_it_was_made_for():
    # cached_plan hands out the plan of contiguous, aligned operands with the given flags once glu_backward_split made
    # it, nothing before or for other flags; the plan's run gives the function's bits, writing over g and u.
    from mlpfuse.kernels import glu_backward as GB

    gen = torch.Generator().manual_seed(23)
    act = A.get("gelu_tanh")
    M, N = 21, 40
    dh, g, u = (randn(M, N, dtype=torch.float32, gen=gen) for _ in range(3))
    GB._pointwise_plans.clear()
    args = dict(activation=act.id, want_h=True, bias_sums=True)
    assert GB.cached_plan(M, N, torch.float32, dh.device, **args) is None
    want = GB.glu_backward_split(dh, g, u, **args)
    plan = GB.cached_plan(M, N, torch.float32, dh.device, **args)
    assert plan is not None
    assert GB.cached_plan(M, N, torch.float32, dh.device, activation=act.id, want_h=False, bias_sums=True) is None
    assert GB.cached_plan(M, N + 8, torch.float32, dh.device, **args) is None
    assert GB.cached_plan(M, N, torch.float16, dh.device, **args) is None
    # A strided layout makes its own plan, not the contiguous one.
    wide = randn(M, 2 * N, dtype=torch.float32, gen=gen)
    GB.glu_backward_split(dh, wide[:, :N], wide[:, N:], **args)
    assert GB.cached_plan(M, N, torch.float32, dh.device, **args) is plan and len(GB._pointwise_plans) == 2
    g2, u2, dh2 = g.clone(), u.clone(), dh.clone()
    dbg, dbu = plan.run(dh2, g2, u2, g2, u2, dh2)
    for got, ref in zip((g2, u2, dh2), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for got, ref in zip((dbg, dbu), want[3:]):  # fp32 atomics: the summation order may vary on a GPU
        torch.testing.assert_close(got, ref)


def test_glu_backward_pointwise_tile_fills_the_gpu():
    # Large passes keep the measured tile; fewer rows shrink the row block until the grid covers the SMs twice, then
    # narrow the strips; every pick divides into whole steps (ROWS a multiple of BM).
    from mlpfuse.kernels import glu_backward as GB

    sms = 132
    assert GB._pointwise_tile(8192, 3072, sms) == GB._POINTWISE_TILE
    for m, n in ((4096, 3072), (1024, 3072), (512, 3072), (64, 3072), (1, 3072), (64, 14336), (17, 14336)):
        bm, bn, rows, warps = tile = GB._pointwise_tile(m, n, sms)
        programs = -(-m // rows) * -(-n // bn)
        assert rows % bm == 0 and (programs >= 2 * sms or tile == GB._POINTWISE_TILE_SMALL), (m, n, tile)
        if tile != GB._POINTWISE_TILE_SMALL and rows < GB._POINTWISE_TILE[2]:
            assert -(-m // (2 * rows)) * -(-n // bn) < 2 * sms  # the largest row block that fills the grid
    assert GB._pointwise_tile(64, 3072, sms) == GB._POINTWISE_TILE_SMALL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_name", ACTS)
def test_glu_forward(act_name, dtype):
    # h = act(g)·u for row-strided g and u (the column halves of one buffer), into a poisoned caller-owned h, and
    # for fresh outputs at a row count past one program per row block.
    from mlpfuse.kernels.glu import glu_forward

    gen = torch.Generator().manual_seed(11 + ACTS.index(act_name))
    act = A.get(act_name)
    M, N = 7, 37
    gu = randn(M, 2 * N + 3, dtype=dtype, gen=gen)
    g, u = gu[:, :N], gu[:, N + 3:]
    out = poisoned(M, N, dtype=dtype, n=1)[0]
    h = glu_forward(g, u, activation=act.id, out=out)
    assert h is out
    assert_close(h, act.forward(g.double()) * u.double(), dtype, "h")
    g2, u2 = randn(130, 19, dtype=dtype, gen=gen), randn(130, 19, dtype=dtype, gen=gen)
    assert_close(glu_forward(g2, u2, activation=act.id), act.forward(g2.double()) * u2.double(), dtype, "h (fresh)")


def test_glu_forward_bad_input_and_empty():
    from mlpfuse.errors import InputError
    from mlpfuse.kernels.glu import glu_forward

    g = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(InputError, match="^u: expected shape"):
        glu_forward(g, torch.randn(4, 5, device=DEVICE), activation=A.SILU)
    with pytest.raises(InputError, match="^g: expected unit column stride"):
        glu_forward(torch.randn(6, 4, device=DEVICE).T, g, activation=A.SILU)
    with pytest.raises(InputError, match="^u: expected"):
        glu_forward(g, g.half(), activation=A.SILU)
    assert glu_forward(g[:0], g[:0], activation=A.SILU).shape == (0, 6)


def padded(rows, cols, pad, dtype, gen):
    """[rows, cols] random values in a buffer of rows of cols + pad elements: its own allocation and row stride;
    the padding holds NaN, so a read through another tensor's stride lands on it."""
    buf = torch.full((rows, cols + pad), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, :cols] = randn(rows, cols, dtype=dtype, gen=gen)
    return buf[:, :cols]


# The interpreter stores fp32 into bf16 by chopping the low bits (round toward zero): its results are checked
# against chopping; a GPU rounds to nearest.
CHOPPED_BF16 = not HAS_CUDA


def pointwise_close(out, ref, dtype, what):
    var = numerics.rounding_var(ref, dtype, chopped=CHOPPED_BF16 and dtype == torch.bfloat16)
    numerics.assert_close(out, ref, dtype, what, var=var)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act_name", ["gelu_tanh", "silu", "relu2"])
def test_glu_forward_reads_each_operand_with_its_own_row_stride(act_name, dtype):
    # g, u and h in three buffers with three row strides (37 + 5, 37 + 11, 37 + 2): an operand addressed with
    # another's stride reads the NaN padding or the wrong row. Twice: the second call runs the kept launch plan.
    from mlpfuse.kernels.glu import glu_forward

    gen = torch.Generator().manual_seed(41 + ACTS.index(act_name))
    act = A.get(act_name)
    M, N = 9, 37
    g, u = padded(M, N, 5, dtype, gen), padded(M, N, 11, dtype, gen)
    want = act.forward(g.double()) * u.double()
    for _ in range(2):
        buf = torch.full((M, N + 2), float("nan"), dtype=dtype, device=DEVICE)
        h = glu_forward(g, u, activation=act.id, out=buf[:, :N])
        assert len({g.stride(0), u.stride(0), h.stride(0)}) == 3
        pointwise_close(h, want, dtype, "h")
        assert torch.isnan(buf[:, N:]).all()  # nothing written past a row
    pointwise_close(glu_forward(g, u, activation=act.id), want, dtype, "h (fresh)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_glu_backward_split_reads_each_operand_with_its_own_row_stride(dtype):
    # dh, g, u, dg, du and h in six buffers with six row strides; the bias sums come back in fp32.
    from mlpfuse.kernels.glu_backward import glu_backward_split

    gen = torch.Generator().manual_seed(43)
    act = A.get("gelu_tanh")
    M, N = 21, 37
    dh, g, u = (padded(M, N, pad, dtype, gen) for pad in (1, 3, 6))
    outs = [padded(M, N, pad, dtype, gen).fill_(float("nan")) for pad in (2, 5, 9)]
    dg, du, h, dbg, dbu = glu_backward_split(dh, g, u, activation=act.id, want_h=True, bias_sums=True,
                                             out=outs[:2], out_h=outs[2])
    assert all(a is b for a, b in zip((dg, du, h), outs))
    dhd, gd, ud = dh.double(), g.double(), u.double()
    dg_ref, du_ref = dhd * ud * act.grad(gd), dhd * act.forward(gd)
    pointwise_close(dg, dg_ref, dtype, "dg")
    pointwise_close(du, du_ref, dtype, "du")
    pointwise_close(h, act.forward(gd) * ud, dtype, "h")
    numerics.assert_close(dbg, dg_ref.sum(0), torch.float32, "dgate_bias", k=M)
    numerics.assert_close(dbu, du_ref.sum(0), torch.float32, "dup_bias", k=M)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cached direct launch runs on CUDA only")
def test_cached_launch_reuses_kernels_across_m_and_respecializes_on_alignment():
    # The second call with the same layout launches the cached compiled kernel directly: it must be right for any M
    # (M is not specialized), and a layout Triton specializes differently (a 16-byte-misaligned x, which also takes
    # the pointer path) must not hit the first entry.
    from mlpfuse.kernels import gated_gemm as gg

    gen = torch.Generator().manual_seed(11)
    act = A.get("gelu_tanh")
    K, N = 64, 96
    wg, wu = randn(N, K, dtype=torch.float16, gen=gen, scale=0.2), randn(N, K, dtype=torch.float16, gen=gen, scale=0.2)
    big = randn(1000 * K + 8, dtype=torch.float16, gen=gen)
    before = len(gg._launch._compiled)
    for M in (1000, 37, 1, 513):
        x = big[: M * K].view(M, K)
        assert_close(gated_gemm(x, wg, wu, activation=act.id), gated_ref(x, wg, wu, None, None, act)[0],
                     torch.float16, f"M={M}", k=K)
    after_aligned = len(gg._launch._compiled)
    assert after_aligned - before <= 1  # one entry served every M
    for M in (300, 5):
        x = big[1: 1 + M * K].view(M, K)  # 2-byte offset: not 16-byte aligned
        assert_close(gated_gemm(x, wg, wu, activation=act.id), gated_ref(x, wg, wu, None, None, act)[0],
                     torch.float16, f"misaligned M={M}", k=K)
    assert len(gg._launch._compiled) == after_aligned + 1
