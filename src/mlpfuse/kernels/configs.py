"""Tile configurations and `auto`'s cut-overs, per card: a fixed table chosen by (card, dtype, size class), never
searched at call time.

Searching per shape would make the first call of every new shape cost seconds; a table keeps it to one compile per
(config, dtype, activation), shared by every M. Configs tuned on one card do not carry to another (the gated rows
picked on an H200 ran 1.33× cuBLAS on an H100 at 8192×4096×14336), so the Hopper rows are kept per card (`CARDS`,
keyed by the device's name and SM count) with the command that measured them. A Hopper card with no
rows gets the first H200 rows for the kernels a caller forces, and `auto` keeps cuBLAS's GEMMs for the gated MLP's
projections (ops.dispatch: the SPLIT path, never slower than eager); the generic rows are safe pointer-path tiles
for older GPUs.
To add a card: run `benchmarks/tune_kernels.py` and `.../tune_gated.py` there, add its rows and a `CARDS` entry with
its cut-overs (`Cutovers`: check them with the layer sweeps, `gpu_run.sh OUT layer-sweep-DxH-MODE`); run
`benchmarks/tune_decode.py` too — the decode kernels' one table (kernels/decode_mlp.py `_CONFIGS`, from the H200) was
also the best of its candidates on the H100 SXM at 1 and 8 rows × 4096×14336, so it is not kept per card yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from mlpfuse.activations import GELU_TANH


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
# Gated rows per card from `benchmarks/tune_gated.py` (ten configs, do_bench with the L2 flushed, median of 3
# interleaved passes; benchmarks/results/nvidia-h100-x1/tune-gated, nvidia-h200/tune-gated). At 4096×14336 the
# paired 128×(2·64) tiles with two CTAs per SM above ran 0.99 / 1.06 / 1.11–1.14 / 1.29–1.33 / 1.28–1.32× cuBLAS's
# packed gate_up GEMM at 1024 / 2048 / 4096 / 8192 / 16384 tokens on an H100 (two runs) and 0.98 / 1.03 / 1.05 /
# 1.06 / 1.04× on an H200; one 128×(2·128) CTA per SM with 8 warps and 4 stages ran 0.98–1.05 / 0.99–1.00 / 1.00 /
# 1.00–1.01 / 0.98–1.01× on the H100 and 0.97 / 0.97 / 0.99 / 1.00 / 1.00× on the H200 (within 1.5 % of the best
# of the ten on every row from 4096 tokens, and on 4096×2048×8192). At 768×3072 the paired tiles stay (GROUP_M 4:
# 0.98–1.00× cuBLAS on both; the wide CTA 1.02×). "large"/"small" is the layer's size here (dim·hidden from 2**24
# is large), not the tile count.
_SM90_MEASURED = {
    **_SM90_16,
    ("gated", "large"): KernelConfig(128, 128, 64, num_stages=4, num_warps=8, programs_per_sm=1, flatten=True),
    ("gated", "small"): KernelConfig(128, 64, 64, group_m=4, num_stages=3, num_warps=4, programs_per_sm=2,
                                     flatten=True),
}
_LARGE_LAYER = 1 << 24  # dim·hidden from which the gated rows take the wide CTA
# Tokens from which a gated GEMM takes a card's long-call row, where it has one: ("gated", "long") on small layers,
# ("gated", "large-long") on large ones. Below them the three-stage TMA-store rows lost to the shared rows in the
# layer sweeps (GeGLU against SwiGLU in one run, one on each row: +10 % at 64×2048×8192 and +4 % at 256×4096×14336
# on the H200, +3 % / +3.5 % on the H100; +2 % at 1024×4096×14336 on the H200, level on the H100), and won from
# 4096 (−1.5 to −2.5 %); nvidia-h200/layer-sweeps/after-tma-rows.
_LONG_M = 16384
_LARGE_LONG_M = 4096


@dataclass(frozen=True)
class Cutovers:
    """Where `auto` changes paths on one card (ops.dispatch reads them; the measurements behind each are told
    there). Tokens are a call's rows; a large layer has dim·hidden from dispatch.DECODE_LARGE_LAYER."""

    decode_large_max_m: int  # large layers: the decode kernels up to this many tokens, then the SPLIT path ...
    gated_large_min_m: int  # ... and the gated GEMM from this many (small layers: the gated GEMM past decode sizes)
    linear_act_min_work: float  # M·out·in multiply-adds from which GEMM+bias+activation replaces addmm + activation
    split_min_layer: int = 1 << 24  # dim·hidden from which a large layer takes SPLIT between those two (below it,
    #                                 the gated GEMM right after the decode sizes)


