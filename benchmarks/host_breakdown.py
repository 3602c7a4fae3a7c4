"""Where the host time of one fused-kernel call goes, piece by piece (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/host_breakdown.py [--out FILE]

At 64 tokens × 768 × 3072 (bf16) every kernel finishes in a few µs, so back-to-back calls measure the host. Pieces:
the whole `gated_gemm` call with its cached plan (C launch or Triton's launcher) and without; its Python before the launch without a plan (the
launch replaced by a no-op); the cached launch alone
with prepared arguments, TMA descriptors on and off; a Triton kernel with one pointer argument and one with the
gated kernel's argument count (the launcher's floor); and the PyTorch calls the fused path replaces or adds.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from host_overhead import per_call_rounds  # the same timing loop (this folder is on sys.path when run)
from mlpfuse import activations as A
from mlpfuse.kernels import _common as C
from mlpfuse.kernels import gated_gemm as GG


def per_call_us(fn, n=400, rounds=9):
    """(median, min, max) µs per call over the rounds."""
    out = per_call_rounds(fn, n, rounds)
    return statistics.median(out), out[0], out[-1]


@triton.jit
def one_arg_kernel(p):
    pass


@triton.jit
def many_args_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12,
                     a13, a14, B: tl.constexpr):
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    m, d, h = 64, 768, 3072
    x = torch.randn(m, d, device=dev, dtype=dt)
    wg = torch.randn(h, d, device=dev, dtype=dt) / 30
    wu = torch.randn(h, d, device=dev, dtype=dt) / 30
    rows = []

    def row(name, res):
        rows.append((name, *res))
        print(f"{name:58s} {res[0]:7.2f} us  (min {res[1]:.2f}, max {res[2]:.2f})", flush=True)

    row("gated_gemm call, plan hit (C launch, cached maps)", per_call_us(
        lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH)))
    (plan,) = GG._plans.values()
    raw, plan.raw = plan.raw, None
    row("gated_gemm call, plan hit (Triton's launcher)", per_call_us(
        lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH)))
    plan.raw = raw
    row("gated_gemm call, plan hit, saving g and u", per_call_us(
        lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH, save_preact=True)))

    class NoPlans(dict):  # every call decides everything again, as before plans existed
        def __setitem__(self, key, value):
            pass

    GG._plans = NoPlans()
    row("gated_gemm call, no plan (direct launch)", per_call_us(
        lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH)))
    captured = {}
    real = GG._launch

    class Record:  # stands in for the kernel's Launcher: keeps the arguments, launches nothing
        def __call__(self, key, grid, a, consts, num_warps, num_stages):
            captured["tma"] = (key, grid, a, consts, num_warps, num_stages)

        def compiled(self, key, device_index):
            return None  # nothing compiled: no plan is built

    record = Record()

    GG._launch = record
    row("gated_gemm Python before the launch, no plan", per_call_us(lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH)))
    GG._launch = real
    key, grid, a, consts, nw, ns = captured["tma"]
    row("cached launch alone, TMA descriptors (3 host encodes)", per_call_us(lambda: real(key, grid, a, consts, nw, ns)))
    cfg = GG.pick("gated", dt, m, h, device=x.device, num_sms=C.num_sms(x.device), arch=C.arch_major(x.device))
    ptr_cfg = cfg.with_(tma=False, tma_store=False)
    GG._launch = record
    GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH, config=ptr_cfg)
    GG._launch = real
    key, grid, a, consts, nw, ns = captured["tma"]
    real(key, grid, a, consts, nw, ns)
    row("cached launch alone, pointer loads", per_call_us(lambda: real(key, grid, a, consts, nw, ns)))
    row("gated_gemm call, pointer loads", per_call_us(
        lambda: GG.gated_gemm(x, wg, wu, activation=A.GELU_TANH, config=ptr_cfg)))

    one = C.Launcher(one_arg_kernel)
    row("Launcher: kernel with 1 pointer", per_call_us(lambda: one(1, (1,), (x,), (), 4, 1)))
    many = C.Launcher(many_args_kernel)
    ptrs = (x,) * 10
    ints = tuple(range(1, 16))
    row("Launcher: kernel with 10 pointers + 15 ints", per_call_us(lambda: many(1, (1,), ptrs + ints, (1,), 4, 1)))
    row("triton kernel[grid](1 pointer)", per_call_us(lambda: one_arg_kernel[(1,)](x)))
    row("torch.empty(64, 3072)", per_call_us(lambda: torch.empty(m, h, device=dev, dtype=dt)))
    row("F.linear(x, wg) (cuBLAS)", per_call_us(lambda: F.linear(x, wg)))
    row("F.gelu(tanh)", per_call_us(lambda: F.gelu(x, approximate="tanh")))
    row("x.stride() + x.data_ptr() x10", per_call_us(lambda: [(x.stride(), x.data_ptr()) for _ in range(10)]))
    print("\n| what | host µs per call (median of 9 rounds × 400) | min | max |\n|---|---|---|---|")
    for name, med, lo, hi in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {hi:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
