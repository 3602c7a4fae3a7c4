"""Check the one-launch decode kernel (mode 0: atomics into an fp32 accumulator, a ticket, the last program casts
and re-zeroes) on a CUDA GPU: correctness for every M in 1..64 on both layer shapes and with 4-warp tiles, with
what a wrong call leaves behind (NaN in the output = never finalized, non-zero accumulator = late partials,
counter != 0), then GPU and wall time against the two-launch modes 3 and 4.

    PYTHONPATH=src python3 benchmarks/decode_one_launch.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import capture, event_us, make_weights, poisoned_call, reference, spin_clocks, wall_us  # noqa: E402

from mlpfuse import activations as A  # noqa: E402
from mlpfuse.kernels import decode_mlp as K  # noqa: E402


def rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def check(name, d, h, reps, configs):
    wg, wu, wd, *_ = make_weights(d, h, torch.bfloat16, seed=3)
    bad = []
    for cfg in configs:
        for m in range(1, 65):
            x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
            ref = reference(x, wg, wu, wd, None, None, None, A.GELU_TANH)
            for r in range(reps):
                y = poisoned_call(lambda: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH, _mode=0,
                                                             _config=cfg), m, d, torch.bfloat16)
                torch.cuda.synchronize()
                e = rel(y, ref)
                acc, cnt = K._scratch[(0, torch._C._cuda_getCurrentRawStream(0))][:2]
                dirty = acc.abs().max().item()
                c = int(cnt.item())
                nan = bool(torch.isnan(y).any())
                if not (e <= 1e-2) or dirty != 0 or c != 0:
                    bad.append((m, r, cfg, round(e, 4), nan, dirty, c))
                    acc.zero_()
                    cnt.zero_()
    print(f"{name:16s} {d}x{h}: {len(bad)} bad of {64 * reps * len(configs)}"
          + (f"; first: {bad[:6]}" if bad else ""), flush=True)
    return len(bad)


def timing(d, h, tokens, rounds=5):
    wg, wu, wd, *_ = make_weights(d, h, torch.bfloat16, seed=3)
    rows = []
    names = {0: "one launch (0)", 3: "atomics + cast (3)", 4: "split (4)"}
    for m in tokens:
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        fns = {mode: (lambda mode=mode: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH, _mode=mode))
               for mode in names}
        graphs = {mode: capture(lambda _x, f=f: f(), x, 20) for mode, f in fns.items()}
        res = {mode: ([], []) for mode in names}
        for _ in range(rounds):
            for mode, f in fns.items():
                res[mode][0].append(event_us(graphs[mode].replay, 20))
                res[mode][1].append(wall_us(f, 200 if d * h < 4e6 else 40))
        for mode, (gpu, wall) in res.items():
            g, w = sorted(gpu)[len(gpu) // 2], sorted(wall)[len(wall) // 2]
            rows.append((f"{m}x{d}x{h}", names[mode], g, w))
            print(f"  {m:3d}x{d}x{h} {names[mode]:20s} gpu {g:7.2f} us  wall {w:7.2f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    spin_clocks(0.5)
    total = 0
    for d, h in ((768, 3072), (4096, 14336)):
        total += check("policy tiles", d, h, args.reps, [None])
    total += check("4-warp tiles", 768, 3072, 1, [(32, 128, 64, 4, 3), (64, 64, 64, 4, 4)])
    print(f"correctness done in {time.time() - t0:.0f}s, {total} bad calls", flush=True)
    rows = timing(768, 3072, (1, 16, 64)) + timing(4096, 14336, (1, 16, 32))
    print("| shape | variant | GPU us (20-call graph) | wall us |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} |")


if __name__ == "__main__":
    main()
