"""Host time of GatedMLP modules that run the same kernels with backend=None (auto), "auto" and "triton", timed in
interleaved rounds of 8-call bursts from an idle GPU (median of 15), then cProfile over 2000 calls each at 1024 tokens:
whether `auto` costs host time of its own.

    PYTHONPATH=src python3 benchmarks/host_auto_triton.py
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import mlpfuse
from host_overhead import Eager  # this folder is on sys.path when run


def host_us(fns: dict, rounds: int = 15, burst: int = 8) -> dict:
    """{name: median host µs per call} over interleaved bursts, each started on an idle GPU."""
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(burst):
                f()
            res[k].append((time.perf_counter() - t) / burst * 1e6)
            torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in res.items()}


def profile(f, calls: int = 2000) -> str:
    """The top of cProfile's table for `calls` calls of f, synchronizing every 8 as the bursts do."""
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for i in range(calls):
        f()
        if i % 8 == 7:
            torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return "\n".join(s.getvalue().splitlines()[:34])


def main() -> int:
    if not torch.cuda.is_available():
        print("host_auto_triton: error: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for d, h, m in ((768, 3072, 1024), (768, 3072, 1), (4096, 14336, 8192)):
        eager = Eager(d, h).to("cuda", torch.bfloat16)
        mods = {"auto": mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh"),
                "auto-named": mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="auto"),
                "triton": mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="triton")}
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        fns = {}
        for k, mod in mods.items():
            def f(mod=mod):
                with torch.no_grad():
                    mod(x)
            fns[k] = f
            for _ in range(5):
                f()
        us = host_us(fns)
        print(f"{m}x{d}x{h}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()), flush=True)
        if m == 1024:
            for k, f in fns.items():
                print(f"--- cProfile {k}\n" + profile(f), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
