"""The fused MLP math in plain PyTorch: the `torch` backend, the CPU path, and the oracle for the kernels.

Every function takes 2-D activations (`x [M, K]`) and nn.Linear-layout weights (`w [out, in]`). It computes the way
eager PyTorch does, so the `torch` backend is never slower than the unfused module: GEMMs and pointwise kernels in
the input dtype (PyTorch's pointwise kernels compute 16-bit inputs in fp32 and round once per kernel), the
activation's backward through PyTorch's fused backward kernels (`activations.Activation.vjp`), bias gradients summed
with fp32 accumulation. In fp64 it is the oracle.

Gated MLP, with act' the activation's derivative and ⊙ the elementwise product:
    forward   g = x·Wgᵀ + bg,  u = x·Wuᵀ + bu,  h = act(g) ⊙ u,  y = h·Wdᵀ + bd
    backward  dh = dy·Wd;  dg = dh ⊙ u ⊙ act'(g);  du = dh ⊙ act(g)
              dx = dg·Wg + du·Wu;  dWg = dgᵀ·x;  dWu = duᵀ·x;  dWd = dyᵀ·h
              dbg, dbu, dbd = column sums of dg, du, dy
Linear + activation:
    forward   z = x·Wᵀ + b,  y = act(z)
    backward  dz = dy ⊙ act'(z);  dx = dz·W;  dW = dzᵀ·x;  db = column sum of dz

`gated_mlp` / `linear_act` at the bottom run the forward at a chosen precision (fp64 by default) for any leading
dimensions: the value a kernel's output is compared against.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mlpfuse import activations


def _colsum(t: Tensor) -> Tensor:
    """Column sums accumulated in fp32 (or wider), returned in t's dtype."""
    return t.sum(0, dtype=torch.promote_types(t.dtype, torch.float32)).to(t.dtype)


class GatedMLPGrads(NamedTuple):
    """Gradients of a gated MLP; None where not asked for (or where there is no bias)."""

    x: Optional[Tensor]
    gate_weight: Optional[Tensor]
    up_weight: Optional[Tensor]
    down_weight: Optional[Tensor]
    gate_bias: Optional[Tensor]
    up_bias: Optional[Tensor]
    down_bias: Optional[Tensor]


class LinearActGrads(NamedTuple):
    x: Optional[Tensor]
    weight: Optional[Tensor]
    bias: Optional[Tensor]


def gated_preact(x: Tensor, gate_weight: Tensor, up_weight: Tensor, gate_bias=None, up_bias=None):
    """(g, u): the gate and up pre-activations."""
    return F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)


def glu(g: Tensor, u: Tensor, activation) -> Tensor:
    """h = act(g)·u."""
    return activations.get(activation).forward(g) * u


def gated_mlp_forward(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    activation="gelu_tanh",
    *,
    save_preact: bool = False,
):
    """y, or (y, h, g, u) with `save_preact`: what the backward reads (h = act(g)·u, the down projection's input)."""
    if not save_preact:
        # Eager's own order: the gate's pre-activation is freed once activated, before the up projection's output
        # is allocated (computing g and u first holds one [M, hidden] buffer more at the peak).
        act = activations.get(activation)
        h = act.forward(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)
        return F.linear(h, down_weight, down_bias)
    g, u = gated_preact(x, gate_weight, up_weight, gate_bias, up_bias)
    h = glu(g, u, activation)
    y = F.linear(h, down_weight, down_bias)
    return (y, h, g, u) if save_preact else y


