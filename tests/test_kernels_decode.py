"""The decode MLP kernels against a float64 reference, through Triton's interpreter on CPU (or on a GPU).

Tiny D/H keep the interpreter fast; every M from 1 to 64 is covered in every reduction mode, and odd sizes
exercise every mask. The interpreter runs programs one after another, so it checks the arithmetic and the
indexing, not inter-program ordering: the one-launch mode's ticket and tail are checked on a GPU by
test_one_launch_every_m_on_gpu (and bf16 by benchmarks/numerics_gpu.py; the interpreter mis-computes bf16
dots).
"""

from __future__ import annotations

import pytest
import torch

import numerics
from conftest import HAS_CUDA, HAS_TRITON

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="Triton not installed"),
              # Triton 3.6's interpreter converts 1-element arrays to scalars the way numpy 2 deprecates
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

if HAS_TRITON:
    from mlpfuse import activations as A
    from mlpfuse.errors import InputError
    from mlpfuse.kernels import decode_mlp as K

DEVICE = "cuda" if HAS_CUDA else "cpu"


def reference(x, wg, wu, wd, bg, bu, bd, act):
    """float64 y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd with plain torch ops."""
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    g = x @ wg.T + (0 if bg is None else bg.double())
    u = x @ wu.T + (0 if bu is None else bu.double())
    fwd = next(a.forward for a in A._TABLE if a.id == act)
    return (fwd(g) * u) @ wd.T + (0 if bd is None else bd.double())


def assert_close(y, x, wg, wu, wd, bg, bu, bd, act, what=""):
    """y against the float64 down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd, within what rounding h and y to x's dtype
    explains (the kernels keep g and u in fp32; tests/numerics.py)."""
    assert torch.isfinite(y).all(), "non-finite output (unwritten or overflowed element)"
    name = next(a.name for a in A._TABLE if a.id == act)  # the oracle's own form of it (tests/oracle.py)
    want, var = numerics.gated_forward(x, wg, wu, wd, bg, bu, bd, name, x.dtype, numerics.FUSED)
    numerics.assert_close(y, want, x.dtype, what or "y", k=max(wg.shape), var=var)


def make(m, d, h, dtype, bias, gen):
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    x = r(m, d)
    w = (r(h, d, scale=d**-0.5), r(h, d, scale=d**-0.5), r(d, h, scale=h**-0.5))
    b = (r(h, scale=0.5), r(h, scale=0.5), r(d, scale=0.5)) if bias else (None, None, None)
    return x, w, b


