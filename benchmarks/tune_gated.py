"""Tile configs of the gated GEMM on this card against cuBLAS's packed gate_up GEMM (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/tune_gated.py [--shapes 16384x768x3072,...] [--activation gelu_tanh] [--out DIR]

Fifteen candidate configs (kernels.configs.KernelConfig) at 1024–16384 tokens × 4096×14336, 8192×768×3072 and
4096×2048×8192 (or --shapes, tokens×dim×hidden), SwiGLU (or --activation), bf16; each timed with Triton's do_bench
(L2 flushed, median) in 3 interleaved passes after a clock spin-up; the median pass with min–max. Per config: its
time over cuBLAS's packed [2·hidden, dim] GEMM, and the block (it + cuBLAS's down GEMM) over eager's block and over
the GEMMs alone (packed + down). What a card's rows in kernels/configs.py come from; tune_gated.json under --out.
Candidates that fail to compile, or whose h is not within 1e-2 (relative) of an fp32 evaluation, are listed and
skipped.
"""

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton.testing

from mlpfuse import activations as A
from mlpfuse.kernels.configs import KernelConfig as K
from mlpfuse.kernels.gated_gemm import gated_gemm
ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.environ.get("OUT", "."))
ap.add_argument("--shapes", default="", help="tokens x dim x hidden, comma-separated (default: the built-in list)")
ap.add_argument("--activation", default="silu", choices=("silu", "gelu_tanh"))
ARGS = ap.parse_args()
OUT = ARGS.out
os.makedirs(OUT, exist_ok=True)
ACT, ACT_F = {"silu": (A.SILU, F.silu), "gelu_tanh": (A.GELU_TANH, lambda t: F.gelu(t, approximate="tanh"))}[
    ARGS.activation]
