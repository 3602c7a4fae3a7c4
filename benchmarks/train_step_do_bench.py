"""A second harness for the eager-mode training step: triton.testing.do_bench (CUDA events, L2 cleared before each
repetition, median), eager's module against GatedMLP (`auto`), interleaved over rounds.

    PYTHONPATH=src python3 benchmarks/train_step_do_bench.py [--tokens 8192] [--dim 768] [--hidden 3072] [--rounds 5]

Each step: parameter and input gradients set to None, forward, `.backward(dy)` into .grad (as a training loop does).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

import mlpfuse
from host_overhead import Eager  # this folder is on sys.path when run
from host_paths import spin_up, training_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    eager = Eager(args.dim, args.hidden).to(dev, dt)
    fused = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh")
    x = torch.randn(args.tokens, args.dim, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(args.tokens, args.dim, device=dev, dtype=dt)
    params = list(eager.parameters())

    fns = {"eager": training_step(eager, x, dy, params), "mlpfuse auto": training_step(fused, x, dy, params)}
    spin_up()
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3)
    base = statistics.median(times["eager"])
    print(f"{args.tokens}x{args.dim}x{args.hidden} training step, do_bench median µs per round; {args.rounds} rounds")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:14s} {med:8.1f} µs  (min {min(v):.1f}, max {max(v):.1f})  {med / base:.3f}× eager  "
              f"rounds: {', '.join(f'{t:.1f}' for t in v)}")


if __name__ == "__main__":
    main()
