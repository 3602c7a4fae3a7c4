"""Host time per call on every path a module call can take, mlpfuse against the eager module (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/host_paths.py [--out DIR] [--quick] [--only train ...]

Host µs: the CPU time to issue one call, measured over short bursts of back-to-back calls started on an idle GPU
(a synchronize before each burst, none inside it), so the launch queue never fills and the GPU's speed does not
enter: what a host-bound step pays. Wall µs: calls back to back with one synchronize per round, the time per call
when the GPU's work and the host's overlap (max of the two). Each figure is the median over rounds, with min and
max. Variants are timed interleaved (A B C A B C …) after a clock spin-up.

Paths (bf16): decode (no_grad, 1 and 16 tokens), few tokens (no_grad, 64 and 128: the decode kernels, the gated GEMM
or cuBLAS around the GLU pass, by layer size), gated forward (no_grad, 1024–8192 tokens), training forward+backward
(`.backward()` into the parameters' .grad, as a training loop does; 64 tokens and 1024 on the SPLIT path under `auto`,
8192 on the gated GEMM), each at 768×3072 and 4096×14336, GeGLU.
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


class Eager(nn.Module):
    """The GeGLU block as transformers writes it: three nn.Linear and the activation, no bias."""

    def __init__(self, d, h):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def wall_us(fn, n):
    """µs per call of n calls back to back between two synchronizes."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def spin_up(seconds=0.5):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ a
    torch.cuda.synchronize()


def host_round(fn, burst):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(burst):
        fn()
    dt = (time.perf_counter() - t) / burst * 1e6
    torch.cuda.synchronize()
    return dt


def training_step(mod, x, dy, params):
    """One eager-mode training step as a loop runs it: the gradients set to None, forward, `.backward(dy)` into
    the parameters' and x's .grad."""
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        mod(x).backward(dy)
    return step


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]}


def measure(fns: dict, rounds: int, burst: int, n_wall: int):
    """{name: {"host": summary, "wall": summary}}; n_wall 0 measures host time only (no "wall" entry)."""
    host = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for k, fn in fns.items():
            host[k].append(host_round(fn, burst))
            if n_wall:
                wall[k].append(wall_us(fn, n_wall))
    return {k: {"host": summary(host[k]), **({"wall": summary(wall[k])} if n_wall else {})} for k in fns}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and sizes")
    ap.add_argument("--only", action="append", choices=("decode", "few tokens", "forward", "train"),
                    help="time only these paths (repeatable)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    rounds = 5 if args.quick else 9
    rows = []
    spin_up()
    for d, hdim in ((768, 3072), (4096, 14336)):
        eager = Eager(d, hdim).to(dev, dt)
        fused = {"auto": mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh"),
                 "triton": mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="triton")}
        paths = [("decode", m, False) for m in (1, 16)] + [("few tokens", m, False) for m in (64, 128)]
        paths += [("forward", m, False) for m in (1024, 8192)]
        paths += [("train", m, True) for m in ((64, 1024, 8192) if not args.quick else (64, 8192))]
        paths = [p for p in paths if not args.only or p[0] in args.only]
        for path, m, train in paths:
            x = torch.randn(m, d, device=dev, dtype=dt, requires_grad=train)
            dy = torch.randn(m, d, device=dev, dtype=dt)
            params = list(eager.parameters())

            def make(mod):
                if not train:
                    def fwd():
                        with torch.no_grad():
                            mod(x)
                    return fwd

                return training_step(mod, x, dy, params)

            fns = {"eager": make(eager), "mlpfuse auto": make(fused["auto"]), "mlpfuse triton": make(fused["triton"])}
            big = m * d * hdim > 2e10
            res = measure(fns, rounds, burst=3 if train else 8, n_wall=5 if big else 30)
            base = res["eager"]
            for name, r in res.items():
                row = {"shape": f"{m}x{d}x{hdim}", "path": path, "variant": name, **{
                    f"{kind}_{stat}": r[kind][stat] for kind in ("host", "wall") for stat in ("median", "min", "max")},
                    "host_vs_eager": r["host"]["median"] / base["host"]["median"],
                    "wall_vs_eager": r["wall"]["median"] / base["wall"]["median"]}
                rows.append(row)
                print(f"{row['shape']:>16s} {path:10s} {name:15s} host {row['host_median']:8.1f} "
                      f"[{row['host_min']:.1f}, {row['host_max']:.1f}] ({row['host_vs_eager']:.2f}x)  wall "
                      f"{row['wall_median']:8.1f} [{row['wall_min']:.1f}, {row['wall_max']:.1f}] "
                      f"({row['wall_vs_eager']:.2f}x)", flush=True)
            del x, dy
        del eager, fused
        torch.cuda.empty_cache()
    print("\n| shape | path | variant | host µs (min–max) | host vs eager | wall µs (min–max) | wall vs eager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['path']} | {r['variant']} | {r['host_median']:.1f} ({r['host_min']:.1f}–"
              f"{r['host_max']:.1f}) | {r['host_vs_eager']:.2f}× | {r['wall_median']:.1f} ({r['wall_min']:.1f}–"
              f"{r['wall_max']:.1f}) | {r['wall_vs_eager']:.2f}× |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_paths.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
