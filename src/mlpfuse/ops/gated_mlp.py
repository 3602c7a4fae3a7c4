"""gated_mlp: y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd, as torch.library custom ops with autograd.

Four ops in the `mlpfuse` namespace (the math is in mlpfuse.reference's docstring):
    gated_mlp(x, Wg, Wu, Wd, bg?, bu?, bd?, activation, backend) -> y
        Inference, or any caller that only has the op: its backward recomputes g and u. May take the one-launch
        decode kernel when no gradient is needed.
    norm_gated_mlp(x, norm_weight, norm_eps, norm_kind, Wg, Wu, Wd, ...) -> y
        Inference on RMSNorm(x) (ops.norm): the decode kernels normalise x themselves (a block that holds the
        norm in front of it, mlpfuse.patching.norms); no autograd.
    gated_mlp_train(..., save_preact) -> (y, h, g, u)
        What `ops.gated_mlp` and the modules call when a gradient is needed; with save_preact the pre-activations
        g, u and the GLU output h (the down projection's input, which eager autograd saves too) come out of the
        forward kernel's epilogue and the backward reads them instead of recomputing.
    gated_mlp_backward(dy, x, Wg, Wu, Wd, bg?, bu?, g, u, h, ...) -> (dx, dWg, dWu, dWd, dbg, dbu, dbd)
        On the Triton path: cuBLAS `dh = dy·Wd`, one Triton pass writing dg and du (over g and u when they are
        handed over: eager training's first backward) and the bias sums, then cuBLAS for dWd = dyᵀ·h, dx = dg·Wg +
        du·Wu, dWu and dWg (`_triton_backward` says in which order, and why). Gradients not asked for come back as
        empty placeholders.
Every op has a fake implementation (shapes only), so torch.compile(fullgraph=True) and torch.export see one node.
Plain eager inference calls the implementation directly: the dispatcher's round trip through a Python custom op
costs more host time than a decode-sized kernel runs. Graph capture, export and TorchScript always see the op.
"""

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mlpfuse import activations, csrc, fp8, reference
from mlpfuse.ops import _checks, _plan, dispatch
from mlpfuse.kernels.pairs import stacked
from mlpfuse.ops.norm import rms_norm
from mlpfuse.errors import InputError
from mlpfuse.ops._util import (
    autocast_dtype, cast_all, hold, leading, linear2d, needs_grad, nothing, op_span, plain_eager, profiling, rows,
    take_held, unrows,
)


def _decode(x2, wg, wu, wd, bg, bu, bd, act_id: int, norm=None, residual2=None) -> Tensor:
    """The decode kernels on 2-D x. torch.use_deterministic_algorithms(True) selects their run-to-run identical
    reduction; fp32 inputs follow torch's tf32 flag. `norm`: an RMSNormPrologue the kernels apply to x first;
    `residual2`: y's rows, added in the epilogue."""
    return dispatch.kernel("decode_mlp").decode_gated_mlp(
        x2, wg, wu, wd, bg, bu, bd, activation=act_id,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        allow_tf32=x2.dtype != torch.float32 or dispatch.allow_tf32(), residual=residual2,
        **({} if norm is None else {"norm_weight": norm.weight, "norm_eps": norm.eps, "norm_kind": norm.kind}),
    )


def residual_fits(residual: Tensor, x: Tensor, wd: Tensor) -> bool:
    """Whether the fused paths can add `residual` to y themselves (in the down projection's epilogue): y's shape,
    x's dtype and device, contiguous, no gradient wanted. Anything else is added to y as the layer added it."""
    return (isinstance(residual, Tensor) and residual.dtype == x.dtype and residual.device == x.device
            and not residual.requires_grad and residual.is_contiguous()
            and residual.shape == (*x.shape[:-1], wd.shape[0]))


def down_residual(h2: Tensor, wd: Tensor, bd: Optional[Tensor], residual2: Optional[Tensor]) -> Tensor:
    """y = h·Wdᵀ + bd (+ residual) on 2-D h: the residual as cuBLAS's C operand (added to the product in fp32,
    rounded once); with a bias as well, the bias after it."""
    if residual2 is None:
        return linear2d(h2, wd, bd)
    y = torch.addmm(residual2, h2, wd.t())
    return y if bd is None else y.add_(bd)


def _forward(x, wg, wu, wd, bg, bu, bd, activation: str, backend: str, grad: bool, save: bool, path: str = "",
             plan=None, norm=None, paired: bool = False, residual=None, fp8_save: bool = False):
    """(y [..., dim], h, g, u): with `save`, g and u the 2-D pre-activations and h = act(g)·u; else all None.
    `path` given: the caller already checked the arguments and chose the path. `plan`: on the SPLIT path, the GLU
    pass's held launch plan (see `hidden`). `norm`: an RMSNormPrologue the DECODE path's kernels apply (the caller
    chose that path for it). `residual` (inference; `residual_fits`): added to y — in the epilogue of the decode
    kernels and of the cuBLAS down projection, after the output elsewhere. `fp8_save` (with `save`): g and u come
    back in the FP8 recipe, (values, scale_inv) each — from the gated GEMM's epilogue on the GATED path, quantized
    after the fact elsewhere."""
    if not path:
        _checks.gated_mlp_args(x, wg, wu, wd, bg, bu, bd)
    act = activations.get(activation)
    x2 = rows(x)
    path = path or dispatch.gated_mlp_path(backend, x2, wg.shape[0], grad)
    h = g = u = None
    r2 = None if residual is None else rows(residual)
    if path == dispatch.TORCH or x2.shape[0] == 0:
        out = reference.gated_mlp_forward(x2, wg, wu, wd, bg, bu, bd, act, save_preact=save)
        y, h, g, u = out if save else (out, None, None, None)
    elif path == dispatch.DECODE:
        y, r2 = _decode(x2, wg, wu, wd, bg, bu, bd, act.id, norm, r2), None
    elif path == dispatch.CUDA:
        # The extension's decode kernel keeps no g and u, so only inference may take it.
        ext = csrc.extension()  # the path's choice checked x2 for it
        y, h, g, u = dispatch.cuda_call(ext.gated_mlp_forward, x2, wg, wu, wd, bg, bu, bd, act.id, save, not grad)
    else:  # SPLIT or GATED: the block up to h, then cuBLAS's down projection
        h, g, u = hidden(x2, wg, wu, bg, bu, act, path, save, plan, paired, fp8_save)
        y, r2 = down_residual(h, wd, bd, r2), None
        if not save:
            h = None
    if r2 is not None:
        y = r2 + y
    if fp8_save and save and not isinstance(g, tuple):
        g, u = fp8.quantize_activation(g), fp8.quantize_activation(u)
    return unrows(y, x), h, g, u