def gated_mlp_backward(
    dy: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    g: Tensor,
    u: Tensor,
    activation="gelu_tanh",
    *,
    need_dx: bool = True,
    need_dw: bool = True,
    bias_grads: tuple[bool, bool, bool] = (False, False, False),
) -> GatedMLPGrads:
    """All gradients of the gated MLP from dy and the saved pre-activations g, u."""
    act = activations.get(activation)
    dh = dy.mm(down_weight)
    a = act.forward(g)
    du = dh * a
    dg = act.vjp(dh * u, g)
    dx = dwg = dwu = dwd = None
    if need_dx:
        dx = dg.mm(gate_weight).addmm_(du, up_weight)
    if need_dw:
        dwg, dwu, dwd = dg.t().mm(x), du.t().mm(x), dy.t().mm(a * u)
    dbg = _colsum(dg) if bias_grads[0] else None
    dbu = _colsum(du) if bias_grads[1] else None
    dbd = _colsum(dy) if bias_grads[2] else None
    return GatedMLPGrads(dx, dwg, dwu, dwd, dbg, dbu, dbd)


def linear_act_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation=None, *, save_preact: bool = False
):
    """y = act(x·Wᵀ + b), or (y, z) with `save_preact`."""
    act = activations.get(activation)
    z = F.linear(x, weight, bias)
    if act.id == activations.IDENTITY:
        return (z, None) if save_preact else z
    y = act.forward(z)
    return (y, z) if save_preact else y


def linear_act_backward(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    z: Optional[Tensor],
    activation=None,
    *,
    need_dx: bool = True,
    need_dw: bool = True,
    need_db: bool = False,
) -> LinearActGrads:
    """Gradients of act(x·Wᵀ + b) from dy and the pre-activation z (z may be None for identity)."""
    act = activations.get(activation)
    dz = dy if act.id == activations.IDENTITY else act.vjp(dy, z)
    dx = dz.mm(weight) if need_dx else None
    dw = dz.t().mm(x) if need_dw else None
    db = _colsum(dz) if need_db else None
    return LinearActGrads(dx, dw, db)


