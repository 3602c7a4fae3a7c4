"""The gated MLP for decode-sized batches (M <= DECODE_MAX_M): weights streamed once, h never leaves the chip
(or, in the split mode, crosses HBM once as a [M, H] vector of a few hundred KB).

    y = down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd        x [M, D], Wg/Wu [H, D], Wd [D, H], y [M, D]

At small M the MLP is bound by streaming its 3·H·D weights; launches, memsets and intermediates are what eager
PyTorch loses time on. `mlpfuse_decode_mlp_kernel` gives each program a slice of BLOCK_H hidden units:

  phase 1  gᵀ, uᵀ [BLOCK_H, M] = Wg/Wu[slice, :] · xᵀ   (K-loop over D; x is tiny and stays in L2)
           hᵀ = act(gᵀ + bg) · (uᵀ + bu) in fp32 registers, rounded once to the input dtype
  phase 2  its partial of y:  yᵀ_p [D, M] = Wd[:, slice] · hᵀ   (loop over D in BLOCK_O row chunks)

With NORM (a patched model's RMSNorm in front of the MLP, ops.norm), phase 1 reads x·w_norm instead of x, sums x²
in the same loop and scales g and u by 1/sqrt(mean(x²) + eps) before the activation: the norm costs no pass of its
own. The weights are the MMA's left operand ("swap AB"): the tiny M becomes the MMA's N, so tiles stay full at M = 1.
Each weight element is read by exactly one program. How the partials become y (MODE):

  0 one launch: fp32 `red.add` of the partials into a cached fp32 accumulator; then every thread fences its own
      atomics, the CTA meets at a barrier, and one acq_rel ticket per program counts arrivals. The last program
      to arrive casts the accumulator (+ bd) into y and re-zeroes it for the next call. One launch, so the
      cheapest on the host; its cost is that tail, run by one SM after all others are done. Not bit-reproducible.
  3 atomics + cast launch: the same atomics; `mlpfuse_decode_reduce_kernel` adds bd, casts, and re-zeroes the
      accumulator with many programs. Two launches.
  4 split: phase 1 only, h [M, H] stored in the input dtype; `mlpfuse_decode_down_kernel` owns output columns and
      runs the whole K = H loop, so nothing is reduced across programs. Two launches, deterministic. Its cost
      is that every down program re-reads h from L2, which beats fp32 atomics once M·D partials get large.
  2 deterministic partials: [P, M, D] fp32 partials, summed in a fixed order by the reduce kernel.

`_POLICY` picks the mode per layer size class and M bucket from measurements (modes 0, 3 or 4 without
`deterministic`, mode 4 with it); `_CONFIGS` holds the tiles. Scratch buffers are cached per (device, stream):
two streams running this kernel at once never share them.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
import triton
import triton.language as tl

from mlpfuse import activations, fp8
from mlpfuse.activations import act_fwd
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels._common import FP16_UNDO, fp16_activations, fp16_weights, pdl_release, pdl_wait, prefetch_l2

# Largest M for which `auto` dispatch should use these kernels. Measured on an H200 by benchmarks/bench_decode.py,
# retired since (benchmarks/README.md; benchmarks/results/decode-h200.md): up to 64 rows they beat eager, torch.compile
# and Liger in wall time per call on 768×3072 and 4096×14336 (at 64×4096×14336 by 2 % only, and inside a CUDA graph they
# lose 4 % there); at 96 and 128 rows they lose on 4096×14336. The kernels themselves accept up to MAX_M rows.
DECODE_MAX_M = 64
MAX_M = 128


_INTERPRET = C.INTERPRET
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# RMSNorm prologues (the kernel's NORM, _common.NORM_*): the kernel rounds x·weight (x·(1 + weight)) to x's dtype
# for the MMA and applies r = 1/sqrt(mean(x²) + eps) to the fp32 products; the modules round x·r and then the
# product: the two differ by a rounding.
NORM_NONE, NORM_WEIGHT_AFTER, NORM_ONE_PLUS = C.NORM_NONE, C.NORM_WEIGHT_AFTER, C.NORM_ONE_PLUS


@triton.jit
def _finalize(acc_ptr, out_ptr, bd_ptr, res_ptr, M, D, stride_om, stride_od, stride_rm, HAS_BD: tl.constexpr,
              HAS_RES: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: y = acc (+ bd) (+ residual) cast to the output dtype, over the flattened [M, D], then acc
    re-zeroed for the next call. Wide steps (BLOCK_T elements, many loads in flight per thread): this runs on one
    SM after all the others are done, so its few dependent steps are the kernel's tail."""
    offs = tl.arange(0, BLOCK_T)
    total = M * D
    for start in range(0, total, BLOCK_T):
        idx = start + offs
        mask = idx < total
        # .cg: the partials were added in L2 by other programs; never trust a stale L1 line.
        v = tl.load(acc_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
        row = idx // D
        col = idx - row * D
        if HAS_BD:
            v += tl.load(bd_ptr + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            v += tl.load(res_ptr + row * stride_rm + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + col * stride_od, v.to(out_ptr.dtype.element_ty), mask=mask)
        # Every thread's reads before anyone's zeroes: the compiler may give the load and the store different
        # thread layouts, and nothing else orders one thread's global store after another thread's load.
        tl.debug_barrier()
        tl.store(acc_ptr + idx, tl.zeros((BLOCK_T,), tl.float32), mask=mask)


@triton.jit
def _fence_gpu(like):
    """fence.acq_rel.gpu in every thread. The CTA barrier orders threads only within the CTA, and a fence orders
    only its own thread's accesses: each thread must fence its own fire-and-forget atomics before the barrier
    that precedes the ticket (the classic threadfence-reduction pattern)."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [like], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit(do_not_specialize=["M"])
def mlpfuse_decode_mlp_kernel(
    x_ptr, wg_ptr, wu_ptr, wd_ptr, bg_ptr, bu_ptr, bd_ptr, out_ptr, acc_ptr, part_ptr, cnt_ptr, h_ptr, nw_ptr, eps,
    x_shift, sg_ptr, su_ptr, sd_ptr, res_ptr,
    M, D, H,
    stride_xm, stride_xd, stride_gh, stride_gd, stride_uh, stride_ud, stride_dd, stride_dh, stride_om, stride_od,
    stride_sg, stride_su, stride_sd, stride_rm,
    ACT: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, HAS_BD: tl.constexpr, MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr, FENCE: tl.constexpr, I64: tl.constexpr, NORM: tl.constexpr,
    W8: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    # ROWS (≤ BLOCK_H, a multiple of 16) hidden units per program: fewer than the tile where BLOCK_H-row slices would
    # leave SMs idle (BALANCED_ROWS); the tile's last BLOCK_H - ROWS rows are masked, never read.
    offs_h = pid * ROWS + tl.arange(0, BLOCK_H)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_D)
    if I64:  # a weight or x reaching past 2**31 elements: index math in 64 bits
        offs_h = offs_h.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    mask_h = (offs_h < H) & (tl.arange(0, BLOCK_H) < ROWS)
    mask_m = offs_m < M
    if PDL:
        # The first PF_LINES 128-byte lines of each of this program's gate and up rows, then the wait: the weight
        # stream starts while the kernel before this one (which wrote x) finishes.
        pf = tl.arange(0, PF_LINES) * PF_STEP
        pf_mask = mask_h[:, None] & (pf[None, :] < D)
        prefetch_l2(wg_ptr + offs_h[:, None] * stride_gh + pf[None, :] * stride_gd, pf_mask, wg_ptr)
        prefetch_l2(wu_ptr + offs_h[:, None] * stride_uh + pf[None, :] * stride_ud, pf_mask, wu_ptr)
        pdl_wait()

    # RMSNorm prologue (NORM): the row scale r = 1/sqrt(mean(x²) + eps) is one number per row, so it factors out of
    # the dot products: each program feeds x·w (or x·(1 + w)) to the MMA, sums x² over the same K loop, and scales
    # its g and u by r at the end. No pass over x before the weight stream starts.
    sq = tl.zeros((BLOCK_M,), tl.float32)

    # Phase 1: this program's slice of g and u, transposed ([BLOCK_H, BLOCK_M]).
    acc_g = tl.zeros((BLOCK_H, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_H, BLOCK_M), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dk = d0 + offs_k
        mask_k = dk < D
        w_mask = mask_h[:, None] & mask_k[None, :]
        wg = tl.load(wg_ptr + offs_h[:, None] * stride_gh + dk[None, :] * stride_gd, mask=w_mask, other=0.0)
        wu = tl.load(wu_ptr + offs_h[:, None] * stride_uh + dk[None, :] * stride_ud, mask=w_mask, other=0.0)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + dk[:, None] * stride_xd,
                     mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        if NORM != 0:
            nw = tl.load(nw_ptr + dk, mask=mask_k, other=0.0).to(tl.float32)[:, None]
            xf = xt.to(tl.float32)
            sq += tl.sum(xf * xf, axis=0)
            if NORM == 1:  # weight · x (Llama's RMSNorm)
                xt = (xf * nw).to(xt.dtype)
            else:  # x · (1 + weight) (Gemma's)
                xt = (xf * (1.0 + nw)).to(xt.dtype)
        if W8:  # e4m3 weights, BLOCK_H and BLOCK_D dividing 128: one scale per tile
            sg = tl.load(sg_ptr + (pid * ROWS // 128) * stride_sg + d0 // 128)
            su = tl.load(su_ptr + (pid * ROWS // 128) * stride_su + d0 // 128)
            if xt.dtype == tl.float32:  # widened exactly to fp32
                acc_g += tl.dot(wg.to(xt.dtype), xt, input_precision=DOT_PRECISION) * sg
                acc_u += tl.dot(wu.to(xt.dtype), xt, input_precision=DOT_PRECISION) * su
            else:  # fp16 MMAs, as kernels.fp8_gemm's weight-only kernel runs them (_common.fp16_weights)
                xk = fp16_activations(xt, x_shift)
                acc_g += tl.dot(fp16_weights(wg), xk) * (sg * FP16_UNDO)
                acc_u += tl.dot(fp16_weights(wu), xk) * (su * FP16_UNDO)
        else:
            acc_g = tl.dot(wg, xt, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(wu, xt, acc_u, input_precision=DOT_PRECISION)
    if PDL:
        pdl_release()
    if NORM != 0:
        rstd = 1.0 / tl.sqrt_rn(sq / D + eps)
        acc_g = acc_g * rstd[None, :]
        acc_u = acc_u * rstd[None, :]
    if HAS_BG:
        acc_g += tl.load(bg_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[:, None]
    if HAS_BU:
        acc_u += tl.load(bu_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[:, None]
    # Rows past H saw zero weights, but 0·x is NaN where x holds an Inf: zero them, or phase 2 would spread the NaN
    # into every output through the (zero) weight columns past H.
    h_t = tl.where(mask_h[:, None], act_fwd(acc_g, ACT) * acc_u, 0.0).to(out_ptr.dtype.element_ty)
    if MODE == 4:  # split: hand h [M, H] to mlpfuse_decode_down_kernel
        tl.store(h_ptr + offs_m[None, :] * H + offs_h[:, None], h_t, mask=mask_h[:, None] & mask_m[None, :])
    else:
        # Phase 2: partial y for this slice, D in chunks. Programs start at different chunks so that their
        # atomics do not all hit the same L2 lines at once.
        n_chunks = tl.cdiv(D, BLOCK_O)
        if W8 and h_t.dtype != tl.float32:
            h_k = fp16_activations(h_t, x_shift)
        for i in range(0, n_chunks):
            c = (i + pid) % n_chunks
            offs_o = c * BLOCK_O + tl.arange(0, BLOCK_O)
            if I64:
                offs_o = offs_o.to(tl.int64)
            mask_o = offs_o < D
            wd = tl.load(wd_ptr + offs_o[:, None] * stride_dd + offs_h[None, :] * stride_dh,
                         mask=mask_o[:, None] & mask_h[None, :], other=0.0)
            if W8:  # BLOCK_O divides 128 too
                sd = tl.load(sd_ptr + (c * BLOCK_O // 128) * stride_sd + pid * ROWS // 128)
                if h_t.dtype == tl.float32:
                    y_t = tl.dot(wd.to(h_t.dtype), h_t, input_precision=DOT_PRECISION) * sd
                else:
                    y_t = tl.dot(fp16_weights(wd), h_k) * (sd * FP16_UNDO)
            else:
                y_t = tl.dot(wd, h_t, input_precision=DOT_PRECISION)  # [BLOCK_O, BLOCK_M]
            y_off = offs_m[None, :] * D + offs_o[:, None]
            y_mask = mask_o[:, None] & mask_m[None, :]
            if MODE == 2:
                tl.store(part_ptr + pid.to(y_off.dtype) * M * D + y_off, y_t, mask=y_mask)
            else:
                tl.atomic_add(acc_ptr + y_off, y_t, mask=y_mask, sem="relaxed")

        if MODE == 0:
            # One launch: each thread fences its own atomics, the barrier gathers the CTA, then one acq_rel ticket
            # publishes them GPU-wide and, for the last program, acquires everyone else's; the last program casts.
            # (The interpreter runs programs one after another and has no inline asm: FENCE is off there.)
            if FENCE:
                _fence_gpu(offs_m)
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
            if ticket == n_progs - 1:
                if FENCE:
                    _fence_gpu(offs_m)
                _finalize(acc_ptr, out_ptr, bd_ptr, res_ptr, M, D, stride_om, stride_od, stride_rm, HAS_BD, HAS_RES,
                          BLOCK_F)
                tl.store(cnt_ptr, 0)  # ready for the next launch: the accumulator is all zeros again


@triton.jit(do_not_specialize=["M", "n_parts"])
def mlpfuse_decode_reduce_kernel(part_ptr, out_ptr, bd_ptr, res_ptr, M, D, n_parts, stride_om, stride_od, stride_rm,
                                 HAS_BD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr,
                                 ZERO_SRC: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """Second launch: y = sum over programs of the [M, D] partials (+ bd) (+ residual). Each program owns BLOCK_F
    consecutive elements of the flattened [M, D] and adds BLOCK_P partials per step: many programs and few
    dependent steps, since the partials sit in L2 and the cost is latency. The order of the sum depends only on
    the compiled kernel, so results are bit-identical run to run."""
    offs = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = offs < M * D
    if PDL:
        pdl_wait()
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_F,), tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        p = p0 + offs_p
        tile = tl.load(part_ptr + p[:, None] * M * D + offs[None, :], mask=(p[:, None] < n_parts) & mask[None, :],
                       other=0.0, cache_modifier=".cg")
        acc += tl.sum(tile, axis=0)
    offs_o = offs % D
    offs_r = offs // D
    if HAS_BD:
        acc += tl.load(bd_ptr + offs_o, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + offs_r * stride_rm + offs_o, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_r * stride_om + offs_o * stride_od, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if ZERO_SRC:  # mode 3: the source is the atomic accumulator, which must be left zeroed (n_parts == 1)
        tl.store(part_ptr + offs, tl.zeros((BLOCK_F,), tl.float32), mask=mask)


@triton.jit(do_not_specialize=["M"])
def mlpfuse_decode_down_kernel(h_ptr, wd_ptr, bd_ptr, out_ptr, res_ptr, M, D, H, stride_dd, stride_dh, stride_om,
                               stride_od, stride_rm, HAS_BD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                               I64: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
                               PF_LINES: tl.constexpr, PF_STEP: tl.constexpr):
    """Split mode, second launch: yᵀ[rows, M] = Wd[rows, :] · hᵀ (+ bd) (+ residual). Each program owns BLOCK_O
    output columns and the whole K = H loop, so nothing is reduced across programs; h (tiny) is re-read from L2."""
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if I64:  # w_down reaching past 2**31 elements: index math in 64 bits
        offs_o = offs_o.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
        offs_k = offs_k.to(tl.int64)
    mask_o = offs_o < D
    mask_m = offs_m < M
    if PDL:  # the first lines of this program's rows of Wd, then wait for h
        pf = tl.arange(0, PF_LINES) * PF_STEP
        prefetch_l2(wd_ptr + offs_o[:, None] * stride_dd + pf[None, :] * stride_dh,
                     mask_o[:, None] & (pf[None, :] < H), wd_ptr)
        pdl_wait()
    acc = tl.zeros((BLOCK_O, BLOCK_M), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < H
        wd = tl.load(wd_ptr + offs_o[:, None] * stride_dd + k[None, :] * stride_dh,
                     mask=mask_o[:, None] & mask_k[None, :], other=0.0)
        h_t = tl.load(h_ptr + offs_m[None, :] * H + k[:, None], mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        acc = tl.dot(wd, h_t, acc, input_precision=DOT_PRECISION)
    if PDL:
        pdl_release()
    if HAS_BD:
        acc += tl.load(bd_ptr + offs_o, mask=mask_o, other=0.0).to(tl.float32)[:, None]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_o[:, None], mask=mask_o[:, None] & mask_m[None, :],
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_o[:, None] * stride_od, acc.to(out_ptr.dtype.element_ty),
             mask=mask_o[:, None] & mask_m[None, :])


# ----------------------------------------------------------------------------------------------------------------
# Configs: (BLOCK_H, BLOCK_D, BLOCK_O, num_warps, num_stages), looked up from the layer's size class, the row
# bucket and the reduction family; no autotuning at call time.

def _bucket(m: int) -> int:
    return 4 if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def _block_m(bucket: int) -> int:
    return max(16, bucket)  # tl.dot needs N >= 16; rows past M are masked


# Measured on an H200 with the retired `benchmarks/bench_decode.py --sweep` (best GPU time per call in a 20-call CUDA
# graph; log in benchmarks/results/decode-h200.md). Size class "small": H·D <= 4M weights per matrix (e.g. 768×3072);
# "large": bigger (e.g. 4096×14336). Families: "atomic" (mode 3, and mode 0 where "one" has no entry), "one" (mode 0)
# and "det" (mode 2) give (BLOCK_H, BLOCK_D, BLOCK_O, num_warps, num_stages); "split" (mode 4) gives the gate/up
# kernel's (BLOCK_H, BLOCK_D, -, num_warps, num_stages) followed by the down kernel's (BLOCK_O, BLOCK_K, num_warps,
# num_stages).
_CONFIGS = {
    ("small", 4, "one"): (64, 128, 128, 8, 3),
    ("small", 16, "one"): (64, 128, 128, 8, 3),
    ("small", 32, "one"): (64, 128, 128, 8, 3),
    ("small", 64, "one"): (64, 128, 64, 4, 3),
    ("small", 128, "one"): (64, 128, 128, 8, 3),
    ("large", 4, "one"): (128, 128, 128, 8, 3),
    ("large", 4, "atomic"): (128, 128, 128, 8, 3),
    ("large", 4, "det"): (128, 128, 64, 8, 3),
    ("large", 4, "split"): (64, 64, 0, 4, 4, 32, 128, 4, 4),
    ("large", 16, "atomic"): (128, 128, 128, 8, 3),
    ("large", 16, "det"): (128, 128, 64, 8, 3),
    ("large", 16, "split"): (64, 64, 0, 4, 4, 16, 256, 4, 3),
    ("large", 32, "atomic"): (128, 128, 64, 4, 3),
    ("large", 32, "det"): (128, 128, 64, 8, 3),
    ("large", 32, "split"): (128, 64, 0, 8, 4, 32, 256, 8, 3),
    ("large", 64, "atomic"): (128, 64, 64, 4, 4),
    ("large", 64, "det"): (128, 64, 32, 8, 4),
    ("large", 64, "split"): (128, 64, 0, 8, 4, 32, 256, 8, 3),
    ("large", 128, "atomic"): (128, 64, 32, 8, 4),
    ("large", 128, "det"): (128, 64, 32, 8, 4),
    ("large", 128, "split"): (128, 64, 0, 8, 4, 64, 128, 8, 3),
    ("small", 4, "atomic"): (64, 128, 128, 8, 3),
    ("small", 4, "det"): (64, 128, 64, 8, 3),
    ("small", 4, "split"): (64, 64, 0, 4, 4, 16, 256, 4, 3),
    ("small", 16, "atomic"): (64, 128, 128, 8, 3),
    ("small", 16, "det"): (64, 128, 64, 8, 3),
    ("small", 16, "split"): (64, 64, 0, 4, 4, 16, 256, 4, 3),
    ("small", 32, "atomic"): (64, 128, 128, 8, 3),
    ("small", 32, "det"): (64, 128, 64, 8, 3),
    ("small", 32, "split"): (64, 64, 0, 4, 4, 16, 256, 4, 3),
    ("small", 64, "atomic"): (64, 64, 64, 4, 4),
    ("small", 64, "det"): (64, 128, 64, 8, 3),
    ("small", 64, "split"): (64, 64, 0, 4, 4, 16, 256, 4, 3),
    ("small", 128, "atomic"): (64, 128, 128, 8, 3),
    ("small", 128, "det"): (64, 128, 64, 8, 3),
    ("small", 128, "split"): (32, 128, 0, 4, 3, 64, 128, 8, 3),
}

# Which mode a call gets, per (size class, bucket, deterministic): the fastest mode by wall time per call (within 5 %:
# the lower GPU time), from the retired `bench_decode.py --sweep` on an H200. Small layers, wall / GPU µs per call by
# mode 0 | 3 | 4: 1 row 13.0/10.2 | 17.8/9.8 | 18.9/11.8; 16 rows 13.3/12.3 | 17.7/9.7 | 18.7/11.9; 32 rows 17.6/16.8 |
# 18.1/12.0 | 19.1/12.2; 64 rows 26.0/25.2 | 18.1/15.5 | 19.4/14.6 (the one launch saves ~5 µs of host time; its one-SM
# tail grows with M·D). 4096×14336 at 1 row: 87.8/86.3 | 87.9/85.9 | 100.2/96.6: level on the GPU, so large layers
# at 1–4 rows take the one launch, whose host time is a launch less (a decode step is host-bound in eager generate).
_POLICY = {
    **{(size, b, True): 4 for size in ("small", "large") for b in (4, 16, 32, 64, 128)},
    ("small", 4, False): 0, ("small", 16, False): 0, ("small", 32, False): 3, ("small", 64, False): 3,
    ("small", 128, False): 4,
    ("large", 4, False): 0, ("large", 16, False): 3, ("large", 32, False): 4, ("large", 64, False): 4,
    ("large", 128, False): 4,
}


def _size_class(d: int, h: int) -> str:
    return "small" if h * d <= 4 * 1024 * 1024 else "large"


def default_config(d: int, h: int, bucket: int, elem_size: int, mode: int) -> tuple:
    size = _size_class(d, h)
    if mode == 4:
        family = "split"
    elif mode == 2:
        family = "det"
    else:
        family = "one" if mode == 0 and (size, bucket, "one") in _CONFIGS else "atomic"
    cfg = list(_CONFIGS[(size, bucket, family)])
    if elem_size == 4:  # fp32 tiles are twice the bytes: halve the K steps to keep the pipelines in shared memory
        cfg[1] = max(32, cfg[1] // 2)
        if mode == 4:
            cfg[6] = max(32, cfg[6] // 2)
    # Tiny layers: never larger tiles than the (power-of-two padded) dimension.
    cfg[0] = max(16, min(cfg[0], triton.next_power_of_2(h)))
    cfg[1] = max(16, min(cfg[1], triton.next_power_of_2(d)))
    cfg[2] = max(16, min(cfg[2], triton.next_power_of_2(d)))
    if mode == 4:
        cfg[5] = max(16, min(cfg[5], triton.next_power_of_2(d)))
        cfg[6] = max(16, min(cfg[6], triton.next_power_of_2(h)))
    return tuple(cfg)


# ----------------------------------------------------------------------------------------------------------------
# Host side. Everything that can be derived once per (shape, dtype, layout) is cached: a call that hits the cache
# costs one key tuple, one output allocation and one direct launch of the compiled kernel.

# Programmatic dependent launch (Hopper and later, CUDA graphs included): each kernel is launched to start while
# the one before it drains, asks L2 for the first PREFETCH_LINES 128-byte lines of each of its weight rows, then
# waits for that kernel before it reads an activation or writes anything. Read when a plan is made (a plan made
# under one setting keeps it). Where the card lacks it: off; MLPFUSE_DECODE_PDL=0 turns it off everywhere.
PDL = os.environ.get("MLPFUSE_DECODE_PDL", "1") != "0"
# Fewer hidden units per program than the tile holds (`_rows`) where the tiles alone leave SMs idle: at 4096×14336
# the 128-row tiles make 112 programs on an H200's 132 SMs, the bf16 decode block streams at 84–88 % of copy, close to
# 112/132. Off until measured (the lab's `mlpfuse-balanced` variant turns it on for an A/B); read when a plan is made;
# e4m3 weights keep whole 128-row tiles (one scale row per tile). MLPFUSE_DECODE_BALANCED=1 turns it on.
BALANCED_ROWS = os.environ.get("MLPFUSE_DECODE_BALANCED", "0") == "1"
PREFETCH_LINES = 2
_FINAL_BLOCK = 64 if _INTERPRET else 4096  # elements per step of mode 0's tail (16 per thread at 8 warps)
_DIRECT_LAUNCH = not _INTERPRET  # benchmarks switch it off to measure Triton's own launch path
_scratch: dict = {}  # (device index, stream) -> [acc fp32, counter int32, partials fp32]
_spares: dict = {}  # device index -> a zeroed scratch for the next CUDA graph captured on a stream with none
_captured: list = []  # _scratch keys a capture in progress took from _spares
_graveyard: list = []  # outgrown buffers: a CUDA graph captured earlier may still point at them
_plans: dict = {}  # call key -> _Plan
_hbufs: dict = {}  # (device index, stream, dtype) -> h scratch of the split mode


class _Plan:
    __slots__ = ("n_progs", "cfg", "consts", "w_strides", "compiled", "reduce_consts", "reduce_compiled",
                 "down_grid", "down_consts", "down_compiled", "captured")

    def __init__(self, **kw):
        self.compiled = self.reduce_compiled = self.down_compiled = self.captured = None
        for k, v in kw.items():
            setattr(self, k, v)


def _pdl(x: torch.Tensor) -> bool:
    return PDL and C.pdl_ok(x)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _fresh_scratch(x: torch.Tensor, acc_numel: int, part_numel: int):
    """Scratch for one call: the accumulator and the counter zeroed by one fill (zero bits are zero in both)."""
    zeroed = torch.zeros(max(acc_numel, 1) + 1, dtype=torch.float32, device=x.device)
    return [zeroed[:-1], zeroed[-1:].view(torch.int32),
            torch.empty(max(part_numel, 1), dtype=torch.float32, device=x.device)]


def _outside_pools(make, device: torch.device):
    """`make()` on a helper thread. torch.compile's CUDA-graph trees route every allocation of the thread that warms
    up or records into their private pool, where a buffer kept between calls is a live tensor they do not track
    ("tensors in the cudagraph pool not tracked as outputs"); the caching allocator routes by thread, so a buffer
    made on another thread lives outside. Only when a buffer is (re)made: never on a steady call."""
    if device.type != "cuda":
        return make()
    box: list = []

    def run():
        try:
            made = make()
            torch.cuda.synchronize(device)  # the zero fill is done before any stream reads the buffer
            box.append((made, None))
        except BaseException as e:  # re-raised on the caller's thread
            box.append((None, e))

    worker = threading.Thread(target=run, name="mlpfuse-scratch")
    worker.start()
    worker.join()
    made, err = box[0]
    if err is not None:
        raise err
    return made


def _zeroed_scratch(device: torch.device, acc_numel: int, part_numel: int):
    # The atomic path relies on acc and the counter being zero at entry; every launch leaves them so.
    return _outside_pools(lambda: [torch.zeros(max(acc_numel, 1), dtype=torch.float32, device=device),
                                   torch.zeros(1, dtype=torch.int32, device=device),
                                   torch.empty(max(part_numel, 1), dtype=torch.float32, device=device)], device)


def _fits(s, acc_numel: int, part_numel: int) -> bool:
    return s is not None and s[0].numel() >= acc_numel and s[2].numel() >= part_numel


def _release_captured() -> None:
    """After a capture (on the first call outside one): its graph keeps the spare it took (the graph reads that
    address on every replay), and a new spare waits for the next capture, which takes its own."""
    for key in _captured:
        taken = _scratch.pop(key, None)
        _graveyard.append(taken)
        if taken is not None and not _fits(_spares.get(key[0]), taken[0].numel(), taken[2].numel()):
            _spares[key[0]] = _zeroed_scratch(torch.device("cuda", key[0]), taken[0].numel(), taken[2].numel())
    _captured.clear()


def _get_scratch(x: torch.Tensor, acc_numel: int, part_numel: int):
    """The accumulator, counter and partials for a call on x's device and current stream, zeroed at entry.

    Kept per (device, stream) between calls. A CUDA graph captured on a stream with none takes the spare made beside
    the last buffer (`_spares`): captured, a fresh zeroed buffer would be one more fill on every replay. Each capture
    takes its own spare, so graphs replayed on different streams never share one."""
    if _captured and not _capturing(x):
        _release_captured()
    key = (x.get_device(), torch._C._cuda_getCurrentRawStream(x.get_device())) if x.is_cuda else (-1, 0)
    s = _scratch.get(key)
    if _fits(s, acc_numel, part_numel):
        return s
    if _capturing(x):
        spare = _spares.pop(key[0], None)
        if not _fits(spare, acc_numel, part_numel):
            if spare is not None:
                _graveyard.append(spare)
            # No spare to take: the graph gets its own zeroed scratch, the fill captured with it.
            return _fresh_scratch(x, acc_numel, part_numel)
        if s is not None:
            _graveyard.append(s)
        _scratch[key] = spare
        _captured.append(key)
        return spare
    if s is not None:
        _graveyard.append(s)
    acc_numel = max(acc_numel, s[0].numel() if s is not None else 0)
    part_numel = max(part_numel, s[2].numel() if s is not None else 0)
    s = _scratch[key] = _zeroed_scratch(x.device, acc_numel, part_numel)
    if x.is_cuda and not _fits(_spares.get(key[0]), acc_numel, part_numel):
        _spares[key[0]] = _zeroed_scratch(x.device, acc_numel, part_numel)
    return s


def _get_hbuf(x: torch.Tensor, numel: int):
    """Split mode's h [M, H] in the input dtype, cached per (device, stream, dtype) like the scratch (it is written
    in full before it is read: a graph captured with none takes an empty one from its own pool, at no cost)."""
    key = (x.get_device(), torch._C._cuda_getCurrentRawStream(x.get_device()) if x.is_cuda else 0, x.dtype)
    buf = _hbufs.get(key)
    if buf is None or buf.numel() < numel:
        if _capturing(x):
            return torch.empty(max(numel, 1), dtype=x.dtype, device=x.device)
        if buf is not None:
            _graveyard.append(buf)
        buf = _hbufs[key] = _outside_pools(lambda: torch.empty(max(numel, 1), dtype=x.dtype, device=x.device),
                                           x.device)
    return buf


def _tensor_key(t):
    # Everything about a tensor that validation or Triton's specialization depends on (16-byte alignment).
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() & 15, t.get_device())


def _check(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InputError("x: expected a 2-D tensor [M, D]")
    m, d = x.shape
    if x.dtype not in _DTYPES:
        raise InputError(f"x: expected dtype bfloat16, float16 or float32, got {x.dtype}")
    if m > MAX_M:
        raise InputError(f"x: the decode kernel takes at most {MAX_M} rows, got {m}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise InputError(f"{name}: expected a 2-D tensor")
        if w.dtype != x.dtype or w.device != x.device:
            raise InputError(f"{name}: expected dtype {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
    h = w_gate.shape[0]
    if w_gate.shape[1] != d or tuple(w_up.shape) != (h, d) or tuple(w_down.shape) != (d, h):
        raise InputError(f"w_gate/w_up/w_down: expected [H, {d}], [H, {d}], [{d}, H] with one H; got "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    for name, b, n in (("b_gate", b_gate, h), ("b_up", b_up, h), ("b_down", b_down, d)):
        if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,) or b.dtype != x.dtype
                              or b.device != x.device):
            raise InputError(f"{name}: expected a [{n}] tensor of dtype {x.dtype} on {x.device} or None")
    if not isinstance(activation, int) or isinstance(activation, bool) or activation not in activations.IDS:
        raise InputError(f"activation: expected an activation id from mlpfuse.activations, got {activation!r}")


def _rows(h: int, block_h: int, sms: int) -> int:
    """Hidden units per program under BALANCED_ROWS: the fewest multiple of 16 (≤ block_h) that spreads h over at
    most `sms` programs, where block_h-row slices alone would leave SMs idle (14336 rows, 128-row tiles, 132 SMs:
    112 programs become 128 of 112 rows)."""
    if triton.cdiv(h, block_h) >= sms:
        return block_h
    return max(16, min(block_h, triton.cdiv(triton.cdiv(h, sms), 16) * 16))


def _plan(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, mode, allow_tf32, bucket, config, norm_kind,
          scales=None, has_res: bool = False):
    d, h = x.shape[1], w_gate.shape[0]
    pdl = _pdl(x)
    pf_step = 128 // w_gate.element_size()  # elements per 128-byte line of a weight row
    w8 = scales is not None
    block_m = _block_m(bucket)
    cfg = config or default_config(d, h, bucket, x.element_size(), mode)
    block_h, block_d, block_o = cfg[:3]
    fp32 = x.dtype == torch.float32
    # The plan serves every M up to MAX_M with these strides: decide index width for the largest.
    x_reach = (MAX_M - 1) * abs(x.stride(0)) + (d - 1) * abs(x.stride(1))
    i64 = (x_reach > C.INT32_SPAN or C.needs_i64(w_gate, w_up, w_down)
           or MAX_M * max(d, h) * (triton.cdiv(h, block_h) if mode == 2 else 1) > C.INT32_SPAN)
    rows = _rows(h, block_h, C.num_sms(x.device)) if BALANCED_ROWS and not w8 else block_h
    consts = (activation, b_gate is not None, b_up is not None, b_down is not None, mode,
              "tf32" if (not fp32 or allow_tf32) else "ieee", block_m, block_h, block_d, block_o,
              _FINAL_BLOCK, not _INTERPRET, i64, norm_kind, w8, has_res, pdl, PREFETCH_LINES, pf_step, rows)
    block_f = 256  # a constant, not a function of M: one compile serves every M
    down = {}
    if mode == 4:
        down = dict(down_grid=triton.cdiv(d, cfg[5]),
                    down_consts=(b_down is not None, consts[5], block_m, cfg[5], cfg[6], i64, has_res, pdl,
                                 PREFETCH_LINES, pf_step))
    block_p = 1 if mode == 3 else min(32, triton.next_power_of_2(triton.cdiv(h, rows)))
    return _Plan(n_progs=triton.cdiv(h, rows), cfg=cfg, consts=consts,
                 w_strides=(w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1), w_down.stride(0),
                            w_down.stride(1), d, 1, *((s.stride(0) for s in scales) if w8 else (0, 0, 0))),
                 reduce_consts=(b_down is not None, block_p, block_f, mode == 3, has_res, pdl), **down)


def _launch(plan, which, grid, args, stream):
    """Launch the compiled kernel directly once Triton has compiled it for this plan (skips Triton's per-call
    argument binding and specialization); the first call, and every call under the interpreter, goes through
    Triton. `which`: "" (main kernel), "reduce_" or "down_". The same idea as kernels._common.Launcher, held on
    the plan the call already looked up: at decode sizes the Launcher's own key lookup per launch (~0.5 µs) is
    not free."""
    compiled = getattr(plan, which + "compiled")
    consts = getattr(plan, which + "consts")
    if compiled is not None:
        if type(compiled) is C.Raw:  # the C launcher itself, tensors as plain addresses
            compiled(grid, stream, (*[a.data_ptr() if type(a) is torch.Tensor else a for a in args], *consts))
            return
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *consts)
        return
    pdl = {"launch_pdl": True} if plan.consts[16] else {}  # launched as a programmatic dependent of the kernel before
    if which == "reduce_":
        compiled = mlpfuse_decode_reduce_kernel[grid](*args, *consts, num_warps=4, **pdl)
    elif which == "down_":
        compiled = mlpfuse_decode_down_kernel[grid](*args, *consts, num_warps=plan.cfg[7], num_stages=plan.cfg[8],
                                                    **pdl)
    else:
        compiled = mlpfuse_decode_mlp_kernel[grid](*args, *consts, num_warps=plan.cfg[3], num_stages=plan.cfg[4],
                                                   **pdl)
    if _DIRECT_LAUNCH and stream is not None:
        raw = C.Raw.of(compiled)
        setattr(plan, which + "compiled", raw if raw is not None and not raw.desc_meta else compiled)


def decode_gated_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, activation: int,
                     deterministic: bool = False, allow_tf32: bool = True,
                     norm_weight=None, norm_eps: float = 0.0, norm_kind: int = NORM_NONE, residual=None,
                     _mode: int | None = None, _config: tuple | None = None):
    """y [M, D] = down(act(x·w_gateᵀ + b_gate) · (x·w_upᵀ + b_up)) + b_down (+ residual), in one or two small
    launches.

    x [M, D] with M <= MAX_M; w_gate, w_up [H, D]; w_down [D, H]; biases [H], [H], [D] or None; all one dtype
    (bf16/fp16/fp32) and device, any strides. `deterministic=True` gives bit-identical results run to run (the
    split mode; without it the faster of atomics and split is taken per layer size and M, see `_POLICY`).
    `allow_tf32` selects tf32 for fp32 inputs. Graph-capturable; allocates only the output once warm.
    `norm_weight` [D] with `norm_kind` NORM_WEIGHT_AFTER or NORM_ONE_PLUS: x goes through an RMSNorm first (each row
    scaled by 1/sqrt(mean(x²) + norm_eps) in fp32, see the kernel), read by the same kernel that streams the weights.
    `residual`: a contiguous [M, D] tensor of x's dtype added to y in the epilogue, in fp32 before y is rounded (a
    decoder layer's `h + mlp(norm(h))` in one rounding instead of two).
    `_mode` / `_config` override the scheme and the tile config (benchmarks and tests only).
    """
    if _mode is not None and _mode not in (0, 2, 3, 4):
        raise InputError(f"_mode: expected 0, 2, 3, 4 or None, got {_mode!r}")
    m = 0
    try:
        # Biases are read as contiguous vectors; a strided one (rare) is copied.
        if b_gate is not None and b_gate.stride(0) != 1:
            b_gate = b_gate.contiguous()
        if b_up is not None and b_up.stride(0) != 1:
            b_up = b_up.contiguous()
        if b_down is not None and b_down.stride(0) != 1:
            b_down = b_down.contiguous()
        m = x.shape[0]
        bucket = _bucket(m)
        mode = _mode if _mode is not None else _policy_mode(w_down, bucket, deterministic)
        key = _key(bucket, activation, mode, allow_tf32, _config, x, w_gate, w_up, w_down, b_gate, b_up, b_down,
                   norm_kind, norm_weight, residual)
    except (AttributeError, TypeError, IndexError, ValueError):
        key = None  # not tensors of the expected ranks: _check names the culprit
    plan = _plans.get(key) if m <= MAX_M else None
    if plan is None:
        _check(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation)
        C.check_norm(x, norm_weight, norm_eps, norm_kind)
    if residual is not None:
        C.check_residual(residual, x.shape, x)  # every call: the plan's key holds the residual's layout, not its rows
    d = x.shape[1]
    out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    h = w_gate.shape[0]
    if d == 0 or h == 0:  # nothing to stream: y is just the bias
        out = out.copy_(b_down.expand(m, d)) if b_down is not None else out.zero_()
        return out if residual is None else out.add_(residual)
    if plan is None:
        plan = _plans[key] = _plan(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, mode, allow_tf32,
                                   bucket, _config, norm_kind, None, residual is not None)
        if _mode is None and mode == 0:
            # Inside a CUDA graph the launch the one-launch mode saves costs nothing, and its one-SM tail costs GPU
            # time: captured calls take mode 3 (atomics, then the cast launch). 1×4096×14336, 20-call graph, µs
            # per call: H100 126.1 (mode 0) vs 122.4 (mode 3); H200 86.3 vs 85.9 (benchmarks/tune_decode.py).
            plan.captured = _plan(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, 3, allow_tf32, bucket,
                                  _config, norm_kind, None, residual is not None)
    return run_plan(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, norm_weight, norm_eps, out,
                    residual=residual)


def decode_gated_mlp_fp8(x, w_gate, s_gate, w_up, s_up, w_down, s_down, b_gate=None, b_up=None, b_down=None, *,
                         activation: int, deterministic: bool = False, allow_tf32: bool = False,
                         norm_weight=None, norm_eps: float = 0.0, norm_kind: int = NORM_NONE, residual=None):
    """`decode_gated_mlp` with weights in the FP8 recipe (mlpfuse.fp8): e4m3 values [H, D], [H, D], [D, H] and their
    fp32 128×128 scales. Weight-only: each weight tile is widened exactly to x's dtype on chip and its block's scale
    applied to the tile's partial sums (16-bit x: fp16 MMAs, _common.fp16_weights); x, h and y stay in x's dtype.
    The atomic modes (0, 3), or the deterministic partials (2): the split mode's down kernel takes K tiles wider
    than a scale block. `residual` as in decode_gated_mlp."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise InputError(f"x: expected a 2-D bfloat16, float16 or float32 tensor, got {x.dtype} {tuple(x.shape)}")
    m, d = x.shape
    if m > MAX_M:
        raise InputError(f"x: the decode kernel takes at most {MAX_M} rows, got {m}")
    h = w_gate.shape[0]
    for name, w, s, shape in (("w_gate", w_gate, s_gate, (h, d)), ("w_up", w_up, s_up, (h, d)),
                              ("w_down", w_down, s_down, (d, h))):
        if w.dtype != fp8.DTYPE or tuple(w.shape) != shape or w.device != x.device:
            raise InputError(f"{name}: expected {fp8.DTYPE} values of shape {shape} on {x.device}")
        groups = fp8.weight_scale_shape(*shape)
        if s.dtype != fp8.SCALE_DTYPE or tuple(s.shape) != groups or s.stride(1) != 1 or s.device != x.device:
            raise InputError(f"{name} scales: expected {fp8.SCALE_DTYPE} of shape {groups} on {x.device}")
    for name, b, n in (("b_gate", b_gate, h), ("b_up", b_up, h), ("b_down", b_down, d)):
        if b is not None and (tuple(b.shape) != (n,) or b.dtype != x.dtype or b.device != x.device):
            raise InputError(f"{name}: expected a [{n}] tensor of dtype {x.dtype} on {x.device} or None")
    C.check_norm(x, norm_weight, norm_eps, norm_kind)
    C.check_residual(residual, x.shape, x)
    out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0 or d == 0 or h == 0:
        out = out.zero_() if b_down is None else out.copy_(b_down.expand(m, d))
        return out if residual is None else out.add_(residual)
    bucket = _bucket(m)
    mode = 2 if deterministic else (_POLICY[(_size_class(d, h), bucket, False)] if bucket <= 16 else 3)
    mode = 3 if mode == 4 else mode
    scales = (s_gate, s_up, s_down)
    key = ("fp8", _key(bucket, activation, mode, allow_tf32, None, x, w_gate, w_up, w_down, b_gate, b_up, b_down,
                       norm_kind, norm_weight, residual), *(_tensor_key(s) for s in scales))
    plan = _plans.get(key)
    has_res = residual is not None
    if plan is None:
        plan = _plans[key] = _plan(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, mode, allow_tf32,
                                   bucket, None, norm_kind, scales, has_res)
        if mode == 0:  # as in decode_gated_mlp: a captured call takes the atomic mode's two launches
            plan.captured = _plan(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, 3, allow_tf32, bucket,
                                  None, norm_kind, scales, has_res)
    return run_plan(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, norm_weight, norm_eps, out, scales,
                    residual)


def held_plan(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, activation: int,
              deterministic: bool = False, allow_tf32: bool = True, norm_weight=None, norm_kind: int = NORM_NONE,
              residual=None):
    """The plan an earlier `decode_gated_mlp` call made for exactly these arguments' layout (None if there is none,
    or a bias is strided). A caller that keys its own memo on at least the same properties (shapes, strides, dtypes,
    devices, 16-byte alignments, weight addresses, and checks `deterministic` per call) may then call
    `run_plan(plan, ...)` itself and skip this module's key per call."""
    if any(b is not None and b.stride(0) != 1 for b in (b_gate, b_up, b_down)) or x.shape[0] > MAX_M:
        return None
    bucket = _bucket(x.shape[0])
    mode = _policy_mode(w_down, bucket, deterministic)
    return _plans.get(_key(bucket, activation, mode, allow_tf32, None, x, w_gate, w_up, w_down, b_gate, b_up, b_down,
                           norm_kind, norm_weight, residual))


def _policy_mode(w_down, bucket: int, deterministic: bool) -> int:
    return _POLICY[(_size_class(w_down.shape[0], w_down.shape[1]), bucket, bool(deterministic))]


def _key(bucket, activation, mode, allow_tf32, config, x, wg, wu, wd, bg, bu, bd, norm_kind, norm_weight, residual):
    """A plan's key: a hit means exactly these dtypes/shapes/strides/alignments/devices were validated and compiled
    before (M itself is not part of it: it is checked on every call; a residual's shape is checked with it: as y's
    rows it is contiguous, of x's dtype and device). The PDL and BALANCED_ROWS switches as they are now: a plan keeps
    the ones it was made under."""
    return (bucket, activation, mode, allow_tf32, config, PDL, BALANCED_ROWS,
            None if residual is None else (residual.dtype, residual.shape[1:], residual.stride(),
                                           residual.data_ptr() & 15, residual.get_device()),
            (x.dtype, x.dim(), x.shape[1], x.stride(), x.data_ptr() & 15, x.get_device()), _tensor_key(wg),
            _tensor_key(wu), _tensor_key(wd), _tensor_key(bg), _tensor_key(bu), _tensor_key(bd), norm_kind,
            None if norm_weight is None else _tensor_key(norm_weight))


def run_plan(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down, norm_weight=None, norm_eps: float = 0.0,
             out=None, scales=None, residual=None):
    """One call on a plan made for this layout (M >= 1, D and H > 0): the output, scratch, and the launches. x is
    [M, D], or a contiguous [..., D] read as its rows (no view op; the output then has x's shape). `scales`: the
    three weights' 128×128 scales, for a plan made for e4m3 weights (decode_gated_mlp_fp8). `residual`: for a plan
    made with one, y's shape, contiguous (checked when the plan was made for its layout)."""
    d = x.shape[-1]
    if x.dim() == 2:
        m = x.shape[0]
        sm, sd = x.stride()
    else:
        m, sm, sd = x.numel() // d, d, 1
    h = w_gate.shape[0]
    if plan.captured is not None and _capturing(x):
        plan = plan.captured
    mode = plan.consts[4]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_progs = plan.n_progs
    acc_numel, part_numel = MAX_M * d if mode in (0, 3) else 0, n_progs * m * d if mode == 2 else 0
    acc, cnt, part = _get_scratch(x, acc_numel, part_numel)
    hbuf = _get_hbuf(x, m * h) if mode == 4 else out
    stream = torch._C._cuda_getCurrentRawStream(x.get_device()) if x.is_cuda else None
    bd = out if b_down is None else b_down  # `out` stands in for absent biases; never read
    res = out if residual is None else residual
    _launch(plan, "", (n_progs, 1), (
        x, w_gate, w_up, w_down, out if b_gate is None else b_gate, out if b_up is None else b_up, bd, out, acc,
        part, cnt, hbuf, out if norm_weight is None else norm_weight, float(norm_eps), C.FP16_X_SHIFT,
        *(scales if scales is not None else (out, out, out)), res, m, d, h, sm, sd, *plan.w_strides, d), stream)
    if mode == 4:
        _launch(plan, "down_", (plan.down_grid, 1), (hbuf, w_down, bd, out, res, m, d, h, plan.w_strides[4],
                                                     plan.w_strides[5], d, 1, d), stream)
    elif mode >= 2:
        _launch(plan, "reduce_", ((m * d + 255) // 256, 1), (part if mode == 2 else acc, out, bd, res, m, d,
                                                         n_progs if mode == 2 else 1, d, 1, d), stream)
    return out
