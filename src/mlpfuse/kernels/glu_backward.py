"""GLU backward fused into the epilogue of the dh GEMM.

    dh = dy·Wd              dy [M,D], Wd [D,N] (the down projection's nn.Linear weight), dh [M,N]
    dg = dh·u·act'(g)       du = dh·act(g)       h = act(g)·u

dh never reaches HBM: the epilogue loads the matching g and u tiles and writes dg and du (the inputs of the dx/dWg/dWu
GEMMs) and h (the input of the dWd GEMM; the training path now saves h from the forward instead).

Measured on an H200 (benchmarks/results/kernels-h200.md, tune-h200.md) the fused form loses: without warp
specialization the epilogue's [M, N] streams do not overlap the main loop, and cuBLAS's dh GEMM followed by the
single pass of `glu_backward_split` (below) is faster (130 vs 200 µs at 8192×768×3072; 134 vs 161 µs once the
activation math got cheaper). Both are kept; the dispatch picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlpfuse import fp8
from mlpfuse.activations import act_fwd, act_grad
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels._common import tile_coords
from mlpfuse.kernels.configs import KernelConfig, pick
from mlpfuse.kernels.fp8_gemm import _EMULATE, _quantize_cols, _quantize_rows


@triton.jit(do_not_specialize=["M"])
def mlpfuse_glu_backward_kernel(
    dy, wd,  # pointers, or TMA descriptors when TMA
    g, u, dg, du, h,
    M, N, K,  # K is D, the down projection's output width
    sym, syk, swk, swn, sgm, sgn, sum_, sun, sdgm, sdgn, sdum, sdun, shm, shn,
    ACT: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    PREFETCH: tl.constexpr, I64: tl.constexpr, WRITE_H: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    out_ty = dg.dtype.element_ty
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        if I64:  # offsets past 2**31 elements: index math in 64 bits (C.needs_i64)
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        if PREFETCH:
            # Issue the g/u reads before the K loop (kept as 16-bit, two column halves) so their latency hides behind
            # the MMAs instead of stalling the epilogue.
            W: tl.constexpr = BN // 2
            rn0 = off_n + tl.arange(0, W)
            if I64:
                rn0 = rn0.to(tl.int64)
            rn1 = rn0 + W
            m0 = (rm[:, None] < M) & (rn0[None, :] < N)
            m1 = (rm[:, None] < M) & (rn1[None, :] < N)
            g0 = tl.load(g + rm[:, None] * sgm + rn0[None, :] * sgn, mask=m0, other=0.0)
            u0 = tl.load(u + rm[:, None] * sum_ + rn0[None, :] * sun, mask=m0, other=0.0)
            g1 = tl.load(g + rm[:, None] * sgm + rn1[None, :] * sgn, mask=m1, other=0.0)
            u1 = tl.load(u + rm[:, None] * sum_ + rn1[None, :] * sun, mask=m1, other=0.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BK
            if TMA:
                a = dy.load([off_m, k0])
                b = wd.load([k0, off_n])
            else:
                rk = k0 + tl.arange(0, BK)
                if I64:
                    rk = rk.to(tl.int64)
                a = tl.load(dy + rm[:, None] * sym + rk[None, :] * syk, mask=(rm[:, None] < M) & (rk[None, :] < K),
                            other=0.0)
                b = tl.load(wd + rk[:, None] * swk + rn[None, :] * swn, mask=(rk[:, None] < K) & (rn[None, :] < N),
                            other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)

        # Epilogue in two column halves: with the whole tile, acc + g + u + the activation's temporaries exceed the
        # register file and spill; halves keep it on chip.
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        if PREFETCH:
            _glu_bwd_math(acc0, g0.to(tl.float32), u0.to(tl.float32), rm, rn0, m0, dg, du, h,
                          sdgm, sdgn, sdum, sdun, shm, shn, ACT, out_ty, WRITE_H)
            _glu_bwd_math(acc1, g1.to(tl.float32), u1.to(tl.float32), rm, rn1, m1, dg, du, h,
                          sdgm, sdgn, sdum, sdun, shm, shn, ACT, out_ty, WRITE_H)
        else:
            _glu_bwd_store(acc0, rm, off_n, g, u, dg, du, h, M, N, sgm, sgn, sum_, sun, sdgm, sdgn, sdum, sdun,
                           shm, shn, ACT, BN // 2, out_ty, WRITE_H)
            _glu_bwd_store(acc1, rm, off_n + BN // 2, g, u, dg, du, h, M, N, sgm, sgn, sum_, sun, sdgm, sdgn,
                           sdum, sdun, shm, shn, ACT, BN // 2, out_ty, WRITE_H)


@triton.jit
def _glu_bwd_math(dh, gv, uv, rm, rn, mask, dg, du, h, sdgm, sdgn, sdum, sdun, shm, shn,
                  ACT: tl.constexpr, out_ty: tl.constexpr, WRITE_H: tl.constexpr):
    ag = act_fwd(gv, ACT)
    tl.store(dg + rm[:, None] * sdgm + rn[None, :] * sdgn, (dh * uv * act_grad(gv, ACT)).to(out_ty), mask=mask)
    tl.store(du + rm[:, None] * sdum + rn[None, :] * sdun, (dh * ag).to(out_ty), mask=mask)
    if WRITE_H:
        tl.store(h + rm[:, None] * shm + rn[None, :] * shn, (ag * uv).to(out_ty), mask=mask)

@triton.jit
def _glu_bwd_store(dh, rm, off_n, g, u, dg, du, h, M, N, sgm, sgn, sum_, sun, sdgm, sdgn, sdum, sdun, shm, shn,
                   ACT: tl.constexpr, W: tl.constexpr, out_ty: tl.constexpr, WRITE_H: tl.constexpr):
    rn = (off_n + tl.arange(0, W)).to(rm.dtype)  # int64 when the caller's rows are
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    gv = tl.load(g + rm[:, None] * sgm + rn[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + rm[:, None] * sum_ + rn[None, :] * sun, mask=mask, other=0.0).to(tl.float32)
    _glu_bwd_math(dh, gv, uv, rm, rn, mask, dg, du, h, sdgm, sdgn, sdum, sdun, shm, shn, ACT, out_ty, WRITE_H)

def matmul_glu_backward(
    dy: torch.Tensor,
    w_down: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    *,
    activation: int,
    allow_tf32: bool = True,
    out=None,
    want_h: bool = True,
    config: KernelConfig | None = None,
):
    """(dg, du, h) with dh = dy·w_down, dg = dh·u·act'(g), du = dh·act(g), h = act(g)·u.

    `out` (optional) is a tuple (dg, du, h) written in place (h may be None without `want_h`). `want_h=False`:
    h is not computed (the forward saved it) and None is returned in its place. dg and du may be g and u
    themselves: each element is read and then written by the same program. `config` overrides the table (tuning
    only).
    """
    C.check_2d("dy", dy, dy)
    C.check_2d("w_down", w_down, dy)
    C.check_2d("g", g, dy)
    C.check_2d("u", u, dy)
    M, D = dy.shape
    N = w_down.shape[1]
    if w_down.shape[0] != D:
        raise InputError(f"w_down: expected shape ({D}, N), got {tuple(w_down.shape)}")
    if tuple(g.shape) != (M, N) or tuple(u.shape) != (M, N):
        raise InputError(f"g, u: expected shape ({M}, {N}), got {tuple(g.shape)}, {tuple(u.shape)}")
    if not want_h:
        dg, du = C.outputs(out[:2] if out is not None else None, [(M, N)] * 2, dy)
        h = None
    else:
        dg, du, h = C.outputs(out, [(M, N)] * 3, dy)
    if M == 0 or N == 0:
        return dg, du, h
    h_arg = h if want_h else dg  # never written without WRITE_H

    dev = dy.device
    sms = C.num_sms(dev)
    cfg = config or pick("glu_bwd", dy.dtype, M, N, device=dev, num_sms=sms, arch=C.arch_major(dev), k=D,
                          name=C.device_name(dev))
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    use_tma = cfg.tma and C.tma_capable(dev) and D > 0 and C.tma_ok(dy) and C.tma_ok(w_down)
    ya, wa = (C.desc(dy, [BM, BK]), C.desc(w_down, [BK, BN])) if use_tma else (dy, w_down)
    mlpfuse_glu_backward_kernel[(C.grid_size(cfg, sms, M, N),)](
        ya, wa, g, u, dg, du, h_arg,
        M, N, D,
        dy.stride(0), dy.stride(1), w_down.stride(0), w_down.stride(1), g.stride(0), g.stride(1),
        u.stride(0), u.stride(1), dg.stride(0), dg.stride(1), du.stride(0), du.stride(1), h_arg.stride(0),
        h_arg.stride(1),
        ACT=activation, TMA=use_tma, DOT_PREC=C.dot_precision(dy.dtype, allow_tf32),
        BM=BM, BN=BN, BK=BK, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, PREFETCH=cfg.prefetch,
        I64=C.needs_i64(dy, w_down, g, u, dg, du, h_arg), WRITE_H=want_h,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return dg, du, h


@triton.jit(do_not_specialize=["M"])
def mlpfuse_glu_backward_pointwise_kernel(
    dh, g, u, dg, du, h, dbg, dbu, sg, su,
    M, N,
    shm, shn, sgm, sgn, sum_, sun, sdgm, sdgn, sdum, sdun, shhm, shhn, s_sgm, s_sum,
    ACT: tl.constexpr, WRITE_H: tl.constexpr, BIAS_SUMS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, I64: tl.constexpr, G8: tl.constexpr,
):
    # G8: g and u in the FP8 recipe (e4m3 values, the fp32 scale_inv of each row's 128-column group at sg, su),
    # dequantized as they are read.
    # One program walks ROWS rows of a BN-wide column strip, so the bias gradients (column sums of dg and du) stay
    # in fp32 registers and cost one atomic per column per program instead of rounding dg/du to 16 bits first.
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if I64:  # offsets past 2**31 elements: index math in 64 bits (C.needs_i64)
        rn = rn.to(tl.int64)
    mask_n = rn < N
    sum_g = tl.zeros((BN,), tl.float32)
    sum_u = tl.zeros((BN,), tl.float32)
    out_ty = dg.dtype.element_ty
    for r0 in range(0, ROWS, BM):
        rm = tl.program_id(0) * ROWS + r0 + tl.arange(0, BM)
        if I64:
            rm = rm.to(tl.int64)
        mask = (rm[:, None] < M) & mask_n[None, :]
        d = tl.load(dh + rm[:, None] * shm + rn[None, :] * shn, mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(g + rm[:, None] * sgm + rn[None, :] * sgn, mask=mask, other=0.0).to(tl.float32)
        uv = tl.load(u + rm[:, None] * sum_ + rn[None, :] * sun, mask=mask, other=0.0).to(tl.float32)
        if G8:
            grp = rm[:, None] * 0 + (rn // 128)[None, :]
            gv = gv * tl.load(sg + rm[:, None] * s_sgm + grp, mask=mask, other=1.0)
            uv = uv * tl.load(su + rm[:, None] * s_sum + grp, mask=mask, other=1.0)
        a = act_fwd(gv, ACT)
        dgv = d * uv * act_grad(gv, ACT)
        duv = d * a
        tl.store(dg + rm[:, None] * sdgm + rn[None, :] * sdgn, dgv.to(out_ty), mask=mask)
        tl.store(du + rm[:, None] * sdum + rn[None, :] * sdun, duv.to(out_ty), mask=mask)
        if WRITE_H:
            tl.store(h + rm[:, None] * shhm + rn[None, :] * shhn, (a * uv).to(out_ty), mask=mask)
        if BIAS_SUMS:
            sum_g += tl.sum(dgv, axis=0)  # masked elements have d = 0, so they add nothing
            sum_u += tl.sum(duv, axis=0)
    if BIAS_SUMS:
        tl.atomic_add(dbg + rn, sum_g, mask=mask_n, sem="relaxed")
        tl.atomic_add(dbu + rn, sum_u, mask=mask_n, sem="relaxed")


def glu_backward_split(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, *, activation: int, want_h: bool = False,
                       bias_sums: bool = False, out=None, out_h=None, tile: tuple[int, int, int, int] | None = None,
                       g_scale: torch.Tensor | None = None, u_scale: torch.Tensor | None = None):
    """(dg, du, h, dgate_bias, dup_bias) from a dh computed elsewhere (e.g. by cuBLAS), in one pass over dh, g, u.

    dg = dh·u·act'(g), du = dh·act(g); h = act(g)·u when `want_h` (the dW_down GEMM's input), else None; the bias
    gradients (column sums of dg and du, accumulated in fp32) when `bias_sums`, else None. The split form of
    `matmul_glu_backward`: on an H200 at 8192×768×3072 the fused epilogue (Triton 3.6, no warp specialization) ran
    slower than cuBLAS's dh GEMM plus this single pass (benchmarks/results/kernels-h200.md). The bias sums use
    fp32 atomics, so their last bits may vary run to run. `out` (optional): caller-owned (dg, du), any strides
    (e.g. the two column halves of one [M, 2·N] buffer; g and u themselves: each element is read before the same
    program overwrites it). `out_h` (with want_h): where h goes, dh itself allowed for the same reason.
    `tile` overrides (BM, BN, ROWS, warps) (tuning only). `g_scale`, `u_scale`: g and u are e4m3 values in the FP8
    recipe (mlpfuse.fp8) with these fp32 scale_inv [M, ceil(N/128)], dequantized as they are read (dg, du, h come
    out in dh's dtype; `out` cannot then be g and u).
    """
    if g_scale is not None or u_scale is not None:
        _check_fp8_pair(dh, g, g_scale, "g")
        _check_fp8_pair(dh, u, u_scale, "u")
        if out is not None and any(o is g or o is u for o in out):
            raise InputError("out: FP8 g and u cannot receive dg and du")
    else:
        _check_pointwise_args(dh, g, u)
    M, N = dh.shape
    dg, du = C.outputs(out, [(M, N)] * 2, dh)
    h = (C.outputs(out_h, [(M, N)], dh, "out_h")[0] if out_h is not None else torch.empty_like(dh)) if want_h else None
    dbg = torch.zeros(N, device=dh.device, dtype=torch.float32) if bias_sums else None
    dbu = torch.zeros(N, device=dh.device, dtype=torch.float32) if bias_sums else None
    if M > 0 and N > 0:
        _launch_pointwise(dh, g, u, dg, du, h, dbg, dbu, activation, tile, g_scale, u_scale)
    return dg, du, h, dbg, dbu


def _check_fp8_pair(dh, values, scale, name: str) -> None:
    groups = (dh.shape[0], -(-dh.shape[1] // fp8.GROUP))
    if (not isinstance(values, torch.Tensor) or values.dtype != fp8.DTYPE or values.shape != dh.shape
            or values.device != dh.device or not isinstance(scale, torch.Tensor) or scale.dtype != fp8.SCALE_DTYPE
            or tuple(scale.shape) != groups or scale.stride(1) != 1 or scale.device != dh.device):
        raise InputError(f"{name}, {name}_scale: expected {fp8.DTYPE} values of shape {tuple(dh.shape)} and "
                         f"{fp8.SCALE_DTYPE} scales of shape {groups} (unit column stride) on {dh.device}")


def _check_pointwise_args(dh, g, u):
    for name, t in (("dh", dh), ("g", g), ("u", u)):
        C.check_2d(name, t, dh)
    if g.shape != dh.shape or u.shape != dh.shape:
        raise InputError(f"g, u: expected shape {tuple(dh.shape)}, got {tuple(g.shape)}, {tuple(u.shape)}")


_launch_pointwise_kernel = C.Launcher(mlpfuse_glu_backward_pointwise_kernel)


# (BM, BN, ROWS, warps) of the pointwise pass: a program walks ROWS rows of a BN-wide strip, BM rows per step.
# At 8192×3072 bf16 on an H200: 68.5 µs, vs 72.2 for (8, 256, 64, 4) (`tune_kernels.py --only blog`).
_POINTWISE_TILE = (16, 256, 64, 4)
# Fewer rows (the SPLIT training path's few tokens): ROWS halves down to BM until the grid fills the SMs twice,
# and below that the strips narrow to this tile (64 threads, 16 elements each), rather than leave most SMs idle
# (64×3072 in 64-row programs: 12 programs on 132 SMs).
_POINTWISE_TILE_SMALL = (8, 128, 8, 2)
_POINTWISE_TILE_INTERPRET = (4, 16, 8, 4)


def _pointwise_tile(M: int, N: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, ROWS, warps) for an [M, N] pass on a GPU of `sms` SMs."""
    bm, bn, rows, warps = _POINTWISE_TILE
    programs = lambda r, n: -(-M // r) * -(-N // n)  # noqa: E731
    while rows > bm and programs(rows, bn) < 2 * sms:
        rows //= 2
    if programs(rows, bn) >= 2 * sms:
        return bm, bn, rows, warps
    return _POINTWISE_TILE_SMALL


def _launch_pointwise(dh, g, u, dg, du, h, dbg, dbu, activation, tile=None, g_scale=None, u_scale=None):
    M, N = dh.shape
    # Placeholders for what the kernel never touches (WRITE_H, BIAS_SUMS, G8 off).
    tensors = (dh, g, u, dg, du, h if h is not None else dg, dbg if dbg is not None else dg,
               dbu if dbu is not None else dg, g_scale if g_scale is not None else dg,
               u_scale if u_scale is not None else dg)
    # Everything the launch decides from shapes, strides, alignments and flags, decided once per layout (a training
    # step repeats the same one): the int64 test alone walks six tensors' shapes and strides.
    memo_key = (M, N, dh.dtype, dh.device, tuple(t.stride() for t in tensors[:6]),
                tuple(t.data_ptr() & 15 for t in tensors), activation, h is not None, dbg is not None, tile,
                g.dtype, tensors[8].stride(0), tensors[9].stride(0))
    plan = _pointwise_plans.get(memo_key)
    if plan is None:
        plan = _PointwisePlan(tensors, activation, h is not None, dbg is not None, tile)
        C.keep_plan(_pointwise_plans, memo_key, plan)
    plan.launch(tensors)


def cached_plan(rows: int, cols: int, dtype: torch.dtype, device: torch.device, *, activation: int, want_h: bool,
                bias_sums: bool) -> "_PointwisePlan | None":
    """The plan an earlier `glu_backward_split` call made for contiguous [rows, cols] dh, g, u, dg, du (and h) at
    16-byte aligned addresses (fresh from a GEMM or the allocator) with these flags, or None. A caller whose own memo
    fixes that layout may call `plan.run(...)` and skip the checks and this key per call."""
    contiguous = ((cols, 1),) * 6
    return _pointwise_plans.get((rows, cols, dtype, device, contiguous, (0,) * 10, activation, want_h, bias_sums, None,
                                 dtype, cols, cols))


class _PointwisePlan(C.PointerPlan):
    """One layout's launch of the pointwise pass (see C.PointerPlan): tile, grid, integer arguments and constexprs
    decided once, with the flags and sizes `run` needs."""

    __slots__ = ("cols", "want_h", "sums", "device")

    def __init__(self, tensors, activation: int, want_h: bool, sums: bool, tile):
        dh = tensors[0]
        M, N = dh.shape
        if tile is None:
            cuda = dh.device.type == "cuda"
            tile = _pointwise_tile(M, N, C.num_sms(dh.device)) if cuda else _POINTWISE_TILE_INTERPRET
        BM, BN, rows, warps = tile
        strides = tuple(t.stride() for t in tensors[:6])
        g8 = tensors[1].dtype == fp8.DTYPE
        consts = (activation, want_h, sums, BM, BN, rows, C.needs_i64(*tensors[:6]), g8)
        # What the compiled kernel is specialized on (all but M): see C.Launcher.
        key = (consts, warps, dh.dtype, N, strides, tuple(C.align16(t) for t in tensors), tensors[8].stride(0),
               tensors[9].stride(0))
        super().__init__(_launch_pointwise_kernel, key, (-(-M // rows), -(-N // BN)),
                         (M, N, *(n for st in strides for n in st), tensors[8].stride(0), tensors[9].stride(0)),
                         consts, warps, 3, dh.device)
        self.cols, self.want_h, self.sums, self.device = N, want_h, sums, dh.device

    def run(self, dh, g, u, dg, du, h=None):
        """(dgate_bias, dup_bias), both None unless the plan sums biases, for tensors of this plan's layout; h
        (dh itself allowed) only with a plan that writes it."""
        dbg = dbu = None
        if self.sums:
            dbg = torch.zeros(self.cols, device=self.device, dtype=torch.float32)
            dbu = torch.zeros(self.cols, device=self.device, dtype=torch.float32)
        self.launch((dh, g, u, dg, du, h if h is not None else dg, dbg if dbg is not None else dg,
                     dbu if dbu is not None else dg, dg, dg))
        return dbg, dbu


_pointwise_plans: dict = {}


def glu_backward_pointwise(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, *, activation: int, out=None):
    """(dg, du) = (dh·u·act'(g), dh·act(g)) in one pass; `out` takes caller-owned (dg, du)."""
    return glu_backward_split(dh, g, u, activation=activation, out=out)[:2]


# ---------------------------------------------------------------- FP8 training: the GLU backward, quantized


@triton.jit
def mlpfuse_fp8_glu_backward_kernel(
    dh, gq, gs, uq, us, o1, s1, o2, s2, o3, s3, sums,
    M, N, s_dh, s_g, s_gs, s_o, s_os,
    ACT: tl.constexpr, ALONG_TOKENS: tl.constexpr, SUMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    EMULATE: tl.constexpr, I64: tl.constexpr,
):
    """A [BM tokens, BN channels] tile of dh [M, N] fp32 and the e4m3 g, u [M, N] with their 1×128 scales: dg =
    dh·u·act'(g), du = dh·act(g), h = act(g)·u, never written in fp32, each quantized for the GEMM that reads it.
    ALONG_TOKENS off (BN = 128: a tile row is one channel group): dg → o1/s1 and du → o2/s2, [M, N] and [M, N/128]
    (dx's operands). ALONG_TOKENS (BM = 128: a tile column is one token group): dgᵀ → o1/s1, duᵀ → o2/s2, hᵀ → o3/s3,
    [N, M] and [N, M/128] (the weight gradients' operands), and with SUMS the tile's column sums of dg and du (the
    bias gradients' parts) into sums [2, M/128, N]. Two passes rather than one: a [128, 128] tile serving both
    quantizations keeps several fp32 tensors live through the divisions' slow-path calls, and spilled (ptxas,
    sm_90: 9–20 KB a thread at 8–16 warps); narrow tiles of two passes spill nothing. Between them the passes read
    dh, g and u twice and write each output once: 18 bytes an element against the ~43 of an fp32 dg, du, h and five
    quantizations, and no fp32 [M, N] tensor beside dh."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    if I64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    mask = mmask[:, None] & nmask[None, :]
    group = rm[:, None] * s_gs + (rn // 128)[None, :]
    d = tl.load(dh + rm[:, None] * s_dh + rn[None, :], mask=mask, other=0.0)
    g = tl.load(gq + rm[:, None] * s_g + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    g = g * tl.load(gs + group, mask=mask, other=1.0)
    u = tl.load(uq + rm[:, None] * s_g + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = u * tl.load(us + group, mask=mask, other=1.0)
    a = act_fwd(g, ACT)
    dg = d * u * act_grad(g, ACT)  # masked elements: d = 0, so dg = du = 0 (and h = 0: g = u = 0)
    du = d * a
    if ALONG_TOKENS:
        # [N, M] outputs, stored from the quantized tile transposed (its e4m3 bytes, through shared memory) along
        # their rows, in vectors where M is a multiple of 16 (M is specialized for that: the launch key)
        at = rn[:, None] * s_o + rm[None, :]
        mask = nmask[:, None] & mmask[None, :]
        scale_at, scale_mask = rn * s_os + tl.program_id(0), nmask
        if SUMS:
            parts = tl.num_programs(0) * N
            tl.store(sums + tl.program_id(0) * N + rn, tl.sum(dg, axis=0), mask=nmask)
            tl.store(sums + parts + tl.program_id(0) * N + rn, tl.sum(du, axis=0), mask=nmask)
    else:
        at = rm[:, None] * s_o + rn[None, :]  # [M, N] outputs
        scale_at, scale_mask = rm * s_os + tl.program_id(1), mmask
    _store_fp8(dg, o1, s1, at, scale_at, mask, scale_mask, ALONG_TOKENS, EMULATE)
    _store_fp8(du, o2, s2, at, scale_at, mask, scale_mask, ALONG_TOKENS, EMULATE)
    if ALONG_TOKENS:
        _store_fp8(a * u, o3, s3, at, scale_at, mask, scale_mask, ALONG_TOKENS, EMULATE)


@triton.jit
def _store_fp8(v, values, scales, at, scale_at, mask, scale_mask, ALONG_TOKENS: tl.constexpr,
               EMULATE: tl.constexpr):
    """v quantized 1×128 along the tile's columns (ALONG_TOKENS: a column is a token group) or its rows."""
    if ALONG_TOKENS:
        q, sc = _quantize_cols(v, EMULATE)
        q = tl.trans(q)  # `at` and `mask` address the transposed tile
    else:
        q, sc = _quantize_rows(v, EMULATE)
    tl.store(values + at, q, mask=mask)
    tl.store(scales + scale_at, sc, mask=scale_mask)


_fp8_launch = C.Launcher(mlpfuse_fp8_glu_backward_kernel)
# The narrow side of both passes' tiles (rows of the channel-group pass, columns of the token-group pass). Compiled
# for sm_90 at 4 warps, 8, 16 and 32 spill nothing. Timed on an H200 (4096×14336, both passes, 4 warps each;
# benchmarks/fp8_train_probe.py): 8 1252 µs, 16 1251, 32 1625 (with the token pass's stores as vectors; before,
# 1398 / 1630 / 2174).
_FP8_NARROW = 8
# Warps per program of each pass (channel groups, token groups). The token pass's column reductions cross its warps
# (SASS for sm_90 at 4 warps: 39 barriers and ~265 instructions an element a thread against ~122 for the channel
# pass). Both passes on an H200 (4096×14336, benchmarks/fp8_train_probe.py, narrow side 8): 4/4 1252 µs, 4/2 1023,
# 4/1 1041, 2/2 971 (narrow 16: 4/2 1125, 4/1 1049, 8/4 1327); after the divisions went call-free, 2/2 964, 2/1 834,
# 1/1 827, 1/2 951, 4/4 1191 (narrow 4 at 1/1: 885).
_FP8_WARPS = (1, 1)


def fp8_glu_backward(dh: torch.Tensor, g: torch.Tensor, g_scale: torch.Tensor, u: torch.Tensor,
                     u_scale: torch.Tensor, *, activation: int, bias_sums: bool = False, joined: tuple | None = None):
    """FP8 training's GLU backward from the dh GEMM's fp32 output and the forward's e4m3 g, u (1×128 scales), its
    outputs quantized for the GEMMs that read them (mlpfuse_fp8_glu_backward_kernel, two passes): returns
    ((dg values, scales), (du values, scales)) 1×128 along the channels, then ((values, scales) of dgᵀ, duᵀ, hᵀ)
    1×128 along the tokens, then the column sums of dg and du (fp32, added in a fixed order: None unless
    `bias_sums`). Bit for bit `fp8_gemm.quantize` of glu_backward_split's fp32 dg, du, h and of their transposes.
    `joined` (N a multiple of 128): (values [M, 2N], scales [M, 2N/128]) to write dg and du into side by side, one
    operand for dx = [dg | du]·[Wg; Wu] as one GEMM."""
    _check_fp8_pair(dh, g, g_scale, "g")
    _check_fp8_pair(dh, u, u_scale, "u")
    if dh.dtype != torch.float32 or dh.stride(1) != 1 or g.stride() != u.stride() or g.stride(1) != 1 \
            or g_scale.stride() != u_scale.stride():
        raise InputError("dh: expected fp32 with unit column stride, and g, u (and their scales) of one layout")
    m, n = dh.shape
    gm, gn = -(-m // fp8.GROUP), -(-n // fp8.GROUP)

    def quantized(rows, cols, groups):
        return (torch.empty(rows, cols, device=dh.device, dtype=fp8.DTYPE),
                torch.empty(rows, groups, device=dh.device, dtype=fp8.SCALE_DTYPE))

    if joined is not None:
        jv, js = joined
        if (n % fp8.GROUP or jv.shape != (m, 2 * n) or js.shape != (m, 2 * gn) or jv.dtype != fp8.DTYPE
                or js.dtype != fp8.SCALE_DTYPE or not jv.is_contiguous() or not js.is_contiguous()):
            raise InputError(f"joined: expected contiguous {fp8.DTYPE} ({m}, {2 * n}) and fp32 ({m}, {2 * gn}) "
                             f"with N a multiple of {fp8.GROUP}")
        dg = jv[:, :n], js[:, :gn]
        du = jv[:, n:], js[:, gn:]
    else:
        dg, du = quantized(m, n, gn), quantized(m, n, gn)
    dgt, dut, ht = quantized(n, m, gm), quantized(n, m, gm), quantized(n, m, gm)
    sums = torch.empty(2, gm, n, device=dh.device, dtype=torch.float32) if bias_sums else None
    if m and n:
        i64 = C.needs_i64(dh, g, dgt[0])
        for along, (bm, bn), outs, ints in (
                (False, (_FP8_NARROW, 128), (*dg, *du, *du),
                 (dh.stride(0), g.stride(0), g_scale.stride(0), dg[0].stride(0), dg[1].stride(0))),
                (True, (128, _FP8_NARROW), (*dgt, *dut, *ht), (dh.stride(0), g.stride(0), g_scale.stride(0), m, gm))):
            consts = (activation, along, bias_sums and along, bm, bn, _EMULATE, i64)
            # M specialized (its multiple-of-16 fact lets the token pass's transposed stores hold over 16 bytes)
            key = (consts, n, C.int_class(m), *ints, tuple(C.align16(t) for t in (dh, g, u, g_scale, u_scale, *outs)))
            warps = _FP8_WARPS[1 if along else 0]
            _fp8_launch((key, warps), (-(-m // bm), -(-n // bn)), (dh, g, g_scale, u, u_scale, *outs,
                                                                  sums if sums is not None else dh, m, n, *ints),
                        consts, num_warps=warps, num_stages=1)
    bias = (sums[0].sum(0), sums[1].sum(0)) if bias_sums else (None, None)
    return dg, du, dgt, dut, ht, *bias