def _at(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def gated_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    activation="gelu_tanh",
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The gated MLP forward for any leading dimensions, computed in `dtype` (fp64: the oracle)."""
    x2 = x.to(dtype).reshape(-1, x.shape[-1])
    y = gated_mlp_forward(
        x2,
        gate_weight.to(dtype),
        up_weight.to(dtype),
        down_weight.to(dtype),
        _at(gate_bias, dtype),
        _at(up_bias, dtype),
        _at(down_bias, dtype),
        activation,
    )
    return y.reshape(*x.shape[:-1], down_weight.shape[0])


def linear_act(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation=None, *, dtype: torch.dtype = torch.float64
) -> Tensor:
    """act(x·Wᵀ + b) for any leading dimensions, computed in `dtype` (fp64: the oracle)."""
    x2 = x.to(dtype).reshape(-1, x.shape[-1])
    y = linear_act_forward(x2, weight.to(dtype), _at(bias, dtype), activation)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# ---- FP8 (the recipe in mlpfuse.fp8): the oracle for the FP8 kernels, and their CPU path ------------------------
#
# Every GEMM here is the dequantized operands multiplied in fp32. That is what an FP8×FP8 GEMM with per-K-block
# scales computes, up to summation order: for one output element, with b the 128-wide K blocks,
#     Σ_k (xq_k·sx_b)(wq_k·sw_b) = Σ_b sx_b·sw_b · Σ_{k∈b} xq_k·wq_k
# and the kernel computes the right side: the tensor cores sum xq·wq within a block in fp32 (a product of two e4m3
# values has at most 8 significant bits, so each product is exact in fp32), then one multiply by sx_b·sw_b per
# block. The left side rounds each dequantized operand to fp32 once (2^-24 relative); both then differ only by
# fp32 rounding in different places, ~K·2^-24 of Σ|x||w|, sixteen times below e4m3's own 2^-4 for K up to 2^16.
# A kernel compared with this reference also meets rare single-ulp differences in quantized h: an h element that
# lies on an e4m3 rounding boundary can round either way after a different summation order.


def linear_fp8(x: Tensor, weight, bias: Optional[Tensor] = None, activation=None) -> Tensor:
    """act(quantize(x)·Wᵀ + b) for `weight` an `fp8.Fp8Weight`: x quantized 1×128, the GEMM in fp32, bias and
    activation in fp32, returned in x's dtype (any leading dimensions)."""
    from mlpfuse import fp8

    xd = fp8.dequantize_activation(*fp8.quantize_activation(x))
    z = F.linear(xd, weight.dequantize(torch.float32), _at(bias, torch.float32))
    return activations.get(activation).forward(z).to(x.dtype)


def gated_mlp_fp8(
    x: Tensor,
    gate,
    up,
    down,
    activation="gelu_tanh",
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
) -> Tensor:
    """The gated MLP in the FP8 recipe, `gate`, `up`, `down` being `fp8.Fp8Weight`s (any leading dimensions):
        x → 1×128 quantized;  g, u = x·Wgᵀ + bg, x·Wuᵀ + bu  (fp32 accumulation, per-K-block scales)
        h = act(g)·u in fp32, then 1×128 quantized: in the fused kernel the epilogue does this, as a 128-column
            tile of h is exactly one scale group per row, so its amax is known before h leaves the chip
        y = h·Wdᵀ + bd in fp32, returned in x's dtype.
    `up` None: the two-layer MLP, h = act(g). Biases stay in high precision (added in fp32), as checkpoints keep
    them."""
    from mlpfuse import fp8

    f32 = torch.float32
    xd = fp8.dequantize_activation(*fp8.quantize_activation(x))
    g = F.linear(xd, gate.dequantize(f32), _at(gate_bias, f32))
    h = activations.get(activation).forward(g)
    if up is not None:
        h = h * F.linear(xd, up.dequantize(f32), _at(up_bias, f32))
    hd = fp8.dequantize_activation(*fp8.quantize_activation(h))
    return F.linear(hd, down.dequantize(f32), _at(down_bias, f32)).to(x.dtype)


# Decode sizes run weight-only (ops.fp8_mlp): the weights in the recipe, x and h in x's dtype. The kernels widen each
# e4m3 weight exactly to x's dtype, sum each 128-wide K block in fp32 and scale it by its weight scale; here the
# dequantized weights are multiplied in fp32, equal up to fp32 rounding (the argument above, with x unquantized).

def linear_fp8_weight_only(x: Tensor, weight, bias: Optional[Tensor] = None, activation=None) -> Tensor:
    """act(x·Wᵀ + b) for `weight` an `fp8.Fp8Weight`, x not quantized: fp32 math, returned in x's dtype."""
    z = F.linear(x.float(), weight.dequantize(torch.float32), _at(bias, torch.float32))
    return activations.get(activation).forward(z).to(x.dtype)


def gated_mlp_fp8_weight_only(x: Tensor, gate, up, down, activation="gelu_tanh", gate_bias: Optional[Tensor] = None,
                              up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None) -> Tensor:
    """The gated MLP with `fp8.Fp8Weight` weights and unquantized activations: g, u, h in fp32, h rounded once to
    x's dtype (what the weight-only kernels store between their two launches), y in x's dtype. `up` None: the
    two-layer MLP."""
    f32 = torch.float32
    xf = x.float()
    g = F.linear(xf, gate.dequantize(f32), _at(gate_bias, f32))
    h = activations.get(activation).forward(g)
    if up is not None:
        h = h * F.linear(xf, up.dequantize(f32), _at(up_bias, f32))
    h = h.to(x.dtype)
    return F.linear(h.float(), down.dequantize(f32), _at(down_bias, f32)).to(x.dtype)


# ---- how far the FP8 MLP may be from the float64 one: a bound derived from the recipe, used by `patch` ---------

FP32_ACCUMULATION = 2.0**-24
# Hopper's FP8 tensor cores add each product into an accumulator of about 14 significant bits within an MMA (the
# DeepSeek-V3 report measured it); mlpfuse's kernels promote to fp32 after every 128-wide K block, so within one
# block a sum is off by at most 128 roundings of 2^-14 relative to its running magnitude.
FP8_MMA_ACCUMULATION = 2.0**-14


def gated_mlp_fp8_bound(x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, activation, bg: Optional[Tensor] = None,
                        bu: Optional[Tensor] = None, bd: Optional[Tensor] = None, *, out_roundoff: float,
                        accumulation: float = FP32_ACCUMULATION) -> tuple[Tensor, Tensor]:
    """(y, bound): the float64 MLP on these (float64) operands and an elementwise bound on |y_fp8 − y| for the recipe
    (x, Wg, Wu, h and Wd rounded as fp8 says, then y rounded to the output dtype, `out_roundoff` its unit
    roundoff). Each step propagated (u = 2^-4, s a group's amax/448):
        a rounding of t:  |Δt| ≤ u·|t| + 2^-10·s
        a GEMM with operand errors ea, eb: |ã·b̃ − a·b| ≤ ea·|b| + |a|·eb + ea·eb, plus γ·|ã|·|b̃| for the sums
        the GLU: |act(g̃)·ũ − act(g)·u| ≤ L·eg·(|u| + eu) + |act(g)|·eu, L = sup|act'|, plus its fp32 evaluation
    γ = (128 + 4)·accumulation per K block (FP8_MMA_ACCUMULATION for tensor-core sums, else fp32's 2^-24 over the
    whole K). The weight-only path (x and h not quantized, h rounded to a 16-bit dtype at most 2^-9) stays within
    the same bound. `wu` None: the two-layer MLP, h = act(g) (|Δh| ≤ L·eg plus its fp32 evaluation). Rigorous,
    so loose: ~√K above a typical error for random signs."""
    from mlpfuse import fp8

    u, sub = fp8.UNIT_ROUNDOFF, fp8.SUBNORMAL_HALF_SPACING

    def group_amax(t: Tensor, dims: str) -> Tensor:
        if dims == "row":
            k = t.shape[-1]
            amax = F.pad(t, (0, -k % 128)).unflatten(-1, (-1, 128)).abs().amax(-1)
            return amax.repeat_interleave(128, -1)[..., :k]
        out, inp = t.shape
        pad = F.pad(t, (0, -inp % 128, 0, -out % 128))
        amax = pad.unflatten(1, (-1, 128)).unflatten(0, (-1, 128)).abs().amax(dim=(1, 3))
        return amax.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]

    def rounding(t_abs: Tensor, dims: str) -> Tensor:
        return u * t_abs + sub * group_amax(t_abs, dims) / 448

    def gamma(k: int) -> float:
        if accumulation > FP32_ACCUMULATION:
            return (128 + 4) * accumulation * 1.01
        return (k + 4) * accumulation * 1.01

    act = activations.get(activation)
    grid = torch.linspace(-60, 60, 240001, dtype=torch.float64)
    lipschitz = float(act.grad(grid).abs().max()) * 1.001
    ex = rounding(x.abs(), "row")
    pre = []
    for w, b in ((wg, bg), (wu, bu)) if wu is not None else ((wg, bg),):
        ew = rounding(w.abs(), "block")
        e = ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T
        e += gamma(x.shape[-1]) * ((x.abs() + ex) @ (w.abs() + ew).T + (0 if b is None else b.abs()))
        pre.append(e)
    eg = pre[0]
    g = F.linear(x, wg, bg)
    a = act.forward(g)
    if wu is None:  # the two-layer MLP: h = act(g)
        h = a
        eh = lipschitz * eg + 2.0**-18 * (a.abs() + g.abs() + eg + 1e-30)  # act evaluated in fp32
    else:
        eu = pre[1]
        up = F.linear(x, wu, bu)
        h = a * up
        eh = lipschitz * eg * (up.abs() + eu) + a.abs() * eu
        eh += 2.0**-18 * (a.abs() + g.abs() + eg + 1e-30) * (up.abs() + eu)  # act and product evaluated in fp32
    hb = h.abs() + eh
    eh = eh + rounding(hb, "row")
    ewd = rounding(wd.abs(), "block")
    ey = eh @ wd.abs().T + h.abs() @ ewd.T + eh @ ewd.T
    ey += gamma(h.shape[-1]) * ((hb + eh) @ (wd.abs() + ewd).T + (0 if bd is None else bd.abs()))
    y = F.linear(h, wd, bd)
    return y, ey + out_roundoff * (y.abs() + ey)


