"""The block-scaled FP8 GEMM of `kernels.fp8_gemm` for Hopper, warp-specialized (Gluon): the same arithmetic and
epilogues, laid out so that the tensor cores keep running while a K block's sum is promoted.

The recipe scales every 128-wide K block's tensor-core sum by its own scales before adding it to the fp32
accumulator, so each block's MMA must finish before its promotion. In one stream of warps (the Triton kernel) the
warps run in step: every warp waits for its MMA, then scales, and the tensor cores idle through each promotion.
Here a program is three partitions:

    loader      one warp: the TMA loads of a stage — the two 64-row halves of x's tile and the weight tile(s) —
                into a ring of STAGES shared-memory buffers, `ready[s]` signalled by the copies' byte count
    consumer 0  four warps (one warpgroup): rows 0–63 of the 128-row tile; per K block its wgmma, the wait, the
                promotion (row scales × the weight block's scale), `empty[s]` arrived
    consumer 1  rows 64–127, the same

The two consumers share the stages but not a lockstep (each waits only on `ready`, the ring is released when both
have arrived), so one's MMA runs while the other scales, and the loader runs STAGES blocks ahead. PAIR: each stage
carries two weight tiles against one x tile — gated, gate's and up's at the same columns; otherwise the weight's
next 256 columns — and each K block's two products are promoted one after the other (at most three 64×128 fp32
tiles live per thread: two sums, one product; with save_gu the epilogue parks u in shared memory while g, h and u
are quantized). Without PAIR (for probes) a stage holds one weight tile, and a gated tile runs gate's K loop, parks
act(g) in shared memory, then runs up's. The
epilogue is `fp8_gemm`'s: biases, the activation, the GLU, then either the output in its dtype (or, TRANS_OUT, its
transpose) or quantized 1×128 (a 128-column tile is one scale group per row), the pre-activations too with
SAVE_GU.

Needs sm_90 (wgmma, TMA, setmaxnreg) and Triton's Gluon; `fp8_gemm` takes it on Hopper for the sizes where it
measured faster, the Triton kernel elsewhere (and under the interpreter: Gluon has none, so the CPU tests run the
Triton kernel, whose numerics this one repeats step for step).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mlpfuse.activations import act_fwd as _act_fwd
from mlpfuse.kernels import _common as C
from mlpfuse.kernels import fp8_gemm as _fp8_gemm

# The Triton helpers, compiled as Gluon functions (their bodies are plain elementwise and reduction code): the
# activation, the tile order and the 1×128 quantization (scale rule and rounding) are fp8_gemm's own.
_act = gluon.jit(_act_fwd.fn)
_tile_coords = gluon.jit(C.tile_coords.fn)
_quantize_rows = gluon.jit(_fp8_gemm._quantize_rows.fn)

BM = gl.constexpr(128)  # two consumer warpgroups of 64 rows (wgmma's M per warpgroup)
HALF = gl.constexpr(64)
BK = gl.constexpr(128)  # one scale group
CONSUMER_REGS = gl.constexpr(232)  # setmaxnreg: 2 × 232 + 40 ≤ 3 × 168 (the launch's maxnreg over 12 warps)
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _store_quantized(vq, sq, v, rm, rn, mmask, nmask, s_om, s_som, group):
    """v [64, 128] quantized 1×128 (one scale group per row: column group `group`), values and scales stored."""
    values, scale = _quantize_rows(gl.where(gl.expand_dims(nmask, 0), v, 0.0), False)
    mask = gl.expand_dims(mmask, 1) & gl.expand_dims(nmask, 0)
    gl.store(vq + gl.expand_dims(rm, 1) * s_om + gl.expand_dims(rn, 0), values, mask=mask)
    gl.store(sq + rm * s_som + group, scale, mask=mmask)


@gluon.jit
def _store(z, out, sout, rm, rn, mmask, nmask, s_om, s_som, group, QUANT_OUT: gl.constexpr,
           TRANS_OUT: gl.constexpr):
    if QUANT_OUT:
        _store_quantized(out, sout, z, rm, rn, mmask, nmask, s_om, s_som, group)
    else:
        mask = gl.expand_dims(mmask, 1) & gl.expand_dims(nmask, 0)
        if TRANS_OUT:  # zᵀ: out [N, M]
            at = gl.expand_dims(rn, 0) * s_om + gl.expand_dims(rm, 1)
        else:
            at = gl.expand_dims(rm, 1) * s_om + gl.expand_dims(rn, 0)
        gl.store(out + at, z.to(out.dtype.element_ty), mask=mask)


@gluon.jit
def _with_bias(acc, b, rn, nmask, HAS: gl.constexpr):
    if HAS:
        acc += gl.expand_dims(gl.load(b + rn, mask=nmask, other=0.0).to(gl.float32), 0)
    return acc


@gluon.jit
def _col_scaled(acc, cs, rn, nmask, HAS: gl.constexpr):
    if HAS:
        acc = acc * gl.expand_dims(gl.load(cs + rn, mask=nmask, other=1.0), 0)
    return acc


@gluon.jit
def _loader(a_desc, w1_desc, w2_desc, a0, a1, ws, ws2, ready, empty, M, N, K,
            GATED: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr):
    """Per tile and K block, x's two 64-row halves and the weight tile(s) into the ring's next stage. Gated without
    PAIR: gate's K blocks, then up's; PAIR: two weight tiles a stage — gated, gate's and up's at the same columns;
    else the weight's next 2·BN columns."""
    tn: gl.constexpr = BN * 2 if PAIR and not GATED else BN
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, tn)
    nk = gl.cdiv(K, BK)
    nbytes: gl.constexpr = BM * BK + (2 if PAIR else 1) * BN * BK  # e4m3: one byte a value
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * tn
        for w in gl.static_range(2 if GATED and not PAIR else 1):
            for ki in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                k0 = ki * BK
                tma.async_copy_global_to_shared(a_desc, [off_m, k0], bar, a0.index(s))
                tma.async_copy_global_to_shared(a_desc, [off_m + HALF, k0], bar, a1.index(s))
                tma.async_copy_global_to_shared(w1_desc if w == 0 else w2_desc, [off_n, k0], bar, ws.index(s))
                if PAIR:
                    if GATED:
                        tma.async_copy_global_to_shared(w2_desc, [off_n, k0], bar, ws2.index(s))
                    else:
                        tma.async_copy_global_to_shared(w1_desc, [off_n + BN, k0], bar, ws2.index(s))
                it += 1


