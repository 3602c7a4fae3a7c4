"""Projections that read one input — an attention's q, k and v, or its output projection alone — as one call: at
decode sizes one launch of kernels.decode_linear (the input's RMSNorm in its prologue when the layer handed it over),
elsewhere the norm's own forward and one GEMM per weight, exactly as the model ran them.

`projections_call` is every such call's one way in (mlpfuse.patching.attention). Whether the call needs a gradient is
decided once, by autograd's rule (`needs_grad`): training and anything autograd must see take the GEMMs. Plain eager
calls launch the kernel directly; torch.compile, export and tensor subclasses see one `mlpfuse::decode_projections`
node, which runs the same choice inside.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mlpfuse.ops import _checks, dispatch
from mlpfuse.ops._util import autocast_dtype, leading, needs_grad, op_span, plain_eager, profiling

_MODULE = "decode_linear"


def projections_call(x: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]], backend: str,
                     norm=None) -> List[Tensor]:
    """(norm(x) if norm else x)·W_iᵀ + b_i for each weight, x [..., K] → one [..., N_i] per weight. `norm` is an
    ops.norm.RMSNormPrologue (the layer's norm, handed to these projections)."""
    fused = (leading(x) <= _max_rows() and autocast_dtype(x) is None
             and not needs_grad([x, *weights, *biases, None if norm is None else norm.weight]))
    if not fused:
        return _unfused(x, weights, biases, norm)
    norm_args = (None, 0.0, 0) if norm is None else (norm.weight, norm.eps, norm.kind)
    if not plain_eager(x):
        return list(torch.ops.mlpfuse.decode_projections(x, weights, biases, *norm_args, backend))
    if profiling():
        with op_span("mlpfuse::decode_projections"):
            return _decode_or_unfused(x, weights, biases, *norm_args, backend, norm)
    return _decode_or_unfused(x, weights, biases, *norm_args, backend, norm)


@torch.compiler.assume_constant_result
def _max_rows() -> int:
    """The most rows the decode kernel takes (0 without Triton); a constant to a graph being recorded."""
    mod = dispatch._kernel_module(_MODULE)
    return int(mod.MAX_M) if mod is not None else 0


def kernel_path(x: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]], norm_weight: Optional[Tensor],
                backend: str) -> bool:
    """Whether the decode kernel runs this (inference-sized) call: "triton" wherever Triton runs, "auto" on a
    Hopper-class GPU in 16-bit dtypes, "torch" never; every tensor in x's dtype, the weights plain tensors with one
    row stride."""
    name = dispatch.resolve_backend(backend)
    if name == "torch" or dispatch.triton_unavailable(x, _MODULE) is not None:
        return False
    if name == "auto" and not dispatch._auto_may_use(x.device, x.dtype, _MODULE):
        return False
    dtype = x.dtype
    if any(type(w) not in _checks.PLAIN or w.dtype != dtype or w.stride(-1) != 1 for w in weights):
        return False  # a DTensor (tensor parallelism) or another subclass: its own GEMMs
    if any(b is not None and b.dtype != dtype for b in biases) or len({b is None for b in biases}) > 1:
        return False
    strides = {w.stride(0) for w in weights if w.shape[0] > 1}
    return len(strides) <= 1 and (norm_weight is None or norm_weight.dtype == dtype)


def _decode_or_unfused(x, weights, biases, norm_weight, norm_eps, norm_kind, backend, norm=None):
    """The kernel where `kernel_path` says so, else the GEMMs after the norm: the module's own forward in eager
    (`norm`), its formula inside the compiled op (ops.norm.rms_norm, which the hand-over checked it equals)."""
    if not kernel_path(x, weights, biases, norm_weight, backend):
        if norm is None and norm_weight is not None:
            from mlpfuse.ops.norm import rms_norm

            x = rms_norm(x, norm_weight, norm_eps, norm_kind)
        return _unfused(x, weights, biases, norm)
    kern = dispatch.kernel(_MODULE)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    outs = kern.decode_linear(x2, weights, biases, norm_weight=norm_weight, norm_eps=norm_eps, norm_kind=norm_kind,
                              allow_tf32=dispatch.allow_tf32())
    lead = x.shape[:-1]
    return [o.view(*lead, o.shape[-1]) for o in outs]


def _unfused(x, weights, biases, norm) -> List[Tensor]:
    """What the model ran: its norm, then one GEMM per weight."""
    if norm is not None:
        x = norm(x)
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


@torch.library.custom_op("mlpfuse::decode_projections", mutates_args=())
def _op(x: Tensor, weights: List[Tensor], biases: List[Optional[Tensor]], norm_weight: Optional[Tensor],
        norm_eps: float, norm_kind: int, backend: str) -> List[Tensor]:
    return _decode_or_unfused(x, weights, biases, norm_weight, norm_eps, norm_kind, backend)


@_op.register_fake
def _(x, weights, biases, norm_weight, norm_eps, norm_kind, backend):
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]