C = {
 "A cur 128x64 s3w4 x2 fl g8": K(128, 64, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
 "B 128x64 s3w4 x2 fl g4": K(128, 64, 64, group_m=4, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
 "C 128x64 s3w4 x2 fl g2": K(128, 64, 64, group_m=2, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
 "D 128x64 s4w4 x2 fl g4": K(128, 64, 64, group_m=4, num_stages=4, num_warps=4, programs_per_sm=2, flatten=True),
 "E 128x128 s4w8 x1 fl g8": K(128, 128, 64, num_stages=4, num_warps=8, programs_per_sm=1, flatten=True),
 "F 128x128 s4w8 x1 fl g4": K(128, 128, 64, group_m=4, num_stages=4, num_warps=8, programs_per_sm=1, flatten=True),
 "G 128x128 s3w8 nonpers g8": K(128, 128, 64, num_stages=3, num_warps=8, persistent=False),
 "H 128x128 s3w8 nonpers g4": K(128, 128, 64, group_m=4, num_stages=3, num_warps=8, persistent=False),
 "I 128x128 s3w8 x1 ws": K(128, 128, 64, num_stages=3, num_warps=8, programs_per_sm=1, warp_specialize=True),
 "J 128x128 s4w8 x1 fl g16": K(128, 128, 64, group_m=16, num_stages=4, num_warps=8, programs_per_sm=1, flatten=True),
 # h through a TMA store: no register-layout conversion before the store (it goes through shared memory instead),
 # so fewer stages keep two CTAs per SM (128×(2·64), 3 stages + the store's tile is 115 KB, over half an SM's).
 "K 128x64 s2w4 x2 fl g4 tmast": K(128, 64, 64, group_m=4, num_stages=2, num_warps=4, programs_per_sm=2, flatten=True,
                                  tma_store=True),
 "L 128x64 s2w4 x2 fl g4": K(128, 64, 64, group_m=4, num_stages=2, num_warps=4, programs_per_sm=2, flatten=True),
 "M 128x64 k32 s4w4 x2 fl g4 tmast": K(128, 64, 32, group_m=4, num_stages=4, num_warps=4, programs_per_sm=2,
                                       flatten=True, tma_store=True),
 "N 128x128 s3w8 x1 fl g4 tmast": K(128, 128, 64, group_m=4, num_stages=3, num_warps=8, programs_per_sm=1, flatten=True,
                                   tma_store=True),
 "O 128x128 s3w8 x1 fl g8 tmast": K(128, 128, 64, num_stages=3, num_warps=8, programs_per_sm=1, flatten=True,
                                   tma_store=True),
}
SHAPES = [(1024, 4096, 14336), (2048, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336), (16384, 4096, 14336),
          (8192, 768, 3072), (4096, 2048, 8192)]
if ARGS.shapes:
    SHAPES = [tuple(int(v) for v in shape.split("x")) for shape in ARGS.shapes.split(",")]
dev = torch.cuda.get_device_name(); print(dev, flush=True)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(200): a @ a
torch.cuda.synchronize(); del a
res = {"device": dev, "activation": ARGS.activation, "rows": {}}
for M, Kd, N in SHAPES:
    dt = torch.bfloat16; act = ACT
    x = torch.randn(M, Kd, device="cuda", dtype=dt)
    wgu = torch.randn(2 * N, Kd, device="cuda", dtype=dt) * Kd ** -0.5
    wg, wu = wgu[:N], wgu[N:]
    wd = torch.randn(Kd, N, device="cuda", dtype=dt) * N ** -0.5
    h = torch.empty(M, N, device="cuda", dtype=dt)
    v = {"cublas packed": lambda: torch.mm(x, wgu.T), "cublas down": lambda: torch.mm(h, wd.T),
         "eager block": lambda: F.linear(ACT_F(F.linear(x, wg)) * F.linear(x, wu), wd)}
    # Each candidate's h against an fp32 evaluation: a fast config that computes something else is no candidate.
    ref = ACT_F(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
    errors = {}
    for name, cfg in C.items():
        try:
            h.fill_(float("nan"))
            gated_gemm(x, wg, wu, activation=act, config=cfg, out=h); torch.cuda.synchronize()
            errors[name] = ((h.float() - ref).norm() / ref.norm()).item()
            if not errors[name] <= 1e-2:  # bf16 output: ~2e-3 expected; NaN (an unwritten element) fails too
                print(f"  {name}: WRONG (relative error {errors[name]:.2e}), not timed", flush=True)
                continue
            v[name] = (lambda cfg=cfg: gated_gemm(x, wg, wu, activation=act, config=cfg, out=h))
        except Exception as e:
            print(f"  {name}: FAILED {type(e).__name__}", flush=True)
    del ref
    t = {k: [] for k in v}
    for _ in range(3):
        for k, f in v.items():
            t[k].append(triton.testing.do_bench(f, warmup=10, rep=150, return_mode="median") * 1e3)
    r = {k: (statistics.median(x_), min(x_), max(x_)) for k, x_ in t.items()}
    cub = r["cublas packed"][0]
    res["rows"][f"{M}x{Kd}x{N}"] = r
    res.setdefault("rel_errors", {})[f"{M}x{Kd}x{N}"] = errors
    print(f"== {M}x{Kd}x{N} cublas packed {cub:.1f} down {r['cublas down'][0]:.1f} "
          f"eager block {r['eager block'][0]:.1f}", flush=True)
    for k, (md, lo, hi) in sorted(r.items(), key=lambda kv: kv[1][0]):
        if k in C:
            blk = (md + r["cublas down"][0])
            print(f"   {k:28s} {md:8.1f} [{lo:.1f}-{hi:.1f}] {md / cub:.3f}x cublas; "
                  f"block {blk / r['eager block'][0]:.3f}x eager, {blk / (cub + r['cublas down'][0]):.3f}x GEMMs",
                  flush=True)
    del x, wgu, wd, h; torch.cuda.empty_cache()
with open(os.path.join(OUT, "tune_gated.json"), "w") as f:
    json.dump(res, f, indent=1)