# ---- FP8 training: the recipe's reference path (forward and backward), the oracle for its kernels --------------
#
# Every GEMM of the step takes FP8 operands, each scaled along the dimension it contracts, as the recipe's forward
# does (DeepSeek-V3's fine-grained scheme, carried into the backward):
#     forward   g, u = x·Wgᵀ, x·Wuᵀ        x 1×128 along D, W 128×128           (as gated_mlp_fp8)
#               y = h·Wdᵀ                  h 1×128 along H
#     dgrad     dh = dy·Wd                 dy 1×128 along D
#               dx = dg·Wg + du·Wu         dg, du 1×128 along H
#     wgrad     dWdᵀ = hᵀ·dy               h 128×1 along the tokens M, dy per channel (one scale a column of D)
#               dWg, dWu = dgᵀ·x, duᵀ·x    dg, du 128×1 along M, x per channel
# In each weight gradient one operand is grouped along the tokens and the other has one scale per channel over all
# the tokens: the GEMM has the forward's form (one scale per row and K block) with the channel's scale applied once
# in the epilogue, and runs on the warp-specialized kernel at ~3× the rate of a GEMM with two per-row scale vectors
# per K block. Channels are not grouped together, as in torchao's rowwise float8 (Adam normalises each weight's
# gradient: a channel small beside another keeps its own precision). For one day dy and x were in 128×128 blocks
# (channels sharing a scale): the stdlib model of benchmarks/stdlib_train.py trained 6.2 % above bf16's held-out
# loss that way, and 6.4 % per channel — the gap lies elsewhere (benchmarks/results/nvidia-h200/stdlib-train/).
# All in e4m3 (gradients too: with one scale per 128 values, e4m3's 2^-4 roundoff beats e5m2's 2^-3 wherever a
# group spans less than e4m3's 2^17 of range; benchmarks/fp8_grad_format.py measures both), products and sums in
# fp32, the GLU and its backward in fp32 on the saved g and u. Master weights stay in their dtype and are quantized
# each step. The step keeps for the backward x in FP8 (its 1×128 values and scales) and g, u either in FP8
# (`save="fp8"`, 1×128 along H) or in x's dtype (`save="high"`); h is rebuilt from them.

