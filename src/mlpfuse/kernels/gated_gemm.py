"""Gate and up projections in one GEMM, the GLU applied in its epilogue.

    g = x·Wgᵀ + bg,   u = x·Wuᵀ + bu,   h = act(g)·u          x [M,K], Wg/Wu [N,K], h [M,N]

One program owns an (BM, BN) tile of h. Each K step loads one x tile and the matching gate and up weight tiles, and
feeds two fp32 accumulators, so x is read once for both projections and g, u never reach HBM (unless the caller asks
for them, e.g. to save them for the backward). The FLOPs are those of two GEMMs; the bytes saved are a write and a
read of g and u. Gate and up weights stay separate tensors with their own strides (views into a packed [2N, K]
weight work without a copy).

With save_preact="fp8" the g and u a backward reads are written in the FP8 recipe (mlpfuse.fp8: e4m3 values, one
fp32 scale_inv per row and 128 columns) by this epilogue: a BN-wide tile holds BN/128 whole scale groups of each
row, so their amax is known on chip and g and u reach HBM at half the bytes, with no pass of their own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mlpfuse import fp8
from mlpfuse.activations import act_fwd
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels.fp8_gemm import _quantize_rows
from mlpfuse.kernels._common import tile_coords
from mlpfuse.kernels.configs import KernelConfig, pick
from mlpfuse.kernels.pairs import preact_pair


@triton.jit(do_not_specialize=["M"])
def mlpfuse_gated_gemm_kernel(
    x, wg, wu,  # pointers, or TMA descriptors when TMA
    wgu,  # PAIR: one 3-D descriptor [2, N, K] over both weights, so one TMA load and one wide MMA per K step
    bg, bu, h, g, u, h_desc, sg, su,  # sg, su: SAVE == 2, the fp32 scale_inv [M, ceil(N/128)] of g and u
    M, N, K,
    sxm, sxk, sgn, sgk, sun, suk, shm, shn, s_gm, s_gn, s_um, s_un, s_sgm, s_sum,
    ACT: tl.constexpr, HAS_BG: tl.constexpr, HAS_BU: tl.constexpr, SAVE: tl.constexpr,
    TMA: tl.constexpr, PAIR: tl.constexpr, UP_FIRST: tl.constexpr, TMA_STORE: tl.constexpr, DOT_PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    WS: tl.constexpr, I64: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    out_ty = h.dtype.element_ty
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WS):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        if I64:  # offsets past 2**31 elements: index math in 64 bits (C.needs_i64)
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        if PAIR:
            # [BM, 2·BN] accumulator = one 128×256-class MMA per K step instead of two narrow ones.
            acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x.load([off_m, ki * BK])
                b = tl.reshape(wgu.load([0, off_n, ki * BK]), (2 * BN, BK))
                acc = tl.dot(a, b.T, acc, input_precision=DOT_PREC)
            first, second = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
            if UP_FIRST:
                acc_g, acc_u = second, first
            else:
                acc_g, acc_u = first, second
        else:
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                k0 = ki * BK
                if TMA:
                    # Out-of-range rows/columns come back as zeros, so edges need no masks.
                    a = x.load([off_m, k0])
                    bgt = wg.load([off_n, k0])
                    but = wu.load([off_n, k0])
                else:
                    rk = k0 + tl.arange(0, BK)
                    if I64:
                        rk = rk.to(tl.int64)
                    km = rk[None, :] < K
                    a = tl.load(x + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & km, other=0.0)
                    wmask = (rn[:, None] < N) & km
                    bgt = tl.load(wg + rn[:, None] * sgn + rk[None, :] * sgk, mask=wmask, other=0.0)
                    but = tl.load(wu + rn[:, None] * sun + rk[None, :] * suk, mask=wmask, other=0.0)
                acc_g = tl.dot(a, bgt.T, acc_g, input_precision=DOT_PREC)
                acc_u = tl.dot(a, but.T, acc_u, input_precision=DOT_PREC)

        nmask = rn < N
        if HAS_BG:
            acc_g += tl.load(bg + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if HAS_BU:
            acc_u += tl.load(bu + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        out = (act_fwd(acc_g, ACT) * acc_u).to(out_ty)
        mask = (rm[:, None] < M) & nmask[None, :]
        if TMA_STORE:
            h_desc.store([off_m, off_n], out)
        else:
            tl.store(h + rm[:, None] * shm + rn[None, :] * shn, out, mask=mask)
        if SAVE == 1:
            tl.store(g + rm[:, None] * s_gm + rn[None, :] * s_gn, acc_g.to(out_ty), mask=mask)
            tl.store(u + rm[:, None] * s_um + rn[None, :] * s_un, acc_u.to(out_ty), mask=mask)
        elif SAVE == 2:  # FP8: BN // 128 scale groups per row of the tile (BN a multiple of 128)
            _store_fp8(acc_g, g, sg, rm, rn, off_n, mask, nmask, s_gm, s_gn, s_sgm, M, N, BM, BN)
            _store_fp8(acc_u, u, su, rm, rn, off_n, mask, nmask, s_um, s_un, s_sum, M, N, BM, BN)


_EMULATE_FP8 = tl.constexpr(C.INTERPRET)  # the interpreter's e4m3 cast, as kernels/fp8_gemm.py


@triton.jit
def _store_fp8(acc, q, s, rm, rn, off_n, mask, nmask, s_qm, s_qn, s_sm, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """acc [BM, BN] fp32 → e4m3 values at q and one scale_inv per row and 128 columns at s, as fp8.quantize_activation
    computes them (columns past N are zeros: they cannot raise a group's amax)."""
    G: tl.constexpr = BN // 128
    rows = tl.reshape(tl.where(nmask[None, :], acc, 0.0), (BM * G, 128))
    values, scale = _quantize_rows(rows, _EMULATE_FP8)
    tl.store(q + rm[:, None] * s_qm + rn[None, :] * s_qn, tl.reshape(values, (BM, BN)), mask=mask)
    cols = off_n // 128 + tl.arange(0, G)
    tl.store(s + rm[:, None] * s_sm + cols[None, :], tl.reshape(scale, (BM, G)),
             mask=(rm[:, None] < M) & (cols[None, :] * 128 < N))


_launch = C.Launcher(mlpfuse_gated_gemm_kernel)


def gated_gemm(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    *,
    activation: int,
    save_preact: bool = False,
    allow_tf32: bool = True,
    out=None,
    paired: bool = False,
    config: KernelConfig | None = None,
):
    """h = act(x·w_gateᵀ + b_gate)·(x·w_upᵀ + b_up); with save_preact also the pre-activations g and u.

    `out` (optional) receives the results in place: a tensor h, or a tuple (h, g, u) when save_preact. `paired`
    (save_preact, no `out`): g and u as the two halves of one allocation (kernels/pairs.py).
    save_preact="fp8": (h, (g values, g scale_inv), (u values, u scale_inv)) with g and u in the FP8 recipe
    (mlpfuse.fp8: e4m3, one fp32 scale_inv per row and 128 columns), written by the epilogue; no `out`.
    `config` overrides the table (tuning only).
    """
    key = None
    if out is None and config is None and (C.DIRECT_LAUNCH or C.INTERPRET):
        # The common call: everything but the output allocation and x's descriptor was decided before for exactly
        # these shapes, strides, alignments, dtypes, devices and weight addresses (see _Plan).
        key = _plan_key(x, w_gate, w_up, b_gate, b_up, activation, save_preact, allow_tf32)
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(x, w_gate, w_up, b_gate, b_up, paired)
    if save_preact == "fp8":
        if out is not None:
            raise InputError("out: not taken with save_preact='fp8'")
        return _gated_gemm(x, w_gate, w_up, b_gate, b_up, activation, "fp8", allow_tf32, None, config, None)
    if out is None and save_preact and paired:
        out = (torch.empty(x.shape[0], w_gate.shape[0], device=x.device, dtype=x.dtype),
               *preact_pair(x.shape[0], w_gate.shape[0], x))
    return _gated_gemm(x, w_gate, w_up, b_gate, b_up, activation, save_preact, allow_tf32, out, config, key)


def _plan_key(x, w_gate, w_up, b_gate, b_up, activation, save_preact, allow_tf32):
    """Every property of the arguments a _Plan's decisions depend on; None for arguments that are not tensors (the
    checks name them)."""
    try:
        return (x.shape, x.stride(), x.data_ptr() & 15, x.dtype, x.get_device(), w_gate.shape, w_gate.stride(),
                w_gate.data_ptr(), w_gate.dtype, w_gate.get_device(), w_up.shape, w_up.stride(), w_up.data_ptr(),
                w_up.dtype, w_up.get_device(), None if b_gate is None else (b_gate.shape, b_gate.data_ptr(),
                                                                           b_gate.dtype, b_gate.get_device()),
                None if b_up is None else (b_up.shape, b_up.data_ptr(), b_up.dtype, b_up.get_device()),
                activation, save_preact, allow_tf32)
    except (AttributeError, TypeError):
        return None


def cached_plan(x, w_gate, w_up, b_gate=None, b_up=None, *, activation: int, save_preact: bool = False,
                allow_tf32: bool = True):
    """The launch plan an earlier `gated_gemm` call made for exactly these arguments' layout, or None. A caller that
    keys its own memo on (at least) the same properties may call `plan.run(x, w_gate, w_up, b_gate, b_up)` itself
    and skip building this key per call."""
    return _plans.get(_plan_key(x, w_gate, w_up, b_gate, b_up, activation, save_preact, allow_tf32))


class _Plan:
    """One call's decisions, kept for the next call with the same key: the configuration, the launch's integer
    arguments and which descriptors to build. It holds no tensor (nothing is kept alive): each call passes its
    own, and the key holds every property the decisions depend on (weights by address, as their descriptors point
    there), so a hit serves only a layout it was built for.

    With the compiled kernel's C launcher at hand (`C.Raw`), a hit passes pointers as integers and descriptors as
    maps encoded once: the weights' when the plan is made (their addresses are in the key), x's and h's per address
    seen (`C.Maps`). Otherwise (another Triton, a launch hook installed) it builds descriptors and launches through
    `launch`, as before."""

    __slots__ = ("launch", "make", "rest", "consts", "grid", "x_block", "w_block", "pair", "h_block", "shape",
                 "save", "warps", "stages", "raw", "device", "x_maps", "h_maps", "w_flat", "tail")

    def run(self, x, wg, wu, bg, bu, paired: bool = False):
        """x [M, K] as the plan was made for, or a contiguous [..., K] with the same rows (read in place by the direct
        launch, which needs only its address); h (and g, u, in one allocation when `paired`) [M, N]."""
        h = self.make(self.shape)
        if not self.save:
            g = u = h
        else:
            g, u = preact_pair(*self.shape, h) if paired else (self.make(self.shape), self.make(self.shape))
        if self.raw is not None and not C.launch_hooks_set():
            xp, hp = x.data_ptr(), h.data_ptr()
            flat = (*(self.x_maps(xp) if self.x_maps is not None else (xp,)), *self.w_flat, hp, g.data_ptr(),
                    u.data_ptr(), *(self.h_maps(hp) if self.h_maps is not None else (None,)), hp, hp, *self.tail)
            self.raw(self.grid, torch._C._cuda_getCurrentRawStream(self.device), flat)
            return (h, g, u) if self.save else h
        if x.dim() != 2:
            x = x.view(-1, x.shape[-1])
        pair = None
        if self.pair is not None:  # (block, gate comes first, shape, strides) of the [2, N, K] weight descriptor
            block, gate_first, shape, strides = self.pair
            pair = C.desc(wg if gate_first else wu, block, shape, strides)
        elif self.w_block is not None:
            wg, wu = C.desc(wg, self.w_block), C.desc(wu, self.w_block)
        args = (C.desc(x, self.x_block) if self.x_block is not None else x, wg, wu, pair,
                x if bg is None else bg, x if bu is None else bu, h, g, u,
                C.desc(h, self.h_block) if self.h_block is not None else None, h, h, *self.rest)
        self.launch(self.grid, args, self.consts, self.warps, self.stages)
        return (h, g, u) if self.save else h

    def bind_raw(self, raw, x, wg, wu, bg, bu, h) -> None:
        """Prepare the direct launch (see the class doc): the fixed part of the flat arguments."""
        self.raw = raw
        if raw is None:
            return
        # Argument order of the kernel: x, wg, wu, wgu, bg, bu, h, g, u, h_desc, sg, su (inference: h stands in for
        # both), then the integers and constexprs.
        if self.x_block is not None:
            self.x_maps = C.Maps(raw, 0, x.shape, (x.stride(0), 1))
        if self.pair is not None:
            block, gate_first, shape, strides = self.pair
            base = (wg if gate_first else wu).data_ptr()
            weights = (wg.data_ptr(), wu.data_ptr(), *raw.encode(3, base, shape, strides))
        elif self.w_block is not None:
            weights = (*raw.encode(1, wg.data_ptr(), wg.shape, (wg.stride(0), 1)),
                       *raw.encode(2, wu.data_ptr(), wu.shape, (wu.stride(0), 1)), None)
        else:
            weights = (wg.data_ptr(), wu.data_ptr(), None)
        self.w_flat = (*weights, 0 if bg is None else bg.data_ptr(), 0 if bu is None else bu.data_ptr())
        if self.h_block is not None:
            self.h_maps = C.Maps(raw, 9, h.shape, (h.stride(0), 1))
        self.tail = (*self.rest, *self.consts)


_plans: dict = {}


def _gated_gemm(x, w_gate, w_up, b_gate, b_up, activation, save_preact, allow_tf32, out, config, plan_key):
    C.check_2d("w_gate", w_gate, x)
    C.check_2d("w_up", w_up, x)
    C.check_2d("x", x, x)
    M, K = x.shape
    N = w_gate.shape[0]
    if tuple(w_gate.shape) != (N, K) or tuple(w_up.shape) != (N, K):
        raise InputError(f"w_gate, w_up: expected shape ({N}, {K}), got {tuple(w_gate.shape)}, {tuple(w_up.shape)}")
    for name, b in (("b_gate", b_gate), ("b_up", b_up)):
        if b is not None and (tuple(b.shape) != (N,) or b.dtype != x.dtype or b.device != x.device):
            raise InputError(f"{name}: expected a {x.dtype} tensor of shape ({N},) on {x.device}")
    fp8_save = save_preact == "fp8"
    if fp8_save:
        outs = [torch.empty(M, N, device=x.device, dtype=x.dtype)]
        outs += [torch.empty(M, N, device=x.device, dtype=fp8.DTYPE) for _ in range(2)]
        scales = [torch.empty(M, -(-N // fp8.GROUP), device=x.device, dtype=fp8.SCALE_DTYPE) for _ in range(2)]
    else:
        outs = C.outputs(out, [(M, N)] * (3 if save_preact else 1), x)
        scales = [outs[0], outs[0]]  # stand-ins, never read
    if M == 0 or N == 0:
        if fp8_save:
            return outs[0], (outs[1], scales[0]), (outs[2], scales[1])
        return tuple(outs) if save_preact else outs[0]
    h = outs[0]
    g, u = (outs[1], outs[2]) if save_preact else (h, h)

    dev = x.device
    sms = C.num_sms(dev)
    cfg = config or pick("gated", x.dtype, M, N, device=dev, num_sms=sms, arch=C.arch_major(dev), k=K,
                          name=C.device_name(dev), activation=activation)
    if fp8_save and cfg.block_n % fp8.GROUP:  # whole scale groups per tile: the large layers' 128-wide row
        cfg = cfg.with_(block_n=fp8.GROUP, **({} if C.INTERPRET else {"num_warps": 8, "programs_per_sm": 1}))
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    use_tma = cfg.tma and C.tma_capable(dev) and K > 0 and all(C.tma_ok(t) for t in (x, w_gate, w_up))
    tma_store = use_tma and cfg.tma_store and C.tma_ok(h)
    # Every host-side descriptor costs a tensor-map encode per launch: build only those the kernel will read.
    xa, ga, ua, pair = x, w_gate, w_up, None
    if use_tma:
        xa = C.desc(x, [BM, BK])
        pair = C.pair_desc(w_gate, w_up, [2, BN, BK]) if cfg.pair else None
        if pair is None:
            ga, ua = C.desc(w_gate, [BN, BK]), C.desc(w_up, [BN, BK])
    bg_arg = b_gate if b_gate is not None else x
    bu_arg = b_up if b_up is not None else x
    consts = (activation, b_gate is not None, b_up is not None, 2 if fp8_save else int(bool(save_preact)), use_tma,
              pair is not None,
              bool(pair and pair[1]), tma_store, C.dot_precision(x.dtype, allow_tf32),
              BM, BN, BK, cfg.group_m, cfg.flatten, cfg.warp_specialize, C.needs_i64(x, w_gate, w_up, h, g, u))
    # Everything the compiled kernel is specialized on except M (not specialized): the constexprs, the config, the
    # dtype, N, K, every stride, and the alignment of every pointer argument.
    key = (consts, cfg, x.dtype, N, K, x.stride(), w_gate.stride(), w_up.stride(), h.stride(), g.stride(),
           u.stride(), C.align16(x), C.align16(w_gate), C.align16(w_up), C.align16(bg_arg), C.align16(bu_arg),
           C.align16(h), C.align16(g), C.align16(u), C.align16(scales[0]), C.align16(scales[1]), g.dtype)
    grid = (C.grid_size(cfg, sms, M, N),)
    rest = (M, N, K, x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1),
            h.stride(0), h.stride(1), g.stride(0), g.stride(1), u.stride(0), u.stride(1), scales[0].stride(0),
            scales[1].stride(0))
    _launch(key, grid, (xa, ga, ua, pair[0] if pair else None, bg_arg, bu_arg, h, g, u,
                        C.desc(h, [BM, BN]) if tma_store else None, *scales, *rest),
            consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan_key is not None:
        device_index = C.device_index(dev)
        launch = _launch.compiled(key, device_index)
        if launch is not None:
            plan = _Plan()
            plan.launch, plan.grid, plan.consts, plan.save, plan.rest = launch, grid, consts, save_preact, rest
            plan.warps, plan.stages, plan.device = cfg.num_warps, cfg.num_stages, device_index
            plan.x_block = [BM, BK] if use_tma else None
            plan.w_block = [BN, BK] if use_tma and pair is None else None
            plan.pair = None
            if pair is not None:
                d = pair[0]
                plan.pair = (d.block_shape, d.base.data_ptr() == w_gate.data_ptr(), d.shape, d.strides)
            plan.h_block = [BM, BN] if tma_store else None
            plan.shape = (M, N)
            plan.make = functools.partial(torch.empty, device=dev, dtype=x.dtype)
            plan.x_maps = plan.h_maps = None
            plan.bind_raw(_launch.raw(key, device_index), x, w_gate, w_up, b_gate, b_up, h)
            C.keep_plan(_plans, plan_key, plan)
    if fp8_save:
        return h, (g, scales[0]), (u, scales[1])
    if save_preact:
        return h, g, u
    return h