# H100 SXM: two rows of its own, from `tune_gated.py` with fifteen candidates (benchmarks/results/nvidia-h100-x1/
# tune-gated-tma-store): h written through a TMA store (no register-layout conversion before the store) by the wide
# CTA with three stages (four and the store's tile do not fit). GeGLU on large layers (its activation's epilogue is
# the heavier): 0.987× the GEMMs alone at 8192×4096×14336 and 0.979× at 1024 tokens, against 1.011× / 1.004× with
# the shipped four-stage row (from 4096 tokens only: below, the layer sweeps had it slower, see _LARGE_LONG_M); with
# SwiGLU the four-stage row stays (0.978× against 0.985×). Small layers from 16384
# tokens, either activation: 1.021× / 1.013× the GEMMs alone at 16384×768×3072 (GeGLU / SwiGLU) against the paired
# tiles' 1.049× / 1.039×; at 4096 tokens the paired tiles stay (0.983× against 1.011×).
_H100_MEASURED = {
    **_SM90_MEASURED,
    ("gated", "large-long", GELU_TANH): KernelConfig(128, 128, 64, num_stages=3, num_warps=8, programs_per_sm=1,
                                                     flatten=True, tma_store=True),
    ("gated", "long"): KernelConfig(128, 128, 64, group_m=4, num_stages=3, num_warps=8, programs_per_sm=1,
                                    flatten=True, tma_store=True),
}

# H200: the same two rows with GROUP_M 8 for small layers' long row (`tune_gated.py`, benchmarks/results/nvidia-h200/
# tune-gated-tma-store): GeGLU on large layers 1.004× the GEMMs alone at 8192×4096×14336 against the four-stage
# row's 1.012× (at 1024 tokens do_bench had it at 0.966× against 1.000×, the sweep 2 % slower: from 4096 tokens only);
# small layers at 16384 tokens 1.016× / 1.011× (GeGLU / SwiGLU) against the paired tiles' 1.051× / 1.046× (GROUP_M 4,
# the H100's: 1.027× / 1.031×). Checked by the layer sweeps on the card (benchmarks/results/nvidia-h200/layer-sweeps/
# after-tma-rows: fused / GEMMs alone at 16384×768×3072 1.000 / 1.001, GeGLU 4096×14336 from 4096 tokens 1.002–1.003).
_H200_MEASURED = {
    **_SM90_MEASURED,
    ("gated", "large-long", GELU_TANH): _H100_MEASURED[("gated", "large-long", GELU_TANH)],
    ("gated", "long"): _H100_MEASURED[("gated", "long")].with_(group_m=8),
}

# H200: decode kernels against cuBLAS and the SPLIT path at 16–64 tokens (benchmarks/results/nvidia-h200/decode,
# small-m), the gated GEMM against both at 16–4096 tokens (small-m, auto-sweeps), training (train-small), linear +
# activation (kernels-h200.md): ops/dispatch.py has the figures.
# The SPLIT path only from 2**25 (4096×8192 and up) since the cut-over run (benchmarks/results/nvidia-h200/cut-over):
# at 2048×8192 the gated GEMM ran 48.7–49.1 µs at 24–80 tokens against SPLIT's 51.1–52.4 (eager's CUDA graph
# 49.2–51.5) and level in training; at 4096×14336 SPLIT still won at 24–32 tokens (110.7–111.9 against 115.3–116.2),
# tied at 48 and lost at 64–80 (119.1 / 118.0 against 114.1 / 112.7) — the 96 there stays until a sweep checks a
# lower one on the larger layers too.
_H200_CUTOVERS = Cutovers(decode_large_max_m=16, gated_large_min_m=96, linear_act_min_work=9e9,
                          split_min_layer=1 << 25)