def hidden(x2, wg, wu, bg, bu, act, path: str, grad: bool, plan=None, paired: bool = False, fp8_save: bool = False):
    """(h, g, u) on 2-D x along `path` (TORCH, SPLIT or GATED; the caller checked the arguments and chose it): the
    block up to the down projection's input h = act(g)·u (`act` an activations entry), and with `grad` the
    pre-activations g and u a backward reads (else None). SPLIT: cuBLAS's gate and up GEMMs and the Triton GLU pass
    between them, through `plan` where one is held for this layout (kernels/glu.py `cached_plan`, which skips the
    pass's checks). Every path that runs its own down projection after it starts here: `_forward`, the module
    plan's SPLIT entries, and tensor parallelism's chunked down projection (ops/reduce_overlap.py). `paired`: the
    gated GEMM's g and u in one allocation (kernels/pairs.py) on calls up to dispatch.MERGED_DW_MAX_M tokens, for a
    backward that computes both weight gradients in one GEMM — only where nothing requires them to be distinct
    tensors (a registered op's outputs must not alias). `fp8_save` (with `grad`): on the GATED path the kernel's
    epilogue writes g and u in the FP8 recipe, (values, scale_inv) each; other paths return them in x's dtype."""
    if path == dispatch.TORCH or x2.shape[0] == 0:
        g, u = reference.gated_preact(x2, wg, wu, bg, bu)
        h = reference.glu(g, u, act)
    elif path == dispatch.SPLIT:
        g, u = linear2d(x2, wg, bg), linear2d(x2, wu, bu)
        h = plan.run(g, u) if plan else dispatch.kernel("glu").glu_forward(g, u, activation=act.id)
    else:
        out = dispatch.kernel("gated_gemm").gated_gemm(
            x2, wg, wu, bg, bu, activation=act.id, save_preact="fp8" if grad and fp8_save else grad,
            allow_tf32=dispatch.allow_tf32(),
            paired=paired and x2.shape[0] <= dispatch.MERGED_DW_MAX_M,  # longer calls free du before dWg
        )
        h, g, u = out if grad else (out, None, None)
    return (h, g, u) if grad else (h, None, None)


def hidden_gradients(path: str, dy2, x2, wg, wu, wd, held: list, activation: str, need_dx: bool, need_dw: bool,
                     bias_grads, on_dx=None):
    """(dx, dWg, dWu, dWd, dbg, dbu, dbd) from what `hidden` kept for `path`: g and u, taken out of `held` (their
    buffers become dg and du). `on_dx(dx)` is called as soon as dx exists, before the weight gradients that read dg
    and du are computed (a caller can start reducing dx across ranks behind them)."""
    if path in (dispatch.GATED, dispatch.SPLIT):
        return _triton_backward(dy2, x2, wg, wu, wd, held, None, activations.get(activation).id, need_dx, need_dw,
                                bias_grads, True, on_dx=on_dx)
    g, u = held
    held.clear()
    grads = reference.gated_mlp_backward(dy2, x2, wg, wu, wd, g, u, activation, need_dx=need_dx, need_dw=need_dw,
                                         bias_grads=bias_grads)
    if on_dx is not None and grads.x is not None:
        on_dx(grads.x)
    return tuple(grads)


@torch.library.custom_op("mlpfuse::gated_mlp", mutates_args=())
def _gated_mlp_op(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
) -> Tensor:
    # Inference: the caller (gated_mlp_call) decided no gradient is needed — an implementation cannot tell, as a
    # model's Parameters require grad under no_grad too. The op keeps nothing, so any path may run it, the decode
    # kernels included; its autograd formula (for a direct call under autograd) recomputes g and u from x.
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    return _forward(*args, activation, backend, False, False)[0]


def _fake_output(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation) -> Tensor:
    """The ops' fake implementations: the same argument checks as the real ones, then y's shape."""
    _checks.gated_mlp_args(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    activations.get(activation)
    return x.new_empty(*x.shape[:-1], down_weight.shape[0])


@_gated_mlp_op.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend):
    return _fake_output(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)


@torch.library.custom_op("mlpfuse::norm_gated_mlp", mutates_args=())
def _norm_gated_mlp_op(
    x: Tensor,
    norm_weight: Tensor,
    norm_eps: float,
    norm_kind: int,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
    residual: Optional[Tensor] = None,
) -> Tensor:
    """Inference through an RMSNorm (ops.norm): what a compiled graph records for a block that holds its norm. The
    DECODE path's kernels apply the norm; every other path runs it in PyTorch first (ops.norm.rms_norm: the same
    ops, in the same order, as the norm module it was recognised from). `residual` (the caller checked it with
    `residual_fits`): y + residual, added in the down projection's epilogue."""
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    _checks.gated_mlp_args(*args)
    if residual is not None and not residual_fits(residual, x, down_weight):
        raise InputError(f"residual: expected a contiguous tensor of the output's shape and x's dtype, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if (dispatch.gated_mlp_path(backend, rows(x), gate_weight.shape[0], False) == dispatch.DECODE
            and norm_weight.dtype == x.dtype):
        return _forward(*args, activation, backend, False, False, dispatch.DECODE,
                        norm=_OpNorm(norm_weight, norm_eps, norm_kind), residual=residual)[0]
    normed = rms_norm(x, norm_weight, norm_eps, norm_kind)
    return _forward(normed, *args[1:], activation, backend, False, False, residual=residual)[0]


