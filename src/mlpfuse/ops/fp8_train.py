"""FP8 training of the gated MLP on mlpfuse's FP8 kernels: every GEMM of the forward and of the backward in e4m3,
the numerics of `mlpfuse.reference.gated_mlp_fp8_train` (its oracle; docs/fp8.md, "Training").

    forward   x → e4m3 1×128 (kernels.fp8_gemm.quantize)
              gate+up GEMM, the GLU and h's 1×128 quantization in its epilogue, g and u written there in e4m3 too
              down GEMM on h → y
    backward  dh = dy·Wd                  dy 1×128 along D, Wdᵀ's 128×128 blocks
              dg, du, h from dh and the saved e4m3 g, u in one pass, written only quantized (kernels.glu_backward)
              dx = [dg | du]·[Wg; Wu]     dg, du 1×128 along H, side by side: one GEMM over 2H
              dWdᵀ = hᵀ·dy, dWg = dgᵀ·x, dWu = duᵀ·x
                                          h, dg, du grouped 128×1 along the tokens, dy and x per channel (one
                                          scale a column over all the tokens, applied in the epilogue; the
                                          forward's GEMM form otherwise), written in the weights' dtype

The master weights stay in their dtype (the optimizer's); each step quantizes them (the forward, and again the
backward: nothing weight-sized is kept between the two). What the step keeps for the backward: x in e4m3 with its
scales, g and u in e4m3 with theirs.

This form composes the kernels: each weight quantized in one kernel pass, straight into Wᵀ's layout for the
backward; the GLU backward one pass over dh that writes dg, du and h only as the five quantized operands of the
GEMMs after it (no fp32 dg, du or h); dy and x quantized per channel, transposed, in one pass each. Correct
against the oracle. Measured on an H200 (docs/fp8.md, "Training"): every GEMM at ~1000–1230 TFLOP/s but the
gated forward with save_gu (its epilogue quantizes three tiles); around the GEMMs the GLU backward and dh written
in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mlpfuse import activations, fp8

_F32 = torch.float32


def _kernels():
    from mlpfuse.kernels import fp8_gemm

    return fp8_gemm


def _outside_autocast(device: torch.device):
    from mlpfuse.ops import fp8_mlp

    return fp8_mlp.outside_autocast(device)


def _reference_path(device: torch.device, backend: str) -> bool:
    """The FP8 backend decision (ops.fp8_mlp): the recipe's reference path in PyTorch ops ("torch"; what "auto"
    takes on a CPU), else the kernels. Made inside the ops, which torch.compile does not trace."""
    from mlpfuse.ops import fp8_mlp

    return fp8_mlp._path(device, backend) == "torch"


def _forward(x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor],
             bd: Optional[Tensor], activation: str, backend: str) -> tuple[Tensor, ...]:
    """y, and what the backward keeps: x, g and u in e4m3 with their 1×128 scales."""
    if _reference_path(x.device, backend):
        from mlpfuse import reference

        with _outside_autocast(x.device):
            y, *kept = reference.fp8_train_forward(x, wg, wu, wd, bg, bu, bd, activation)
        return (y.to(x.dtype), *kept)
    k = _kernels()
    qg, qu, qd = (k.quantize_weight(w.detach()) for w in (wg, wu, wd))
    xq, xs = k.quantize(x)
    hq, hs, gq, gs, uq, us = k.fp8_gemm(xq, xs, *qg, *qu, bg, bu, activation=activations.get(activation).id,
                                        quant_out=True, save_gu=True)
    y = k.fp8_gemm(hq, hs, *qd, None, None, bd, activation=activations.IDENTITY, quant_out=False, out_dtype=x.dtype)
    return y, xq, xs, gq, gs, uq, us


def _backward(dy: Tensor, xq: Tensor, xs: Tensor, gq: Tensor, gs: Tensor, uq: Tensor, us: Tensor, wg: Tensor,
              wu: Tensor, wd: Tensor, activation: str, backend: str) -> tuple[Tensor, ...]:
    """dx (in dy's dtype, x's), dWg, dWu, dWd (each in its weight's dtype) and the three bias gradients (fp32)
    (module docstring)."""
    if _reference_path(dy.device, backend):
        from mlpfuse import reference

        with _outside_autocast(dy.device):
            dx, dwg, dwu, dwd, *dbs = reference.fp8_train_backward(dy, xq, xs, wg, wu, wd, (gq, gs, uq, us),
                                                                   activation)
        return dx.to(dy.dtype), dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype), *dbs
    from mlpfuse.kernels import glu_backward

    k = _kernels()
    act = activations.get(activation)
    ident = activations.IDENTITY
    m, d, h = dy.shape[0], wg.shape[1], wg.shape[0]
    # Wᵀ in the recipe, each weight's blocks quantized and transposed in one pass over it; Wgᵀ and Wuᵀ side by
    # side ([D, 2H]) when H is whole blocks, so that dx is one GEMM over [dg | du]
    joined = h % fp8.GROUP == 0
    if joined:
        gd, gh = -(-d // fp8.GROUP), h // fp8.GROUP
        wgu = (torch.empty(d, 2 * h, device=dy.device, dtype=fp8.DTYPE),
               torch.empty(gd, 2 * gh, device=dy.device, dtype=fp8.SCALE_DTYPE))
        k.quantize_weight(wg.detach(), transposed=True, out=(wgu[0][:, :h], wgu[1][:, :gh]))
        k.quantize_weight(wu.detach(), transposed=True, out=(wgu[0][:, h:], wgu[1][:, gh:]))
        dgu = (torch.empty(m, 2 * h, device=dy.device, dtype=fp8.DTYPE),
               torch.empty(m, 2 * gh, device=dy.device, dtype=fp8.SCALE_DTYPE))
    else:
        qg, qu = (k.quantize_weight(w.detach(), transposed=True) for w in (wg, wu))
    dh = k.fp8_gemm(*k.quantize(dy), *k.quantize_weight(wd.detach(), transposed=True), activation=ident,
                    quant_out=False, out_dtype=_F32)
    # dg = dh·u·act'(g), du = dh·act(g), h = act(g)·u in one pass over dh and the e4m3 g, u, each written only as
    # the quantized operands its GEMMs read: dg, du along the channels; dgᵀ, duᵀ, hᵀ along the tokens
    dg, du, dg_t, du_t, h_t, dbg, dbu = glu_backward.fp8_glu_backward(dh, gq, gs, uq, us, activation=act.id,
                                                                      bias_sums=True, joined=dgu if joined else None)
    del dh
    if joined:
        dx = k.fp8_gemm(*dgu, *wgu, activation=ident, quant_out=False, out_dtype=dy.dtype)
    else:
        dx = (k.fp8_gemm(*dg, *qg, activation=ident, quant_out=False, out_dtype=_F32)
              + k.fp8_gemm(*du, *qu, activation=ident, quant_out=False, out_dtype=_F32)).to(dy.dtype)
    # the weight gradients: one operand along the tokens, the other per channel (one scale a column over all the
    # tokens, transposed in the pass that quantizes it; block scales of ones and the channels' scales applied in
    # the epilogue): the forward's GEMM form. dWd = (hᵀ·dy)ᵀ, stored transposed by the epilogue. x comes back from
    # its e4m3 values in fp32, as the reference path dequantizes it (no rounding between)
    dy_c, dy_s = k.quantize_channels(dy)
    x_c, x_s = k.quantize_channels(fp8.dequantize_activation(xq, xs))
    ones = torch.ones(-(-d // fp8.GROUP), -(-m // fp8.GROUP), device=dy.device, dtype=fp8.SCALE_DTYPE)
    dwd = k.fp8_gemm(*h_t, dy_c, ones, activation=ident, quant_out=False, out_dtype=wd.dtype, out_transposed=True,
                     col_scale=dy_s)
    dwg = k.fp8_gemm(*dg_t, x_c, ones, activation=ident, quant_out=False, out_dtype=wg.dtype, col_scale=x_s)
    dwu = k.fp8_gemm(*du_t, x_c, ones, activation=ident, quant_out=False, out_dtype=wu.dtype, col_scale=x_s)
    return dx, dwg, dwu, dwd, dbg, dbu, dy.sum(0, dtype=_F32)


# As custom ops, so that torch.compile and export see two nodes (the forward keeping x, g and u in e4m3, and the
# backward), never the kernels' launches.
@torch.library.custom_op("mlpfuse::fp8_gated_mlp_train", mutates_args=())
def _train_op(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor, gate_bias: Optional[Tensor],
              up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, backend: str) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend)


@_train_op.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend):
    m, d, h = x.shape[0], x.shape[1], gate_weight.shape[0]

    def quantized(cols):
        return x.new_empty(m, cols, dtype=fp8.DTYPE), x.new_empty(m, -(-cols // fp8.GROUP), dtype=fp8.SCALE_DTYPE)

    return (x.new_empty(m, down_weight.shape[0]), *quantized(d), *quantized(h), *quantized(h))


@torch.library.custom_op("mlpfuse::fp8_gated_mlp_train_backward", mutates_args=())
def _backward_op(dy: Tensor, xq: Tensor, xs: Tensor, gq: Tensor, gs: Tensor, uq: Tensor, us: Tensor,
                 gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor, activation: str, backend: str) -> tuple[
        Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _backward(dy, xq, xs, gq, gs, uq, us, gate_weight, up_weight, down_weight, activation, backend)


@_backward_op.register_fake
def _(dy, xq, xs, gq, gs, uq, us, gate_weight, up_weight, down_weight, activation, backend):
    m, h, d = xq.shape[0], gate_weight.shape[0], xq.shape[1]

    def f32(*shape):
        return dy.new_empty(*shape, dtype=_F32)

    def like(w, *shape):
        return dy.new_empty(*shape, dtype=w.dtype)

    return (dy.new_empty(m, d), like(gate_weight, h, d), like(up_weight, h, d), like(down_weight, d, h), f32(h), f32(h),
            f32(d))


def _setup(ctx, inputs, output):
    x, wg, wu, wd, bg, bu, bd, activation, backend = inputs
    ctx.save_for_backward(*output[1:], wg, wu, wd)
    ctx.mark_non_differentiable(*output[1:])
    ctx.activation, ctx.backend, ctx.x_dtype = activation, backend, x.dtype
    ctx.bias_dtypes = tuple(None if b is None else b.dtype for b in (bg, bu, bd))


def _backward_autograd(ctx, dy, *_):
    xq, xs, gq, gs, uq, us, wg, wu, wd = ctx.saved_tensors
    dx, dwg, dwu, dwd, *dbs = torch.ops.mlpfuse.fp8_gated_mlp_train_backward(dy.contiguous(), xq, xs, gq, gs, uq, us,
                                                                             wg, wu, wd, ctx.activation,
                                                                             ctx.backend)
    biases = [None if dt is None else t.to(dt) for t, dt in zip(dbs, ctx.bias_dtypes)]
    return dx.to(ctx.x_dtype), dwg, dwu, dwd, *biases, None, None


_train_op.register_autograd(_backward_autograd, setup_context=_setup)


def fp8_gated_mlp_train(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor,
                        bg: torch.Tensor | None = None, bu: torch.Tensor | None = None,
                        bd: torch.Tensor | None = None, activation: str = "silu",
                        backend: str | None = None) -> torch.Tensor:
    """The gated MLP trained in FP8 (module docstring): x [..., D]; weights [H, D], [H, D], [D, H] in a float dtype
    (the masters, quantized per step); returns y [..., D] in x's dtype, differentiable in x, the weights and the
    biases. `backend` decides as for FP8 inference (ops.fp8_mlp): the kernels ("triton"; "auto" on a GPU with FP8
    tensor cores), or the recipe's reference path in PyTorch ops ("torch"; what "auto" takes on a CPU)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.ops.mlpfuse.fp8_gated_mlp_train(x2, wg, wu, wd, bg, bu, bd, activations.get(activation).name,
                                              backend or "")[0]
    return y.reshape(*x.shape[:-1], wd.shape[0])