# H100 SXM: the gated GEMM right after the decode sizes (no SPLIT path). Measured on the card at 24–80 tokens,
# forward (and forward+backward at 2048×8192), `auto` with the committed cut-over against the same with the gated
# GEMM from 24 tokens (benchmarks/results/nvidia-h100-x1/cut-over): at 2048×8192 the gated GEMM ran 59.5–60.7 µs
# against SPLIT's 62.8–65.2 (eager replayed from a CUDA graph: 60.5–63.0) with 54–86 µs of wall time against
# 85–135; at 4096×14336 150.1–153.7 against 151.1–158.1 (eager's graph 148.5–156.6); training level (169–182 against
# 171–184 µs). Re-run with it, the sweeps' 64-token rows at 4096×14336 and 8192×28672 came to 0.98–0.99× eager's
# graph (nvidia-h100-x1/layer-sweeps/after-h100-rows). The decode/gated boundary (16) and linear + activation's were
# not measured apart on this card.
_H100_CUTOVERS = Cutovers(decode_large_max_m=16, gated_large_min_m=17, linear_act_min_work=9e9)
# Where no card's are known (the CPU through Triton's interpreter, a GPU without a CARDS entry, on which `auto`
# runs only the decode kernels): the H200's.
DEFAULT_CUTOVERS = _H200_CUTOVERS


class Card(NamedTuple):
    id: str
    table: dict  # the 16-bit tile rows
    rule: str  # "layer": gated rows by layer size; "tiles": by tile count
    cutovers: Cutovers


# Cards with measured rows, by the device's name as CUDA reports it and its SM count. Exact names: an H100 NVL or
# PCIe, a GH200 or an H800 runs other clocks, power limits or memory, and is not measured.
CARDS = {
    ("NVIDIA H200", 132): Card("h200", _H200_MEASURED, "layer", _H200_CUTOVERS),
    ("NVIDIA H100 80GB HBM3", 132): Card("h100-sxm", _H100_MEASURED, "layer", _H100_CUTOVERS),
}


def card(name: str, num_sms: int) -> Optional[Card]:
    """The measured rows and cut-overs of a device, or None (an untuned card)."""
    return CARDS.get((name.strip(), num_sms))


def card_of(props) -> Optional[Card]:
    """`card` for a CUDA device's properties (torch.cuda.get_device_properties: `name`, `multi_processor_count`)."""
    return card(props.name, props.multi_processor_count)


def _fp32(table: dict) -> dict:
    # fp32 rows: half the K depth keeps a stage's bytes (and the 128-byte TMA swizzle row) the same as 16-bit.
    return {key: cfg.with_(block_k=32) for key, cfg in table.items()}


# Every 16-bit table's fp32 rows, by the table's identity (the tables are module constants).
_FP32 = {id(table): _fp32(table) for table in (_SM90_16, *(c.table for c in CARDS.values()))}

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


def pick(op: str, dtype: torch.dtype, m: int, n: int, *, device: torch.device, num_sms: int, arch: int, k: int = 0,
         name: str = "", activation: int = -1) -> KernelConfig:
    """The table's config for one call. op: 'gated' | 'gemm_act' | 'glu_bwd'; k: the reduction depth; name: the
    device's name (which card's rows); activation: an activations id, for a card whose long-call gated row is kept
    per activation ((op, "large-long", activation))."""
    if device.type != "cuda":
        return _INTERPRET
    if arch >= 9:
        measured = card(name, num_sms)
        table, rule = (measured.table, measured.rule) if measured else (_SM90_16, "tiles")
        if dtype == torch.float32:
            table = _FP32[id(table)]
        if rule == "layer" and op == "gated":
            large = n * k >= _LARGE_LAYER
            if m >= (_LARGE_LONG_M if large else _LONG_M):  # the card's long-call row, where it has one
                long_row = "large-long" if large else "long"
                cfg = table.get((op, long_row, activation)) or table.get((op, long_row))
                if cfg is not None:
                    return cfg
            cls = "large" if large else "small"
        else:
            cls = size_class(m, n, num_sms, table[(op, "large")])
        return table[(op, cls)]
    cfg = _GENERIC[op]
    return cfg.with_(block_k=cfg.block_k // 2) if dtype == torch.float32 else cfg
