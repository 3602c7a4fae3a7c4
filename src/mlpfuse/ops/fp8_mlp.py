"""The MLP in FP8 (inference): where precision "fp8" goes from a module to its kernels, in one file.

    fp8_gated_mlp(x, Wg, sg, Wu?, su?, Wd, sd, bg?, bu?, bd?, activation, backend, norm?) -> y   (y of norm(x);
        without Wu the two-layer MLP, y = down(act(gate(x))))
    fp8_linear(x, W, s, b?, activation, backend) -> act(x·Wᵀ + b)

W* are e4m3 values [out, in] and s* their fp32 128×128 block scales (mlpfuse.fp8). Two paths, chosen here by the
number of tokens M:
- M ≤ WEIGHT_ONLY_MAX_M (decode): weight-only — the weights are read once as e4m3 and widened in registers; x, h and
  y stay in x's dtype (kernels.fp8_gemm.fp8_weight_gemm; DECODE_KERNEL below says which form the gated MLP takes).
  At these sizes the step is the weight bytes, which FP8 halves; quantizing x and h would add passes and error for
  nothing.
- larger M: x quantized 1×128 (one pass), the gate+up GEMM in FP8 with the GLU and h's 1×128 quantization in its
  epilogue, the down GEMM in FP8 reading h and its scales (three launches; h crosses HBM once, as FP8).
The "torch" backend computes the same two forms with PyTorch ops from the dequantized operands
(reference.gated_mlp_fp8 and its weight-only counterpart): the CPU path, and the kernels' oracle.

Inference only: a call that needs a gradient (autograd's rule, decided once in `_check_call`) is refused in one line.
Plain eager calls run the kernels directly; torch.compile, export and graph capture see one custom op each
(`mlpfuse::fp8_gated_mlp`, `mlpfuse::fp8_linear`), whose kernels are the same, so compiled output equals eager's bit
for bit.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from mlpfuse import activations, fp8, reference
from mlpfuse.errors import InputError
from mlpfuse.ops import dispatch
from mlpfuse.ops._util import needs_grad, op_span, plain_eager, profiling
from mlpfuse.ops.gated_mlp import residual_fits
from mlpfuse.ops.norm import rms_norm

# Tokens up to which the weight-only kernels run (their tiles keep every row; they take up to 64).
WEIGHT_ONLY_MAX_M = 16

# Which weight-only form the gated MLP takes at decode sizes: False, kernels.fp8_gemm's two weight-only GEMMs (h
# through HBM); True, kernels.decode_mlp's kernel reading e4m3 weights (h on chip, the bf16 decode kernel's tiles and
# reduction modes). Measured on an H200 at 4096×14336, graph replays (benchmarks/fp8_decode_gpu.py, results in
# benchmarks/results/nvidia-h200/fp8-second/fp8_decode.json): the kernel 111.8 µs against 121.1 at 1 token, 112.7
# against 120.3 at 16, the same error (4.6e-2 against float64). It stays off: its atomic reduction modes sum in
# an order that differs between an eager call and a captured or compiled one (measured: compiled != eager, graph !=
# eager at 16 tokens), and the FP8 path promises compiled output bit for bit equal to eager's. (Those times are of
# its bf16-widening form; it now runs fp16 MMAs as the weight-only GEMMs do, not yet timed: the lab's
# `mlpfuse-fp8-onekernel` variant turns it on for an A/B in the decode step.)
DECODE_KERNEL = False

# Whether the weight-only path applies a handed-over RMSNorm in its gate+up kernel's prologue (kernels.fp8_gemm,
# NORM), or runs the norm's own module in front (outside the op, where torch.compile can fuse it). Measured on an
# H200, 32-layer Llama-3-8B-shaped decode step replayed from a CUDA graph (`mlpfuse bench --model llama3-8b --mode
# decode-step --tokens 1x128,8x128 --variants eager,mlpfuse,mlpfuse-fp8,mlpfuse-fp8-nonorm`;
# benchmarks/results/nvidia-h200/fp8-stream/): with the fp16-MMA kernels, 5.869 / 6.840 ms in the prologue against
# 6.077 / 7.274 ms in front (batch 1 / 8). (With the earlier bf16-widening kernels it was the other way round, 7.047
# against 6.927.) Above WEIGHT_ONLY_MAX_M tokens the quantization's pass applies the norm either way.
NORM_IN_WEIGHT_ONLY = True

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards


def _path(device: torch.device, backend: str) -> str:
    """'triton' or 'torch' for a call on `device`: `auto` takes the kernels on a GPU with FP8 tensor cores and the
    reference path on the CPU; an impossible request is one InputError line saying what is needed."""
    interpret = "" if device.type == "cuda" else os.environ.get("TRITON_INTERPRET", "0")
    return _decide(device, dispatch.resolve_backend(backend), interpret)


def check_device(device: torch.device, backend: str = "") -> None:
    """Raise the one-line InputError a call on `device` with this backend would raise; None when FP8 runs there."""
    _path(device, backend)


@functools.lru_cache(maxsize=None)
def _decide(device: torch.device, backend: str, interpret: str) -> str:
    """_path's decision per (device, backend, the interpreter's switch): asking the driver costs host time."""
    if backend == "cuda":
        raise InputError("backend: precision='fp8' runs on the 'triton' or 'torch' backends, not 'cuda'")
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CAPABILITY:
            raise InputError(f"precision='fp8' needs a GPU with FP8 tensor cores (compute capability 8.9 or newer); "
                             f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
        why = dispatch.triton_unavailable(torch.empty(0, device=device), "fp8_gemm")
        if why is not None:
            raise InputError(f"precision='fp8' needs mlpfuse's Triton kernels on this GPU: {why}")
        return "triton"
    if device.type == "cpu":
        if backend == "triton":
            why = dispatch.triton_unavailable(torch.empty(0), "fp8_gemm")
            if why is not None:
                raise InputError(f"backend 'triton': {why}")
            return "triton"
        return "torch"  # auto on the CPU: the reference path
    raise InputError(f"precision='fp8' runs on CUDA GPUs with FP8 tensor cores or on the CPU, not on {device.type}")


def _kernels():
    return dispatch.kernel("fp8_gemm")


def outside_autocast(device: torch.device):
    """The recipe's reference path runs its own dtypes: inside a custom op's implementation torch.autocast would
    still recast its F.linear calls (to bf16 under a bf16 region: other numbers than the kernels', and an output
    dtype the op's fake does not promise), so it runs with autocast off."""
    return torch.autocast(device.type, enabled=False)


def _weight(values: Tensor, scale: Tensor, dtype: torch.dtype) -> fp8.Fp8Weight:
    return fp8.Fp8Weight(values, scale, dtype)


def _gated_impl(x, wg, sg, wu, su, wd, sd, bg, bu, bd, activation: str, backend: str, norm_weight=None,
                norm_eps: float = 0.0, norm_kind: int = 0, residual=None) -> Tensor:
    act = activations.get(activation)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    norm = {} if not norm_kind else {"norm_weight": norm_weight, "norm_eps": norm_eps, "norm_kind": norm_kind}
    if _path(x.device, backend) == "torch":
        if norm_kind:
            x2 = rms_norm(x2, norm_weight, norm_eps, norm_kind)
        w = [None if v is None else _weight(v, s, x.dtype) for v, s in ((wg, sg), (wu, su), (wd, sd))]
        with outside_autocast(x.device):
            if m <= WEIGHT_ONLY_MAX_M:
                y = reference.gated_mlp_fp8_weight_only(x2, *w, act.name, bg, bu, bd)
            else:
                y = reference.gated_mlp_fp8(x2, *w, act.name, bg, bu, bd)
        y = y.reshape(*x.shape[:-1], wd.shape[0])
        return y if residual is None else residual + y
    kern = _kernels()
    x2 = x2.contiguous()
    res2 = None if residual is None else residual.reshape(m, -1)
    if m <= WEIGHT_ONLY_MAX_M and DECODE_KERNEL and wu is not None:  # the decode kernel: h stays on chip
        y = dispatch.kernel("decode_mlp").decode_gated_mlp_fp8(
            x2, wg, sg, wu, su, wd, sd, bg, bu, bd, activation=act.id,
            deterministic=torch.are_deterministic_algorithms_enabled(), residual=res2, **norm)
        return y.reshape(*x.shape[:-1], wd.shape[0])
    if m <= WEIGHT_ONLY_MAX_M:  # the RMSNorm, if any, in the first kernel's prologue; the residual in the last's
        h = kern.fp8_weight_gemm(x2, wg, sg, wu, su, bg, bu, activation=act.id, **norm)
        y = kern.fp8_weight_gemm(h, wd, sd, None, None, bd, activation=activations.IDENTITY, residual=res2)
        return y.reshape(*x.shape[:-1], wd.shape[0])
    # the RMSNorm, if any, in the quantization's pass
    xq, xs = kern.quantize(x2, **norm)
    hq, hs = kern.fp8_gemm(xq, xs, wg, sg, wu, su, bg, bu, activation=act.id, quant_out=True)
    y = kern.fp8_gemm(hq, hs, wd, sd, None, None, bd, activation=activations.IDENTITY, quant_out=False,
                      out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], wd.shape[0])
    return y if residual is None else y.add_(residual)