class _OpNorm:
    """The norm's arguments as the decode kernels read them (an RMSNormPrologue without its module)."""

    __slots__ = ("weight", "eps", "kind")

    def __init__(self, weight, eps, kind):
        self.weight, self.eps, self.kind = weight, eps, kind


@_norm_gated_mlp_op.register_fake
def _(x, norm_weight, norm_eps, norm_kind, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
      activation, backend, residual=None):
    return _fake_output(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)


@torch.library.custom_op("mlpfuse::gated_mlp_train", mutates_args=())
def _gated_mlp_train_op(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
    save_preact: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    y, h, g, u = _forward(*args, activation, backend, True, save_preact)
    return (y, *(t if t is not None else nothing(x) for t in (h, g, u)))


@_gated_mlp_train_op.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend, save_preact):
    y = _fake_output(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    if not save_preact:
        return y, nothing(x), nothing(x), nothing(x)
    m, hidden = leading(x), gate_weight.shape[0]
    return y, x.new_empty(m, hidden), x.new_empty(m, hidden), x.new_empty(m, hidden)


def _backward_impl(
    dy: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    g: Tensor,
    u: Tensor,
    h: Tensor,
    activation: str,
    backend: str,
    recompute: bool,
    need_dx: bool,
    need_dw: bool,
    need_dgate_bias: bool,
    need_dup_bias: bool,
    need_ddown_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """All seven gradients (empty placeholders where not needed); what the backward op runs. Reads g and u only."""
    return _gradients((dy, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, g, u, h, activation, backend,
                       recompute, need_dx, need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias))


def _gradients(args: tuple, held: Optional[list] = None, path: str = ""):
    """All seven gradients (empty placeholders where not needed) for the backward op's arguments `args`. `held`:
    eager training's [g, u], handed over to be overwritten with dg and du and released as soon as their last reader
    ran (g and u are then placeholders); FP8-kept ones come as (values, scale_inv) pairs, which the Triton paths'
    GLU pass reads as they are and the others dequantize first. `path`: the one the forward took (else chosen
    again, as the forward would)."""
    (dy, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, g, u, h, activation, backend, recompute, need_dx,
     need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias) = args
    del args  # no second reference to g and u in this frame: each dies with its name below
    act = activations.get(activation)
    x2, dy2 = rows(x), rows(dy.to(x.dtype))
    path = path or dispatch.gated_mlp_path(backend, x2, gate_weight.shape[0], True)
    fused = path != dispatch.TORCH and x2.shape[0] > 0
    triton = fused and path != dispatch.CUDA
    consume = held is not None and not recompute
    if consume:
        g, u = held
        held.clear()  # the caller's list: no reference to g and u may outlive their last use below
        if isinstance(g, tuple) and not triton:
            g, u = (fp8.dequantize_activation(v, sc, x.dtype) for v, sc in (g, u))
    if fused and not triton:
        return _cuda_backward(dy2, x, x2, gate_weight, up_weight, down_weight, gate_bias, up_bias, g, u, h, act.id,
                              recompute, consume, need_dx, need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias)
    if recompute:
        if path == dispatch.GATED:
            tf32 = dispatch.allow_tf32()
            gg = dispatch.kernel("gated_gemm").gated_gemm
            h, g, u = gg(x2, gate_weight, up_weight, gate_bias, up_bias, activation=act.id, save_preact=True,
                         allow_tf32=tf32)
        else:
            g, u = reference.gated_preact(x2, gate_weight, up_weight, gate_bias, up_bias)
    bias_grads = (need_dgate_bias, need_dup_bias, need_ddown_bias)
    if not triton:
        grads = reference.gated_mlp_backward(
            dy2, x2, gate_weight, up_weight, down_weight, g, u, act,
            need_dx=need_dx, need_dw=need_dw, bias_grads=bias_grads,
        )
        dx, dwg, dwu, dwd, dbg, dbu, dbd = grads
    else:
        held = [g, u]  # handed over: _triton_backward releases them as it goes
        del g, u
        dx, dwg, dwu, dwd, dbg, dbu, dbd = _triton_backward(
            dy2, x2, gate_weight, up_weight, down_weight, held, h, act.id, need_dx, need_dw, bias_grads, consume
        )
    dx = dx.reshape(x.shape) if dx is not None else None
    return tuple(t if t is not None else nothing(x) for t in (dx, dwg, dwu, dwd, dbg, dbu, dbd))


def _cuda_backward(dy2, x, x2, wg, wu, wd, bg, bu, g, u, h, act_id: int, recompute: bool, consume: bool, need_dx,
                   need_dw, need_dbg, need_dbu, need_dbd):
    """The CUDA backend's gradients: one C++ call (cuBLAS dh, one GLU-backward pass with fp32 bias sums, cuBLAS dx
    and weight gradients). With `consume` it writes dg and du over the g and u handed over."""
    ext = csrc.extension()  # the path's choice checked x2 for it
    if recompute:
        _, h, g, u = dispatch.cuda_call(ext.gated_mlp_forward, x2, wg, wu, wd, bg, bu, None, act_id, True, False)
        consume = True  # recomputed here: nobody else holds them
    grads = dispatch.cuda_call(ext.gated_mlp_backward, dy2, x2, wg, wu, wd, g, u, h, act_id, consume, need_dx, need_dw,
                               need_dbg, need_dbu, need_dbd)
    dx = grads[0].reshape(x.shape) if grads[0] is not None else None
    return tuple(t if t is not None else nothing(x) for t in (dx, *grads[1:]))


def _triton_backward(dy2, x2, wg, wu, wd, held: list, h, act_id: int, need_dx: bool, need_dw: bool, bias_grads,
                     consume: bool, entry: "Optional[_Entry]" = None, on_dx=None):
    """The Triton path's gradients from the saved (or recomputed) g and u, taken out of `held`, and h (None or empty:
    not saved, rebuilt here). `entry`: the module call plan's entry of a SPLIT-path step, which holds the GLU-backward
    pass's launch plan (g, u fresh from cuBLAS and dh from this function: contiguous, aligned).

    The order keeps the peak low, as eager autograd's node-by-node release does: dh = dy·Wd; one pass writes dg and
    du (and h, when not saved, over dh); dWd = dyᵀ·h, after which h is released; dx; dWu = duᵀ·x, after which du
    is released; dWg = dgᵀ·x. With `consume` (eager training's first backward) dg and du are written over g and u,
    each element by the program that just read it: the backward then allocates no [M, hidden] buffer but dh, and
    while the last weight gradient is computed only dg is alive besides the gradients. `on_dx(dx)`, when given, is
    called as soon as dx is computed (tensor parallelism starts its all-reduce there, behind dWu and dWg).
    """
    g, u = held
    held.clear()  # no reference left with the caller: each buffer dies with its last local name below
    tf32 = dispatch.allow_tf32()
    scales = {}
    if isinstance(g, tuple):  # FP8-saved (values, scale_inv): dg and du get buffers of their own
        (g, scales["g_scale"]), (u, scales["u_scale"]) = g, u
        consume = False
        entry = None  # the held GLU-backward plan is for 16-bit g and u
    if consume:
        dg, du = g, u
    elif scales:
        dg, du = (torch.empty(g.shape, device=g.device, dtype=dy2.dtype) for _ in range(2))
    else:
        dg, du = torch.empty_like(g), torch.empty_like(u)
    kernels = dispatch.kernel("glu_backward")
    dbg = dbu = None
    if dispatch.GLU_BACKWARD == "fused" and not scales:
        rebuild_h = (h is None or h.numel() == 0) and need_dw  # a saved h is not written again
        rebuilt = kernels.matmul_glu_backward(dy2, wd, g, u, activation=act_id, allow_tf32=tf32, want_h=rebuild_h,
                                              out=(dg, du, torch.empty_like(g) if rebuild_h else None))[2]
        if rebuild_h:
            h = rebuilt
        del rebuilt
    else:
        dh = dy2.mm(wd)
        # Without a saved h (eager training keeps only g and u), the pass writes h over dh, each element after
        # reading it.
        rebuild_h = (h is None or h.numel() == 0) and need_dw
        sums = bias_grads[0] or bias_grads[1]
        plan = entry.held_backward if entry is not None else None
        if plan and plan.want_h == rebuild_h and plan.sums == sums:
            dbg, dbu = plan.run(dh, g, u, dg, du, dh if rebuild_h else None)
        else:
            # Only the bias sums are taken from the result: binding its other entries (even to `_`) would keep h
            # alive until the function returns, past its last reader.
            dbg, dbu = kernels.glu_backward_split(
                dh, g, u, activation=act_id, bias_sums=sums, out=(dg, du), want_h=rebuild_h,
                out_h=dh if rebuild_h else None, **scales,
            )[3:]
            if entry is not None and plan is None and not scales:
                entry.held_backward = kernels.cached_plan(dh.shape[0], dh.shape[1], dh.dtype, dh.device,
                                                          activation=act_id, want_h=rebuild_h, bias_sums=sums) or False
        if rebuild_h:
            h = dh
        del dh
    del g, u
    dx = dwg = dwu = dwd = None
    if need_dw:
        dwd = dy2.t().mm(h)
    del h
    if need_dx:
        dx = dg.mm(wg).addmm_(du, wu)
        if on_dx is not None:
            on_dx(dx)
    # Bias gradients are column sums taken in fp32 (the split pass has them from before dg and du were rounded).
    dbg, dbu, dbd = (
        (fp32 if fp32 is not None else t.sum(0, dtype=torch.float32)).to(x2.dtype) if need else None
        for t, fp32, need in zip((dg, du, dy2), (dbg, dbu, None), bias_grads)
    )
    if need_dw:
        # Both weight gradients from one batched GEMM over dg and du where they share an allocation (the forward
        # paired g and u: eager training, up to dispatch.MERGED_DW_MAX_M tokens): one launch fewer where launches are
        # a visible share of the step. Otherwise du is freed before dWg's output is allocated (the lower peak, as
        # eager's node order has it).
        both = stacked(dg, du)
        if both is not None:
            dwg, dwu = torch.bmm(both.transpose(1, 2), x2.expand(2, *x2.shape)).unbind(0)
        else:
            dwu = du.t().mm(x2)
            del du
            dwg = dg.t().mm(x2)
    return dx, dwg, dwu, dwd, dbg, dbu, dbd


_gated_mlp_backward_op = torch.library.custom_op("mlpfuse::gated_mlp_backward", mutates_args=())(_backward_impl)


@_gated_mlp_backward_op.register_fake
def _(dy, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, g, u, h, activation, backend, recompute,
      need_dx, need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias):
    return _backward_fake(x, gate_weight, up_weight, down_weight, need_dx, need_dw, need_dgate_bias, need_dup_bias,
                          need_ddown_bias)


def _backward_fake(x, gate_weight, up_weight, down_weight, need_dx, need_dw, need_dgate_bias, need_dup_bias,
                   need_ddown_bias):
    """The backward ops' seven outputs as shapes (empty placeholders where not needed)."""
    def like(t, need):
        return torch.empty_like(t) if need else nothing(x)

    return (
        like(x, need_dx),
        like(gate_weight, need_dw),
        like(up_weight, need_dw),
        like(down_weight, need_dw),
        x.new_empty(gate_weight.shape[0]) if need_dgate_bias else nothing(x),
        x.new_empty(gate_weight.shape[0]) if need_dup_bias else nothing(x),
        x.new_empty(down_weight.shape[0]) if need_ddown_bias else nothing(x),
    )


def _backward(ctx, dy, h, g, u, impl=None, saved=None):
    """Gradients for autograd; `impl` None runs the registered backward op (what compile and export record).
    `saved`: ctx's saved tensors when the caller unpacked them already."""
    x, wg, wu, wd, bg, bu, bd = (saved if saved is not None else ctx.saved_tensors)[:7]
    need = ctx.needs_input_grad
    need_dw = need[1] or need[2] or need[3]
    grads = (impl or torch.ops.mlpfuse.gated_mlp_backward)(
        dy, x, wg, wu, wd, bg, bu, g, u, h, ctx.activation, ctx.backend, ctx.recompute,
        need[0], need_dw,
        bg is not None and need[4], bu is not None and need[5], bd is not None and need[6],
    )
    return (*(t if need[i] else None for i, t in enumerate(grads)), None, None) + (None,) * ctx.extra_inputs


def _setup(ctx, inputs, output):
    x, wg, wu, wd, bg, bu, bd, activation, backend = inputs[:9]
    ctx.activation, ctx.backend = activation, backend
    ctx.extra_inputs = len(inputs) - 9  # the train op's save_preact
    ctx.recompute = not (ctx.extra_inputs and inputs[9])
    ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd, *(output[1:4] if not ctx.recompute else ()))
    ctx.set_materialize_grads(False)  # no zero-filled gradients for h, g and u, which only the backward reads


def _backward_inference(ctx, dy):
    empty = nothing(dy)
    return _backward(ctx, dy, empty, empty, empty)


def _backward_train(ctx, dy, _dh, _dg, _du):
    if ctx.recompute:
        empty = nothing(dy)
        return _backward(ctx, dy, empty, empty, empty)
    return _backward(ctx, dy, *ctx.saved_tensors[7:])


_gated_mlp_op.register_autograd(_backward_inference, setup_context=_setup)
_gated_mlp_train_op.register_autograd(_backward_train, setup_context=_setup)


# Training with g and u kept in the FP8 recipe (save="fp8"), as a graph records it: the forward's outputs are y and
# g, u as (e4m3 values, fp32 scale_inv per row and 128 columns), which is what AOTAutograd then saves for the
# backward op.
@torch.library.custom_op("mlpfuse::gated_mlp_train_fp8", mutates_args=())
def _gated_mlp_train_fp8_op(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    y, _, (gq, gs), (uq, us) = _forward(*args, activation, backend, True, True, fp8_save=True)
    return y, gq, gs, uq, us


@_gated_mlp_train_fp8_op.register_fake
def _(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend):
    y = _fake_output(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation)
    m, hidden = leading(x), gate_weight.shape[0]
    values = [x.new_empty(m, hidden, dtype=fp8.DTYPE) for _ in range(2)]
    scales = [x.new_empty(m, -(-hidden // fp8.GROUP), dtype=fp8.SCALE_DTYPE) for _ in range(2)]
    return y, values[0], scales[0], values[1], scales[1]


@torch.library.custom_op("mlpfuse::gated_mlp_backward_fp8", mutates_args=())
def _gated_mlp_backward_fp8_op(
    dy: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    g: Tensor,
    g_scale: Tensor,
    u: Tensor,
    u_scale: Tensor,
    activation: str,
    backend: str,
    need_dx: bool,
    need_dw: bool,
    need_dgate_bias: bool,
    need_dup_bias: bool,
    need_ddown_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The seven gradients (empty placeholders where not needed) from FP8-kept g and u (`_gradients`)."""
    empty = nothing(x)
    return _gradients((dy, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, empty, empty, empty, activation,
                       backend, False, need_dx, need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias),
                      [(g, g_scale), (u, u_scale)])


@_gated_mlp_backward_fp8_op.register_fake
def _(dy, x, gate_weight, up_weight, down_weight, gate_bias, up_bias, g, g_scale, u, u_scale, activation, backend,
      need_dx, need_dw, need_dgate_bias, need_dup_bias, need_ddown_bias):
    return _backward_fake(x, gate_weight, up_weight, down_weight, need_dx, need_dw, need_dgate_bias, need_dup_bias,
                          need_ddown_bias)


def _setup_fp8(ctx, inputs, output):
    x, wg, wu, wd, bg, bu, bd, activation, backend = inputs
    ctx.activation, ctx.backend = activation, backend
    ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd, *output[1:5])
    ctx.set_materialize_grads(False)


def _backward_train_fp8(ctx, dy, *_):
    x, wg, wu, wd, bg, bu, bd, gq, gs, uq, us = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = torch.ops.mlpfuse.gated_mlp_backward_fp8(
        dy, x, wg, wu, wd, bg, bu, gq, gs, uq, us, ctx.activation, ctx.backend, need[0],
        need[1] or need[2] or need[3], bg is not None and need[4], bu is not None and need[5],
        bd is not None and need[6])
    return (*(t if need[i] else None for i, t in enumerate(grads)), None, None)


_gated_mlp_train_fp8_op.register_autograd(_backward_train_fp8, setup_context=_setup_fp8)


class _EagerTraining(torch.autograd.Function):
    """Plain eager training: the same forward and backward as the registered ops, without the custom-op machinery.

    Measured with benchmarks/profile_training.py (since retired) on an H200 (8192×768×3072 bf16): through
    torch.library's autograd wrapper the two Python ops cost ~640 µs of host time per step, more than the GPU work they launch, and autograd
    zero-filled gradients for the saved g and u outputs. torch.compile, export and TorchScript still see the ops.

    g and u are kept in a plain list on ctx, not through save_for_backward (which would hold them until the node
    finished): the first backward takes them, writes dg and du over them and releases each as soon as its last
    reader ran (`_triton_backward`); a later backward through the same graph (retain_graph=True) finds none and
    recomputes them from x. Under saved-tensor hooks (activation checkpointing) they are saved like the rest
    (`_util.hold`). h is not kept: the backward rebuilds it over dh, so the step's activations are g and u
    alone, as with Liger and compile.

    `entry`: the module call plan's entry (None for a direct op call); on the SPLIT path it holds the GLU pass's and
    the GLU-backward pass's launch plans. The first backward on the Triton paths goes straight to
    `_triton_backward` (a host-bound step pays for every Python layer); the rest takes the ops' general route.
    """

    @staticmethod
    def forward(ctx, x, wg, wu, wd, bg, bu, bd, activation: str, backend: str, path: str, entry=None,
                save=True):
        # save: True (g and u in x's dtype), "fp8" (in the FP8 recipe), False (neither: recomputed)
        plan = entry.held if entry is not None and path == dispatch.SPLIT else None
        y, _, g, u = _forward(x, wg, wu, wd, bg, bu, bd, activation, backend, True, bool(save), path, plan,
                              paired=save is True, fp8_save=save == "fp8")
        # extras: path, entry, save
        ctx.activation, ctx.backend, ctx.extra_inputs, ctx.path = activation, backend, 3, path
        ctx.entry = entry if path == dispatch.SPLIT else None
        hold(ctx, (x, wg, wu, wd, bg, bu, bd), g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        if profiling():
            with op_span("mlpfuse::gated_mlp_backward"):
                return _EagerTraining._backward(ctx, dy)
        return _EagerTraining._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        saved, held = take_held(ctx)
        if held is None or ctx.path not in (dispatch.GATED, dispatch.SPLIT):
            ctx.recompute = held is None
            empty = nothing(dy)
            return _backward(ctx, dy, empty, empty, empty,
                             impl=lambda *args: _gradients(args, held, ctx.path), saved=saved)
        x, wg, wu, wd, bg, bu, bd = saved[:7]
        need = ctx.needs_input_grad
        bias_grads = (bg is not None and need[4], bu is not None and need[5], bd is not None and need[6])
        if dy.dtype != x.dtype:
            dy = dy.to(x.dtype)
        grads = _triton_backward(rows(dy), rows(x), wg, wu, wd, held, None, activations.get(ctx.activation).id,
                                 need[0], need[1] or need[2] or need[3], bias_grads, True, ctx.entry)
        held = None  # the buffers go as soon as the gradients are out
        dx = grads[0]
        if dx is not None and x.dim() != 2:
            dx = dx.reshape(x.shape)
        return (dx, *(t if need[i] else None for i, t in enumerate(grads[1:], 1)), None, None, None, None, None)


class CallPlan(_plan.Memo):
    """A module's memo of its plain eager calls: arguments checked and the path chosen once per layout, not per call.

    A module (or patched block) owns one and hands it to `gated_mlp_call`, which consults it for plain tensors in
    eager execution outside autocast. The key of a call holds every property the checks and the path read — x's
    shape, strides, 16-byte alignment, dtype and device; each weight's and bias's address, shape and dtype (and the
    weights' strides); the backend as resolved for this call; whether a gradient is needed (decided by the caller);
    TF32 for fp32 (see ops._plan). A new key runs the op layer's checks and path choice (same errors, same path)
    and is remembered. Per call on a hit: the key, then straight to the kernels — for the gated GEMM its launch plan
    is held here (on the split path the GLU passes'), so the kernel wrapper's own key is not built again.
    """

    __slots__ = ()

    def run(self, x, wg, wu, wd, bg, bu, bd, activation: str, backend: str, grad: bool, norm=None,
            recompute: bool = False, residual=None, save_fp8: bool = False) -> Tensor:
        """`residual` (inference, `residual_fits` checked by the caller): y + residual, in the epilogue. `save_fp8`:
        training keeps g and u in the FP8 recipe (see gated_mlp_call)."""
        norm_key = None if norm is None else norm.key(x)
        key = (dispatch.resolve_backend(backend), _plan.x_key(x), _plan.weight_key(wg), _plan.weight_key(wu),
               _plan.weight_key(wd), _plan.bias_key(bg), _plan.bias_key(bu), _plan.bias_key(bd), activation, grad,
               x.dtype is torch.float32 and dispatch.allow_tf32(), norm_key, grad and (recompute, save_fp8),
               None if residual is None else residual.data_ptr() & 15)  # kernels specialise on 16-byte alignment
        entry = self.entries.get(key)
        if entry is None:
            _checks.module_input(x, wg, "gate_proj.weight")
            entry = _Entry.choose(x, wg, wu, wd, bg, bu, bd, activation, backend, grad, True,
                                  _keep(recompute, save_fp8))
            if norm is not None and (norm_key is None or entry.path != dispatch.DECODE):
                entry = False  # the norm's own forward, then the block as for any input
            entry = self.remember(key, entry)
        if entry is False:
            return self.run(norm(x), wg, wu, wd, bg, bu, bd, activation, backend, grad, None, recompute, residual,
                            save_fp8)
        return entry(x, wg, wu, wd, bg, bu, bd, norm, residual)


class _Entry:
    """One layout's call with its path chosen: on the torch path eager PyTorch's own ops in eager's order (under
    autograd when a gradient is needed), else `_forward` on that path, or `_EagerTraining` for a gradient. For
    inference on the gated path the GEMM's launch plan, and on the split path (inference and training) the GLU
    pass's, looked up after the first call, is held here and run directly (`hold`: a module's plan keeps the entry;
    a one-off call's entry does not look the plans up)."""

    __slots__ = ("path", "activation", "act", "backend", "grad", "held", "held_backward", "save")

    def __init__(self, path: str, activation: str, backend: str, grad: bool, hold: bool, save: bool = True):
        self.path, self.activation, self.backend, self.grad = path, activation, backend, grad
        # training: keep g and u for the backward (True; "fp8": in the FP8 recipe), else recompute them (False)
        self.save = save if dispatch.SAVE_PREACT else False
        self.act = activations.get(activation)
        self.held = None if hold else False  # the kernel's launch plan; False once known there is none to hold
        self.held_backward = None  # the same for the GLU-backward pass (SPLIT path, training; _triton_backward)

    @classmethod
    def choose(cls, x, wg, wu, wd, bg, bu, bd, activation: str, backend: str, grad: bool, hold: bool,
               save: bool = True) -> "_Entry":
        """The entry for this call's layout: the arguments checked, the path chosen (dispatch.gated_mlp_path).
        `save` False: a training call keeps only x, and its backward recomputes g and u."""
        if _checks.foreign(wg, wu, wd):
            return cls(dispatch.TORCH, activation, backend, grad, False)
        _checks.gated_mlp_args(x, wg, wu, wd, bg, bu, bd)
        activations.get(activation)
        return cls(dispatch.gated_mlp_path(backend, rows(x), wg.shape[0], grad), activation, backend, grad, hold,
                   save)

    def __call__(self, x, wg, wu, wd, bg, bu, bd, norm=None, residual=None) -> Tensor:
        """`residual` (inference only; `residual_fits`): y + residual, in the epilogue where the path has one."""
        if self.path == dispatch.DECODE:  # inference only (with `norm`: the kernels apply it)
            return self._decode(x, wg, wu, wd, bg, bu, bd, norm, residual)
        if self.path == dispatch.TORCH:  # eager's kernels, under autograd when a gradient is needed
            if self.grad and not self.save:  # recompute: keep x alone, run the forward again in the backward
                return checkpoint(reference.gated_mlp_forward, x, wg, wu, wd, bg, bu, bd, self.act,
                                  use_reentrant=False)
            y = reference.gated_mlp_forward(x, wg, wu, wd, bg, bu, bd, self.act)
            return y if residual is None else residual + y
        plan = self.held
        if self.grad:
            y = _EagerTraining.apply(x, wg, wu, wd, bg, bu, bd, self.activation, self.backend, self.path, self,
                                     self.save)
        elif plan:
            r2 = None if residual is None else rows(residual)
            if self.path == dispatch.SPLIT:
                y = down_residual(hidden(rows(x), wg, wu, bg, bu, self.act, dispatch.SPLIT, False, plan)[0], wd, bd,
                                  r2)
            else:  # the gated GEMM's plan reads a contiguous x of any rank as its rows (no view op)
                y = down_residual(plan.run(x if x.is_contiguous() else rows(x), wg, wu, bg, bu), wd, bd, r2)
            return unrows(y, x)
        else:
            y = _forward(x, wg, wu, wd, bg, bu, bd, self.activation, self.backend, False, False, self.path,
                         residual=residual)[0]
        if plan is None:
            self.held = self._held_plan(x, wg, wu, bg, bu) or False
        return y

    def _decode(self, x, wg, wu, wd, bg, bu, bd, norm, residual=None) -> Tensor:
        """The DECODE path: after the first call straight to the decode kernels' plan for this layout (held with
        the deterministic flag it was made under), whose own key is then not built again."""
        held = self.held
        deterministic = torch.are_deterministic_algorithms_enabled()
        if held and held[1] is deterministic:
            # A contiguous x goes as it is (the kernels read its rows; no view op either way); else as rows.
            xr = x if x.is_contiguous() else rows(x)
            y = dispatch.kernel("decode_mlp").run_plan(
                held[0], xr, wg, wu, wd, bg, bu, bd, *((None, 0.0) if norm is None else (norm.weight, norm.eps)),
                residual=residual if xr is x or residual is None else rows(residual))
            return y if xr is x else unrows(y, x)
        y = _forward(x, wg, wu, wd, bg, bu, bd, self.activation, self.backend, False, False, self.path, norm=norm,
                     residual=residual)[0]
        if held is None:
            plan = dispatch.kernel("decode_mlp").held_plan(
                rows(x), wg, wu, wd, bg, bu, bd, activation=self.act.id, deterministic=deterministic,
                allow_tf32=x.dtype != torch.float32 or dispatch.allow_tf32(),
                norm_weight=None if norm is None else norm.weight, norm_kind=0 if norm is None else norm.kind,
                residual=None if residual is None else rows(residual))
            self.held = (plan, deterministic) if plan is not None else False
        return y

    def _held_plan(self, x, wg, wu, bg, bu):
        """The launch plan the call just made (the same arguments `_forward` passed), where there is one. Under
        autograd only the SPLIT path's forward has one (the gated GEMM's training launch is not held)."""
        if self.path == dispatch.GATED and not self.grad:
            return dispatch.kernel("gated_gemm").cached_plan(rows(x), wg, wu, bg, bu, activation=self.act.id,
                                                             allow_tf32=dispatch.allow_tf32())
        if self.path == dispatch.SPLIT:  # g and u come fresh from cuBLAS: contiguous, aligned
            return dispatch.kernel("glu").cached_plan(rows(x).shape[0], wg.shape[0], x.dtype, x.device,
                                                      activation=self.act.id)
        return None


def gated_mlp_call(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
    plan: Optional[CallPlan] = None,
    norm=None,
    recompute: bool = False,
    residual: Optional[Tensor] = None,
    save_fp8: bool = False,
) -> Tensor:
    """Every gated MLP call's one way in (the modules, the patched blocks, `ops.gated_mlp`, tensor parallelism).

    Whether the call needs a gradient is decided here, once, by autograd's own rule (`needs_grad`), and handed on:
    plain eager calls go to their path's kernels (through the module's `plan` when one is given; the backward then
    reads what the forward kept), everything else — torch.compile, export, tracing, tensor subclasses — to one of
    the registered ops (`registered_call`). Under torch.profiler an eager call shows as a `mlpfuse::gated_mlp` CPU
    op around the kernels it launches. `plan` also marks a module's call: bad input is then named in its terms.
    `norm` (ops.norm.RMSNormPrologue): the block's input is norm(x); the decode kernels apply it themselves, every
    other path calls the norm first. `recompute`: a training call keeps only x (not g, u, h); its backward
    recomputes them with the forward's kernels (two GEMMs more, three [tokens, hidden] tensors less).
    `residual`: the call returns `residual + y` (a decoder layer's add, handed to the block by
    mlpfuse.patching.residual); in inference the down projection's epilogue adds it (`residual_fits`), anywhere
    else it is added as the layer added it. `save_fp8`: eager training keeps g and u for the backward in the FP8
    recipe (mlpfuse.fp8: e4m3 values, one fp32 scale per row and 128 columns; written by the gated GEMM's epilogue),
    half the bytes of x's dtype; the backward's GLU pass dequantizes them as it reads them. Compiled, the graph
    records `mlpfuse::gated_mlp_train_fp8`, whose FP8 outputs are what it saves for the backward.
    """
    if residual is not None and not residual_fits(residual, x, down_weight):
        return residual + gated_mlp_call(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                         activation, backend, plan, norm, recompute, None, save_fp8)
    if not plain_eager(x):
        if norm is not None:
            if plan is not None:
                _checks.module_input(x, gate_weight, "gate_proj.weight")
            if (leading(x) <= _decode_rows()
                    and not needs_grad([x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                        norm.weight])):
                # One node for the norm and the block, which the decode kernels apply themselves. Past decode sizes
                # the norm stays in the graph, where the compiler fuses it (the op would run it unfused).
                return torch.ops.mlpfuse.norm_gated_mlp(x, norm.weight, norm.eps, norm.kind, gate_weight, up_weight,
                                                        down_weight, gate_bias, up_bias, down_bias, activation,
                                                        backend, residual)
            x = norm(x)
        if plan is not None:
            _checks.module_input(x, gate_weight, "gate_proj.weight")
        y = registered_call(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                            backend, recompute, save_fp8)
        return y if residual is None else residual + y
    if profiling():
        with op_span("mlpfuse::gated_mlp"):
            return _eager(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend,
                          plan, norm, recompute, residual, save_fp8)
    return _eager(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend, plan,
                  norm, recompute, residual, save_fp8)


@torch.compiler.assume_constant_result
def _decode_rows() -> int:
    """The most tokens the decode kernels take (0 without them); a constant to a graph being recorded."""
    return dispatch.decode_max_m()


def _keep(recompute: bool, save_fp8: bool):
    """What a training call keeps for its backward (_Entry.save): nothing (recompute), g and u in FP8, or as they
    are."""
    return False if recompute else "fp8" if save_fp8 else True


def _eager(x, wg, wu, wd, bg, bu, bd, activation: str, backend: str, plan: Optional[CallPlan], norm=None,
           recompute: bool = False, residual=None, save_fp8: bool = False) -> Tensor:
    low = autocast_dtype(x)
    if low is not None:  # the ops are outside autocast's op lists: cast here, as it would for nn.Linear
        if norm is not None:
            x, norm = norm(x), None
        x, wg, wu, wd, bg, bu, bd = cast_all([x, wg, wu, wd, bg, bu, bd], low)
        plan = None  # fresh copies every call: no layout worth remembering
    grad = needs_grad([x, wg, wu, wd, bg, bu, bd, None if norm is None else norm.weight])
    if residual is not None and (grad or low is not None):  # under autograd or autocast: the layer's own add
        return residual + _eager(x, wg, wu, wd, bg, bu, bd, activation, backend, plan, norm, recompute, None,
                                 save_fp8)
    plain = _checks.PLAIN  # (three tests, not a generator: this runs on every eager call)
    planned = plan is not None and type(wg) in plain and type(wu) in plain and type(wd) in plain
    if norm is not None and (grad or not planned):
        x, norm = norm(x), None  # under autograd (or without a plan to hold the choice): the norm's own forward
    if planned:
        return plan.run(x, wg, wu, wd, bg, bu, bd, activation, backend, grad, norm, recompute, residual, save_fp8)
    entry = _Entry.choose(x, wg, wu, wd, bg, bu, bd, activation, backend, grad, False, _keep(recompute, save_fp8))
    return entry(x, wg, wu, wd, bg, bu, bd, None, residual)


def registered_call(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor],
    up_bias: Optional[Tensor],
    down_bias: Optional[Tensor],
    activation: str,
    backend: str,
    recompute: bool = False,
    save_fp8: bool = False,
) -> Tensor:
    """The call as a graph records it: `mlpfuse::gated_mlp_train` when a gradient is needed (it keeps g, u and h for
    the backward, unless `recompute`; `mlpfuse::gated_mlp_train_fp8` with `save_fp8`: g and u in the FP8 recipe),
    else `mlpfuse::gated_mlp`, which computes inference only.
    TorchScript-compatible (a scripted module calls it directly). Weights the kernels cannot read
    (`_checks.foreign`) take the module's own math instead, in the graph, with no break."""
    if not torch.jit.is_scripting():
        if not isinstance(x, Tensor):
            raise InputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if _checks.foreign(gate_weight, up_weight, down_weight):
            return reference.gated_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias,
                                               activations.get(activation))
        low = autocast_dtype(x)
        if low is not None:
            cast = cast_all([x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias], low)
            x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias = cast
    if needs_grad([x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias]):
        if save_fp8 and not recompute and dispatch.SAVE_PREACT:
            return torch.ops.mlpfuse.gated_mlp_train_fp8(x, gate_weight, up_weight, down_weight, gate_bias, up_bias,
                                                         down_bias, activation, backend)[0]
        return torch.ops.mlpfuse.gated_mlp_train(
            x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend,
            dispatch.SAVE_PREACT and not recompute,
        )[0]
    return torch.ops.mlpfuse.gated_mlp(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, backend
    )


def gated_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    activation: Optional[str] = "gelu_tanh",
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    *,
    backend: Optional[str] = None,
    recompute: bool = False,
) -> Tensor:
    """y = down_proj(act(gate_proj(x)) · up_proj(x)) with nn.Linear-layout weights, for any leading dimensions.

    gate_weight, up_weight: [hidden, dim] (separate tensors; views of one packed [2·hidden, dim] tensor are fine);
    down_weight: [dim, hidden]; biases optional. activation: a name or alias from mlpfuse.activations (None:
    identity). backend: "auto" | "triton" | "torch" | "cuda"; None reads MLPFUSE_BACKEND, else "auto".
    Differentiable in x, every weight and every bias. recompute: under autograd keep only x for the backward,
    which recomputes the pre-activations (less memory, two GEMMs more).
    """
    name = activations.get(activation).name
    backend_name = dispatch.check_backend_name(backend)
    _checks.tensors([("x", x), ("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)],
                    [("gate_bias", gate_bias), ("up_bias", up_bias), ("down_bias", down_bias)])
    _checks.flag("recompute", recompute)
    return gated_mlp_call(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, name, backend_name,
                          recompute=recompute)
