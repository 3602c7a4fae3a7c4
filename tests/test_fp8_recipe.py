"""The FP8 recipe (mlpfuse.fp8) and its reference MLP (reference.gated_mlp_fp8) against float64 oracles.

Error bounds used throughout, u = 2^-4 (e4m3's unit roundoff), s a group's scale_inv = amax/448:
- an element whose scaled value |t|/s is at least e4m3's smallest normal 2^-6 rounds within u·|t|;
- below it, e4m3's subnormal spacing is 2^-9, so the error is at most 2^-10·s; in general u·|t| + 2^-10·s;
- fp32 steps (the division by s, the product values·s) add 2^-24 relative each: the margin (1 + 2^-20) covers them.
Every assertion is one of these bounds (or one derived from them for the MLP), so no test depends on a lucky draw.
"""

import io
import math

import pytest
import torch
import torch.nn.functional as F

from mlpfuse import activations, fp8, reference
from mlpfuse.errors import InputError

U = fp8.UNIT_ROUNDOFF
SUB = fp8.SUBNORMAL_HALF_SPACING
MARGIN = 1 + 2.0**-20


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _varied(shape, gen, groups_dim=-1):
    """Normal draws times a magnitude that changes per 128-group of the last dimension, from 2^-20 to 2^20, so the
    scales are exercised far from 1; exactly representable in fp32, so the oracle and the recipe see one value."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    n = shape[-1]
    mags = 2.0 ** torch.randint(-20, 21, (*shape[:-1], -(-n // 128)), generator=gen).double()
    return (t * mags.repeat_interleave(128, -1)[..., :n]).float().double()


def _group_scale(x64, dims):
    """The recipe's scale_inv recomputed in float64 from the real elements, broadcast back to x's shape."""
    if dims == "row":
        k = x64.shape[-1]
        pad = F.pad(x64, (0, -k % 128)).unflatten(-1, (-1, 128)).abs().amax(-1)
        return (pad / 448).repeat_interleave(128, -1)[..., :k]
    out, inp = x64.shape
    pad = F.pad(x64, (0, -inp % 128, 0, -out % 128))
    amax = pad.unflatten(1, (-1, 128)).unflatten(0, (-1, 128)).abs().amax(dim=(1, 3))
    return (amax / 448).repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]


def _check_within_roundoff(x64, deq, s64):
    err = (deq.double() - x64).abs()
    assert bool((err <= (U * x64.abs() + SUB * s64) * MARGIN).all())
    normal = x64.abs() >= 2.0**-6 * s64
    assert bool((err[normal] <= U * x64.abs()[normal] * MARGIN).all())
    return (err[normal] / x64.abs()[normal]).max().item()


@pytest.mark.parametrize("shape", [(4, 3, 256), (7, 300), (5, 1)])
def test_activation_round_trip_is_within_e4m3_roundoff(shape):
    x64 = _varied(shape, _gen(1))
    values, scale_inv = fp8.quantize_activation(x64)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x64.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (*shape[:-1], -(-shape[-1] // 128))
    deq = fp8.dequantize_activation(values, scale_inv, torch.float64)
    assert _check_within_roundoff(x64, deq, _group_scale(x64, "row")) <= U


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1)])
def test_weight_round_trip_is_within_e4m3_roundoff(shape):
    gen = _gen(2)
    w64 = (torch.randn(*shape, generator=gen, dtype=torch.float64)
           * 2.0 ** torch.randint(-20, 21, shape, generator=gen).double()).float().double()  # magnitudes mixed too
    q = fp8.quantize_weight(w64)
    assert q.shape == shape and q.dtype == torch.float64 and q.block == (128, 128)
    assert q.scale_inv.shape == fp8.weight_scale_shape(*shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    _check_within_roundoff(w64, q.dequantize(torch.float64), _group_scale(w64, "block"))


def test_channel_round_trip_keeps_each_channel_at_its_own_scale():
    """fp8.quantize_channels (FP8 training's weight-gradient operands): one scale per column over all the rows, the
    values transposed; each value within e4m3's roundoff of its column's amax/448 (float64 oracle), so a column
    2^20 below its neighbours keeps full precision — channels never share a scale."""
    x64 = _varied((300, 96), _gen(5)).t().contiguous()  # [96 rows, 300 columns]
    x64 = x64 * 2.0 ** torch.randint(-20, 21, (1, 300), generator=_gen(6)).double()  # each column its magnitude
    values, scale_inv = fp8.quantize_channels(x64.float())
    assert values.shape == (300, 96) and scale_inv.shape == (300,)
    assert torch.equal(scale_inv.double(), x64.abs().amax(0).div(448).float().double())
    deq = values.t().double() * scale_inv.double()
    _check_within_roundoff(x64, deq, (x64.abs().amax(0) / 448).expand_as(x64))


def test_a_partial_last_group_is_scaled_by_its_real_elements_only():
    x = torch.full((2, 130), 1000.0)
    x[:, 128:] = torch.tensor([3.0, -5.0])
    _, scale_inv = fp8.quantize_activation(x)
    f32 = torch.float32
    assert torch.equal(scale_inv[:, 1], torch.full((2,), 5.0, dtype=f32) / 448)  # not the padding, not 1000
    w = torch.ones(129, 130)
    w[128, 129] = -7.0
    expected = torch.tensor([[1.0, 1.0], [1.0, 7.0]], dtype=f32) / 448
    assert torch.equal(fp8.quantize_weight(w).scale_inv, expected)


def test_zero_groups_get_scale_one_and_tiny_or_huge_groups_never_overflow():
    x = torch.zeros(3, 384)
    x[1, 128:256] = torch.linspace(-1e-40, 1e-40, 128)  # fp32 subnormals: amax/448 would be a subnormal scale
    x[2, 256:] = torch.linspace(-1, 1, 128) * 3e38  # near fp32's largest
    values, scale_inv = fp8.quantize_activation(x)
    assert scale_inv[0].tolist() == [1.0, 1.0, 1.0] and scale_inv[1, 0] == 1.0
    assert bool((scale_inv >= 2.0**-126).all()) and bool(scale_inv.isfinite().all())
    deq = fp8.dequantize_activation(values, scale_inv, torch.float64)
    assert bool(deq.isfinite().all())
    assert bool((deq[0] == 0).all())
    assert (deq[1] - x[1].double()).abs().max() <= SUB * 2.0**-126  # flushed, never blown up to inf or 448
    big = x[2, 256:].double()
    assert bool(((deq[2, 256:] - big).abs() <= U * big.abs() * MARGIN + SUB * 3e38 / 448).all())
    q = fp8.quantize_weight(torch.zeros(200, 130))
    assert bool((q.scale_inv == 1).all()) and bool((q.dequantize(torch.float32) == 0).all())


def test_an_outlier_is_scaled_not_clipped():
    gen = _gen(3)
    x = 0.5 + torch.rand(4, 256, generator=gen)  # ~1
    x[:, 3] = 1e4
    x[2, 200] = -1e30  # far beyond e4m3's 448 before scaling
    values, scale_inv = fp8.quantize_activation(x)
    assert float(values.float().abs().max()) == 448.0  # the largest element lands on 448, nothing beyond
    deq = fp8.dequantize_activation(values, scale_inv, torch.float64)
    assert bool(deq.isfinite().all())
    assert bool(((deq[:, 3] - 1e4).abs() <= 1e4 * 2.0**-22).all())  # exact up to fp32 rounding of amax/448·448
    assert abs(deq[2, 200].item() + 1e30) <= 1e30 * 2.0**-22
    # the ~1 elements sit at ~1/22 after scaling, inside e4m3's normal range: within 2^-4
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[:, 3] = False
    rest[2, 128:] = False  # the group sharing the 1e30 is flushed towards 0 (finite): float math's absorption
    assert bool(((deq - x.double()).abs()[rest] <= U * x.double().abs()[rest] * MARGIN).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_make_their_whole_group_nan_and_no_other(bad):
    gen = _gen(4)
    x = torch.randn(3, 300, generator=gen)
    x[1, 140] = bad
    values, scale_inv = fp8.quantize_activation(x)
    deq = fp8.dequantize_activation(values, scale_inv)
    assert bool(deq[1, 128:256].isnan().all())  # the group holding it: all NaN (e4m3fn has no inf)
    others = torch.ones_like(x, dtype=torch.bool)
    others[1, 128:256] = False
    assert bool(deq[others].isfinite().all())
    w = torch.randn(200, 300, generator=gen)
    w[150, 10] = bad
    dq = fp8.quantize_weight(w).dequantize(torch.float32)
    assert bool(dq[128:, :128].isnan().all()) and int(dq.isnan().sum()) == 72 * 128


def test_a_nan_in_a_token_makes_that_tokens_output_nan_as_in_float_math():
    gen = _gen(5)
    ws = [fp8.quantize_weight(torch.randn(256, 128, generator=gen)),
          fp8.quantize_weight(torch.randn(256, 128, generator=gen)),
          fp8.quantize_weight(torch.randn(128, 256, generator=gen))]
    x = torch.randn(3, 128, generator=gen)
    x[1, 7] = math.nan
    y = reference.gated_mlp_fp8(x, *ws, "silu")
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())


def test_checkpoint_keys_round_trip_bitwise_and_load_into_transformers_fp8linear():
    q = fp8.quantize_weight(torch.randn(300, 200, generator=_gen(6), dtype=torch.bfloat16))
    prefix = "model.layers.0.mlp.gate_proj."
    state = q.state_dict(prefix)
    assert sorted(state) == [prefix + "weight", prefix + "weight_scale_inv"]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    back = fp8.Fp8Weight.from_state_dict(torch.load(buf), prefix, dtype=torch.bfloat16)
    assert torch.equal(back.values.view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(back.scale_inv.view(torch.int32), q.scale_inv.view(torch.int32))
    assert back.dtype == torch.bfloat16 and back.to("cpu").device.type == "cpu"

    ft = pytest.importorskip("transformers.integrations.finegrained_fp8")
    assert fp8.TRANSFORMERS_CLASS == f"{ft.__name__}.{ft.FP8Linear.__name__}"
    layer = ft.FP8Linear(200, 300, block_size=fp8.BLOCK)  # what FineGrainedFP8Config((128, 128)) builds
    layer.load_state_dict(q.state_dict(), strict=True)  # same names, shapes and dtypes
    assert fp8.Fp8Weight.from_state_dict(layer.state_dict()).scale_inv.shape == (3, 2)
    dequant = getattr(ft, "_dequantize_fp8_weight", None)  # transformers' own dequantization, where it has one
    if dequant is not None:
        assert torch.equal(dequant(layer.weight.detach(), layer.weight_scale_inv.detach(), list(fp8.BLOCK),
                                   torch.float32), q.dequantize(torch.float32))


def _one_line_error(fn, *names):
    with pytest.raises(InputError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def test_import_validation_names_the_tensor_in_one_line():
    q = fp8.quantize_weight(torch.randn(256, 384))
    p = "mlp.up_proj."
    good = q.state_dict(p)
    load = fp8.Fp8Weight.from_state_dict
    _one_line_error(lambda: load({**good, p + "weight_scale_inv": torch.ones(3, 3)}, p),
                    "mlp.up_proj.weight_scale_inv", "[3, 3]", "[2, 3]")
    _one_line_error(lambda: load({**good, p + "weight_scale_inv": torch.ones(())}, p), "weight_scale_inv", "[]")
    _one_line_error(lambda: load({**good, p + "weight": torch.randn(256, 384)}, p), "mlp.up_proj.weight:", "float32")
    _one_line_error(lambda: load({**good, p + "weight_scale_inv": torch.ones(2, 3, dtype=torch.bfloat16)}, p),
                    "mlp.up_proj.weight_scale_inv:", "bfloat16")
    _one_line_error(lambda: load({p + "weight": good[p + "weight"]}, p), "mlp.up_proj.weight_scale_inv", "missing")
    _one_line_error(lambda: fp8.Fp8Weight(q.values, q.scale_inv[:1]), "weight_scale_inv")
    _one_line_error(lambda: fp8.quantize_weight(torch.randn(3, 4, 5)), "weight")
    _one_line_error(lambda: fp8.dequantize_activation(*fp8.quantize_activation(torch.randn(2, 300))[:1],
                                                      torch.ones(2, 2)), "scale_inv", "[2, 3]")
    # ue8m0 scales (powers of two) are widened to fp32 exactly
    e8 = getattr(torch, "float8_e8m0fnu", None)
    if e8 is not None:
        pow2 = torch.tensor([[0.5, 2.0**-20, 4.0], [1.0, 8.0, 2.0**10]])
        w = load({p + "weight": q.values, p + "weight_scale_inv": pow2.to(e8)}, p)
        assert torch.equal(w.scale_inv, pow2)


def test_per_k_block_scaling_equals_dequantize_then_matmul():
    """The kernels' form: per 128-wide K block, Σ xq·wq (exact products, fp32 sums) times sx·sw. Against the
    reference's dequantized fp32 GEMM: equal up to fp32 rounding, K·2^-24 of Σ|x||w| (see reference.py)."""
    gen = _gen(7)
    x, w = _varied((9, 300), gen), torch.randn(130, 300, generator=gen)
    xq, xs = fp8.quantize_activation(x)
    wq = fp8.quantize_weight(w)
    y = reference.linear_fp8(x.float(), wq)
    blocks = []
    for b in range(3):
        k = slice(128 * b, 128 * (b + 1))
        partial = xq[:, k].double() @ wq.values[:, k].double().T  # exact: 8-bit products, short sums
        sw = wq.scale_inv[:, b].double().repeat_interleave(128)[:130]
        blocks.append(partial * xs[:, b:b + 1].double() * sw)
    y_blocks = sum(blocks)
    scale = fp8.dequantize_activation(xq, xs, torch.float64).abs() @ wq.dequantize(torch.float64).abs().T
    assert bool(((y.double() - y_blocks).abs() <= 310 * 2.0**-24 * scale).all())


# ---- the reference FP8 MLP against the float64 MLP (and reference.gated_mlp_fp8_bound, the bound `patch` uses) -

def _mlp_case(seed, m, d, hidden, bias):
    gen = _gen(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float().double()

    x = r(m, d)
    ws = [r(hidden, d, scale=d**-0.5), r(hidden, d, scale=d**-0.5), r(d, hidden, scale=hidden**-0.5)]
    bs = [r(hidden, scale=0.1), r(hidden, scale=0.1), r(d, scale=0.1)] if bias else [None] * 3
    return x, ws, bs


@pytest.mark.parametrize("act,bias,dtype,shape", [
    ("gelu_tanh", False, torch.float32, (33, 256, 384)),
    ("silu", True, torch.bfloat16, (17, 200, 300)),  # partial groups, biases, a 16-bit input and output
    ("relu", True, torch.float32, (8, 128, 130)),
])
def test_fp8_mlp_error_is_within_the_derived_bound(act, bias, dtype, shape):
    x, ws, bs = _mlp_case(11, *shape, bias)
    x_in = x.to(dtype)
    x = x_in.double()  # the oracle sees the input the recipe sees
    qs = [fp8.quantize_weight(w) for w in ws]
    y = reference.gated_mlp_fp8(x_in.reshape(1, *x.shape), *qs, act, *bs).reshape(x.shape[0], -1)
    assert y.dtype == dtype
    y64 = reference.gated_mlp(x, *ws, act, *bs)
    out_roundoff = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    y_bound, bound = reference.gated_mlp_fp8_bound(x, *ws, act, *bs, out_roundoff=out_roundoff)
    torch.testing.assert_close(y_bound, y64, rtol=1e-12, atol=1e-12)
    err = (y.double() - y64).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # Norm-wise: the elementwise bound above is rigorous but ignores cancellation in the GEMMs (|x|·|W|ᵀ is ~√K times
    # |x·Wᵀ| for random signs). The first-order variance model below is the norm-wise statement. It bounds each
    # rounding's mean square by u²t²/3; for significands spread log-uniformly the mean square is 2^-6·0.541/12·t²
    # ≈ 0.54 of that, so the measured norm should come out near √0.54 ≈ 0.73 of the prediction (0.69–0.70 here):
    # the assertion has that 1.4× margin, and thousands of elements keep the measured norm within ~1 % of its mean.
    predicted = _predicted_error_norm(x, *ws, act, *bs, out_roundoff)
    measured = float(err.norm())
    assert measured <= predicted, (measured, predicted)
    assert predicted / float(y64.norm()) < 2 * U  # the model's own scale: a fraction of e4m3's 2^-4 norm-wise


def _rounding_variance(t, dims, roundoff=U):
    """Upper bound on the mean square of one rounding of t: (max(u·|t|, 2^-10·s))²/3 ≤ (u²t² + 2^-20·s²)/3."""
    sub = 0 if dims is None else SUB * _group_scale(t, dims)
    return (roundoff**2 * t**2 + sub**2) / 3


def _predicted_error_norm(x, wg, wu, wd, act, bg, bu, bd, out_roundoff):
    """‖Δy‖_F predicted to first order, each rounding an independent zero-mean error of bounded mean square:
        Var Δg = Var(Δx)·(Wg²)ᵀ + x²·Var(ΔWg)ᵀ   (and Δu)
        Var Δh = (act'(g)·u)²·Var Δg + act(g)²·Var Δu + Var(h's own rounding)
        Var Δy = Var Δh·(Wd²)ᵀ + h²·Var(ΔWd)ᵀ + Var(the output cast)
    fp32 accumulation (2^-24) is three orders below and left out."""
    vx = _rounding_variance(x, "row")
    g, u = reference.gated_preact(x, wg, wu, bg, bu)
    vg = vx @ (wg**2).T + x**2 @ _rounding_variance(wg, "block").T
    vu = vx @ (wu**2).T + x**2 @ _rounding_variance(wu, "block").T
    a = activations.get(act)
    h = a.forward(g) * u
    vh = (a.grad(g) * u) ** 2 * vg + a.forward(g) ** 2 * vu + _rounding_variance(h, "row")
    y = F.linear(h, wd, bd)
    vy = vh @ (wd**2).T + h**2 @ _rounding_variance(wd, "block").T + _rounding_variance(y, None, out_roundoff)
    return float(vy.sum().sqrt())


# ---- why the recipe: outliers ----------------------------------------------------------------------------------

def _per_tensor(t):
    """The comparison: one scale for the whole tensor, same rounding and guards."""
    s = fp8._scale_inv(t.float().abs().amax())
    return ((t.float() / s).to(fp8.DTYPE).float() * s).double()


def _fixed_magnitudes(shape, gen):
    """Magnitudes evenly spread over [2^-4, 1], in random places and signs: the multiset of values does not depend
    on the draw, so neither does any error summed over them."""
    n = math.prod(shape)
    mags = torch.linspace(2.0**-4, 1.0, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]
    signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
    return (mags * signs).reshape(shape).float().double()


def test_channel_outliers_spoil_one_group_in_the_recipe_and_every_value_per_tensor():
    """Activation channels 5 and 300 at 2^16 (LLM outlier features). Per tensor, every other value lands at ≤ 448·
    2^-16 ≈ 0.007 after scaling, where e4m3's spacing is 2^-9: relative errors of order one. The recipe scales each
    token's 128-channel groups apart, so groups 1 and 3 (channels 128..255, 384..511) keep 2^-4."""
    gen = _gen(12)
    x = _fixed_magnitudes((64, 512), gen)
    x[:, [5, 300]] = 2.0**16
    recipe = fp8.dequantize_activation(*fp8.quantize_activation(x), torch.float64)
    clean = torch.cat([torch.arange(128, 256), torch.arange(384, 512)])
    rel_recipe = ((recipe - x).abs() / x.abs())[:, clean]
    rel_tensor = ((_per_tensor(x) - x).abs() / x.abs())[:, clean]
    assert float(rel_recipe.max()) <= U * MARGIN
    # per tensor, |x| < 2^-10·2^16/448 ≈ 0.143 flushes to zero: (0.143 − 0.0625)/0.9375 ≈ 8.6 % of the multiset,
    # each a 100 % error, and the rest rounds on a grid of ±0.143 absolute
    assert float((rel_tensor == 1).double().mean()) > 0.08
    assert float(rel_tensor.mean()) > 2 * U > 4 * float(rel_recipe.mean())


def test_weight_output_channel_outliers_stay_in_their_block():
    """Output channels 0..7 of W at 2^16: 128×128 blocks confine them to rows 0..127; per tensor they ruin all."""
    gen = _gen(13)
    w = _fixed_magnitudes((384, 256), gen)
    w[:8] *= 2.0**16
    rel_recipe = ((fp8.quantize_weight(w).dequantize(torch.float64) - w).abs() / w.abs())[128:]
    rel_tensor = ((_per_tensor(w) - w).abs() / w.abs())[128:]
    assert float(rel_recipe.max()) <= U * MARGIN
    assert float((rel_tensor == 1).double().mean()) > 0.08  # as for activations: |w| < 0.143 flushes to zero
    assert float(rel_tensor.mean()) > 2 * U


def test_massive_activation_tokens_spoil_every_token_per_tensor_but_none_in_the_recipe():
    """Two tokens 2^16 larger than the rest (massive activations, e.g. a first token). Per tensor, x's and h's
    single scales follow them (h scales with their square), so the other tokens' outputs are mostly rounding; the
    recipe's per-token scales keep each token's relative error at its own few u."""
    x, ws, bs = _mlp_case(14, 16, 256, 384, bias=False)
    x[:2] *= 2.0**16
    y64 = reference.gated_mlp(x, *ws, "gelu_tanh")
    y = reference.gated_mlp_fp8(x.float(), *[fp8.quantize_weight(w) for w in ws], "gelu_tanh").double()
    wq = [_per_tensor(w) for w in ws]
    h = activations.get("gelu_tanh").forward(F.linear(_per_tensor(x), wq[0])) * F.linear(_per_tensor(x), wq[1])
    y_tensor = F.linear(_per_tensor(h), wq[2])

    def per_token(yy):
        return ((yy - y64).norm(dim=1) / y64.norm(dim=1))[2:]

    _, bound = reference.gated_mlp_fp8_bound(x, *ws, "gelu_tanh", out_roundoff=2.0**-24)
    assert bool(((y - y64).abs() <= bound).all())
    assert float(per_token(y).max()) < 0.25 and float(per_token(y_tensor).min()) > 0.5


@pytest.mark.parametrize("act,bias,dtype,shape", [
    ("gelu_tanh", True, torch.float32, (33, 256, 384)),
    ("relu", False, torch.bfloat16, (17, 200, 300)),
])
def test_the_two_layer_fp8_mlp_is_within_the_same_bound_without_an_up_projection(act, bias, dtype, shape):
    """up None: y = down(act(gate(x))) in the recipe (GPT-2's c_fc / c_proj), against the float64 two-layer MLP,
    within reference.gated_mlp_fp8_bound with wu None (h = act(g): its error L·|Δg|)."""
    x, (wg, _, wd), (bg, _, bd) = _mlp_case(12, *shape, bias)
    x_in = x.to(dtype)
    x = x_in.double()
    qg, qd = fp8.quantize_weight(wg), fp8.quantize_weight(wd)
    y = reference.gated_mlp_fp8(x_in, qg, None, qd, act, bg, None, bd)
    f = activations.get(act).forward
    y64 = torch.nn.functional.linear(f(torch.nn.functional.linear(x, wg, bg)), wd, bd)
    out_roundoff = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    y_bound, bound = reference.gated_mlp_fp8_bound(x, wg, None, wd, act, bg, None, bd, out_roundoff=out_roundoff)
    torch.testing.assert_close(y_bound, y64, rtol=1e-12, atol=1e-12)
    err = (y.double() - y64).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert 1e-3 < float(err.norm() / y64.norm()) < 2 * U  # FP8's error, not bf16's, and not a wrong function
    wrong = reference.gated_mlp_fp8(x_in, qg, None, qd, "gelu" if act == "relu" else "relu", bg, None, bd)
    assert float((wrong.double() - y64).norm() / y64.norm()) > 2 * U  # another activation is told apart
