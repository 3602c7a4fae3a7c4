"""GEMM with bias and activation in the epilogue: z = x·wᵀ + b, y = act(z).

The bias and activation ride on the accumulator before the single store, so `nn.Linear` + activation becomes one
kernel instead of a GEMM plus a pointwise pass over [M, N]. With save_preact the pre-activation z is stored too
(what an autograd backward needs for act'(z)).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mlpfuse.activations import act_fwd
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C
from mlpfuse.kernels._common import tile_coords
from mlpfuse.kernels.configs import KernelConfig, pick


@triton.jit(do_not_specialize=["M"])
def mlpfuse_gemm_act_kernel(
    x, w,  # pointers, or TMA descriptors when TMA
    b, y, z, y_desc,
    M, N, K,
    sxm, sxk, swn, swk, sym, syn, szm, szn,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SAVE: tl.constexpr,
    TMA: tl.constexpr, TMA_STORE: tl.constexpr, DOT_PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
    I64: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    out_ty = y.dtype.element_ty
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        if I64:  # offsets past 2**31 elements: index math in 64 bits (C.needs_i64)
            rm = rm.to(tl.int64)
            rn = rn.to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BK
            if TMA:
                a = x.load([off_m, k0])
                bt = w.load([off_n, k0])
            else:
                rk = k0 + tl.arange(0, BK)
                if I64:
                    rk = rk.to(tl.int64)
                km = rk[None, :] < K
                a = tl.load(x + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & km, other=0.0)
                bt = tl.load(w + rn[:, None] * swn + rk[None, :] * swk, mask=(rn[:, None] < N) & km, other=0.0)
            acc = tl.dot(a, bt.T, acc, input_precision=DOT_PREC)

        nmask = rn < N
        if HAS_BIAS:
            acc += tl.load(b + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        out = act_fwd(acc, ACT).to(out_ty)
        mask = (rm[:, None] < M) & nmask[None, :]
        if TMA_STORE:
            y_desc.store([off_m, off_n], out)
        else:
            tl.store(y + rm[:, None] * sym + rn[None, :] * syn, out, mask=mask)
        if SAVE:
            tl.store(z + rm[:, None] * szm + rn[None, :] * szn, acc.to(out_ty), mask=mask)


_launch = C.Launcher(mlpfuse_gemm_act_kernel)


def gemm_act(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: int,
    save_preact: bool = False,
    allow_tf32: bool = True,
    out=None,
    config: KernelConfig | None = None,
):
    """y = act(x·wᵀ + bias); with save_preact also z = x·wᵀ + bias.

    `out` (optional) receives the results in place: a tensor y, or a tuple (y, z) when save_preact.
    `config` overrides the table (tuning only).
    """
    key = None
    if out is None and config is None and (C.DIRECT_LAUNCH or C.INTERPRET):
        # A repeated layout: the checks and decisions were made for exactly these shapes, strides, alignments,
        # dtypes, devices and weight/bias addresses (see _Plan).
        try:
            key = (x.shape, x.stride(), x.data_ptr() & 15, x.dtype, x.get_device(), w.shape, w.stride(),
                   w.data_ptr(), w.dtype, w.get_device(),
                   None if bias is None else (bias.shape, bias.stride(), bias.data_ptr(), bias.dtype,
                                              bias.get_device()),
                   activation, save_preact, allow_tf32)
        except (AttributeError, TypeError):
            key = None  # not tensors: the checks below name the argument
        plan = _plans.get(key)
        if plan is not None:
            return plan.run(x, w, bias)
    return _gemm_act(x, w, bias, activation, save_preact, allow_tf32, out, config, key)


class _Plan:
    """One layout's decisions, as in gated_gemm._Plan: no tensor held, weight and bias by address in the key; with
    the compiled kernel's C launcher (`C.Raw`) a hit passes addresses and encoded TMA maps (the weight's made once,
    x's and y's per address seen), otherwise it builds descriptors and launches through `launch`."""

    __slots__ = ("launch", "make", "rest", "consts", "grid", "x_block", "w_block", "y_block", "shape", "save",
                 "warps", "stages", "raw", "device", "x_maps", "y_maps", "w_flat", "tail")

    def run(self, x, w, bias):
        y = self.make(self.shape)
        z = self.make(self.shape) if self.save else y
        if self.raw is not None and not C.launch_hooks_set():
            xp, yp = x.data_ptr(), y.data_ptr()
            flat = (*(self.x_maps(xp) if self.x_maps is not None else (xp,)), *self.w_flat, yp, z.data_ptr(),
                    *(self.y_maps(yp) if self.y_maps is not None else (None,)), *self.tail)
            self.raw(self.grid, torch._C._cuda_getCurrentRawStream(self.device), flat)
            return (y, z) if self.save else y
        args = (C.desc(x, self.x_block) if self.x_block is not None else x,
                C.desc(w, self.w_block) if self.w_block is not None else w, x if bias is None else bias, y, z,
                C.desc(y, self.y_block) if self.y_block is not None else None, *self.rest)
        self.launch(self.grid, args, self.consts, self.warps, self.stages)
        return (y, z) if self.save else y

    def bind_raw(self, raw, x, w, bias, y) -> None:
        """Prepare the direct launch: the fixed part of the flat arguments (kernel order: x, w, b, y, z, y_desc)."""
        self.raw, self.x_maps, self.y_maps = raw, None, None
        if raw is None:
            return
        if self.x_block is not None:
            self.x_maps = C.Maps(raw, 0, x.shape, (x.stride(0), 1))
            weight = raw.encode(1, w.data_ptr(), w.shape, (w.stride(0), 1))
        else:
            weight = (w.data_ptr(),)
        self.w_flat = (*weight, 0 if bias is None else bias.data_ptr())
        if self.y_block is not None:
            self.y_maps = C.Maps(raw, 5, y.shape, (y.stride(0), 1))
        self.tail = (*self.rest, *self.consts)


_plans: dict = {}


def _gemm_act(x, w, bias, activation, save_preact, allow_tf32, out, config, plan_key):
    C.check_2d("x", x, x)
    C.check_2d("w", w, x)
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise InputError(f"w: expected shape ({N}, {K}), got {tuple(w.shape)}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.dtype != x.dtype or bias.device != x.device):
        raise InputError(f"bias: expected a {x.dtype} tensor of shape ({N},) on {x.device}")
    outs = C.outputs(out, [(M, N)] * (2 if save_preact else 1), x)
    if M == 0 or N == 0:
        return tuple(outs) if save_preact else outs[0]
    y = outs[0]
    z = outs[1] if save_preact else y

    dev = x.device
    sms = C.num_sms(dev)
    cfg = config or pick("gemm_act", x.dtype, M, N, device=dev, num_sms=sms, arch=C.arch_major(dev), k=K,
                          name=C.device_name(dev))
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    use_tma = cfg.tma and C.tma_capable(dev) and K > 0 and C.tma_ok(x) and C.tma_ok(w)
    tma_store = use_tma and cfg.tma_store and C.tma_ok(y)
    xa, wa = (C.desc(x, [BM, BK]), C.desc(w, [BN, BK])) if use_tma else (x, w)
    b_arg = bias if bias is not None else x
    consts = (activation, bias is not None, save_preact, use_tma, tma_store, C.dot_precision(x.dtype, allow_tf32),
              BM, BN, BK, cfg.group_m, cfg.flatten, C.needs_i64(x, w, y, z))
    # What the compiled kernel is specialized on (all but M): see C.Launcher.
    key = (consts, cfg, x.dtype, N, K, x.stride(), w.stride(), y.stride(), z.stride(), C.align16(x), C.align16(w),
           C.align16(b_arg), C.align16(y), C.align16(z))
    grid = (C.grid_size(cfg, sms, M, N),)
    rest = (M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1), z.stride(0),
            z.stride(1))
    _launch(key, grid, (xa, wa, b_arg, y, z, C.desc(y, [BM, BN]) if tma_store else None, *rest), consts,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan_key is not None:
        device_index = C.device_index(dev)
        launch = _launch.compiled(key, device_index)
        if launch is not None:
            plan = _Plan()
            plan.launch, plan.grid, plan.consts, plan.rest, plan.save = launch, grid, consts, rest, save_preact
            plan.warps, plan.stages, plan.device, plan.shape = cfg.num_warps, cfg.num_stages, device_index, (M, N)
            plan.x_block = [BM, BK] if use_tma else None
            plan.w_block = [BN, BK] if use_tma else None
            plan.y_block = [BM, BN] if tma_store else None
            plan.make = functools.partial(torch.empty, device=dev, dtype=x.dtype)
            plan.bind_raw(_launch.raw(key, device_index), x, w, bias, y)
            C.keep_plan(_plans, plan_key, plan)
    if save_preact:
        return y, z
    return y
