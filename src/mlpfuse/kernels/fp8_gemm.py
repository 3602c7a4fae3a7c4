"""The FP8 forms of the MLP's GEMMs, in the recipe of `mlpfuse.fp8` (e4m3 values; weights with one fp32 scale per
128×128 block, activations with one per token and 128 consecutive channels).

    quantize          x [M, K] → xq [M, K] e4m3, sx [M, K/128]                   (one pass, when x has no producer;
                      with an RMSNorm handed to the block, the norm's pass: x read twice, its output never written)
    fp8_gemm          z = Σ_b sx[:, b]·sw[:, b] · (xq_b · wq_bᵀ)   per 128-wide K block b, fp32 accumulators;
                      GATED: a second weight (up), its K loop after the gate's, z = act(g)·u;  else z = act(g)
                      epilogue: biases (fp32), then either z in the output dtype, or z quantized again (QUANT_OUT):
                      a BN = 128 tile is exactly one scale group per row, so its row amax is known on chip and
                      the next GEMM's operand (hq, sh) leaves it already in FP8 — no pass of its own over h
    fp8_weight_gemm   decode sizes (M ≤ 64): weight-only — W read once as e4m3 and widened in registers (to
                      fp16 for 16-bit x, the MMAs in fp16; to fp32 for fp32 x), each 128×128 block's scale applied
                      to its partial sum; x and the output stay in x's dtype (the bytes are the weights; quantizing
                      x would only add a pass and error); the residual, if given, added before rounding; K split
                      where the output rows alone leave SMs idle, the parts added in a fixed order by a second launch

The K step is 128 (the scale group), so each step's tensor-core sum is one block's, scaled by one activation scale
per row and the tile's one weight scale (BN divides 128) and added to the fp32 accumulator: the per-K-block scaling
of the recipe, each block's sum promoted out of the tensor cores' narrower accumulation (reference.py). Accumulating
in place instead (the accumulator rescaled by the ratio of consecutive blocks' scales before each MMA) was measured
and dropped: no faster than the gated kernel's two loops, and 14× the error (2.6e-3 against 1.9e-4 of the float64
sum at 512×4096×14336), the whole K summed at the tensor cores' precision.

On Hopper, from WS_MIN_ROWS rows, fp8_gemm launches the same GEMM warp-specialized instead
(kernels/fp8_gemm_ws.py, Gluon: a loader warp and two consumer warpgroups, so that one's MMA runs while the other
promotes its block; bit for bit this kernel's outputs).

Rounding to e4m3 is round-to-nearest-even. On the GPU that is the hardware conversion; Triton's interpreter (the CPU
tests) converts out-of-range, tie and NaN values wrongly, so there the rounding is done in fp32 arithmetic first
(`EMULATE`) and the cast then only meets values e4m3 holds exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mlpfuse import fp8
from mlpfuse.activations import act_fwd
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels._common import (FP16_UNDO, fp16_activations, fp16_weights, pdl_release, pdl_wait, prefetch_l2,
                                     tile_coords)

GROUP = fp8.GROUP  # the K step and the output tile width of QUANT_OUT: one scale group
_EMULATE = C.INTERPRET


@triton.jit
def _e4m3(v, EMULATE: tl.constexpr):
    """fp32 v (|v| ≤ 448, or NaN) → e4m3, round to nearest even."""
    if EMULATE:
        # The e4m3 spacing around v: 2^(e-3) for a normal exponent e ≥ -6, 2^-9 below (subnormals); adding and
        # subtracting 1.5·2^23 rounds v/spacing (|v/spacing| ≤ 16) to an integer, ties to even.
        e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
        spacing = ((tl.maximum(e, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
        r = ((v / spacing + 12582912.0) - 12582912.0) * spacing
        r = tl.where(r == 0.0, v * 0.0, r)  # keep the sign of a zero
        q = tl.where(v != v, 0x7F, r.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        return q.to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


# IEEE division without division instructions. PTX's div.rn.f32 compiles to a reciprocal, FMA corrections and a
# check that branches to a slow-path subroutine for operands out of the corrections' range; in an epilogue holding
# two fp32 accumulators those calls made ptxas save the live registers around them (the gated GEMM's paired save_gu
# form: 2.9 KB of spill stores a thread for sm_90). The quantizations' divisors are never out of that range once a
# tiny group is scaled (below), so the corrections run inline, call-free. Under the interpreter (EMULATE) the
# division is numpy's, which is IEEE already.
_TINY_SCALE = tl.constexpr(2.0 ** -78)  # a group's scale below: its values and scale taken ×2^48 (_divide)


@triton.jit
def _reciprocal(s, EMULATE: tl.constexpr):
    """1/s for s a positive normal float, +inf or NaN: the approximate division's estimate refined by one Newton
    step (within an ulp: _divide's corrections need no more); 0 for s = inf. Unused under EMULATE (s returned)."""
    if EMULATE:
        return s
    y = 1.0 / s
    y = tl.fma(y, tl.fma(-s, y, 1.0), y)
    return tl.where(s == float("inf"), 0.0, y)


@triton.jit
def _divide(v, s, y, EMULATE: tl.constexpr):
    """v / s rounded to nearest (IEEE) wherever the quotient reaches e4m3's range (|v/s| ≥ 2^-12; below it rounds to
    ±0 there, and keeps its sign), NaN and inf as IEEE's; s, y: the groups' scales and their _reciprocal, broadcast
    to v. q = v·y is within two ulps; two corrections q += (v - s·q)·y, each residual exact in an FMA, make it the
    rounded quotient (the sequence of div.rn's own fast path) — exact while the residual is normal, which holds for
    |v| ≥ 2^-90: where a quotient of e4m3's range has a smaller v (s under 2^-78, a tiny group), the group's v and s
    are taken ×2^48 first. s = inf: y = 0, so v·y is IEEE's v/inf (±0; NaN for v = ±inf, as the corrections)."""
    if EMULATE:
        return tl.math.div_rn(v, s)
    tiny = s < _TINY_SCALE
    v = tl.where(tiny, v * 281474976710656.0, v)
    s = tl.where(tiny, s * 281474976710656.0, s)
    y = tl.where(tiny, y * 3.552713678800501e-15, y)
    q = v * y
    r = tl.fma(tl.fma(-s, q, v), y, q)
    r = tl.fma(tl.fma(-s, r, v), y, r)
    # q = ±0 (v = ±0, or s = inf and v finite: y = 0) is the quotient, whose sign the corrections would lose
    return tl.where(q == 0.0, q, r)


@triton.jit
def _scale_inv(amax, has_nan, EMULATE: tl.constexpr):
    """A scale group's scale_inv, as fp8's: max(amax/448, 2^-126), 1 for an all-zero group, NaN for a group holding
    a NaN (found apart: tl.max drops NaNs, max.f32 returning the other operand); ±inf makes it inf. amax/448 is
    IEEE's, by _divide's corrections with 448's reciprocal (amax under 2^-64 scaled by 2^64, so the residuals stay
    normal: below 448·2^-126 the clamp decides anyway). Under EMULATE, numpy's division."""
    if EMULATE:
        q = tl.math.div_rn(amax, 448.0)
    else:
        q = _over_448(amax)
    s = tl.maximum(q, 1.1754943508222875e-38)
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where(has_nan, float("nan"), s)


@triton.jit
def _over_448(amax):
    """amax/448 rounded to nearest (IEEE), amax ≥ 0 or +inf, call-free (_scale_inv)."""
    small = amax < 5.421010862427522e-20
    a = tl.where(small, amax * 18446744073709551616.0, amax)
    q = a * 0.002232142857142857
    q = tl.fma(tl.fma(-448.0, q, a), 0.002232142857142857, q)
    q = tl.fma(tl.fma(-448.0, q, a), 0.002232142857142857, q)
    q = tl.where(small, q * 5.421010862427522e-20, q)
    return tl.where(amax == float("inf"), amax, q)


@triton.jit
def _quantize_rows(v, EMULATE: tl.constexpr):
    """v [R, 128] fp32 (one scale group per row) → (values e4m3, scale_inv [R] fp32), as fp8.quantize_activation."""
    s = _scale_inv(tl.max(tl.abs(v), axis=1), tl.max((v != v).to(tl.int32), axis=1) > 0, EMULATE)
    return _e4m3(_divide(v, s[:, None], _reciprocal(s, EMULATE)[:, None], EMULATE), EMULATE), s


@triton.jit
def _quantize_cols(v, EMULATE: tl.constexpr):
    """v [128, C] fp32 (one scale group per column: 128 consecutive rows, e.g. tokens) → (values e4m3, scale_inv [C]
    fp32): the groups of a transposed view's 1×128 quantization, as `quantize(t.t())` makes them."""
    s = _scale_inv(tl.max(tl.abs(v), axis=0), tl.max((v != v).to(tl.int32), axis=0) > 0, EMULATE)
    return _e4m3(_divide(v, s[None, :], _reciprocal(s, EMULATE)[None, :], EMULATE), EMULATE), s


@triton.jit(do_not_specialize=["M"])
def mlpfuse_fp8_quantize_kernel(x, q, s, M, K, sxm, sxk, sqm, ssm, BM: tl.constexpr, EMULATE: tl.constexpr,
                                I64: tl.constexpr):
    """x [M, K] (any strides: sxk is 1 for a row-major x, sxm for a transposed view) → e4m3 values and 1×128 scales,
    row-major."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    b = tl.program_id(1)
    rk = b * 128 + tl.arange(0, 128)
    if I64:
        rm = rm.to(tl.int64)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    v = tl.load(x + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    values, scale = _quantize_rows(v, EMULATE)
    tl.store(q + rm[:, None] * sqm + rk[None, :], values, mask=mask)
    tl.store(s + rm * ssm + b, scale, mask=rm < M)


@triton.jit(do_not_specialize=["M"])
def mlpfuse_fp8_norm_quantize_kernel(x, nw, q, s, M, K, sxm, sqm, ssm, eps, BM: tl.constexpr, NORM: tl.constexpr,
                                     EMULATE: tl.constexpr, I64: tl.constexpr):
    """RMSNorm then the 1×128 quantization, x read twice by one program per BM rows (its rows' sum of squares, then
    each 128-column group normalised, rounded as ops.norm.rms_norm rounds, and quantized): the norm's output never
    reaches HBM in x's dtype."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk0 = tl.arange(0, 128)
    if I64:
        rm = rm.to(tl.int64)
    mmask = rm < M
    dt = x.dtype.element_ty
    sq = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, 128):
        rk = k0 + rk0
        v = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
        v = v.to(tl.float32)
        sq += tl.sum(v * v, axis=1)
    r = 1.0 / tl.sqrt_rn(sq / K + eps)
    for k0 in range(0, K, 128):
        rk = k0 + rk0
        mask = mmask[:, None] & (rk < K)[None, :]
        v = tl.load(x + rm[:, None] * sxm + rk[None, :], mask=mask, other=0.0).to(tl.float32) * r[:, None]
        g = tl.load(nw + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
        if NORM == 1:  # weight · round(x·r), rounded again
            v = (g * v.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:  # round(x·r·(1 + weight))
            v = (v * (1.0 + g)).to(dt).to(tl.float32)
        values, scale = _quantize_rows(v, EMULATE)
        tl.store(q + rm[:, None] * sqm + rk[None, :], values, mask=mask)
        tl.store(s + rm * ssm + k0 // 128, scale, mask=mmask)


@triton.jit
def mlpfuse_fp8_weight_quantize_kernel(w, q, s, N, K, s_wn, s_wk, s_qn, s_sn, TRANSPOSED: tl.constexpr,
                                       EMULATE: tl.constexpr, I64: tl.constexpr, CHANNELS: tl.constexpr):
    """One 128×128 block of W [N, K] (any strides) → e4m3 values and its one scale, as fp8.quantize_weight: written
    as W's [N, K] (q, s [ceil(N/128), ceil(K/128)]), or TRANSPOSED as Wᵀ's [K, N] (the same values and scales at
    transposed places: a block-quantized weight's transpose is its blocks transposed). CHANNELS (with TRANSPOSED):
    the scales are given, one per column of W (s [K]), and only the values are written, as fp8.quantize_channels."""
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    rn = bn * 128 + tl.arange(0, 128)
    rk = bk * 128 + tl.arange(0, 128)
    if I64:
        rn = rn.to(tl.int64)
        rk = rk.to(tl.int64)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    v = tl.load(w + rn[:, None] * s_wn + rk[None, :] * s_wk, mask=mask, other=0.0).to(tl.float32)
    if CHANNELS:
        scale = tl.load(s + rk, mask=rk < K, other=1.0)[None, :]
    else:
        scale = _scale_inv(tl.max(tl.max(tl.abs(v), axis=1), axis=0),
                           tl.max(tl.max((v != v).to(tl.int32), axis=1), axis=0) > 0, EMULATE)
    values = _e4m3(_divide(v, scale, _reciprocal(scale, EMULATE), EMULATE), EMULATE)
    if TRANSPOSED:
        # the e4m3 values transposed (through shared memory: a quarter of the fp32 tile's bytes), so that the store
        # runs along Wᵀ's rows in 16-byte vectors — which needs N specialized (quantize_weight's key): with N
        # unspecialized the mask could not be shown constant over 16 bytes and each thread stored 64 single bytes,
        # 260–290 µs against 75 for a 14336×4096 weight on an H200 (benchmarks/fp8_transpose_probe.py,
        # benchmarks/results/nvidia-h200/fp8-train-wgrad/)
        tl.store(q + rk[:, None] * s_qn + rn[None, :], tl.trans(values), mask=(rk[:, None] < K) & (rn[None, :] < N))
        if not CHANNELS:
            tl.store(s + bk * s_sn + bn, scale)
    else:
        tl.store(q + rn[:, None] * s_qn + rk[None, :], values, mask=mask)
        tl.store(s + bn * s_sn + bk, scale)


@triton.jit
def _k_sum(a, sa, w, ws, off_m, off_n, rm, rn, mmask, nmask, K, s_am, s_sam, s_w, s_ws, TMA: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr):
    """Σ_b sa[:, b]·sw_b·(a_b·w_bᵀ) over the K blocks b of one weight: each block's tensor-core sum promoted to
    the fp32 accumulator with its row scales and the weight's scale for the block: the tile's one 128×128 block
    scale (BN divides 128, so a tile's columns share one weight block per K block)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, 128)):
        k0 = ki * 128
        if TMA:  # out-of-range rows and columns come back as zeros
            at = a.load([off_m, k0])
            wt = w.load([off_n, k0])
        else:
            rk = k0 + tl.arange(0, 128)
            kmask = rk[None, :] < K
            at = tl.load(a + rm[:, None] * s_am + rk[None, :], mask=mmask[:, None] & kmask, other=0.0)
            wt = tl.load(w + rn[:, None] * s_w + rk[None, :], mask=nmask[:, None] & kmask, other=0.0)
        sx = tl.load(sa + rm * s_sam + ki, mask=mmask, other=1.0)
        acc += tl.dot(at, wt.T) * (sx * tl.load(ws + (off_n // 128) * s_ws + ki))[:, None]
    return acc


@triton.jit(do_not_specialize=["M"])
def mlpfuse_fp8_gemm_kernel(
    a, sa, w1, s1, w2, s2, b1, b2, out, sout, gq, gs, uq, us, cs,
    M, N, K, s_am, s_sam, s_w1, s_s1, s_w2, s_s2, s_om, s_som,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, QUANT_OUT: tl.constexpr,
    TMA: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
    I64: tl.constexpr, SAVE_GU: tl.constexpr, TRANS_OUT: tl.constexpr, COL_SCALE: tl.constexpr,
):
    """z = act(a·W1ᵀ + b1) [· (a·W2ᵀ + b2)], a e4m3 with 1×128 scales, each W e4m3 with 128×128 block scales.
    QUANT_OUT: z leaves quantized 1×128 (values in out, scales in sout; BN = 128); else in out's dtype, TRANS_OUT as
    zᵀ (out [N, M], row stride s_om). SAVE_GU (gated, QUANT_OUT): the pre-activations g = a·W1ᵀ + b1 and
    u = a·W2ᵀ + b2 leave quantized the same way too (gq/gs, uq/us, out's and sout's layout) — what FP8 training
    keeps for the backward. COL_SCALE (not gated): a·W1ᵀ's columns multiplied by cs [N] before the bias — W1's
    rows quantized with one scale each (FP8 training's weight gradients), W1's block scales then ones."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        if I64:
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        mmask = rm < M
        nmask = rn < N
        # One weight's K loop at a time (gate's, its activation held, then up's): one accumulator and one block
        # product live at once, so 128×128 tiles fit in registers; x's tile is read once per loop, as by one
        # GEMM over both weights' columns.
        acc = _k_sum(a, sa, w1, s1, off_m, off_n, rm, rn, mmask, nmask, K, s_am, s_sam, s_w1, s_s1, TMA, BM, BN)
        if COL_SCALE:
            acc = acc * tl.load(cs + rn, mask=nmask, other=1.0)[None, :]
        if HAS_B1:
            acc += tl.load(b1 + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        mask = mmask[:, None] & nmask[None, :]
        if SAVE_GU:  # BN == 128: one scale group per row of the tile, columns past N kept out of the amax
            values, scale = _quantize_rows(tl.where(nmask[None, :], acc, 0.0), EMULATE)
            tl.store(gq + rm[:, None] * s_om + rn[None, :], values, mask=mask)
            tl.store(gs + rm * s_som + pid_n, scale, mask=mmask)
        z = act_fwd(acc, ACT)
        if GATED:
            acc = _k_sum(a, sa, w2, s2, off_m, off_n, rm, rn, mmask, nmask, K, s_am, s_sam, s_w2, s_s2, TMA, BM, BN)
            if HAS_B2:
                acc += tl.load(b2 + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if SAVE_GU:
                values, scale = _quantize_rows(tl.where(nmask[None, :], acc, 0.0), EMULATE)
                tl.store(uq + rm[:, None] * s_om + rn[None, :], values, mask=mask)
                tl.store(us + rm * s_som + pid_n, scale, mask=mmask)
            z = z * acc
        if QUANT_OUT:  # BN == 128: this tile's columns are one scale group; columns past N must not raise amax
            values, scale = _quantize_rows(tl.where(nmask[None, :], z, 0.0), EMULATE)
            tl.store(out + rm[:, None] * s_om + rn[None, :], values, mask=mask)
            tl.store(sout + rm * s_som + pid_n, scale, mask=mmask)
        elif TRANS_OUT:
            tl.store(out + rn[None, :] * s_om + rm[:, None], z.to(out.dtype.element_ty), mask=mask)
        else:
            tl.store(out + rm[:, None] * s_om + rn[None, :], z.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _block_sum(w, xt, scale, dt: tl.constexpr, F16: tl.constexpr, DOT_PREC: tl.constexpr):
    """One scale block's contribution: e4m3 tile w [BN, 128] against xt [128, BM] (fp16 MMAs when F16, see the
    weight-only kernel), times the block's scale."""
    if F16:
        return tl.dot(fp16_weights(w), xt) * (scale * FP16_UNDO)
    return tl.dot(w.to(dt), xt, input_precision=DOT_PREC) * scale


@triton.jit(do_not_specialize=["M"])
def mlpfuse_fp8_weight_gemm_kernel(
    x, w1, s1, w2, s2, b1, b2, out, part, nw, res, w1p, w2p,
    M, N, K, K_PER, s_xm, s_w1, s_s1, s_w2, s_s2, s_om, s_rm, eps, x_shift,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr, I64: tl.constexpr,
    F16: tl.constexpr, TMA: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """Weight-only: outᵀ [BLOCK_N, M] = Wq[slice] · xᵀ, the weight the MMA's left operand ("swap AB") so that a tiny M
    is the MMA's narrow side. BLOCK_N divides 128, so the program's rows share one row of weight scales. With SPLIT,
    program (n, s) sums the K range [s·K_PER, (s+1)·K_PER) and writes its fp32 partial sums to part [splits, 2, M, N]
    (the second weight's at 1); mlpfuse_fp8_split_reduce_kernel adds them in a fixed order and applies the epilogue.
    HAS_RES: z + res (a residual of out's shape), added in fp32 before the one rounding to out's dtype.

    F16 (16-bit x): the MMA runs in fp16 — e4m3 widens to fp16 in one conversion per two weights (to bf16 it takes
    three instructions per weight, and that widening, not the bytes, bounded the kernel). The operands go scaled by
    powers of two, W·2^-15 and x·2^-6, each step's sums by 2^21 back: every e4m3 value times 2^-15 is an fp16
    value (the smallest, 2^-9, becomes fp16's smallest, 2^-24), and the tensor cores' products and their partial
    sums stay far inside fp16's range (|W·2^-15| < 2^-6, |x·2^-6| < 2^16: unscaled, e4m3's 448 times bf16 x past
    ~10^4 would overflow them). x keeps fp16's 11 significant bits from 2^-8 up (more than bf16's 8), an absolute
    error under 2^-19 below; |x| ≥ FP16_X_LIMIT (about 4.2·10^6) becomes ±inf in fp16, so that token's outputs are
    inf or NaN — never a finite wrong value; NaN and ±inf in x propagate. x's factor comes as an argument
    (x_shift = 2^-6), not a constant: with a constant, the compiler narrowed fp16(fp32(x)·2^-6) to fp16(x)·2^-6,
    and bf16 x past fp16's 65504 became inf before its scaling (measured on an H200).
    TMA: the weight tiles through tensor descriptors (w1, w2 are then descriptors of [N, K] blocks [BLOCK_N, 128]).
    PDL: launched as a programmatic dependent of the kernel before it — the first two 128-byte lines of each of the
    program's weight rows are asked of L2 (through w1p, w2p: the weights' addresses, also under TMA), then the wait,
    before x, the residual or any output is touched; the next kernel may launch once the K loop is done.

    NORM (1: weight·norm(x), Llama's RMSNorm; 2: norm(x)·(1 + weight), Gemma's): x is read through an RMSNorm of
    weight nw. Its row scale r = 1/sqrt(mean(x²) + eps) factors out of the dot products, so the MMA takes x·nw
    (or x·(1 + nw)) and the sums are scaled by r at the end: no pass over x before the weights stream (the bf16
    decode kernel's prologue, kernels.decode_mlp). A split program sums x² over all of K (x is a few rows, read
    from L2)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk0 = tl.arange(0, 128)
    if I64:
        rn = rn.to(tl.int64)
        rm = rm.to(tl.int64)
        rk0 = rk0.to(tl.int64)
    nmask = rn < N
    mmask = rm < M
    srow = (pid * BLOCK_N) // 128
    dt = tl.float16 if F16 else x.dtype.element_ty
    k_lo = tl.program_id(1) * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PDL:
        pf = k_lo + tl.arange(0, 2) * 128
        pf_mask = nmask[:, None] & (pf[None, :] < k_hi)
        prefetch_l2(w1p + rn[:, None] * s_w1 + pf[None, :], pf_mask, w1p)
        if GATED:
            prefetch_l2(w2p + rn[:, None] * s_w2 + pf[None, :], pf_mask, w2p)
        pdl_wait()
    for k0 in range(k_lo, k_hi, 128):
        rk = k0 + rk0
        kmask = rk < k_hi
        kb = k0 // 128
        xt = tl.load(x + rm[None, :] * s_xm + rk[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        if NORM != 0:
            if not SPLIT:  # a split program sums x² over the whole row below
                sq += tl.sum(xf * xf, axis=0)
            g = tl.load(nw + rk, mask=kmask, other=0.0).to(tl.float32)[:, None]
            xf = xf * (g if NORM == 1 else 1.0 + g)
        xt = fp16_activations(xf, x_shift) if F16 else xf.to(dt)
        if TMA:  # rows past N and columns past K come back as zeros
            wt = w1.load([pid * BLOCK_N, k0])
        else:
            wt = tl.load(w1 + rn[:, None] * s_w1 + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc1 += _block_sum(wt, xt, tl.load(s1 + srow * s_s1 + kb), dt, F16, DOT_PREC)
        if GATED:
            if TMA:
                wt2 = w2.load([pid * BLOCK_N, k0])
            else:
                wt2 = tl.load(w2 + rn[:, None] * s_w2 + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                              other=0.0)
            acc2 += _block_sum(wt2, xt, tl.load(s2 + srow * s_s2 + kb), dt, F16, DOT_PREC)
    if NORM != 0:
        if SPLIT:  # the whole row's x², not only this program's K range
            for k0 in range(0, K, 128):
                rk = k0 + rk0
                xf = tl.load(x + rm[None, :] * s_xm + rk[:, None], mask=(rk < K)[:, None] & mmask[None, :],
                             other=0.0).to(tl.float32)
                sq += tl.sum(xf * xf, axis=0)
        r = 1.0 / tl.sqrt_rn(sq / K + eps)
        acc1 = acc1 * r[None, :]
        acc2 = acc2 * r[None, :]
    if PDL:
        pdl_release()
    mask = nmask[:, None] & mmask[None, :]
    if SPLIT:
        at = (tl.program_id(1) * 2 * M + rm[None, :]) * N + rn[:, None]
        tl.store(part + at, acc1, mask=mask)
        if GATED:
            tl.store(part + at + M * N, acc2, mask=mask)
    else:
        if HAS_B1:
            acc1 += tl.load(b1 + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            if HAS_B2:
                acc2 += tl.load(b2 + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
            z = act_fwd(acc1, ACT) * acc2
        else:
            z = act_fwd(acc1, ACT)
        if HAS_RES:
            z += tl.load(res + rm[None, :] * s_rm + rn[:, None], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + rm[None, :] * s_om + rn[:, None], z.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def mlpfuse_fp8_split_reduce_kernel(part, b1, b2, out, res, M, N, SPLITS, s_om, s_rm, ACT: tl.constexpr,
                                    GATED: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,
                                    BLOCK: tl.constexpr, I64: tl.constexpr, HAS_RES: tl.constexpr,
                                    PDL: tl.constexpr):
    """The weight-only kernel's split sums added in split order (deterministic), then its epilogue (the residual
    too, HAS_RES). PDL: launched as a programmatic dependent of the split kernel; waits for it before reading."""
    if PDL:
        pdl_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if I64:
        offs = offs.to(tl.int64)
    mask = offs < M * N
    n = offs % N
    acc1 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in range(SPLITS):
        acc1 += tl.load(part + sp * 2 * M * N + offs, mask=mask, other=0.0)
        if GATED:
            acc2 += tl.load(part + (sp * 2 + 1) * M * N + offs, mask=mask, other=0.0)
    if HAS_B1:
        acc1 += tl.load(b1 + n, mask=mask, other=0.0).to(tl.float32)
    z = act_fwd(acc1, ACT)
    if GATED:
        if HAS_B2:
            acc2 += tl.load(b2 + n, mask=mask, other=0.0).to(tl.float32)
        z = z * acc2
    if HAS_RES:
        z += tl.load(res + (offs // N) * s_rm + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + (offs // N) * s_om + n, z.to(out.dtype.element_ty), mask=mask)


_quantize_launch = C.Launcher(mlpfuse_fp8_quantize_kernel)
_weight_quantize_launch = C.Launcher(mlpfuse_fp8_weight_quantize_kernel)
_norm_quantize_launch = C.Launcher(mlpfuse_fp8_norm_quantize_kernel)
_gemm_launch = C.Launcher(mlpfuse_fp8_gemm_kernel)
_weight_launch = C.Launcher(mlpfuse_fp8_weight_gemm_kernel)
_reduce_launch = C.Launcher(mlpfuse_fp8_split_reduce_kernel)

# Launch plans (see gated_gemm._Plan): a wrapper's checks, configuration and launch arguments decided once per
# layout of its arguments, later calls with the same layout going straight to the compiled kernel's C launcher.
# The key holds every property the checks and decisions read (weights by address: their descriptors point there),
# so a hit skips only work whose outcome is already known. Off under the interpreter and for non-CUDA tensors.
_plans: dict = {}


def _layout(t) -> tuple | None:
    """The properties of an optional tensor argument a plan depends on (the address itself for weights: `_fixed`)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)


def _fixed(t) -> tuple | None:
    return None if t is None else (t.data_ptr(), *_layout(t))


def _plan_key(kind: str, acts, weights, *flags):
    """A plan's key: `acts` by layout (their addresses change per call), `weights` by address too; None for
    arguments that are not CUDA tensors (the full path checks and names them)."""
    if C.INTERPRET or not C.DIRECT_LAUNCH:
        return None
    try:
        if not acts[0].is_cuda:
            return None
        return (kind, *[_layout(t) for t in acts], *[_fixed(t) for t in weights], *flags)
    except (AttributeError, TypeError):
        return None


class _GemmPlan:
    """fp8_gemm's decisions for one layout: output shapes, grid, flat launch arguments of the weights (their TMA maps
    encoded once), a's maps per address (C.Maps), the integers and constexprs. Holds no tensor."""

    __slots__ = ("raw", "device", "grid", "out_shape", "out_dtype", "sout_shape", "a_maps", "w_flat", "tail",
                 "quant_out")

    def run(self, a, a_scale):
        if C.launch_hooks_set():
            return None  # a profiler's launch hook: the full path launches through Triton
        out = torch.empty(self.out_shape, device=a.device, dtype=self.out_dtype)
        sout = torch.empty(self.sout_shape, device=a.device, dtype=fp8.SCALE_DTYPE) if self.quant_out else a_scale
        ap = a.data_ptr()
        op, sp = out.data_ptr(), sout.data_ptr()
        self.raw(self.grid, torch._C._cuda_getCurrentRawStream(self.device),
                 (*(self.a_maps(ap) if self.a_maps is not None else (ap,)), a_scale.data_ptr(), *self.w_flat,
                  op, sp, op, sp, op, sp, sp, *self.tail))  # gq, gs, uq, us, cs: unread (SAVE_GU, COL_SCALE off)
        return (out, sout) if self.quant_out else out


def _pointer_launch(launcher, key, grid, ints, consts, warps, stages, device, pdl: bool = False):
    """A C.PointerPlan for a kernel whose arguments are plain pointers, once its compiled form exists; else None."""
    plan = C.PointerPlan(launcher, key, grid, ints, consts, warps, stages, device, pdl)
    plan.raw = launcher.raw(key, plan.index) if device.type == "cuda" else None
    return plan if plan.raw is not None else None


def _check_act(x: torch.Tensor, name: str = "x", any_strides: bool = False) -> None:
    if x.dim() != 2 or (x.stride(-1) != 1 and not any_strides):
        raise InputError(f"{name}: expected a 2-D tensor with unit inner stride, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _check_weight(name: str, w: torch.Tensor, s: torch.Tensor, k: int, like: torch.Tensor,
                  n: int | None = None) -> None:
    """Values e4m3 [n, k] and scales fp32 [ceil(n/128), ceil(k/128)], row-major, on `like`'s device."""
    n_rows = w.shape[0] if w.dim() == 2 else -1
    if (w.dtype != fp8.DTYPE or w.dim() != 2 or w.shape[1] != k or (n is not None and n_rows != n)
            or w.stride(1) != 1 or w.device != like.device):
        raise InputError(f"{name}: expected row-major {fp8.DTYPE} values of shape ({n if n is not None else 'N'}, "
                         f"{k}) on {like.device}, got {w.dtype} {tuple(w.shape)} on {w.device}")
    shape = fp8.weight_scale_shape(n_rows, k)
    if (s.dtype != fp8.SCALE_DTYPE or tuple(s.shape) != shape or (s.stride(1) != 1 and shape[1] > 1)
            or s.device != like.device):  # (a one-column scale's stride is never stepped)
        raise InputError(f"{name}_scale: expected fp32 scales of shape {shape} on {like.device}, got {s.dtype} "
                         f"{tuple(s.shape)} on {s.device}")


def _check_bias(name: str, b, n: int, like: torch.Tensor) -> None:
    if b is not None and (tuple(b.shape) != (n,) or not b.is_floating_point() or b.device != like.device):
        raise InputError(f"{name}: expected a floating-point tensor of shape ({n},) on {like.device}")


def _check_operands(w1, s1, w2, s2, b1, b2, k: int, like: torch.Tensor):
    """Both GEMMs' weights and biases, checked: (N, gated, w2, s2), the second weight standing in for itself or, when
    there is none, for the first (the kernel then never reads it)."""
    _check_weight("w1", w1, s1, k, like)
    n = w1.shape[0]
    gated = w2 is not None
    if gated:
        _check_weight("w2", w2, s2, k, like, n)
    else:
        w2, s2 = w1, s1
    _check_bias("b1", b1, n, like)
    _check_bias("b2", b2, n, like)
    return n, gated, w2, s2


def quantize(x: torch.Tensor, block_m: int = 32, *, norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
             norm_kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (values e4m3 [M, K], scale_inv fp32 [M, ceil(K/128)], both row-major): fp8.quantize_activation in one
    pass — x in any strides (a transposed view quantizes along its source's first dimension, no copy made); with
    `norm_kind` (NORM_WEIGHT_AFTER or NORM_ONE_PLUS), of x (unit inner stride) read through an RMSNorm of weight
    `norm_weight` (ops.norm.rms_norm's rounding), the norm's output never written."""
    plan_key = _plan_key("quantize", (x,), (norm_weight,), block_m, norm_eps, norm_kind)
    plan = _plans.get(plan_key) if plan_key is not None else None
    if plan is not None:
        q = torch.empty(x.shape, device=x.device, dtype=fp8.DTYPE)
        s = torch.empty(x.shape[0], -(-x.shape[1] // GROUP), device=x.device, dtype=fp8.SCALE_DTYPE)
        plan.launch((x, q, s) if norm_kind == NORM_NONE else (x, norm_weight, q, s))
        return q, s
    _check_act(x, any_strides=norm_kind == NORM_NONE)
    C.check_norm(x, norm_weight, norm_eps, norm_kind, same_dtype=True)
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=fp8.DTYPE)
    s = torch.empty(m, -(-k // GROUP), device=x.device, dtype=fp8.SCALE_DTYPE)
    if m == 0 or k == 0:
        return q, s
    bm = 16 if C.INTERPRET else block_m
    i64 = C.needs_i64(x, q)
    strides = (x.stride(0), q.stride(0), s.stride(0))
    if norm_kind == NORM_NONE:
        launcher, tensors, grid = _quantize_launch, (x, q, s), (triton.cdiv(m, bm), s.shape[1])
        ints, consts = (m, k, strides[0], x.stride(1), *strides[1:]), (bm, _EMULATE, i64)
    else:
        launcher, tensors, grid = _norm_quantize_launch, (x, norm_weight, q, s), (triton.cdiv(m, bm),)
        ints, consts = (m, k, *strides, float(norm_eps)), (bm, norm_kind, _EMULATE, i64)
    # K itself: besides x's strides it sets q's row stride (K) and s's (ceil(K / 128)), each specialized by value
    # class (== 1, multiple of 16); a key without them ran a K ≤ 128 kernel (s's stride the constant 1) at larger K.
    key = (x.dtype, consts, C.align16(x), k, x.stride(), norm_weight is None or C.align16(norm_weight))
    launcher(key, grid, (*tensors, *ints), consts, num_warps=4, num_stages=1)
    plan = _pointer_launch(launcher, key, grid, ints, consts, 4, 1, x.device) if plan_key else None
    if plan is not None:
        C.keep_plan(_plans, plan_key, plan)
    return q, s


def quantize_weight(w: torch.Tensor, transposed: bool = False,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype and strides) → (values e4m3, scale_inv fp32), one scale per 128×128 block, bit for
    bit fp8.quantize_weight(w)'s values and scales in one pass over W; `transposed`: those of Wᵀ [K, N] (what the
    backward's GEMMs read) in the same pass, no copy of W or of its values. `out`: (values, scales) to write into
    instead of fresh tensors — views with unit column stride, e.g. the halves of one operand two weights share."""
    fp8.check_weight_source(w)
    n, k = w.shape
    gn, gk = -(-n // GROUP), -(-k // GROUP)
    rows, cols, srows, scols = (k, n, gk, gn) if transposed else (n, k, gn, gk)
    if out is None:
        q = torch.empty(rows, cols, device=w.device, dtype=fp8.DTYPE)
        s = torch.empty(srows, scols, device=w.device, dtype=fp8.SCALE_DTYPE)
    else:
        q, s = out
        if (q.shape != (rows, cols) or s.shape != (srows, scols) or q.dtype != fp8.DTYPE
                or s.dtype != fp8.SCALE_DTYPE or q.stride(1) != 1 or (s.stride(1) != 1 and scols > 1)
                or q.device != w.device or s.device != w.device):
            raise InputError(f"out: expected {fp8.DTYPE} values ({rows}, {cols}) and fp32 scales ({srows}, {scols}) "
                             f"with unit column stride on {w.device}")
    if n == 0 or k == 0:
        return q, s.fill_(1.0)
    i64 = C.needs_i64(w, q)
    ints = (n, k, w.stride(0), w.stride(1), q.stride(0), s.stride(0))
    consts = (transposed, _EMULATE, i64, False)
    # N specialized (its multiple-of-16 fact lets the transposed store's mask hold over 16 bytes: vector stores
    # where an unspecialized N left 64 byte stores a thread, ~3.5× the pass's time)
    key = (w.dtype, consts, C.align16(w), C.align16(q), C.align16(s), C.int_class(n), *ints[1:])
    _weight_quantize_launch(key, (gn, gk), (w, q, s, *ints), consts, num_warps=8, num_stages=1)
    return q, s


def quantize_channels(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, N] (any float dtype and strides) → (values e4m3 [N, M], scale_inv fp32 [N]): one scale per column
    over all M rows, the values transposed — bit for bit fp8.quantize_channels(t). The scales are fp8's own
    (a column reduction), the values one pass over t."""
    scale = fp8.channel_scales(t)
    m, n = t.shape
    q = torch.empty(n, m, device=t.device, dtype=fp8.DTYPE)
    if m and n:
        i64 = C.needs_i64(t, q)
        consts = (True, _EMULATE, i64, True)
        ints = (m, n, t.stride(0), t.stride(1), q.stride(0), 1)
        key = (t.dtype, consts, C.align16(t), C.align16(q), C.int_class(m), *ints[1:])
        _weight_quantize_launch(key, (-(-m // GROUP), -(-n // GROUP)), (t, q, scale, *ints), consts, num_warps=8,
                                num_stages=1)
    return q, scale


def _gemm_config(m: int, n: int, quant_out: bool, gated: bool) -> tuple[int, int, int, int, int]:
    """(BM, BN, GROUP_M, num_warps, num_stages). BN divides 128 (a tile's columns share one weight scale per K block)
    and is 128 when the output is quantized (one scale group); the interpreter runs small tiles (each program is
    emulated). From `benchmarks/fp8_tune.py --gemm-only` on an H200 (benchmarks/results/nvidia-h200/fp8-prefill):
    128×128 tiles, 4 stages: the gated kernel 2.23 ms at 8192×4096×14336 (862 TFLOP/s), the down GEMM 1.02 ms (942);
    the down GEMM takes 64×64 tiles below 512 rows (52 µs at 64 tokens; 64×128: 65–75)."""
    if C.INTERPRET:
        return 16, 128, 2, 4, 1
    if gated or m >= 512:
        return 128, 128, 8, 8, 4
    return 64, 128 if quant_out else 64, 8, 4, 4


# The warp-specialized form of the GEMM (kernels/fp8_gemm_ws.py, Gluon, sm_90 only) from this many rows: there the
# H200 measured it faster (8192×4096×14336: gated 1810 against 2423 µs, down with one weight tile a stage 958 against
# 1081 — with two, as launched, 823 against cuBLAS's 796 in a later run; 2048 rows: 471 against 652 and 246 against
# 273), at 512 rows slower (the down GEMM's 128 tiles leave SMs idle: 171 against 71 µs; the
# cut-over at 1024 lies between, not measured itself);
# `benchmarks/fp8_ws_probe.py`, benchmarks/results/nvidia-h200/fp8-ws/. Same sums, same epilogue: bit for bit the
# Triton kernel's outputs in that probe (save_gu too, in its one-tile gated form). MLPFUSE_FP8_WS=0 turns it off.
WS_MIN_ROWS = 1024
WS = os.environ.get("MLPFUSE_FP8_WS", "1") == "1"
_ws_module = None


def _ws(device: torch.device):
    """kernels.fp8_gemm_ws where it runs (a CUDA sm_90 device, Triton with Gluon), else None."""
    global _ws_module
    if not WS or C.INTERPRET or device.type != "cuda" or C.arch_major(device) != 9:
        return None
    if _ws_module is None:
        try:
            from mlpfuse.kernels import fp8_gemm_ws
        except ImportError:  # a Triton without Gluon's Hopper API
            _ws_module = False
        else:
            _ws_module = fp8_gemm_ws
    return _ws_module or None


def outputs(a: torch.Tensor, a_scale: torch.Tensor, n: int, quant_out: bool, out_dtype: torch.dtype,
            save_gu: bool, out_transposed: bool = False):
    """fp8_gemm's fresh outputs for a [M, K] and N columns: (out, sout, saved, what fp8_gemm returns). sout is a_scale
    when the output is not quantized, and saved (gq, gs, uq, us) those two again without save_gu: placeholders the
    kernels never write. `out_transposed`: out is [N, M]."""
    m = a.shape[0]
    if quant_out:
        out = torch.empty(m, n, device=a.device, dtype=fp8.DTYPE)
        sout = torch.empty(m, -(-n // GROUP), device=a.device, dtype=fp8.SCALE_DTYPE)
    else:
        out = torch.empty(*((n, m) if out_transposed else (m, n)), device=a.device, dtype=out_dtype)
        sout = a_scale
    saved = tuple(torch.empty_like(t) for t in (out, sout, out, sout)) if save_gu else (out, sout, out, sout)
    return out, sout, saved, (out, sout, *saved) if save_gu else (out, sout) if quant_out else out


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
             w2: torch.Tensor | None = None, s2: torch.Tensor | None = None, b1: torch.Tensor | None = None,
             b2: torch.Tensor | None = None, *, activation: int, quant_out: bool,
             out_dtype: torch.dtype = torch.bfloat16, save_gu: bool = False, out_transposed: bool = False,
             col_scale: torch.Tensor | None = None):
    """z = act(a·W1ᵀ + b1) [· (a·W2ᵀ + b2) when w2 is given], a [M, K] e4m3 with 1×128 scales, each weight e4m3
    [N, K] with its 128×128 scales; returns z in `out_dtype` (`out_transposed`: zᵀ [N, M], row-major, written so by
    the epilogue), or (values, scale_inv) of z quantized 1×128 when `quant_out`. `save_gu` (gated, quant_out): also
    g = a·W1ᵀ + b1 and u = a·W2ᵀ + b2 quantized 1×128, returning (z values, z scales, g values, g scales, u values,
    u scales). `col_scale` (not gated): fp32 [N], each column of a·W1ᵀ multiplied by its scale before the bias —
    for a W1 quantized per row (fp8.quantize_channels), passed with block scales of ones."""
    if save_gu and not (quant_out and w2 is not None):
        raise InputError("save_gu: needs a gated call (w2) with quant_out=True")
    if out_transposed and quant_out:
        raise InputError("out_transposed: needs quant_out=False (a quantized z is grouped along its rows)")
    plain = not (save_gu or out_transposed or col_scale is not None)  # the calls plans serve
    plan_key = _plan_key("gemm", (a, a_scale), (w1, s1, w2, s2, b1, b2), activation, quant_out, out_dtype) \
        if plain else None
    plan = _plans.get(plan_key) if plan_key is not None else None
    if plan is not None:
        done = plan.run(a, a_scale)
        if done is not None:
            return done
    _check_act(a, "a")
    if a.dtype != fp8.DTYPE:
        raise InputError(f"a: expected {fp8.DTYPE} values, got {a.dtype}")
    m, k = a.shape
    if (tuple(a_scale.shape) != (m, -(-k // GROUP)) or a_scale.dtype != fp8.SCALE_DTYPE
            or (a_scale.stride(1) != 1 and a_scale.shape[1] > 1)):
        raise InputError(f"a_scale: expected fp32 scales of shape ({m}, {-(-k // GROUP)}), got {a_scale.dtype} "
                         f"{tuple(a_scale.shape)}")
    n, gated, w2, s2 = _check_operands(w1, s1, w2, s2, b1, b2, k, a)
    if col_scale is not None and (gated or col_scale.dtype != fp8.SCALE_DTYPE or tuple(col_scale.shape) != (n,)
                                  or col_scale.stride(0) != 1 or col_scale.device != a.device):
        raise InputError(f"col_scale: expected contiguous fp32 ({n},) on {a.device}, for a call without w2")
    out, sout, saved, done = outputs(a, a_scale, n, quant_out, out_dtype, save_gu, out_transposed)
    if m == 0 or n == 0:
        return done
    use_tma = C.tma_capable(a.device) and k > 0 and C.tma_ok(a) and C.tma_ok(w1) and C.tma_ok(w2)
    ws = _ws(a.device) if use_tma and m >= WS_MIN_ROWS else None
    if ws is not None:
        ws.launch(a, a_scale, w1, s1, w2 if gated else None, s2, b1, b2, out, sout, activation, quant_out,
                  saved=saved if save_gu else None, out_transposed=out_transposed, col_scale=col_scale)
        return done
    bm, bn, group_m, warps, stages = _gemm_config(m, n, quant_out, gated)
    aa, wa1, wa2 = a, w1, w2
    if use_tma:
        aa, wa1 = C.desc(a, [bm, GROUP]), C.desc(w1, [bn, GROUP])
        wa2 = C.desc(w2, [bn, GROUP]) if gated else wa1
    i64 = C.needs_i64(a, out, w1, w2)
    consts = (activation, gated, b1 is not None, b2 is not None, quant_out, use_tma, _EMULATE, bm, bn, group_m, i64,
              save_gu, out_transposed, col_scale is not None)
    key = (consts, out.dtype, n, k, a.stride(0), a_scale.stride(0), w1.stride(0), s1.stride(0), w2.stride(0),
           s2.stride(0), out.stride(0), sout.stride(0), C.align16(a), C.align16(a_scale), C.align16(out),
           C.align16(sout), C.align16(w1), C.align16(s1), C.align16(w2), C.align16(s2),
           b1 is None or (b1.dtype, C.align16(b1)), b2 is None or (b2.dtype, C.align16(b2)), warps, stages)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(tiles, C.num_sms(a.device)),)
    args = (aa, a_scale, wa1, s1, wa2, s2, a if b1 is None else b1, a if b2 is None else b2, out, sout, *saved,
            a_scale if col_scale is None else col_scale, m, n, k, a.stride(0), a_scale.stride(0), w1.stride(0),
            s1.stride(0), w2.stride(0), s2.stride(0), out.stride(0), sout.stride(0))
    _gemm_launch(key, grid, args, consts, num_warps=warps, num_stages=stages)
    if plan_key is not None:
        _keep_gemm_plan(plan_key, key, grid, args, consts, use_tma, quant_out, out, sout, (a, w1, s1, w2, s2, b1, b2))
    return done


def _keep_gemm_plan(plan_key, key, grid, args, consts, use_tma: bool, quant_out: bool, out, sout, tensors) -> None:
    """Keep fp8_gemm's plan for this layout (`args` as launched, `tensors` the arguments behind them)."""
    device = C.device_index(out.device)
    raw = _gemm_launch.raw(key, device)
    if raw is None:
        return
    a, w1, s1, w2, s2, b1, b2 = tensors
    aa, wa1, wa2 = args[0], args[2], args[4]

    def flat(i, t, d):  # argument i: a descriptor's encoded map, or a pointer
        return raw.encode(i, t.data_ptr(), d.shape, d.strides) if use_tma else (t.data_ptr(),)

    plan = _GemmPlan()
    plan.raw, plan.device, plan.grid, plan.quant_out = raw, device, grid, quant_out
    plan.out_shape, plan.out_dtype = tuple(out.shape), out.dtype
    plan.sout_shape = tuple(sout.shape)
    plan.a_maps = C.Maps(raw, 0, aa.shape, aa.strides) if use_tma else None
    plan.w_flat = (*flat(2, w1, wa1), s1.data_ptr(), *flat(4, w2, wa2), s2.data_ptr(),
                   0 if b1 is None else b1.data_ptr(), 0 if b2 is None else b2.data_ptr())
    plan.tail = (*args[15:], *consts)
    C.keep_plan(_plans, plan_key, plan)


def _weight_config(m: int, n: int, k: int, gated: bool, sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps, num_stages, SPLITS) for the weight-only kernel: 64-row slices, 4 warps, one
    scale block per step, and K split into up to 8 parts (a power of two) where the slices alone would leave SMs
    idle. From `benchmarks/fp8_stream_probe.py` on an H200 at 1 and 16 rows × 4096×14336 with fp16 MMAs and TMA
    (benchmarks/results/nvidia-h200/fp8-stream/): gate+up 43.5 µs unsplit, 3 stages (split 2 ways, 128-row slices
    of 8 warps, 5 stages: within 1 µs); down 25.1 µs split 8 ways, 4 stages (4 ways 26.3). The interpreter splits K
    in two (the CPU tests run both forms)."""
    block_m = max(16, triton.next_power_of_2(m))
    if C.INTERPRET:
        return 32, block_m, 4, 1, 2
    slices = triton.cdiv(n, 64)
    splits = 1 if slices >= sms else min(8, triton.next_power_of_2(4 * sms // slices + 1) // 2, triton.cdiv(k, 128))
    splits = max(1, splits)
    return 64, block_m, 4, 3 if splits == 1 else 4, splits


WEIGHT_ONLY_MAX_M = 64  # the weight-only kernel's largest M (its tiles keep M whole)
FP16_X_LIMIT = C.FP16_X_LIMIT  # 16-bit x at or past this magnitude overflows the kernel's fp16 copy
WEIGHT_TMA = True  # weight tiles through TMA descriptors where the card and the weights allow (tests switch it off)
# PDL: the weight-only kernel and its split reduction launched as programmatic dependents (each may start while the
# kernel before it drains: its first weight lines asked of L2, then the wait) where the card allows (C.pdl_ok). Off:
# in the 32-layer decode step it measured slightly slower (H200, CUDA graph: 0.782 / 0.787× eager's against 0.780 /
# 0.784× without; benchmarks/results/nvidia-h200/fp8-stream/). MLPFUSE_FP8_PDL=1 or the lab's mlpfuse-fp8-pdl
# variant turns it on.
PDL = os.environ.get("MLPFUSE_FP8_PDL", "0") == "1"
_REDUCE_BLOCK = 1024
NORM_NONE, NORM_WEIGHT_AFTER, NORM_ONE_PLUS = C.NORM_NONE, C.NORM_WEIGHT_AFTER, C.NORM_ONE_PLUS


class _TmaLaunch:
    """The weight-only kernel's launch for one layout with its weights' TMA maps encoded once (the weights' addresses
    are in the plan's key); the other tensors go as addresses. Holds no tensor."""

    __slots__ = ("raw", "index", "grid", "flat_w1", "flat_w2", "tail")

    def launch(self, tensors) -> None:
        x, _, s1, _, s2, b1, b2, out, part, nw, res, w1p, w2p = tensors  # the weights' maps are in the plan
        self.raw(self.grid, torch._C._cuda_getCurrentRawStream(self.index),
                 (x.data_ptr(), *self.flat_w1, s1.data_ptr(), *self.flat_w2, s2.data_ptr(), b1.data_ptr(),
                  b2.data_ptr(), out.data_ptr(), part.data_ptr(), nw.data_ptr(), res.data_ptr(), w1p.data_ptr(),
                  w2p.data_ptr(), *self.tail))


def _tma_launch(key, grid, ints, consts, device, w1, d1, w2, d2):
    """A _TmaLaunch once the kernel's compiled form exists and its C launcher can be called directly; else None."""
    index = C.device_index(device)
    raw = _weight_launch.raw(key, index)
    if raw is None:
        return None
    plan = _TmaLaunch()
    plan.raw, plan.index, plan.grid, plan.tail = raw, index, grid, (*ints, *consts)
    plan.flat_w1 = raw.encode(1, w1.data_ptr(), d1.shape, d1.strides)
    plan.flat_w2 = raw.encode(3, w2.data_ptr(), d2.shape, d2.strides)
    return plan


class _WeightPlan:
    """fp8_weight_gemm's launches for one layout (the kernel's — a _TmaLaunch or a C.PointerPlan — and the split
    reduction's when K is split), the output's and the partial sums' shapes. Holds no tensor."""

    __slots__ = ("main", "reduce", "out_cols", "part_shape", "tma")

    def run(self, x, w1, s1, w2, s2, b1, b2, norm_weight, residual):
        if self.tma and C.launch_hooks_set():
            return None  # a profiler's launch hook: the full path launches through Triton with descriptors
        out = torch.empty(x.shape[0], self.out_cols, device=x.device, dtype=x.dtype)
        part = torch.empty(self.part_shape, device=x.device, dtype=torch.float32) if self.reduce else out
        w2, s2 = (w1, s1) if w2 is None else (w2, s2)
        b1, b2 = x if b1 is None else b1, x if b2 is None else b2
        res = out if residual is None else residual
        self.main.launch((x, w1, s1, w2, s2, b1, b2, out, part, x if norm_weight is None else norm_weight, res, w1,
                          w2))
        if self.reduce is not None:
            self.reduce.launch((part, b1, b2, out, res))
        return out


def fp8_weight_gemm(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor | None = None,
                    s2: torch.Tensor | None = None, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    *, activation: int, allow_tf32: bool = False, norm_weight: torch.Tensor | None = None,
                    norm_eps: float = 0.0, norm_kind: int = NORM_NONE,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """z = act(x·W1ᵀ + b1) [· (x·W2ᵀ + b2)] for x [M ≤ 64, K] in bf16/fp16/fp32, the weights read as e4m3; with
    `norm_kind` (NORM_WEIGHT_AFTER or NORM_ONE_PLUS) x is first read through an RMSNorm of weight `norm_weight`;
    with `residual` (contiguous, z's shape and x's dtype) z + residual, added before the output's rounding."""
    plan_key = _plan_key("weight", (x, residual), (w1, s1, w2, s2, b1, b2, norm_weight), activation, allow_tf32,
                         norm_eps, norm_kind, PDL)
    plan = _plans.get(plan_key) if plan_key is not None else None
    if plan is not None:
        done = plan.run(x, w1, s1, w2, s2, b1, b2, norm_weight, residual)
        if done is not None:
            return done
    _check_act(x)
    m, k = x.shape
    if m > WEIGHT_ONLY_MAX_M:
        raise InputError(f"x: the weight-only kernel takes at most {WEIGHT_ONLY_MAX_M} rows, got {m}")
    n, gated, w2, s2 = _check_operands(w1, s1, w2, s2, b1, b2, k, x)
    C.check_norm(x, norm_weight, norm_eps, norm_kind, same_dtype=True)
    C.check_residual(residual, (m, n), x)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    block_n, block_m, warps, stages, splits = _weight_config(m, n, k, gated, C.num_sms(x.device))
    k_per = -(-k // (splits * 128)) * 128  # whole scale blocks per split
    splits = -(-k // k_per) if k else 1
    part = torch.empty(splits, 2, m, n, device=x.device, dtype=torch.float32) if splits > 1 else out
    bb1, bb2 = x if b1 is None else b1, x if b2 is None else b2
    nw = x if norm_weight is None else norm_weight
    res = out if residual is None else residual
    i64 = C.needs_i64(x, out, w1, w2, part)
    f16 = x.dtype != torch.float32
    use_tma = WEIGHT_TMA and C.tma_capable(x.device) and C.tma_ok(w1) and C.tma_ok(w2)
    wa1, wa2 = (C.desc(w1, [block_n, GROUP]), C.desc(w2, [block_n, GROUP])) if use_tma else (w1, w2)
    pdl = PDL and C.pdl_ok(x)
    consts = (activation, gated, b1 is not None, b2 is not None, C.dot_precision(x.dtype, allow_tf32), block_n,
              block_m, splits > 1, norm_kind, i64, f16, use_tma, residual is not None, pdl)
    key = (consts, x.dtype, n, k, k_per, x.stride(0), w1.stride(0), s1.stride(0), w2.stride(0), s2.stride(0),
           out.stride(0), C.align16(x), C.align16(out), C.align16(w1), C.align16(s1), C.align16(w2), C.align16(s2),
           C.align16(part), C.align16(nw), C.align16(res), b1 is None or (b1.dtype, C.align16(b1)),
           b2 is None or (b2.dtype, C.align16(b2)), warps, stages)
    ints = (m, n, k, k_per, x.stride(0), w1.stride(0), s1.stride(0), w2.stride(0), s2.stride(0), out.stride(0),
            res.stride(0), float(norm_eps), C.FP16_X_SHIFT)
    grid = (triton.cdiv(n, block_n), splits)
    _weight_launch(key, grid, (x, wa1, s1, wa2, s2, bb1, bb2, out, part, nw, res, w1, w2, *ints), consts,
                   num_warps=warps, num_stages=stages, launch_pdl=pdl)
    reduce = None
    if splits > 1:
        r_consts = (activation, gated, b1 is not None, b2 is not None, _REDUCE_BLOCK, i64, residual is not None, pdl)
        r_key = (r_consts, x.dtype, n, out.stride(0), C.align16(out), C.align16(res),
                 b1 is None or (b1.dtype, C.align16(b1)), b2 is None or (b2.dtype, C.align16(b2)))
        r_grid, r_ints = (triton.cdiv(m * n, _REDUCE_BLOCK),), (m, n, splits, out.stride(0), res.stride(0))
        _reduce_launch(r_key, r_grid, (part, bb1, bb2, out, res, *r_ints), r_consts, num_warps=4, num_stages=1,
                       launch_pdl=pdl)
        reduce = _pointer_launch(_reduce_launch, r_key, r_grid, r_ints, r_consts, 4, 1, x.device, pdl)
    if plan_key is None:
        return out
    if use_tma:
        main = _tma_launch(key, grid, ints, consts, x.device, w1, wa1, w2, wa2)
    else:
        main = _pointer_launch(_weight_launch, key, grid, ints, consts, warps, stages, x.device, pdl)
    if main is not None and (splits == 1 or reduce is not None):
        plan = _WeightPlan()
        plan.main, plan.reduce, plan.out_cols, plan.part_shape = main, reduce, n, tuple(part.shape)
        plan.tma = use_tma
        C.keep_plan(_plans, plan_key, plan)
    return out