def _linear_impl(x, w, s, b, activation: str, backend: str) -> Tensor:
    act = activations.get(activation)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if _path(x.device, backend) == "torch":
        weight = _weight(w, s, x.dtype)
        with outside_autocast(x.device):
            if m <= WEIGHT_ONLY_MAX_M:
                y = reference.linear_fp8_weight_only(x2, weight, b, act.name)
            else:
                y = reference.linear_fp8(x2, weight, b, act.name)
        return y.reshape(*x.shape[:-1], w.shape[0])
    kern = _kernels()
    x2 = x2.contiguous()
    if m <= WEIGHT_ONLY_MAX_M:
        y = kern.fp8_weight_gemm(x2, w, s, None, None, b, activation=act.id)
    else:
        xq, xs = kern.quantize(x2)
        y = kern.fp8_gemm(xq, xs, w, s, None, None, b, activation=act.id, quant_out=False, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("mlpfuse::fp8_gated_mlp", mutates_args=())
def _gated_op(x: Tensor, gate_weight: Tensor, gate_scale: Tensor, up_weight: Optional[Tensor],
              up_scale: Optional[Tensor], down_weight: Tensor, down_scale: Tensor, gate_bias: Optional[Tensor],
              up_bias: Optional[Tensor], down_bias: Optional[Tensor], activation: str, backend: str,
              norm_weight: Optional[Tensor], norm_eps: float, norm_kind: int, residual: Optional[Tensor]) -> Tensor:
    return _gated_impl(x, gate_weight, gate_scale, up_weight, up_scale, down_weight, down_scale, gate_bias, up_bias,
                       down_bias, activation, backend, norm_weight, norm_eps, norm_kind, residual)


@_gated_op.register_fake
def _(x, gate_weight, gate_scale, up_weight, up_scale, down_weight, down_scale, gate_bias, up_bias, down_bias,
      activation, backend, norm_weight, norm_eps, norm_kind, residual):
    return x.new_empty(*x.shape[:-1], down_weight.shape[0])


@torch.library.custom_op("mlpfuse::fp8_linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor], activation: str,
               backend: str) -> Tensor:
    return _linear_impl(x, weight, scale, bias, activation, backend)


@_linear_op.register_fake
def _(x, weight, scale, bias, activation, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _check_call(x, w: Tensor, biases) -> None:
    """The checks every call makes once, before any path: a gradient is not supported; x is a floating tensor of the
    weights' width on their device."""
    if needs_grad([x, *biases]):
        raise InputError("precision='fp8' is inference-only: run it under torch.no_grad() or torch.inference_mode() "
                         "(x or a bias requires grad)")
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype == fp8.DTYPE:
        raise InputError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise InputError(f"x: expected last dimension {w.shape[1]}, got shape {tuple(x.shape)}")
    if x.device != w.device:
        raise InputError(f"x: on {x.device}, the FP8 weights on {w.device}")


def fp8_gated_mlp(x: Tensor, gate_weight: Tensor, gate_scale: Tensor, up_weight: Optional[Tensor],
                  up_scale: Optional[Tensor], down_weight: Tensor, down_scale: Tensor,
                  gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
                  down_bias: Optional[Tensor] = None, activation: str = "silu", backend: str = "",
                  norm=None, residual: Optional[Tensor] = None) -> Tensor:
    """y = down(act(gate(x))·up(x)), each weight as e4m3 values and fp32 128×128 scales (the fields of an
    fp8.Fp8Weight), any leading dimensions, y in x's dtype; with `up_weight` None the two-layer MLP
    y = down(act(gate(x))) (GPT-2's c_fc / c_proj). `norm` (ops.norm.RMSNormPrologue): the block's input
    is norm(x): above WEIGHT_ONLY_MAX_M tokens the quantization's pass normalises x; at decode sizes the norm runs as
    its own module first (NORM_IN_WEIGHT_ONLY), as does a norm whose weight is not in x's dtype. `residual` (the
    layer's add after the MLP, mlpfuse.patching.residual): y + residual, added in the weight-only down projection's
    epilogue at decode sizes (before its one rounding), to the down GEMM's output above them."""
    _check_call(x, gate_weight, (gate_bias, up_bias, down_bias))
    if residual is not None and not residual_fits(residual, x, down_weight):
        raise InputError(f"residual: expected a contiguous tensor of shape {(*x.shape[:-1], down_weight.shape[0])} "
                         f"and dtype {x.dtype} on {x.device}, without a gradient; got "
                         f"{tuple(getattr(residual, 'shape', ()))} {getattr(residual, 'dtype', type(residual))}")
    if norm is not None and (norm.key(x) is None or (not NORM_IN_WEIGHT_ONLY
                                                     and x.numel() <= WEIGHT_ONLY_MAX_M * x.shape[-1])):
        x, norm = norm(x), None
    n = (None, 0.0, 0) if norm is None else (norm.weight, norm.eps, norm.kind)
    return _run("fp8_gated_mlp", _gated_impl, (x, gate_weight, gate_scale, up_weight, up_scale, down_weight,
                                               down_scale, gate_bias, up_bias, down_bias, activation, backend, *n,
                                               residual))


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Optional[Tensor] = None, activation: str = "identity",
               backend: str = "") -> Tensor:
    """act(x·Wᵀ + b), W as e4m3 values and fp32 128×128 scales, any leading dimensions, in x's dtype."""
    _check_call(x, weight, (bias,))
    return _run("fp8_linear", _linear_impl, (x, weight, scale, bias, activation, backend))


def _run(op: str, impl, args: tuple) -> Tensor:
    """Plain eager calls run `impl` directly (inside a `mlpfuse::<op>` span under the profiler); anything a graph
    records goes through the registered op."""
    if not plain_eager(args[0]):
        return getattr(torch.ops.mlpfuse, op)(*args)
    if profiling():
        with op_span(f"mlpfuse::{op}"):
            return impl(*args)
    return impl(*args)