def _round_trip_rows(t: Tensor) -> Tensor:
    """t quantized 1×128 along its last dimension and dequantized, in fp32."""
    from mlpfuse import fp8

    return fp8.dequantize_activation(*fp8.quantize_activation(t))


def _round_trip_tokens(t: Tensor) -> Tensor:
    """t [M, N] quantized 128×1 (one scale per channel and 128 consecutive tokens) and dequantized, in fp32."""
    return _round_trip_rows(t.t()).t()


def _round_trip_channels(t: Tensor) -> Tensor:
    """t [M, N] quantized per channel (one scale per column over all M rows) and dequantized, in fp32."""
    from mlpfuse import fp8

    values, scale_inv = fp8.quantize_channels(t)
    return values.t().to(torch.float32) * scale_inv


def fp8_train_forward(x2: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor],
                      bd: Optional[Tensor], activation: str, save: str = "fp8") -> tuple[Tensor, ...]:
    """The step's forward on x2 [M, D] (the scheme above): (y in fp32, x's e4m3 values and scales, then g and u as
    kept: each as (e4m3 values, scales) for save="fp8", else in x's dtype)."""
    from mlpfuse import fp8

    f32 = torch.float32
    xq, xs = fp8.quantize_activation(x2)
    xd = fp8.dequantize_activation(xq, xs)
    g = F.linear(xd, fp8.quantize_weight(wg.detach()).dequantize(f32), _at(bg, f32))
    u = F.linear(xd, fp8.quantize_weight(wu.detach()).dequantize(f32), _at(bu, f32))
    h = activations.get(activation).forward(g) * u
    y = F.linear(_round_trip_rows(h), fp8.quantize_weight(wd.detach()).dequantize(f32), _at(bd, f32))
    if save == "fp8":
        return (y, xq, xs, *fp8.quantize_activation(g), *fp8.quantize_activation(u))
    return y, xq, xs, g.to(x2.dtype), u.to(x2.dtype)


