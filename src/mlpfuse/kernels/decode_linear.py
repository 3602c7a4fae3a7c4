"""Projections for decode-sized batches (M <= MAX_M): one to three weights that read the same input, streamed once
in one launch, the input optionally read through an RMSNorm and the output optionally added to a residual.

    out_i = [norm](x) · W_iᵀ + b_i [+ residual]        x [M, K], W_i [N_i, K], out_i [M, N_i]

A decoder layer's attention reads its input through three projections (q, k, v) after an RMSNorm, and at decode
sizes they are bound by streaming their weights: eager PyTorch runs the norm's six to eight small kernels and three
GEMMs whose grids are shaped for one weight each (the k and v ones leave most SMs idle). Here every program owns
BLOCK_N rows of one of the weights (the programs of W_0 first, then W_1's, then W_2's: no concatenated copy of the
weights is made) and runs the whole K loop, so nothing is reduced across programs and each output element is one
fp32 sum rounded once. The weights are the MMA's left operand ("swap AB"): M is the MMA's narrow side.

With NORM (kernels._common.NORM_*), the K loop feeds x·w (or x·(1 + w)) to the MMA, sums x² over the same loop and
scales the products by r = 1/sqrt(mean(x²) + eps) at the end: the norm costs no pass of its own (x is tiny and
every program re-reads it from L2). As the gated decode kernel does, this rounds x·w to x's dtype where the norm
module rounds x·r and then the product: the two differ by a rounding.

With a residual (one weight only: an attention's output projection), out = residual + x·Wᵀ (+ b), one rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels._common import pdl_release, pdl_wait, prefetch_l2

MAX_M = 16  # the most rows these kernels take; past it the projections' own GEMMs are the faster form
MAX_PARTS = 3
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Programmatic dependent launch as the gated decode kernels use it (kernels.decode_mlp.PDL): each program asks L2 for
# the first lines of its weight rows, then waits for the kernel before it. MLPFUSE_DECODE_PDL=0 turns it off.
PDL = os.environ.get("MLPFUSE_DECODE_PDL", "1") != "0"
PREFETCH_LINES = 2


# The sizes and output strides that pick a program's weight are never specialized (a value of 1 would make one
# branch's value a constant and the other's a tensor); the weights share one row stride, specialized as usual.
@triton.jit(do_not_specialize=["M", "N0", "N1", "N2", "s_o0", "s_o1", "s_o2"])
def mlpfuse_decode_linear_kernel(
    x, w0, w1, w2, b0, b1, b2, o0, o1, o2, nw, res, eps,
    M, K, N0, N1, N2, s_xm, s_w, s_o0, s_o1, s_o2, s_rm,
    PARTS: tl.constexpr, HAS_B: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, I64: tl.constexpr, PDL: tl.constexpr,
    PF_LINES: tl.constexpr, PF_STEP: tl.constexpr,
):
    pid = tl.program_id(0)
    # Which weight this program streams: W_0's programs first, then W_1's, then W_2's.
    t0 = tl.cdiv(N0, BLOCK_N)
    w, b, o, n, s_o, first = w0, b0, o0, N0, s_o0, pid * BLOCK_N
    if PARTS > 1:
        t1 = tl.cdiv(N1, BLOCK_N)
        if pid >= t0:
            w, b, o, n, s_o, first = w1, b1, o1, N1, s_o1, (pid - t0) * BLOCK_N
        if PARTS > 2:
            if pid >= t0 + t1:
                w, b, o, n, s_o, first = w2, b2, o2, N2, s_o2, (pid - t0 - t1) * BLOCK_N
    offs_n = first + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if I64:  # a weight or x reaching past 2**31 elements: index math in 64 bits
        offs_n = offs_n.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    mask_n = offs_n < n
    mask_m = offs_m < M
    if PDL:  # the first lines of this program's weight rows, then wait for the kernel that wrote x
        pf = tl.arange(0, PF_LINES) * PF_STEP
        prefetch_l2(w + offs_n[:, None] * s_w + pf[None, :], mask_n[:, None] & (pf[None, :] < K), w)
        pdl_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    # x² summed elementwise over the loop and reduced once after it: a reduction across the K step in every step
    # (threads exchanging partial sums) made the norm cost more than the weight stream at these row counts.
    sq = tl.zeros((BLOCK_K, BLOCK_M), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        wt = tl.load(w + offs_n[:, None] * s_w + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        xt = tl.load(x + offs_m[None, :] * s_xm + k[:, None], mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        if NORM != 0:
            g = tl.load(nw + k, mask=mask_k, other=0.0).to(tl.float32)[:, None]
            xf = xt.to(tl.float32)
            sq += xf * xf
            if NORM == 1:  # weight · x (Llama's RMSNorm)
                xt = (xf * g).to(xt.dtype)
            else:  # x · (1 + weight) (Gemma's)
                xt = (xf * (1.0 + g)).to(xt.dtype)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PREC)
    if PDL:
        pdl_release()
    if NORM != 0:
        acc = acc * (1.0 / tl.sqrt_rn(tl.sum(sq, axis=0) / K + eps))[None, :]
    if HAS_B:
        acc += tl.load(b + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out_mask = mask_n[:, None] & mask_m[None, :]
    if HAS_RES:
        acc += tl.load(res + offs_m[None, :] * s_rm + offs_n[:, None], mask=out_mask, other=0.0).to(tl.float32)
    tl.store(o + offs_m[None, :] * s_o + offs_n[:, None], acc.to(o.dtype.element_ty), mask=out_mask)


_launch = C.Launcher(mlpfuse_decode_linear_kernel)


def config(n_total: int, k: int, elem_size: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): 64 rows per program while that makes programs for at least 70 % of
    the SMs (all weights' rows together), else 32 or 16; K steps of 512 bytes per row, 5 stages. Measured on an H200
    (`benchmarks/decode_linear_probe.py --configs`, CUDA-graph replays of 8 weight sets, 1 and 16 rows): Llama-3-8B's
    q, k, v (6144 rows × 4096) 14.5–14.8 µs at (64, 256, 4, 5) against 26.1–29.2 for cuBLAS's three GEMMs, with the
    norm prologue 15.9–16.6 (at 32 rows per program it took 36: keep 64 there); the output projection (4096 × 4096)
    11.1–11.4 µs at (32, 256, 4, 5) against cuBLAS's 13.2–13.5."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n_total, block_n) < 0.7 * sms:
        block_n //= 2
    block_k = max(32, min(512 // elem_size, triton.next_power_of_2(max(k, 1))))
    if C.INTERPRET:
        block_n, block_k = 16, min(block_k, 32)
    return block_n, block_k, 4, 5


def decode_linear(x: torch.Tensor, weights, biases=None, *, norm_weight: torch.Tensor | None = None,
                  norm_eps: float = 0.0, norm_kind: int = C.NORM_NONE, residual: torch.Tensor | None = None,
                  allow_tf32: bool = True, _config: tuple | None = None) -> list[torch.Tensor]:
    """[norm](x)·W_iᵀ + b_i for each weight (module docstring), x [M <= MAX_M, K]; weights [N_i, K] with unit inner
    stride and one row stride among them, biases [N_i] or None, all in x's dtype and on its device; `residual`
    [M, N_0] (one weight only) is added before the output's rounding. Returns one [M, N_i] tensor per weight, in x's
    dtype. A layout checked once (CUDA) keeps its launch: later calls allocate their outputs and launch."""
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    plan_key = _plan_key(x, weights, biases, norm_weight, norm_eps, norm_kind, residual, allow_tf32, _config)
    plan = _plans.get(plan_key) if plan_key is not None else None
    if plan is not None:  # this layout checked and launched before: its output allocations and the launch
        return plan.run(x, weights, biases, norm_weight, residual)
    _check(x, weights, biases, residual)
    C.check_norm(x, norm_weight, norm_eps, norm_kind, same_dtype=True)
    m, k = x.shape
    ns = [w.shape[0] for w in weights]
    outs = [torch.empty(m, n, device=x.device, dtype=x.dtype) for n in ns]
    if m == 0 or sum(ns) == 0:
        return outs
    if k == 0:  # nothing to sum: the biases (and the residual)
        for o, b in zip(outs, biases):
            o.copy_(b.expand_as(o) if b is not None else torch.zeros_like(o))
        if residual is not None:
            outs[0] += residual
        return outs
    parts = len(weights)
    block_n, block_k, warps, stages = _config or config(sum(ns), k, x.element_size(), C.num_sms(x.device))
    block_m = max(16, triton.next_power_of_2(m))
    pad = [weights[0]] * (MAX_PARTS - parts)
    ws = weights + pad
    bs = [b if b is not None else x for b in biases] + [x] * (MAX_PARTS - parts)
    os_ = outs + [outs[0]] * (MAX_PARTS - parts)
    n_pad = ns + [0] * (MAX_PARTS - parts)
    res = outs[0] if residual is None else residual
    nw = x if norm_weight is None else norm_weight
    pdl = PDL and C.pdl_ok(x)
    i64 = C.needs_i64(x, res, *weights, *outs)
    has_b = biases[0] is not None
    consts = (parts, has_b, norm_kind, residual is not None, C.dot_precision(x.dtype, allow_tf32), block_n, block_m,
              block_k, i64, pdl, PREFETCH_LINES, 128 // x.element_size())
    s_w = _row_stride(weights)
    ints = (m, k, *n_pad, x.stride(0), s_w, *(o.stride(0) for o in os_), res.stride(0))
    key = (consts, x.dtype, k, x.stride(0), s_w, res.stride(0), tuple(C.align16(t) for t in (x, *ws, *bs, *os_, nw, res)),
           warps, stages)
    grid = (sum(triton.cdiv(n, block_n) for n in ns),)
    _launch(key, grid, (x, *ws, *bs, *os_, nw, res, float(norm_eps), *ints), consts, num_warps=warps,
            num_stages=stages, launch_pdl=pdl)
    if plan_key is not None:
        C.keep_plan(_plans, plan_key, _Plan(key, grid, consts, ints, warps, stages, pdl, ns, float(norm_eps)))
    return outs


_plans: dict = {}  # a call's layout (x's, the weights' addresses, the flags) -> _Plan


def _plan_key(x, weights, biases, norm_weight, norm_eps, norm_kind, residual, allow_tf32, cfg):
    """What a checked call's launch depends on (None for a call with its own tiles, or not on a plain tensor): x's
    shape, strides, dtype, device and alignment, the weights', biases' and norm weight's addresses and layouts, the
    norm's kind and eps, the residual's layout. Outputs are fresh allocations (aligned, contiguous). Kept under
    Triton's interpreter too, so that the CPU tests run the plans' path."""
    if cfg is not None or type(x) is not torch.Tensor:
        return None
    try:
        return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15,
                *[(w.data_ptr(), w.shape, w.stride(), w.dtype, w.get_device()) for w in weights],
                *[None if b is None else (b.data_ptr(), b.shape, b.stride(), b.dtype, b.get_device()) for b in biases],
                None if norm_weight is None else (norm_weight.data_ptr(), norm_weight.shape, norm_weight.stride(),
                                                  norm_weight.dtype, norm_weight.get_device()),
                norm_eps, norm_kind, None if residual is None else (residual.shape, residual.stride(), residual.dtype,
                                                                     residual.get_device(), residual.data_ptr() & 15),
                allow_tf32, PDL)
    except (AttributeError, TypeError):  # not tensors: the full path names what is wrong
        return None


class _Plan:
    """A checked call's launch: everything but the tensors' addresses and the fresh outputs."""

    __slots__ = ("key", "grid", "consts", "ints", "warps", "stages", "pdl", "ns", "eps")

    def __init__(self, key, grid, consts, ints, warps, stages, pdl, ns, eps):
        self.key, self.grid, self.consts, self.ints = key, grid, consts, ints
        self.warps, self.stages, self.pdl, self.ns, self.eps = warps, stages, pdl, ns, eps

    def run(self, x, weights, biases, norm_weight, residual) -> list[torch.Tensor]:
        m = x.shape[0]
        outs = [torch.empty(m, n, device=x.device, dtype=x.dtype) for n in self.ns]
        pad = MAX_PARTS - len(weights)
        ws = weights + [weights[0]] * pad
        bs = [x if b is None else b for b in biases] + [x] * pad
        os_ = outs + [outs[0]] * pad
        _launch(self.key, self.grid, (x, *ws, *bs, *os_, x if norm_weight is None else norm_weight,
                                      outs[0] if residual is None else residual, self.eps, *self.ints), self.consts,
                num_warps=self.warps, num_stages=self.stages, launch_pdl=self.pdl)
        return outs


def _row_stride(weights) -> int:
    """The weights' one row stride (a one-row weight's is never read)."""
    return next((w.stride(0) for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] > 1),
                1)


def _check(x, weights, biases, residual) -> None:
    """One InputError line naming what the kernel cannot take."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(1) != 1 and x.shape[1] > 1:
        raise InputError(f"x: expected a 2-D tensor with unit inner stride, got {C._describe(x)}")
    if x.dtype not in _DTYPES:
        raise InputError(f"x: expected one of {', '.join(str(d) for d in _DTYPES)}, got {x.dtype}")
    if x.shape[0] > MAX_M:
        raise InputError(f"x: the decode projections take at most {MAX_M} rows, got {x.shape[0]}")
    if not 1 <= len(weights) <= MAX_PARTS or len(biases) != len(weights):
        raise InputError(f"weights: expected 1 to {MAX_PARTS} weights and a bias (or None) for each, got "
                         f"{len(weights)} and {len(biases)}")
    if len({b is None for b in biases}) > 1:
        raise InputError("biases: expected a bias for every weight or for none")
    k = x.shape[1]
    s_w = _row_stride(weights)
    for i, (w, b) in enumerate(zip(weights, biases)):
        if (not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype
                or w.device != x.device or (w.stride(1) != 1 and k > 1)
                or w.stride(0) != s_w and w.shape[0] > 1):
            raise InputError(f"weights[{i}]: expected a [N, {k}] {x.dtype} tensor with unit inner stride and the "
                             f"other weights' row stride on {x.device}, got {C._describe(w)} strides {w.stride()}"
                             if isinstance(w, torch.Tensor) else f"weights[{i}]: expected a tensor, got "
                             f"{type(w).__name__}")
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)
                              or b.dtype != x.dtype or b.device != x.device or b.stride(0) != 1):
            raise InputError(f"biases[{i}]: expected a contiguous [{w.shape[0]}] {x.dtype} tensor on {x.device}, "
                             f"got {C._describe(b)}")
    if residual is not None:
        if len(weights) != 1:
            raise InputError("residual: taken with one weight only")
        C.check_residual(residual, (x.shape[0], weights[0].shape[0]), x)
