"""Where the host time of one FP8 MLP call goes: cProfile over repeated calls of mlpfuse.GatedMLP(precision="fp8")
at a few token counts (4096×14336 SwiGLU), the GPU idle enough that launches never wait.

    PYTHONPATH=src python3 benchmarks/fp8_host_probe.py [--tokens 32,8192] [--calls 200]

Prints, per token count, host µs per call (wall clock, synchronized before and after) and the profile's top entries
by cumulative time."""

import argparse
import cProfile
import io
import pstats
import time

import torch

import mlpfuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,8192")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    mlp = mlpfuse.GatedMLP(4096, 14336, activation="silu", device="cuda", dtype=torch.bfloat16)
    mlp = mlp.to_fp8()
    for m in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(3):
                mlp(x)
            torch.cuda.synchronize()
            calls = a.calls if m <= 1024 else 20
            t0 = time.perf_counter()
            for _ in range(calls):
                mlp(x)
            host = (time.perf_counter() - t0) / calls * 1e6
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                mlp(x)
            prof.disable()
            torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
        print(f"-- {m} tokens: host {host:.1f} µs per call (launch loop, not synchronized per call)")
        print(s.getvalue())


if __name__ == "__main__":
    main()