@gluon.jit
def _k_sum(a_bufs, ws, ready, empty, it, sa, rm, mmask, s_sam, w_scale, s_ws, K, off_n,
           BN: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Σ_b sa[:, b]·sw_b·(a_b·w_bᵀ) over one weight tile's K blocks, from the ring's next stages (`it` counts the
    stages consumed so far): each block's wgmma, then its promotion with the rows' scales and the tile's one
    128×128 block scale. Returns (sum, it)."""
    acc = gl.zeros([HALF, BN], gl.float32, layout)
    p = gl.zeros([HALF, BN], gl.float32, layout)
    col_block = off_n // BK
    for ki in range(gl.cdiv(K, BK)):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        # The product's registers are the last product's (dead once promoted): use_acc=False ignores them.
        p = warpgroup_mma(a_bufs.index(s), ws.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
        sx = gl.load(sa + rm * s_sam + ki, mask=mmask, other=1.0) * gl.load(w_scale + col_block * s_ws + ki)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + p * gl.expand_dims(sx, 1)
        it += 1
    return acc, it


@gluon.jit
def _k_sum_pair(a_bufs, ws, ws2, ready, empty, it, sa, rm, mmask, s_sam, s1, s2, s_s1, s_s2, K, block1, block2,
                BN: gl.constexpr, STAGES: gl.constexpr, layout: gl.constexpr):
    """Two weight tiles' sums from stages that hold both (x's tile read once for the two): per K block the first
    tile's wgmma, its promotion, the second's, its promotion; the tiles' block scales are rows block1 of s1 and
    block2 of s2. A wait on the first promoted sum orders that promotion before the second wgmma, so that at most
    three 64×128 fp32 tiles are live (scheduled freely, the compiler hoisted the second MMA above the first
    promotion: four tiles, spilled)."""
    acc1 = gl.zeros([HALF, BN], gl.float32, layout)
    acc2 = gl.zeros([HALF, BN], gl.float32, layout)
    p = gl.zeros([HALF, BN], gl.float32, layout)
    for ki in range(gl.cdiv(K, BK)):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(s)
        p = warpgroup_mma(a, ws.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
        sx = gl.load(sa + rm * s_sam + ki, mask=mmask, other=1.0)
        sc1 = sx * gl.load(s1 + block1 * s_s1 + ki)
        sc2 = sx * gl.load(s2 + block2 * s_s2 + ki)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
        acc1 = acc1 + p * gl.expand_dims(sc1, 1)
        acc1, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, p))
        p = warpgroup_mma(a, ws2.index(s).permute((1, 0)), p, use_acc=False, is_async=True)
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc2 = acc2 + p * gl.expand_dims(sc2, 1)
        it += 1
    return acc1, acc2, it


@gluon.jit
def _consumer(a_bufs, shared, tail, HALF_INDEX: gl.constexpr, ACT: gl.constexpr, GATED: gl.constexpr,
              HAS_B1: gl.constexpr, HAS_B2: gl.constexpr, QUANT_OUT: gl.constexpr, SAVE_GU: gl.constexpr,
              TRANS_OUT: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              I64: gl.constexpr, PAIR: gl.constexpr, COL_SCALE: gl.constexpr):
    ws, ws2, zbuf, ready, empty = shared
    sa, s1, s2, b1, b2, out, sout, gq, gs, uq, us, cs, M, N, K, s_sam, s_s1, s_s2, s_om, s_som = tail
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    tn: gl.constexpr = BN * 2 if PAIR and not GATED else BN
    z_here = zbuf.index(HALF_INDEX)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, tn)
    it = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_n = pid_n * tn
        rm = pid_m * BM + HALF_INDEX * HALF + gl.arange(0, HALF, layout=rows_l)
        if I64:
            rm = rm.to(gl.int64)
        mmask = rm < M
        group = off_n // BK  # the output's first scale group (QUANT_OUT), the weights' block column
        if PAIR:
            if GATED:
                acc, acc2, it = _k_sum_pair(a_bufs, ws, ws2, ready, empty, it, sa, rm, mmask, s_sam, s1, s2, s_s1,
                                            s_s2, K, group, group, BN, STAGES, layout)
            else:
                # A second half past N (the last tile of an odd count) reads its zeros' scales from the last block
                # row: those columns are never stored, but the scales must be read inside the tensor.
                acc, acc2, it = _k_sum_pair(a_bufs, ws, ws2, ready, empty, it, sa, rm, mmask, s_sam, s1, s1, s_s1,
                                            s_s1, K, group, gl.minimum(group + 1, gl.cdiv(N, BK) - 1), BN, STAGES,
                                            layout)
        else:
            acc, it = _k_sum(a_bufs, ws, ready, empty, it, sa, rm, mmask, s_sam, s1, s_s1, K, off_n, BN, STAGES,
                             layout)
        # The columns' indices only now: kept through the K loop they would hold 32 more registers a thread.
        rn = off_n + gl.arange(0, BN, layout=cols_l)
        if I64:
            rn = rn.to(gl.int64)
        nmask = rn < N
        acc = _with_bias(_col_scaled(acc, cs, rn, nmask, COL_SCALE), b1, rn, nmask, HAS_B1)
        if PAIR and SAVE_GU:
            # u waits in shared memory while g, then h, then u are quantized, so that no quantization runs beside
            # more than one other 64×128 fp32 tile (with g and u both held through g's, ptxas spilled 1.1 KB a
            # thread for sm_90)
            z_here.store(_with_bias(acc2, b2, rn, nmask, HAS_B2))
            _store_quantized(gq, gs, acc, rm, rn, mmask, nmask, s_om, s_som, group)
            _store(_act(acc, ACT) * z_here.load(layout), out, sout, rm, rn, mmask, nmask, s_om, s_som, group,
                   QUANT_OUT, TRANS_OUT)
            _store_quantized(uq, us, z_here.load(layout), rm, rn, mmask, nmask, s_om, s_som, group)
        else:
            if SAVE_GU:
                _store_quantized(gq, gs, acc, rm, rn, mmask, nmask, s_om, s_som, group)
            z = _act(acc, ACT)
            if GATED:
                if not PAIR:
                    # act(g) waits in shared memory through up's K loop (in registers it would take 64 more a thread).
                    z_here.store(z)
                    acc2, it = _k_sum(a_bufs, ws, ready, empty, it, sa, rm, mmask, s_sam, s2, s_s2, K, off_n, BN,
                                      STAGES, layout)
                    z = z_here.load(layout)
                acc2 = _with_bias(acc2, b2, rn, nmask, HAS_B2)
                if SAVE_GU:
                    _store_quantized(uq, us, acc2, rm, rn, mmask, nmask, s_om, s_som, group)
                _store(z * acc2, out, sout, rm, rn, mmask, nmask, s_om, s_som, group, QUANT_OUT, TRANS_OUT)
            else:
                _store(z, out, sout, rm, rn, mmask, nmask, s_om, s_som, group, QUANT_OUT, TRANS_OUT)
                if PAIR:  # the tile's second 128 columns
                    rn2 = rn + BN
                    nmask2 = rn2 < N
                    z2 = _act(_with_bias(_col_scaled(acc2, cs, rn2, nmask2, COL_SCALE), b1, rn2, nmask2, HAS_B1),
                              ACT)
                    _store(z2, out, sout, rm, rn2, mmask, nmask2, s_om, s_som, group + 1, QUANT_OUT, TRANS_OUT)


@gluon.jit(do_not_specialize=["M"])
def mlpfuse_fp8_gemm_ws_kernel(
    a_desc, sa, w1_desc, s1, w2_desc, s2, b1, b2, out, sout, gq, gs, uq, us, cs,
    M, N, K, s_sam, s_s1, s_s2, s_om, s_som,
    ACT: gl.constexpr, GATED: gl.constexpr, HAS_B1: gl.constexpr, HAS_B2: gl.constexpr, QUANT_OUT: gl.constexpr,
    SAVE_GU: gl.constexpr, TRANS_OUT: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    I64: gl.constexpr, PAIR: gl.constexpr, COL_SCALE: gl.constexpr,
):
    """kernels.fp8_gemm.mlpfuse_fp8_gemm_kernel's z, warp-specialized (module docstring). a_desc: x's values
    [M, K] in [64, 128] boxes; w*_desc: the weights' [N, K] in [BN, 128] boxes. TRANS_OUT: z (not quantized) stored
    as zᵀ, out [N, M] of row stride s_om."""
    a0 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BK], a_desc.layout)
    a1 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BK], a_desc.layout)
    ws = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, BN, BK], w1_desc.layout)
    if PAIR:
        ws2 = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, BN, BK], w1_desc.layout)
    else:
        ws2 = ws
    z_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    zbuf = gl.allocate_shared_memory(gl.float32, [2 if GATED and (SAVE_GU or not PAIR) else 1, HALF, BN], z_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    shared = (ws, ws2, zbuf, ready, empty)
    tail = (sa, s1, s2, b1, b2, out, sout, gq, gs, uq, us, cs, M, N, K, s_sam, s_s1, s_s2, s_om, s_som)
    gl.warp_specialize([
        (_consumer, (a0, shared, tail, 0, ACT, GATED, HAS_B1, HAS_B2, QUANT_OUT, SAVE_GU, TRANS_OUT, BN, GROUP_M,
                     STAGES, I64, PAIR, COL_SCALE)),
        (_consumer, (a1, shared, tail, 1, ACT, GATED, HAS_B1, HAS_B2, QUANT_OUT, SAVE_GU, TRANS_OUT, BN, GROUP_M,
                     STAGES, I64, PAIR, COL_SCALE)),
        (_loader, (a_desc, w1_desc, w2_desc, a0, a1, ws, ws2, ready, empty, M, N, K, GATED, BN, GROUP_M, STAGES,
                   PAIR)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def descriptors(a, w1, w2, bn: int):
    """The kernel's TMA descriptors: x's values in [64, 128] boxes, the weights' in [bn, 128] (w2 may be w1)."""
    a_layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    ad = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [64, 128], a_layout)
    wd1 = TensorDescriptor(w1, list(w1.shape), [w1.stride(0), 1], [bn, 128], w_layout)
    wd2 = wd1 if w2 is w1 else TensorDescriptor(w2, list(w2.shape), [w2.stride(0), 1], [bn, 128], w_layout)
    return ad, wd1, wd2


