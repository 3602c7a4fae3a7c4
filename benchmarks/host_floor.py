"""What one call costs the host on this machine, from a single launch up to the whole module (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/host_floor.py [--out DIR]

At 64×768×3072 bf16 (GeGLU, no_grad) the GPU's work is a few microseconds, so the host decides the wall time of a
call. This script puts the module's wall µs next to the floor set by the host itself: one tiny elementwise op,
one `F.linear` of the layer's size, one `nn.Linear` module call, one Triton launch of an empty kernel, then eager's
module, mlpfuse's `GatedMLP` (auto and triton) and both replayed from a CUDA graph. Host and wall µs as in
host_paths.py (median over interleaved rounds, min–max). A module that launches two kernels from Python cannot be
cheaper than two of the single-launch rows.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import mlpfuse
from host_overhead import Eager
from host_paths import measure, spin_up


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def graphed(fn):
    """fn captured once in a CUDA graph; the returned callable replays it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt, (m, d, h) = "cuda", torch.bfloat16, (64, 768, 3072)
    spin_up()
    x = torch.randn(m, d, device=dev, dtype=dt)
    small = torch.randn(16, device=dev, dtype=dt)
    lin = torch.nn.Linear(d, h, bias=False).to(dev, dt)
    eager = Eager(d, h).to(dev, dt)
    auto = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh")
    tri = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="triton")

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    fns = {
        "torch.add (1 launch)": lambda: torch.add(small, small),
        "F.linear 64x768->3072 (1 launch)": lambda: F.linear(x, lin.weight),
        "nn.Linear module (1 launch)": no_grad(lambda: lin(x)),
        "empty Triton kernel (1 launch)": lambda: _empty_kernel[(1,)](small, 16),
        "eager module (5 launches)": no_grad(lambda: eager(x)),
        "GatedMLP auto": no_grad(lambda: auto(x)),
        "GatedMLP triton": no_grad(lambda: tri(x)),
    }
    with torch.no_grad():
        fns["eager module, CUDA graph replay"] = graphed(lambda: eager(x))
        fns["GatedMLP triton, CUDA graph replay"] = graphed(lambda: tri(x))
    res = measure(fns, args.rounds, burst=8, n_wall=30)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{m}x{d}x{h} bf16, no_grad\n")
    print("| call | host µs (min–max) | wall µs (min–max) |")
    print("|---|---|---|")
    for name, r in res.items():
        hs, ws = r["host"], r["wall"]
        print(f"| {name} | {hs['median']:.1f} ({hs['min']:.1f}–{hs['max']:.1f}) | "
              f"{ws['median']:.1f} ({ws['min']:.1f}–{ws['max']:.1f}) |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_floor.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
