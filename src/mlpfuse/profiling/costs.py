"""What a kernel must move and compute, from the op that launched it and the op's recorded inputs (record_shapes):
the roofline of one call, for the module view (profiling/modules.py).

    cost(op, dims, dtypes) -> Cost(flops, bytes, kind) or None

Counted as the fewest bytes the op must read and write (each input once, the output once) and its arithmetic:
    GEMM       mm [M,K]·[K,N], addmm (+ bias), bmm / baddbmm [B,M,K]·[B,K,N]: 2·M·K·N (·B) FLOPs;
               bytes: the inputs and the output (the first operand's dtype)
    attention  flash / memory-efficient / cuDNN SDPA, q [B,H,Lq,D], k [B,Hk,Lk,D], v [B,Hk,Lk,Dv]:
               2·B·H·Lq·Lk·(D + Dv) FLOPs (no causal discount: the flag is not recorded); bytes q, k, v and the output
    elementwise unary and binary ops (in place too), copy_: the inputs and the broadcast output, one FLOP an element;
               fill_ / zero_: the output alone
    reduction  mean / sum / amax / ...: the input (the output is smaller by the reduced dims: left out); softmax:
               the input and an output of its size
    norm       layer_norm / rms_norm: x read and written, the weight (and bias) read
Anything else (an op not listed, a list input, a dtype not known): None — the kernel is timed, not costed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

ELEMENT_BYTES = {
    "c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
    "long int": 8, "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
}

GEMM, ATTENTION, ELEMENTWISE, REDUCTION, NORM = "gemm", "attention", "elementwise", "reduction", "norm"
MEMORY_KINDS = (ELEMENTWISE, REDUCTION, NORM)  # the small, memory-bound kernels a fusion removes passes of

_UNARY = {"silu", "gelu", "relu", "sigmoid", "tanh", "neg", "rsqrt", "sqrt", "exp", "log", "abs", "reciprocal", "sin",
          "cos", "erf", "clone"}
_BINARY = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "copy"}
_FILL = {"fill", "zero"}  # writes only
_REDUCE = {"mean", "sum", "amax", "amin", "max", "min", "var", "norm", "linalg_vector_norm"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}  # a reduction that writes its input's size
_ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
              "_cudnn_attention_forward"}


class Cost(NamedTuple):
    flops: float
    bytes: float
    kind: str


def _numel(dims) -> int:
    return math.prod(dims)


def _tensors(dims, dtypes):
    """(numel, element bytes) of each tensor input whose dtype is known (scalars and non-tensors left out)."""
    return [(_numel(d), ELEMENT_BYTES[t]) for d, t in zip(dims, dtypes) if t in ELEMENT_BYTES]


def _broadcast(shapes) -> int | None:
    """numel of the broadcast of `shapes`, or None when they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(1, rank + 1):
        sizes = {s[-i] for s in shapes if len(s) >= i} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return _numel(out)


def _base(op: str) -> str:
    """'aten::add_' -> 'add', 'aten::silu' -> 'silu', 'aten::_to_copy' -> '_to_copy'."""
    name = op.split("::", 1)[-1].split(".", 1)[0]
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _gemm(dims, dtypes, batched: bool, bias_first: bool) -> Cost | None:
    a, b = (1, 2) if bias_first else (0, 1)
    if len(dims) <= b or dtypes[a] not in ELEMENT_BYTES or dtypes[b] not in ELEMENT_BYTES:
        return None
    x, w = dims[a], dims[b]
    rank = 3 if batched else 2
    if len(x) != rank or len(w) != rank or x[-1] != w[-2] or (batched and x[0] != w[0]):
        return None
    batch = x[0] if batched else 1
    m, k, n = x[-2], x[-1], w[-1]
    s = ELEMENT_BYTES[dtypes[a]]
    moved = batch * (m * k * s + k * n * ELEMENT_BYTES[dtypes[b]] + m * n * s)
    if bias_first and dtypes[0] in ELEMENT_BYTES:
        moved += _numel(dims[0]) * ELEMENT_BYTES[dtypes[0]]
    return Cost(2.0 * batch * m * k * n, float(moved), GEMM)


def _attention(dims, dtypes) -> Cost | None:
    if len(dims) < 3 or any(t not in ELEMENT_BYTES for t in dtypes[:3]):
        return None
    q, k, v = dims[:3]
    if len(q) != 4 or len(k) != 4 or len(v) != 4 or q[0] != k[0] or q[3] != k[3] or k[2] != v[2]:
        return None
    b, h, lq, d = q
    lk, dv = k[2], v[3]
    s = ELEMENT_BYTES[dtypes[0]]
    moved = (_numel(q) + _numel(k) + _numel(v) + b * h * lq * dv) * s
    return Cost(2.0 * b * h * lq * lk * (d + dv), float(moved), ATTENTION)


def cost(op: str, dims, dtypes) -> Cost | None:
    """The Cost of one call of `op` with these recorded inputs (trace.op_inputs' form), or None (see the module
    doc)."""
    if not op or dims is None or dtypes is None:
        return None
    base = _base(op)
    if base == "mm":
        return _gemm(dims, dtypes, False, False)
    if base == "addmm":
        return _gemm(dims, dtypes, False, True)
    if base == "bmm":
        return _gemm(dims, dtypes, True, False)
    if base == "baddbmm":
        return _gemm(dims, dtypes, True, True)
    if base in _ATTENTION:
        return _attention(dims, dtypes)
    tensors = _tensors(dims, dtypes)
    if not tensors:
        return None
    if base in _UNARY or base in _BINARY:
        shapes = [d for d, t in zip(dims, dtypes) if t in ELEMENT_BYTES]
        out = _broadcast(shapes)
        if out is None:
            return None
        if base == "copy":  # copy_(dst, src): dst is the output, read only where it is written
            return Cost(0.0, float(sum(n * s for n, s in tensors)), ELEMENTWISE)
        out_bytes = out * max(tensors, key=lambda t: t[0])[1]
        return Cost(float(out), float(sum(n * s for n, s in tensors) + out_bytes), ELEMENTWISE)
    if base in _FILL:
        n, s = tensors[0]
        return Cost(0.0, float(n * s), ELEMENTWISE)
    if base in _REDUCE or base in _SOFTMAX:
        n, s = tensors[0]
        return Cost(float(n), float(n * s * (2 if base in _SOFTMAX else 1)), REDUCTION)
    if base in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
        n, s = tensors[0]
        return Cost(5.0 * n, float(2 * n * s + sum(m * t for m, t in tensors[1:])), NORM)
    return None


def roofline(c: Cost, seconds: float, peaks: dict | None, dtype_key: str | None) -> dict:
    """Achieved rates of one costed call that took `seconds` on the GPU, and their fractions of the card's measured
    peaks (`peaks`: {'copy_gbps': GB/s, 'gemm_tflops': {dtype: TFLOP/s}}, as the bench measures them; None: no
    fractions)."""
    gbps = c.bytes / seconds / 1e9 if seconds > 0 else None
    tflops = c.flops / seconds / 1e12 if seconds > 0 else None
    out = {"gbps": gbps, "tflops": tflops, "of_bandwidth": None, "of_compute": None}
    if peaks and gbps is not None:
        bw = peaks.get("copy_gbps")
        out["of_bandwidth"] = gbps / bw if bw else None
        peak = (peaks.get("gemm_tflops") or {}).get(dtype_key or "")
        out["of_compute"] = tflops / peak if peak and c.kind in (GEMM, ATTENTION) else None
    return out


DTYPE_KEYS = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32"}  # the bench's names for peaks
