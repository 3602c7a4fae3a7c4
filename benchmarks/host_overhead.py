"""Host cost per call of mlpfuse's launch paths on a CUDA GPU, and what it does to a training step.

    PYTHONPATH=src python3 benchmarks/host_overhead.py [--out DIR]

1. Host µs per call at a problem size the GPU finishes in a few µs (64 tokens, 768×3072, bf16), so the host is
   the bottleneck: perf_counter over N back-to-back calls, one synchronize at the end, median of rounds. Each
   Triton kernel through Triton's own launcher (`kernel[grid](...)`: binding and specialization on every call) and
   through mlpfuse's cached direct launch (`kernels._common.Launcher`), next to the cuBLAS call it replaces.
2. The decode path's layers at 1, 16 and 64 rows: the kernel API, ops.gated_mlp, the GatedMLP module (its
   decode shortcut), and eager's module.
3. One training step (forward + backward) at 8192×768×3072: wall per step for eager and for GatedMLP on the
   Triton path with either launcher, and on `auto`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import mlpfuse
from mlpfuse import activations as A
from mlpfuse.kernels import _common as C
from mlpfuse.kernels import decode_mlp, gated_gemm, gemm_act, glu_backward


def per_call_rounds(fn, n=300, rounds=7):
    """µs per call in each round of n back-to-back calls (one synchronize per round), sorted."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n * 1e6)
    return sorted(out)


def per_call_us(fn, n=300, rounds=7):
    return statistics.median(per_call_rounds(fn, n, rounds))


class Eager(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def both_launchers(fn):
    res = {}
    for direct in (False, True):
        C.DIRECT_LAUNCH = direct
        res["direct" if direct else "triton"] = per_call_us(fn)
    C.DIRECT_LAUNCH = True
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    d, h, m = 768, 3072, 64
    x = torch.randn(m, d, device=dev, dtype=dt)
    wg, wu = torch.randn(h, d, device=dev, dtype=dt) / 30, torch.randn(h, d, device=dev, dtype=dt) / 30
    wd = torch.randn(d, h, device=dev, dtype=dt) / 60
    bias = torch.randn(h, device=dev, dtype=dt)
    dh, g, u = (torch.randn(m, h, device=dev, dtype=dt) for _ in range(3))
    rows = []

    def row(name, us, note=""):
        rows.append((name, us, note))
        print(f"{name:55s} {us:8.2f} us  {note}", flush=True)

    gg = both_launchers(lambda: gated_gemm.gated_gemm(x, wg, wu, activation=A.GELU_TANH))
    row("gated_gemm, Triton launcher", gg["triton"])
    row("gated_gemm, direct launch", gg["direct"])
    ggs = both_launchers(lambda: gated_gemm.gated_gemm(x, wg, wu, activation=A.GELU_TANH, save_preact=True))
    row("gated_gemm save g,u, Triton launcher", ggs["triton"])
    row("gated_gemm save g,u, direct launch", ggs["direct"])
    row("cuBLAS x@Wg^T (F.linear)", per_call_us(lambda: F.linear(x, wg)))
    ga = both_launchers(lambda: gemm_act.gemm_act(x, wg, bias, activation=A.GELU_TANH))
    row("gemm_act + bias, Triton launcher", ga["triton"])
    row("gemm_act + bias, direct launch", ga["direct"])
    row("cuBLAS addmm + F.gelu", per_call_us(lambda: F.gelu(F.linear(x, wg, bias), approximate="tanh")))
    gb = both_launchers(lambda: glu_backward.glu_backward_split(dh, g, u, activation=A.GELU_TANH, want_h=True))
    row("glu_backward_split, Triton launcher", gb["triton"])
    row("glu_backward_split, direct launch", gb["direct"])

    eager = Eager(d, h).to(dev, dt)
    fused = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh")
    with torch.no_grad():
        for rows_ in (1, 16, 64):
            xm = torch.randn(rows_, d, device=dev, dtype=dt)
            row(f"{rows_} rows: decode kernel API (decode_gated_mlp)", per_call_us(
                lambda: decode_mlp.decode_gated_mlp(xm, wg, wu, wd, activation=A.GELU_TANH)))
            row(f"{rows_} rows: ops.gated_mlp (auto)", per_call_us(
                lambda: mlpfuse.ops.gated_mlp(xm, wg, wu, wd, "gelu_tanh")))
            row(f"{rows_} rows: GatedMLP module (auto)", per_call_us(lambda: fused(xm)))
            row(f"{rows_} rows: eager module", per_call_us(lambda: eager(xm)))
        row("torch.empty(64, 768)", per_call_us(lambda: torch.empty(m, d, device=dev, dtype=dt)))

    # Training step at the blog shape.
    M = 8192
    X = torch.randn(M, d, device=dev, dtype=dt, requires_grad=True)
    dY = torch.randn(M, d, device=dev, dtype=dt)
    tri = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="triton")

    def step(model):
        def run():
            X.grad = None
            for p in model.parameters():
                p.grad = None
            model(X).backward(dY)
        return run

    row("train step 8192x768x3072 eager", per_call_us(step(eager), n=30))
    t = both_launchers(step(tri))
    row("train step GatedMLP triton, Triton launcher", t["triton"])
    row("train step GatedMLP triton, direct launch", t["direct"])
    row("train step GatedMLP auto", per_call_us(step(fused), n=30))
    print("\n| what | host µs per call |\n|---|---|")
    for name, us, _ in rows:
        print(f"| {name} | {us:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