def fp8_train_backward(dy2: Tensor, xq: Tensor, xs: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, kept,
                       activation: str) -> tuple[Tensor, ...]:
    """The step's backward from dy2 [M, D] and what the forward kept (`kept`: g and u as fp8_train_forward returned
    them, four tensors for save="fp8", two otherwise): (dx, dWg, dWu, dWd, dbg, dbu, dbd), all in fp32."""
    from mlpfuse import fp8

    f32 = torch.float32
    if len(kept) == 4:
        g, u = fp8.dequantize_activation(kept[0], kept[1]), fp8.dequantize_activation(kept[2], kept[3])
    else:
        g, u = kept[0].float(), kept[1].float()
    act = activations.get(activation)
    a = act.forward(g)
    h = a * u
    dy2 = dy2.float()
    wgd, wud, wdd = (fp8.quantize_weight(w.detach()).dequantize(f32) for w in (wg, wu, wd))
    dh = _round_trip_rows(dy2) @ wdd
    dwd = (_round_trip_tokens(h).t() @ _round_trip_channels(dy2)).t()
    dg = dh * u * act.grad(g)
    du = dh * a
    dx = _round_trip_rows(dg) @ wgd + _round_trip_rows(du) @ wud
    x_channels = _round_trip_channels(fp8.dequantize_activation(xq, xs))
    dwg = _round_trip_tokens(dg).t() @ x_channels
    dwu = _round_trip_tokens(du).t() @ x_channels
    return dx, dwg, dwu, dwd, dg.sum(0), du.sum(0), dy2.sum(0)


class GatedMLPFp8Train(torch.autograd.Function):
    """y = down(act(gate(x))·up(x)) with every GEMM of its forward and backward in FP8 (the scheme above)."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd, bg, bu, bd, activation: str, save: str):
        y, xq, xs, *kept = fp8_train_forward(x.reshape(-1, x.shape[-1]), wg, wu, wd, bg, bu, bd, activation, save)
        ctx.save_for_backward(xq, xs, wg, wu, wd, *kept)
        ctx.activation, ctx.x_shape, ctx.x_dtype = activation, x.shape, x.dtype
        ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (bg, bu, bd))
        return y.to(x.dtype).reshape(*x.shape[:-1], wd.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, xs, wg, wu, wd, *kept = ctx.saved_tensors
        dx, dwg, dwu, dwd, *dbs = fp8_train_backward(dy.reshape(-1, dy.shape[-1]), xq, xs, wg, wu, wd, kept,
                                                     ctx.activation)
        biases = [None if dt is None else t.to(dt) for t, dt in zip(dbs, ctx.bias_dtypes)]
        return (dx.to(ctx.x_dtype).reshape(ctx.x_shape), dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype),
                *biases, None, None)


def gated_mlp_fp8_train(x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, activation="silu",
                        bg: Optional[Tensor] = None, bu: Optional[Tensor] = None, bd: Optional[Tensor] = None,
                        save: str = "fp8") -> Tensor:
    """The gated MLP for training in the FP8 recipe (the scheme above), differentiable in x, the weights and the
    biases: the reference the FP8 training kernels are held to. `save`: "fp8" keeps g and u for the backward in
    FP8 with their 1×128 scales (half the bytes of a 16-bit dtype), "high" in x's dtype."""
    from mlpfuse.errors import InputError

    if save not in ("fp8", "high"):
        raise InputError(f"save: expected 'fp8' or 'high', got {save!r}")
    return GatedMLPFp8Train.apply(x, wg, wu, wd, bg, bu, bd, activations.get(activation).name, save)
