"""Tile configurations: a fixed table, chosen by (architecture, dtype, size class), never searched at call time.

Searching per shape would make the first call of every new shape cost seconds; a table keeps it to one compile per
(config, dtype, activation), shared by every M. The Hopper rows come from `benchmarks/tune_kernels.py` on an H200
(results in benchmarks/results/kernels-h200.md); the generic rows are safe pointer-path tiles for other GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int  # per accumulator: the gated kernel computes a gate and an up tile of this width
    block_k: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    tma: bool = True  # operands through TMA descriptors where the tensors allow it
    tma_store: bool = False  # main output through a TMA store (async; needs a 16-byte aligned output)
    flatten: bool = False  # pipeline across tile boundaries of the persistent loop (tl.range(flatten=True))
    pair: bool = True  # gated only: gate and up tiles through one 3-D descriptor, one [BM, 2·BN] MMA per K step
    warp_specialize: bool = False
    programs_per_sm: int = 1  # persistent grid size = SMs × this (more when small tiles let CTAs share an SM)
    persistent: bool = True  # False: one program per tile
    prefetch: bool = False  # glu_bwd only: read the g/u tiles before the K loop

    def with_(self, **kw) -> "KernelConfig":
        return replace(self, **kw)


# Small tiles for the interpreter: every program is emulated element by element, so fewer, smaller ones are faster
# and odd edges get exercised.
_INTERPRET = KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4)

# Hopper (sm_90), 16-bit operands, keyed by op and size class; picked from `benchmarks/tune_kernels.py` runs on an
# H200 (benchmarks/results/kernels-h200.md). Gated: the paired [BM, 2·64] MMA with two CTAs per SM (one's epilogue
# hides behind the other's main loop) beat one 128×256-class CTA per SM by 3 % at 8192×768×3072 and tied at
# 8192×4096×14336. Flattening the persistent loop (the next tile's loads overlap this tile's epilogue) then took the
# gated kernel from 137.4–140.2 to 126.5–127.4 µs at 8192×768×3072 in two runs of `tune_kernels.py --only blog`
# and left 8192×4096×14336 level (2753 vs 2750 µs, `--only llama`). gemm_act: once the activation's epilogue got
# cheaper (sigmoid through ex2/rcp.approx instead of IEEE division), one warpgroup per 128×128 tile with the
# flattened loop took it from 79.9 to 74.0 µs at 8192×768→3072 (8 warps flattened: 100.3; no activation: 71.3),
# `--only linear`; logs in benchmarks/results/tune-h200.md. glu_bwd: one CTA of 8 warps, deeper pipeline (the
# epilogue's g/u traffic needs the registers).
_SM90_16 = {
    ("gated", "large"): KernelConfig(128, 64, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    ("gated", "small"): KernelConfig(128, 64, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    ("gemm_act", "large"): KernelConfig(128, 128, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    ("gemm_act", "small"): KernelConfig(128, 128, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    ("glu_bwd", "large"): KernelConfig(128, 128, 64, num_stages=4, num_warps=8),
    ("glu_bwd", "small"): KernelConfig(64, 128, 64, num_stages=3, num_warps=4, programs_per_sm=2),
}
# fp32 rows: half the K depth keeps a stage's bytes (and the 128-byte TMA swizzle row) the same as 16-bit.
_SM90_32 = {key: cfg.with_(block_k=32) for key, cfg in _SM90_16.items()}

# Other CUDA GPUs (Ampere and older): pointer loads, software pipelining only.
_GENERIC = {
    "gated": KernelConfig(128, 64, 32, group_m=8, num_stages=3, num_warps=4, tma=False),
    "gemm_act": KernelConfig(128, 128, 32, group_m=8, num_stages=3, num_warps=8, tma=False),
    "glu_bwd": KernelConfig(128, 64, 32, group_m=8, num_stages=3, num_warps=4, tma=False),
}


def size_class(m: int, n: int, num_sms: int, cfg: KernelConfig) -> str:
    """'large' when the big tiles still give every SM at least two tiles; else smaller tiles keep the SMs busy."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    return "large" if tiles >= 2 * num_sms else "small"


def pick(op: str, dtype: torch.dtype, m: int, n: int, *, device: torch.device, num_sms: int, arch: int) -> KernelConfig:
    """The table's config for one call. op: 'gated' | 'gemm_act' | 'glu_bwd'."""
    if device.type != "cuda":
        return _INTERPRET
    if arch >= 9:
        table = _SM90_32 if dtype == torch.float32 else _SM90_16
        cls = size_class(m, n, num_sms, table[(op, "large")])
        return table[(op, cls)]
    cfg = _GENERIC[op]
    return cfg.with_(block_k=cfg.block_k // 2) if dtype == torch.float32 else cfg