def run_poisoned(x, w, b, **kw):
    # The output comes from the allocator; fill a same-sized block with NaN and free it first so that on a GPU an
    # unwritten element reads NaN (the CPU allocator gives no such guarantee, the check below still applies).
    torch.full((x.shape[0], w[2].shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return K.decode_gated_mlp(x, *w, *b, **kw)


MODES = {0: "one-launch", 2: "det-reduce-launch", 3: "atomic-cast-launch", 4: "split"}


@pytest.mark.parametrize("d,h,mode", [(17, 33, 0), (24, 40, 0), (17, 33, 2), (17, 33, 3), (17, 33, 4), (24, 40, 3),
                                     (24, 40, 4)],
                         ids=lambda v: MODES.get(v, str(v)) if isinstance(v, int) and v < 5 else str(v))
def test_every_m_fp32(d, h, mode):
    gen = torch.Generator().manual_seed(d * h + mode)
    x_all, w, b = make(64, d, h, torch.float32, True, gen)
    for m in range(1, 65):
        x = x_all[:m].clone()
        y = run_poisoned(x, w, b, activation=A.GELU_TANH, allow_tf32=False, _mode=mode)
        assert y.shape == (m, d) and y.dtype == torch.float32
        assert_close(y, x, *w, *b, A.GELU_TANH, f"M={m}")


@pytest.mark.parametrize("mode", [0, 2, 3, 4], ids=lambda v: MODES[v])
def test_balanced_rows_mask_the_tiles_tail(monkeypatch, mode):
    """BALANCED_ROWS: programs own fewer hidden units than their tile (here 16 of a 64-row tile: the interpreter
    reports no SM limit), the rest masked; every mode still computes the MLP."""
    monkeypatch.setattr(K, "BALANCED_ROWS", True)
    monkeypatch.setattr(K, "_plans", {})  # this test's plans only
    gen = torch.Generator().manual_seed(77 + mode)
    x_all, w, b = make(17, 24, 40, torch.float32, True, gen)
    for m in (1, 5, 17):
        x = x_all[:m].clone()
        y = run_poisoned(x, w, b, activation=A.SILU, allow_tf32=False, _mode=mode)
        assert_close(y, x, *w, *b, A.SILU, f"M={m}")
    assert {(p.consts[-1], p.n_progs) for p in K._plans.values()} == {(16, 3)}  # one plan per row bucket


def test_balanced_rows_spread_the_hidden_units_over_the_sms():
    assert K._rows(14336, 128, 132) == 112  # 112 programs of 128 rows become 128 of 112
    assert K._rows(14336, 128, 100) == 128  # the tiles already fill the SMs
    assert K._rows(3072, 64, 132) == 32
    assert K._rows(40, 64, 1 << 30) == 16  # never below one MMA's 16 rows


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", [A.IDENTITY, A.GELU_TANH, A.GELU, A.SILU, A.RELU, A.RELU2, A.QUICK_GELU] if HAS_TRITON else [])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activations_dtypes_biases(dtype, act, bias, deterministic):
    gen = torch.Generator().manual_seed(act * 8 + bias * 2 + deterministic)
    for m in (1, 13, 40):
        x, w, b = make(m, 17, 33, dtype, bias, gen)
        y = run_poisoned(x, w, b, activation=act, deterministic=deterministic, allow_tf32=False)
        assert y.dtype == dtype
        assert_close(y, x, *w, *b, act)


def test_each_bias_alone_and_m_past_64():
    gen = torch.Generator().manual_seed(5)
    for which in range(3):
        x, w, b = make(100, 24, 40, torch.float32, True, gen)
        b = tuple(t if i == which else None for i, t in enumerate(b))
        for mode in MODES:
            y = run_poisoned(x, w, b, activation=A.SILU, allow_tf32=False, _mode=mode)
            assert_close(y, x, *w, *b, A.SILU)


def test_strided_inputs_and_packed_weights():
    gen = torch.Generator().manual_seed(9)
    d, h, m = 24, 40, 5
    packed = (torch.randn(2 * h, d, generator=gen) * d**-0.5).to(DEVICE)  # [gate; up] like a gate_up_proj
    wd_t = (torch.randn(h, d, generator=gen) * h**-0.5).to(DEVICE)
    x_wide = torch.randn(m, 2 * d, generator=gen).to(DEVICE)
    x, wg, wu, wd = x_wide[:, ::2], packed[:h], packed[h:], wd_t.T  # x and w_down both non-contiguous
    bias_wide = torch.randn(2 * d, generator=gen).to(DEVICE)
    y = K.decode_gated_mlp(x, wg, wu, wd, None, None, bias_wide[::2], activation=A.GELU, allow_tf32=False)
    assert_close(y, x, wg, wu, wd, None, None, bias_wide[::2], A.GELU)


@pytest.mark.parametrize("mode", [2, 4, None])
def test_deterministic_modes_are_bit_identical(mode):
    gen = torch.Generator().manual_seed(1)
    x, w, b = make(37, 17, 33, torch.float32, True, gen)
    kw = {"activation": A.GELU_TANH, "deterministic": True, "_mode": mode, "allow_tf32": False}
    first = K.decode_gated_mlp(x, *w, *b, **kw)
    assert_close(first, x, *w, *b, A.GELU_TANH)  # IEEE fp32 dots (tf32 off) on any device
    for _ in range(2):
        assert torch.equal(first, K.decode_gated_mlp(x, *w, *b, **kw))


def test_policy_modes_and_configs():
    assert set(K._POLICY.values()) <= {0, 2, 3, 4}
    assert all(K._POLICY[key] in (2, 4) for key in K._POLICY if key[2])  # deterministic: no atomics
    for m in (1, 5, 17, 40, 100):
        for d, h in ((17, 33), (4096, 14336)):
            cfg = K.default_config(d, h, K._bucket(m), 2, 4)
            assert len(cfg) == 9 and all(v >= 0 for v in cfg)


@pytest.mark.skipif(not HAS_CUDA, reason="inter-program ordering needs a GPU (the interpreter runs programs in turn)")
def test_one_launch_every_m_on_gpu():
    # The last program to arrive casts everyone's partials: every M, both tail lengths, repeated, on real hardware.
    # (An earlier tail zeroed the accumulator with a thread layout different from its reads and lost partials at
    # 17-62 rows; the reads and the zeroing are now separated by a CTA barrier.)
    gen = torch.Generator().manual_seed(4)
    for d, h in ((768, 3072), (4096, 1024)):
        x_all, w, b = make(64, d, h, torch.bfloat16, True, gen)
        for m in range(1, 65):
            x = x_all[:m].clone()
            for _ in range(2):
                y = run_poisoned(x, w, b, activation=A.GELU_TANH, _mode=0)
                assert_close(y, x, *w, *b, A.GELU_TANH, f"M={m} {d}x{h}")
        acc, cnt = K._scratch[(0, torch._C._cuda_getCurrentRawStream(0))][:2]
        assert acc.abs().max().item() == 0 and cnt.item() == 0  # left ready for the next call


def test_unknown_mode_is_refused():
    gen = torch.Generator().manual_seed(6)
    x, w, b = make(3, 17, 33, torch.float32, False, gen)
    with pytest.raises(InputError, match="_mode"):
        K.decode_gated_mlp(x, *w, activation=A.SILU, _mode=1)


def test_atomic_scratch_is_left_zeroed_between_calls():
    # The atomic path accumulates into a cached scratch that each launch must leave zeroed: repeated calls with
    # different shapes and inputs would drift if it did not.
    gen = torch.Generator().manual_seed(2)
    for mode in (0, 3):
        for m, d, h in ((3, 24, 40), (64, 24, 40), (9, 17, 33), (3, 24, 40)):
            x, w, b = make(m, d, h, torch.float32, False, gen)
            y = K.decode_gated_mlp(x, *w, *b, activation=A.RELU, allow_tf32=False, _mode=mode)
            assert_close(y, x, *w, *b, A.RELU)


def test_empty_m_and_empty_hidden():
    gen = torch.Generator().manual_seed(3)
    x, w, b = make(4, 24, 40, torch.float32, True, gen)
    y = K.decode_gated_mlp(x[:0], *w, activation=A.SILU)
    assert y.shape == (0, 24)
    w0 = (w[0][:0], w[1][:0], w[2][:, :0])  # H = 0: y is the down bias alone
    y = K.decode_gated_mlp(x, *w0, None, None, b[2], activation=A.SILU)
    assert torch.equal(y, b[2].expand(4, 24))


@pytest.mark.parametrize("case", ["rank", "dtype", "shape", "bias", "too_many_rows", "activation"])
def test_bad_input_raises_one_line_input_error(case):
    gen = torch.Generator().manual_seed(4)
    x, (wg, wu, wd), _ = make(4, 24, 40, torch.float32, False, gen)
    kwargs = {"activation": A.SILU}
    args = [x, wg, wu, wd]
    if case == "rank":
        args[0] = x[0]
    elif case == "dtype":
        args[1] = wg.half()
    elif case == "shape":
        args[3] = wd[:, :-1]
    elif case == "bias":
        args += [torch.zeros(7, device=DEVICE)]
    elif case == "too_many_rows":
        args[0] = torch.zeros(K.MAX_M + 1, 24, device=DEVICE)
    else:
        kwargs["activation"] = 17
    with pytest.raises(InputError) as info:
        K.decode_gated_mlp(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_rows_past_max_m_are_refused_even_after_a_warm_call():
    # The cached fast path skips validation for known layouts; the row limit must still hold on every call.
    gen = torch.Generator().manual_seed(6)
    x, w, _ = make(K.MAX_M, 24, 40, torch.float32, False, gen)
    K.decode_gated_mlp(x, *w, activation=A.SILU)
    with pytest.raises(InputError):
        K.decode_gated_mlp(torch.cat([x, x[:1]]), *w, activation=A.SILU)
    with pytest.raises(InputError):
        K.decode_gated_mlp(x, w[0], w[1], "not a tensor", activation=A.SILU)


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu", "relu"])
def test_inf_in_x_matches_eager(mode, act):
    # H = 40 is not a multiple of the hidden-slice width: the padded slice rows see zero weights times an Inf in x
    # (NaN), which must not leak into the outputs through the zero down-projection columns.
    gen = torch.Generator().manual_seed(3)
    m, d, h = 3, 24, 40
    wg, wu, wd = (torch.rand(*s, generator=gen).to(DEVICE) for s in ((h, d), (h, d), (d, h)))
    x = torch.rand(m, d, generator=gen).to(DEVICE)
    x[0, 3] = float("inf")
    a = A.get(act)
    ref = reference(x, wg, wu, wd, None, None, None, a.id)
    y = K.decode_gated_mlp(x, wg, wu, wd, activation=a.id, allow_tf32=False, _mode=mode).double()
    assert torch.equal(torch.isinf(y), torch.isinf(ref)) and torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert torch.isinf(ref[0]).all() and finite[1:].all()  # the case is what it claims: row 0 Inf, the rest finite
    assert torch.allclose(y[finite], ref[finite], rtol=1e-5)
