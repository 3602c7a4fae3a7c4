"""h = act(g)·u in one pass over two [M, N] pre-activations (the GLU between separate gate and up GEMMs).

Where neither the gated GEMM nor the decode kernels beat cuBLAS (inference at a few dozen tokens on large layers,
ops/dispatch.py), `auto` runs cuBLAS's gate and up GEMMs and this pass instead of eager's activation and multiply:
one read of g and u, one write of h, the activation in fp32 and h rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlpfuse.activations import act_fwd
from mlpfuse.errors import InputError
from mlpfuse.kernels import _common as C


@triton.jit(do_not_specialize=["M"])
def mlpfuse_glu_forward_kernel(g, u, h, M, N, sgm, sum_, shm, ACT: tl.constexpr, BN: tl.constexpr,
                               I64: tl.constexpr):
    # One program: BN columns of one row (rows on grid axis 0, which allows 2**31 - 1 of them).
    row = tl.program_id(0)
    if I64:  # offsets past 2**31 elements: the row offset in 64 bits (C.needs_i64)
        row = row.to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = rn < N
    gv = tl.load(g + row * sgm + rn, mask=mask, other=0.0).to(tl.float32)
    uv = tl.load(u + row * sum_ + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(h + row * shm + rn, (act_fwd(gv, ACT) * uv).to(h.dtype.element_ty), mask=mask)


_launch_kernel = C.Launcher(mlpfuse_glu_forward_kernel)

# Columns per program and warps: 8 elements (16 bytes of bf16) per thread.
_TILE = (1024, 4)
_TILE_INTERPRET = (16, 1)


def glu_forward(g: torch.Tensor, u: torch.Tensor, *, activation: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """h [M, N] = act(g)·u for g, u [M, N] of one dtype and device with unit column stride (any row stride).
    `out`: a caller-owned h (same constraints)."""
    C.check_2d("g", g, g)
    C.check_2d("u", u, g)
    if u.shape != g.shape:
        raise InputError(f"u: expected shape {tuple(g.shape)} (g's), got {tuple(u.shape)}")
    h = C.outputs(out, [tuple(g.shape)], g)[0]
    for name, t in (("g", g), ("u", u), ("out", h)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise InputError(f"{name}: expected unit column stride, got strides {tuple(t.stride())}")
    if g.shape[0] == 0 or g.shape[1] == 0:
        return h
    key = _plan_key(g.shape, g.dtype, g.device, (g.stride(0), u.stride(0), h.stride(0)),
                    (g.data_ptr() & 15, u.data_ptr() & 15, h.data_ptr() & 15), activation)
    plan = _plans.get(key)
    if plan is None:
        plan = _Plan(g, u, h, activation)
        C.keep_plan(_plans, key, plan)
    plan.launch((g, u, h))
    return h


def cached_plan(rows: int, cols: int, dtype: torch.dtype, device: torch.device, *, activation: int) -> "_Plan | None":
    """The plan an earlier `glu_forward` call made for contiguous [rows, cols] g and u (fresh from a GEMM, so
    16-byte aligned) and a fresh h, or None. A caller whose own memo fixes that layout may call `plan.run(g, u)` and
    skip the checks and this key per call."""
    return _plans.get(_plan_key((rows, cols), dtype, device, (cols, cols, cols), (0, 0, 0), activation))


def _plan_key(shape, dtype, device, row_strides, aligns, activation) -> tuple:
    """The layout a plan serves: g's shape, dtype and device; g's, u's and h's row strides and their addresses
    modulo 16 bytes; the activation."""
    return (tuple(shape), dtype, device, row_strides, aligns, activation)


class _Plan(C.PointerPlan):
    """One layout's launch (see C.PointerPlan), with the shape, dtype and device of the h it allocates."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, g, u, h, activation):
        M, N = g.shape
        bn, warps = _TILE if g.device.type == "cuda" else _TILE_INTERPRET
        consts = (activation, bn, C.needs_i64(g, u, h))
        # What the compiled kernel is specialized on (all but M): see C.Launcher.
        key = (consts, warps, g.dtype, N, g.stride(0), u.stride(0), h.stride(0), C.align16(g), C.align16(u),
               C.align16(h))
        super().__init__(_launch_kernel, key, (M, -(-N // bn)), (M, N, g.stride(0), u.stride(0), h.stride(0)), consts,
                         warps, 1, g.device)
        self.shape, self.dtype, self.device = (M, N), g.dtype, g.device

    def run(self, g, u) -> torch.Tensor:
        """h for g and u of this plan's layout, into a fresh h."""
        h = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.launch((g, u, h))
        return h


_plans: dict = {}
