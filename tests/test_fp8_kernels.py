"""The FP8 kernels (kernels/fp8_gemm.py) against the recipe (mlpfuse.fp8) and float64 oracles.

On the CPU they run through Triton's interpreter, whose own e4m3 conversion is wrong for ties, NaN and values past
448 (the kernels round in fp32 there first: EMULATE), so these tests check the rounding the GPU's hardware does.
Every assertion is a bound derived from the recipe (u = 2^-4 per rounding, 2^-10·scale below e4m3's normal range,
fp32 sums K·2^-24), never a tolerance picked to pass; inputs are fp32/fp16 (the interpreter's bf16 dot is wrong).
"""

import pytest
import torch

from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse import activations, fp8, reference
from mlpfuse.errors import InputError

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

U, SUB = fp8.UNIT_ROUNDOFF, fp8.SUBNORMAL_HALF_SPACING
DEVICE = "cuda" if HAS_CUDA else "cpu"
# fp32 accumulation; on a GPU the FP8 tensor cores' own (~14 bits within a 128-wide block, reference.py)
ACC = reference.FP8_MMA_ACCUMULATION * 132 if HAS_CUDA else None


def _k():
    from mlpfuse.kernels import fp8_gemm

    return fp8_gemm


def _same_bits_or_both_nan(a, b):
    fa, fb = a.float(), b.float()
    return bool(((fa == fb) & (torch.signbit(fa) == torch.signbit(fb)) | (fa.isnan() & fb.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_kernel_is_the_recipe_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 300, generator=gen) * 2.0 ** torch.randint(-12, 12, (37, 1), generator=gen)
    x[3, 5] = float("nan")
    x[7, 200] = float("inf")
    x[8, 10] = -float("inf")
    x[9] = 0
    x[10, :128] = torch.linspace(-448 * 1.5, 448 * 1.5, 128)  # ties and values past 448 before scaling
    x[11, 256:] = 2.0**-14  # fp16's smallest normal: a tiny group
    x = x.to(DEVICE, dtype)
    q, s = _k().quantize(x)
    rq, rs = fp8.quantize_activation(x)
    assert torch.equal(s.nan_to_num(7.0, 8.0, 9.0), rs.nan_to_num(7.0, 8.0, 9.0))
    assert _same_bits_or_both_nan(q, rq)
    assert bool(s[3].isnan()[0]) and not bool(s[3, 1:].isnan().any())  # the NaN's group only


def _across_the_exponents(rows, cols, seed):
    """fp32 rows whose groups sit anywhere in fp32's range: each row's values 2^e·[1, 2) with e drawn from a
    40-wide window that slides from the subnormals (every value, the amax too, below 2^-126) to 2^127, so that the
    divisors run from the 2^-126 floor to ~2^119 and dividends are subnormal beside normal scales."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.linspace(-150, 127, rows).round()[:, None]
    e = top - torch.randint(0, 40, (rows, cols), generator=gen)
    mant = 1.0 + torch.rand(rows, cols, generator=gen, dtype=torch.float64)
    sign = torch.randint(0, 2, (rows, cols), generator=gen) * 2 - 1
    return (sign * mant * torch.pow(2.0, e.double())).float()


def test_quantizations_divide_as_ieee_across_fp32s_range():
    """The kernels divide without division instructions (fp8_gemm._divide and _over_448): values and scales equal
    the recipe's IEEE divisions bit for bit wherever a group lies in fp32's range, subnormal groups included — the
    activations' 1×128 groups (rows and, through a transposed view, columns) and the weights' 128×128 blocks."""
    x = _across_the_exponents(2048, 256, 3).to(DEVICE)
    for view in (x, x.t()):
        q, s = _k().quantize(view)
        rq, rs = fp8.quantize_activation(view)
        assert torch.equal(s, rs)
        assert _same_bits_or_both_nan(q, rq)
    w = _across_the_exponents(128 * 24, 128 * 2, 4).to(DEVICE)
    for transposed in (False, True):
        got = _k().quantize_weight(w, transposed=transposed)
        ref = fp8.quantize_weight(w.t().contiguous() if transposed else w)
        assert torch.equal(got[1], ref.scale_inv)
        assert _same_bits_or_both_nan(got[0], ref.values)


def _case(seed, m, k, n, bias=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    ws = [fp8.quantize_weight((torch.randn(*s, generator=gen) * s[1] ** -0.5).to(DEVICE)) for s in
          ((n, k), (n, k), (k, n))]
    bs = [(torch.randn(s, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None for s in (n, n, k)]
    return x, ws, bs


@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_tanh", True)])
def test_gated_gemm_quantizes_h_in_its_epilogue_within_one_rounding(act, bias):
    """hq, sh from the epilogue against h computed in float64 from the same quantized operands: the scales are
    amax/448 of h (up to fp32 rounding of the sums), each value one e4m3 rounding of h/scale."""
    x, (wg, wu, _), (bg, bu, _) = _case(2, 33, 300, 260, bias)  # partial K group, partial N tile
    kern = _k()
    xq, xs = kern.quantize(x)
    hq, hs = kern.fp8_gemm(xq, xs, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu,
                           activation=activations.get(act).id, quant_out=True)
    xd = fp8.dequantize_activation(xq, xs, torch.float64)
    g = xd @ wg.dequantize(torch.float64).T + (0 if bg is None else bg.double())
    u = xd @ wu.dequantize(torch.float64).T + (0 if bu is None else bu.double())
    h = activations.get(act).forward(g) * u
    # fp32 sums of 300 products and the fp32 activation: ≤ 2^-14 of Σ|x||w| scale, far inside e4m3's rounding
    scale_err = (xd.abs() @ wg.dequantize(torch.float64).abs().T) * (xd.abs() @ wu.dequantize(torch.float64).abs().T)
    slack = (ACC or 310 * 2.0**-24) * 4 * scale_err + 2.0**-20 * h.abs()
    amax = torch.nn.functional.pad(h.abs(), (0, -h.shape[1] % 128)).unflatten(1, (-1, 128)).amax(-1)
    assert bool(((hs.double() - amax / 448).abs() <= amax / 448 * 2.0**-18
                 + slack.max(1, keepdim=True).values / 448 + 1e-300).all())
    hd = fp8.dequantize_activation(hq, hs, torch.float64)
    sh = hs.double().repeat_interleave(128, 1)[:, :h.shape[1]]
    assert bool(((hd - h).abs() <= U * h.abs() + SUB * sh + slack * (1 + U)).all())


def test_the_gated_gemm_keeps_rows_whose_block_scales_lie_far_apart():
    """Each K block's sum is promoted with its own scales: a subnormal block after a large one, the other order, a
    zero block (scale 1), subnormal blocks before a normal one and large rows all come out as the float64 sum of
    the same quantized operands; a NaN spoils its own row only."""
    x, (wg, wu, _), _ = _case(8, 20, 512, 128)
    x[0, :128] *= 1e3
    x[0, 128:] *= 1e-38  # blocks 1–3 of row 0 subnormal after a block ~1e3
    x[1, :128] *= 1e-30  # the other order (~1e-30)
    x[2, 256:384] = 0.0  # a zero block (scale 1)
    x[3, :384] *= 2.0**-130  # subnormal blocks in fp32, then a normal one
    x[4] *= 1e15  # large everywhere (g·u ~1e30)
    x[5, 300] = float("nan")
    kern = _k()
    xq, xs = kern.quantize(x)
    z = kern.fp8_gemm(xq, xs, wg.values, wg.scale_inv, wu.values, wu.scale_inv, activation=activations.IDENTITY,
                      quant_out=False, out_dtype=torch.float32).double()
    xd = fp8.dequantize_activation(xq, xs, torch.float64)
    g, u = (xd @ w.dequantize(torch.float64).T for w in (wg, wu))
    sg, su = ((xd.abs() @ w.dequantize(torch.float64).abs().T) for w in (wg, wu))
    eps = ACC or 520 * 2.0**-24  # fp32 sums of 512 terms and four promotions
    bound = eps * (sg * (u.abs() + eps * su) + g.abs() * su) + 2.0**-24 * (g * u).abs() + 2.0**-149
    ok = torch.arange(20) != 5
    assert bool(z[5].isnan().all()) and not bool(z[ok].isnan().any())
    assert bool(((z[ok] - (g * u)[ok]).abs() <= bound[ok]).all())
    assert bool((z[0].abs() > 0).any()) and bool((z[1].abs() > 0).any())


def test_down_gemm_is_the_dequantized_product_to_fp32_rounding():
    x, (_, _, wd), (_, _, bd) = _case(3, 40, 200, 384, bias=True)
    kern = _k()
    hq, hs = kern.quantize(torch.randn(40, 384, generator=torch.Generator().manual_seed(4)).to(DEVICE))
    y = kern.fp8_gemm(hq, hs, wd.values, wd.scale_inv, None, None, bd, activation=activations.IDENTITY,
                      quant_out=False, out_dtype=torch.float32)
    hd = fp8.dequantize_activation(hq, hs, torch.float64)
    w = wd.dequantize(torch.float64)
    ref = hd @ w.T + bd.double()
    bound = (ACC or 390 * 2.0**-24) * (hd.abs() @ w.abs().T + bd.double().abs()) + 2.0**-24 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("m", [1, 5, 16])
def test_weight_only_kernels_are_the_dequantized_weights_in_fp32(m):
    x, (wg, wu, wd), (bg, bu, bd) = _case(5, m, 260, 200, bias=True)
    kern = _k()
    act = activations.get("gelu_tanh")
    h = kern.fp8_weight_gemm(x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu, activation=act.id)
    x64 = x.double()
    g = x64 @ wg.dequantize(torch.float64).T + bg.double()
    u = x64 @ wu.dequantize(torch.float64).T + bu.double()
    h64 = act.forward(g) * u
    sums = lambda w, b: x64.abs() @ w.dequantize(torch.float64).abs().T + b.double().abs()  # noqa: E731
    eg, eu = 270 * 2.0**-24 * sums(wg, bg), 270 * 2.0**-24 * sums(wu, bu)
    lip = 1.2  # sup |gelu_tanh'| ≈ 1.13
    bound = lip * eg * (u.abs() + eu) + act.forward(g).abs() * eu + 2.0**-20 * (h64.abs() + 1e-30)
    assert bool(((h.double() - h64).abs() <= bound).all())
    y = kern.fp8_weight_gemm(h, wd.values, wd.scale_inv, None, None, bd, activation=activations.IDENTITY)
    ref = h.double() @ wd.dequantize(torch.float64).T + bd.double()
    yb = 210 * 2.0**-24 * (h.double().abs() @ wd.dequantize(torch.float64).abs().T + bd.double().abs())
    assert bool(((y.double() - ref).abs() <= yb + 2.0**-24 * ref.abs()).all())


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("m", [1, 6])
def test_weight_only_kernels_take_bf16_x_through_fp16_mmas(monkeypatch, tma, m):
    """bf16 x goes to fp16 MMAs as x·2^-6 against W·2^-15 (both exact, W always; x from 2^-8 up, an absolute 2^-19
    below). Against float64 of the same bf16 x, with x spanning 1e-5..1e6 in magnitude: the fp32 sums
    (K·2^-24 Σ|x||w|), that absolute error through Σ|w|, and one bf16 ulp (2^-7 relative) for the output's rounding
    (the interpreter's fp32 → bf16 store truncates; the GPU rounds to nearest, within half of that)."""
    kern = _k()
    monkeypatch.setattr(kern, "WEIGHT_TMA", tma)
    x, (wg, wu, wd), (bg, bu, bd) = _case(21, m, 260, 200, bias=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(22)
    x, hx = ((t.float().cpu() * 10.0 ** torch.randint(-5, 6, t.shape, generator=gen)).to(DEVICE, torch.bfloat16)
             for t in (x, torch.randn(m, 200, generator=gen)))
    act = activations.get("silu")
    h = kern.fp8_weight_gemm(x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu, activation=act.id)
    x64 = x.double()
    wgd, wud, wdd = (w.dequantize(torch.float64) for w in (wg, wu, wd))
    g, u = x64 @ wgd.T + bg.double(), x64 @ wud.T + bu.double()
    h64 = act.forward(g) * u

    def err(xa, w, b):  # fp32 sums, the smallest elements' fp16 rounding, the bias
        return 270 * 2.0**-24 * (xa.abs() @ w.abs().T + b.double().abs()) + 2.0**-19 * w.abs().sum(1)

    eg, eu = err(x64, wgd, bg), err(x64, wud, bu)
    bound = 1.2 * eg * (u.abs() + eu) + act.forward(g).abs() * eu + 2.0**-7 * h64.abs()
    assert bool(((h.double() - h64).abs() <= bound).all())
    y = kern.fp8_weight_gemm(hx, wd.values, wd.scale_inv, None, None, bd, activation=activations.IDENTITY)
    ref = hx.double() @ wdd.T + bd.double()
    assert bool(((y.double() - ref).abs() <= err(hx.double(), wdd, bd) + 2.0**-7 * ref.abs()).all())


@pytest.mark.parametrize("big", [float("inf"), 2.0 * 65520 * 2.0**6])
def test_a_bf16_token_past_the_fp16_range_gives_no_finite_answer(big):
    """An inf, or a magnitude past FP16_X_LIMIT, in one bf16 token: that token's outputs are not finite (never a
    finite wrong value), and the other tokens' are those of a call without it, bit for bit."""
    kern = _k()
    assert big >= kern.FP16_X_LIMIT
    x, (wg, wu, _), _ = _case(23, 3, 256, 128, dtype=torch.bfloat16)
    args = (wg.values, wg.scale_inv, wu.values, wu.scale_inv)
    clean = kern.fp8_weight_gemm(x, *args, activation=activations.SILU)
    x[1, 5] = big
    h = kern.fp8_weight_gemm(x, *args, activation=activations.SILU)
    assert not bool(h[1].isfinite().any())
    assert torch.equal(h[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("k", [128, 384])  # one K range; split in parts summed by the reduce kernel
def test_the_weight_only_epilogue_adds_the_residual_before_rounding(k):
    """y = x·Wᵀ + b + residual against float64: the fp32 sums and one rounding of the result, in the kernel's own
    epilogue (K whole) and in the split sums' reduction (K split)."""
    kern = _k()
    x, (w, _, _), (b, _, _) = _case(31, 5, k, 200, bias=True)
    res = torch.randn(5, 200, generator=torch.Generator().manual_seed(32)).to(DEVICE) * 10
    y = kern.fp8_weight_gemm(x, w.values, w.scale_inv, None, None, b, activation=activations.IDENTITY, residual=res)
    wd = w.dequantize(torch.float64)
    ref = x.double() @ wd.T + b.double() + res.double()
    bound = 270 * 2.0**-24 * (x.double().abs() @ wd.abs().T + b.double().abs()) + 2.0**-23 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())
    with pytest.raises(InputError, match="residual: expected a contiguous tensor of \\(5, 200\\)"):
        kern.fp8_weight_gemm(x, w.values, w.scale_inv, activation=activations.IDENTITY, residual=res[:, :100])


@pytest.mark.parametrize("m", [3, 40])
def test_a_nan_token_spoils_its_own_outputs_only(m):
    from mlpfuse.ops import fp8_mlp

    x, ws, _ = _case(6, m, 256, 256)
    x[1, 7] = float("nan")
    y = fp8_mlp.fp8_gated_mlp(x, *[t for w in ws for t in (w.values, w.scale_inv)], activation="silu",
                              backend="triton")
    assert bool(y[1].isnan().all())
    assert not bool(y[torch.arange(m) != 1].isnan().any())


def test_the_kernels_name_a_wrong_operand_in_one_line():
    kern = _k()
    x, (wg, wu, _), _ = _case(7, 4, 256, 128)
    with pytest.raises(InputError, match="w1: expected row-major torch.float8_e4m3fn"):
        kern.fp8_weight_gemm(x, wg.dequantize(), wg.scale_inv, activation=0)
    with pytest.raises(InputError, match=r"w2_scale: expected fp32 scales of shape \(1, 2\)"):
        kern.fp8_weight_gemm(x, wg.values, wg.scale_inv, wu.values, wu.scale_inv[:, :1], activation=0)
    xq, xs = kern.quantize(x)
    with pytest.raises(InputError, match="a_scale: expected fp32 scales"):
        kern.fp8_gemm(xq, xs[:, :1], wg.values, wg.scale_inv, activation=0, quant_out=True)
    with pytest.raises(InputError, match="at most 64 rows"):
        kern.fp8_weight_gemm(torch.zeros(65, 256, device=DEVICE), wg.values, wg.scale_inv, activation=0)


@pytest.mark.parametrize("mode", [0, 2, 3])
def test_the_decode_kernel_with_e4m3_weights_is_the_weight_only_recipe(mode):
    """One launch (or two) for the whole MLP, h on chip: against the weight-only reference in float64 on the same
    dequantized weights, within fp32 sums (K·2^-24 of Σ|x||w| per GEMM, through the GLU) and the cast of h."""
    from mlpfuse.kernels import decode_mlp

    x, (wg, wu, wd), (bg, bu, bd) = _case(8, 5, 256, 384, bias=True)
    act = activations.get("silu")
    args = (x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, wd.values, wd.scale_inv, bg, bu, bd)
    if mode == 2:
        y = decode_mlp.decode_gated_mlp_fp8(*args, activation=act.id, deterministic=True)
        assert torch.equal(y, decode_mlp.decode_gated_mlp_fp8(*args, activation=act.id, deterministic=True))
    else:
        key_policy = decode_mlp._POLICY
        try:  # the mode the policy table gives 5 rows of this size, set for this test
            decode_mlp._POLICY = {**key_policy, ("small", 16, False): mode}
            decode_mlp._plans.clear()
            y = decode_mlp.decode_gated_mlp_fp8(*args, activation=act.id)
        finally:
            decode_mlp._POLICY = key_policy
            decode_mlp._plans.clear()
    x64 = x.double()
    dq = [w.dequantize(torch.float64) for w in (wg, wu, wd)]
    g, u = x64 @ dq[0].T + bg.double(), x64 @ dq[1].T + bu.double()
    h64 = act.forward(g) * u
    eg = 270 * 2.0**-24 * (x64.abs() @ dq[0].abs().T + bg.double().abs())
    eu = 270 * 2.0**-24 * (x64.abs() @ dq[1].abs().T + bu.double().abs())
    eh = 1.2 * eg * (u.abs() + eu) + act.forward(g).abs() * eu + 2.0**-20 * (h64.abs() + 1e-30)
    hb = h64.abs() + eh
    ref = h64 @ dq[2].T + bd.double()
    bound = eh @ dq[2].abs().T + 400 * 2.0**-24 * (hb @ dq[2].abs().T + bd.double().abs()) + 2.0**-24 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_decode_kernel_runs_bf16_x_through_fp16_mmas(deterministic):
    """bf16 x, e4m3 weights, h on chip: x·2^-6 and h·2^-6 against W·2^-15 in fp16 MMAs, as the weight-only kernel.
    Against float64 on the dequantized weights with x over 1e-3..1e3: fp32 sums (K·2^-24 Σ|x||w|), the fp16 copies'
    absolute 2^-19 below 2^-8 (through Σ|w|), h's and y's bf16 roundings (one ulp, 2^-7: the interpreter truncates)."""
    from mlpfuse.kernels import decode_mlp

    x, (wg, wu, wd), (bg, bu, bd) = _case(41, 5, 256, 384, bias=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(42)
    x = (x.float().cpu() * 10.0 ** torch.randint(-3, 4, x.shape, generator=gen)).to(DEVICE, torch.bfloat16)
    act = activations.get("silu")
    args = (x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, wd.values, wd.scale_inv, bg, bu, bd)
    y = decode_mlp.decode_gated_mlp_fp8(*args, activation=act.id, deterministic=deterministic)
    x64 = x.double()
    dq = [w.dequantize(torch.float64) for w in (wg, wu, wd)]
    g, u = x64 @ dq[0].T + bg.double(), x64 @ dq[1].T + bu.double()
    h64 = act.forward(g) * u

    def err(a, w, b):
        return 270 * 2.0**-24 * (a.abs() @ w.abs().T + b.double().abs()) + 2.0**-19 * w.abs().sum(1)

    eg, eu = err(x64, dq[0], bg), err(x64, dq[1], bu)
    eh = 1.2 * eg * (u.abs() + eu) + act.forward(g).abs() * eu + 2.0**-7 * h64.abs()
    ref = h64 @ dq[2].T + bd.double()
    bound = eh @ dq[2].abs().T + err(h64.abs() + eh, dq[2], bd) + 2.0**-7 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_the_decode_kernel_with_e4m3_weights_adds_the_residual_in_its_epilogue():
    """y(residual) against y + residual: the same sums, one fp32 rounding apart (the epilogue rounds z + residual
    once, the unfused add rounds y, then y + residual)."""
    from mlpfuse.kernels import decode_mlp

    x, ws, bs = _case(43, 3, 256, 384, bias=True)
    res = torch.randn(3, 256, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    args = (x, *[t for w in ws for t in (w.values, w.scale_inv)], *bs)
    y = decode_mlp.decode_gated_mlp_fp8(*args, activation=activations.SILU, deterministic=True)
    yr = decode_mlp.decode_gated_mlp_fp8(*args, activation=activations.SILU, deterministic=True, residual=res)
    want = y.double() + res.double()
    assert bool(((yr.double() - want).abs() <= 2.0**-23 * (want.abs() + y.double().abs())).all())


@pytest.mark.skipif(not HAS_CUDA, reason="launch plans are kept for CUDA tensors only")
def test_a_planned_call_equals_the_full_path_and_serves_only_its_layout(monkeypatch):
    """A repeated call with the same layout goes straight to the compiled kernel (its plan); its result is bit for
    bit the full path's (plans off: Triton's own launch), for every wrapper, with and without biases, and another
    layout (rows, a strided x, other weights) gets a plan of its own."""
    from mlpfuse.kernels import _common as C

    kern = _k()
    kern._plans.clear()
    x, (wg, wu, wd), (bg, bu, bd) = _case(9, 300, 256, 384, bias=True, dtype=torch.bfloat16)
    wide = torch.randn(300, 512, generator=torch.Generator().manual_seed(10)).to(DEVICE, torch.bfloat16)

    def calls(x):
        xq, xs = kern.quantize(x)
        hq, hs = kern.fp8_gemm(xq, xs, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu,
                               activation=activations.get("silu").id, quant_out=True)
        y = kern.fp8_gemm(hq, hs, wd.values, wd.scale_inv, None, None, bd, activation=activations.IDENTITY,
                          quant_out=False, out_dtype=torch.bfloat16)
        d = kern.fp8_weight_gemm(x[:5], wg.values, wg.scale_inv, wu.values, wu.scale_inv,
                                 activation=activations.get("silu").id)
        return xq, xs, hq, hs, y, d

    first = calls(x)
    assert len(kern._plans) == 4
    again = calls(x.clone())  # same layout, another address: the plans
    assert len(kern._plans) == 4
    calls(wide[:, :256])  # a strided x: plans of its own
    assert len(kern._plans) == 6  # quantize and the weight-only kernel; hq and the GEMMs' layouts are the same
    monkeypatch.setattr(C, "DIRECT_LAUNCH", False)
    full = calls(x)
    for a, b, c in zip(first, again, full):
        assert _same_bits_or_both_nan(a, c) and _same_bits_or_both_nan(b, c)
    kern._plans.clear()


def _rms64(x, nw, eps, kind):
    """The RMSNorm in float64 (kind 1: weight·norm(x); 2: norm(x)·(1 + weight))."""
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return n * (nw.double() if kind == 1 else 1.0 + nw.double())


@pytest.mark.parametrize("kind", [1, 2])
def test_the_norm_and_quantization_pass_is_the_norm_then_the_recipe(kind):
    """quantize(x, norm): each row's RMSNorm (rounded as ops.norm.rms_norm rounds) quantized 1×128 in one pass: the
    scales are the normalised groups' amax/448 and each value one e4m3 rounding of the normalised x (the norm's own
    fp32 rounding may move a value across a rounding boundary: two steps allowed where the reference's is one)."""
    from mlpfuse.ops.norm import rms_norm

    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(37, 300, generator=gen) * 2.0 ** torch.randint(-6, 6, (37, 1), generator=gen)).to(DEVICE)
    nw = (torch.randn(300, generator=gen) * 0.2 + (1.0 if kind == 1 else 0.0)).to(DEVICE)
    q, s = _k().quantize(x, norm_weight=nw, norm_eps=1e-6, norm_kind=kind)
    v = _rms64(x, nw, 1e-6, kind)
    amax = torch.nn.functional.pad(v.abs(), (0, -v.shape[1] % 128)).unflatten(1, (-1, 128)).amax(-1)
    assert bool(((s.double() - amax / 448).abs() <= amax / 448 * 2.0**-20).all())
    deq = fp8.dequantize_activation(q, s, torch.float64)
    sh = s.double().repeat_interleave(128, 1)[:, :300]
    assert bool(((deq - v).abs() <= (U + 2.0**-20) * v.abs() + SUB * sh).all())
    rq, rs = fp8.quantize_activation(rms_norm(x, nw, 1e-6, kind))  # the unfused form: the same values
    assert float((deq - fp8.dequantize_activation(rq, rs, torch.float64)).abs().max()) <= 2 * U * float(v.abs().max())


@pytest.mark.parametrize("kind,m", [(1, 1), (2, 5), (1, 16)])
def test_the_weight_only_kernel_reads_x_through_the_norm(kind, m):
    """fp8_weight_gemm(x, norm): act(g)·u of the normalised x against float64, within the fp32 sums (K·2^-24 of
    Σ|x̂||w| per projection, x̂ the normalised x, through the GLU) and the row scale's own rounding."""
    x, (wg, wu, _), (bg, bu, _) = _case(12, m, 260, 200, bias=True)
    nw = (torch.randn(260, generator=torch.Generator().manual_seed(13)) * 0.2 + (kind == 1)).to(DEVICE)
    act = activations.get("silu")
    h = _k().fp8_weight_gemm(x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu, activation=act.id,
                             norm_weight=nw, norm_eps=1e-5, norm_kind=kind)
    xn = _rms64(x, nw, 1e-5, kind)
    g = xn @ wg.dequantize(torch.float64).T + bg.double()
    u = xn @ wu.dequantize(torch.float64).T + bu.double()
    h64 = act.forward(g) * u
    sums = lambda w, b: xn.abs() @ w.dequantize(torch.float64).abs().T + b.double().abs()  # noqa: E731
    eg, eu = 280 * 2.0**-24 * sums(wg, bg), 280 * 2.0**-24 * sums(wu, bu)
    bound = 1.2 * eg * (u.abs() + eu) + act.forward(g).abs() * eu + 2.0**-20 * (h64.abs() + 1e-30)
    assert bool(((h.double() - h64).abs() <= bound).all())


def test_a_bad_norm_is_one_line():
    kern = _k()
    x, (wg, wu, _), _ = _case(14, 4, 256, 128)
    nw = torch.ones(256, device=DEVICE)
    with pytest.raises(InputError, match=r"norm_weight: expected a contiguous floating-point \[256\] tensor"):
        kern.quantize(x, norm_weight=nw[:128], norm_kind=1)
    with pytest.raises(InputError, match=r"norm_weight: expected torch.float32 \(x's dtype\), got torch.float64"):
        kern.quantize(x, norm_weight=nw.double(), norm_kind=1)
    with pytest.raises(InputError, match="norm_kind: expected 1"):
        kern.fp8_weight_gemm(x, wg.values, wg.scale_inv, activation=0, norm_weight=nw, norm_kind=3)
    with pytest.raises(InputError, match="norm_weight: given without a norm_kind"):
        kern.quantize(x, norm_weight=nw)


@pytest.mark.parametrize("m", [5, 40])
def test_the_two_layer_mlp_runs_the_same_kernels_without_an_up_projection(m):
    """fp8_gated_mlp with no up projection (GPT-2's c_fc / c_proj): the weight-only kernels at decode sizes, x and
    h quantized (h in the first GEMM's epilogue) above; against the recipe in float64 within its bound, and against
    the reference path within a few of h's roundings norm-wise."""
    from mlpfuse.ops import fp8_mlp

    x, (wg, _, wd), (bg, _, bd) = _case(15, m, 256, 384, bias=True)
    args = (x, wg.values, wg.scale_inv, None, None, wd.values, wd.scale_inv, bg, None, bd)
    y = fp8_mlp.fp8_gated_mlp(*args, activation="gelu_tanh", backend="triton")
    ref = fp8_mlp.fp8_gated_mlp(*args, activation="gelu_tanh", backend="torch")
    w64 = [w.dequantize(torch.float64) for w in (wg, wd)]
    y64, bound = reference.gated_mlp_fp8_bound(x.double(), w64[0], None, w64[1], "gelu_tanh", bg.double(), None,
                                               bd.double(), out_roundoff=2.0**-24,
                                               accumulation=reference.FP8_MMA_ACCUMULATION if HAS_CUDA else
                                               reference.FP32_ACCUMULATION)
    assert bool(((y.double() - y64).abs() <= bound).all())
    assert float((y - ref).norm() / ref.norm()) < 4 * U / 16  # the same recipe: h's roundings may differ at ties


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs and programmatic dependent launch need a GPU")
@pytest.mark.parametrize("m", [1, 16])
def test_the_decode_chain_launched_as_programmatic_dependents_waits_for_its_inputs(monkeypatch, m):
    """Four decode-sized blocks back to back (gate+up, then down split with its reduction and the residual), each
    block's x the last one's output: with PDL (sm90+) every kernel may start while the one before it drains, so one
    that touched x, the residual or its output before its wait would read a stale value. Eager and CUDA-graph replays
    with PDL, and eager without it, all agree bit for bit (the kernels are deterministic)."""
    kern = _k()
    gen = torch.Generator().manual_seed(41)
    d, h = 512, 1536
    wg, wu, wd = (fp8.quantize_weight((torch.randn(*s, generator=gen) * s[1] ** -0.5).cuda())
                  for s in ((h, d), (h, d), (d, h)))
    silu = activations.get("silu").id

    def chain(x):
        for _ in range(4):
            g = kern.fp8_weight_gemm(x, wg.values, wg.scale_inv, wu.values, wu.scale_inv, activation=silu)
            x = kern.fp8_weight_gemm(g, wd.values, wd.scale_inv, activation=activations.IDENTITY, residual=x)
        return x

    x = torch.randn(m, d, generator=gen).cuda().to(torch.bfloat16)
    kern._plans.clear()
    monkeypatch.setattr(kern, "PDL", True)
    eager = chain(x)
    static = x.clone()
    chain(static)  # plans made before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(out.clone())
    monkeypatch.setattr(kern, "PDL", False)
    plain = chain(x)
    kern._plans.clear()
    assert torch.isfinite(eager.float()).all()
    for r in replays:
        assert torch.equal(r, eager)
    assert torch.equal(plain, eager)