def stages(gated: bool, pair: bool, save_gu: bool = False) -> int:
    """Ring depth: 4 for the paired forms (48 KB a stage: x's 128×128 tile and two weight tiles; at 8192 rows the
    fastest of 3 and 4 in both probe runs) but 3 with save_gu (its 64 KB of u parked for the epilogue), 4 for the
    two-loop gated form (32 KB a stage and 64 KB for act(g) of the two halves), 6 otherwise (32 KB a stage)."""
    if pair and gated and save_gu:
        return 3
    if pair or gated:
        return 4
    return 6


def launch(a, a_scale, w1, s1, w2, s2, b1, b2, out, sout, activation: int, quant_out: bool, *,
           saved=None, out_transposed: bool = False, stages_: int | None = None, group_m: int = 16,
           pair: bool = True, col_scale=None):
    """z into `out` (and `sout` when quant_out; zᵀ into out [N, M] when `out_transposed`), as
    kernels.fp8_gemm.fp8_gemm computes it, whose checks the arguments passed (TMA-ready row-major e4m3 operands on an
    sm_90 device). `saved`: (gq, gs, uq, us) to keep g and u too. `pair`: two weight tiles a stage (gated: gate's
    and up's; else 256 columns of the one weight); False for probes to time the one-tile forms. `col_scale`:
    fp8_gemm's."""
    m, k = a.shape
    n = w1.shape[0]
    gated = w2 is not None
    save_gu = saved is not None
    w2, s2 = (w2, s2) if gated else (w1, s1)
    bn = 128
    ad, wd1, wd2 = descriptors(a, w1, w2, bn)
    tiles = triton.cdiv(m, BM) * triton.cdiv(n, bn * (2 if pair and not gated else 1))
    grid = (min(tiles, C.num_sms(a.device)),)
    i64 = C.needs_i64(a, out, w1, w2)
    mlpfuse_fp8_gemm_ws_kernel[grid](
        ad, a_scale, wd1, s1, wd2, s2, a_scale if b1 is None else b1, a_scale if b2 is None else b2, out, sout,
        *(saved or (out, sout, out, sout)), a_scale if col_scale is None else col_scale, m, n, k,
        a_scale.stride(0), s1.stride(0), s2.stride(0), out.stride(0), sout.stride(0), activation, gated,
        b1 is not None, b2 is not None, quant_out, save_gu, out_transposed, bn, group_m,
        stages_ or stages(gated, pair, save_gu), i64, pair, col_scale is not None, num_warps=4, maxnreg=168)


def gemm(a, a_scale, w1, s1, w2=None, s2=None, b1=None, b2=None, *, activation: int, quant_out: bool,
         out_dtype=None, save_gu: bool = False, out_transposed: bool = False, col_scale=None, **options):
    """kernels.fp8_gemm.fp8_gemm's result on this kernel alone (its arguments as that function checks them; for
    probes and tests: fp8_gemm takes this kernel itself where it measured faster). `options`: launch's."""
    out, sout, saved, done = _fp8_gemm.outputs(a, a_scale, w1.shape[0], quant_out, out_dtype, save_gu,
                                               out_transposed)
    launch(a, a_scale, w1, s1, w2, s2, b1, b2, out, sout, activation, quant_out, saved=saved if save_gu else None,
           out_transposed=out_transposed, col_scale=col_scale, **options)
    return done
