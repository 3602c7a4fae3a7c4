"""Tile candidates for the FP8 kernels (kernels/fp8_gemm.py) on one GPU, timed with triton.testing.do_bench (median of
its repetitions; the L2 is not flushed: decode weights exceed it anyway).

    PYTHONPATH=src python3 benchmarks/fp8_tune.py [--dim 4096 --hidden 14336]

Prints, per kernel and shape, each candidate's µs and the GB/s (weight-only) or TFLOP/s (FP8 GEMM)."""

import argparse
import itertools

import torch
import triton.testing

from mlpfuse import fp8
from mlpfuse.kernels import fp8_gemm as K


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    a = ap.parse_args()
    d, h = a.dim, a.hidden
    torch.manual_seed(0)
    w = {n: fp8.quantize_weight(torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02)
         for n, s in (("g", (h, d)), ("u", (h, d)), ("d", (d, h)))}
    orig_w, orig_g = K._weight_config, K._gemm_config
    print("weight-only (gate+up gated | down), µs and GB/s of weight bytes")
    for m in (1, 16):
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        hx = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        for bn, warps, stages in itertools.product((16, 32, 64, 128), (4, 8), (3, 4, 6)):
            K._weight_config = lambda mm, nn, gated, bn=bn, warps=warps, stages=stages: (bn, max(16, mm), warps, stages)
            try:
                t1 = triton.testing.do_bench(lambda: K.fp8_weight_gemm(x, w["g"].values, w["g"].scale_inv,
                                                                       w["u"].values, w["u"].scale_inv,
                                                                       activation=3), warmup=10, rep=50) * 1e3
                t2 = triton.testing.do_bench(lambda: K.fp8_weight_gemm(hx, w["d"].values, w["d"].scale_inv,
                                                                       activation=0), warmup=10, rep=50) * 1e3
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
                print(f"  m={m} bn={bn} w={warps} s={stages}: {type(e).__name__}")
                continue
            print(f"  m={m:3d} bn={bn:3d} w={warps} s={stages}: gated {t1:7.1f} ({2 * h * d / t1 / 1e3:5.0f} GB/s)"
                  f" | down {t2:7.1f} ({h * d / t2 / 1e3:5.0f} GB/s)", flush=True)
    K._weight_config = orig_w
    print("FP8 GEMM (gated with quantized h | down), µs and TFLOP/s")
    for m in (64, 512, 8192):
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        xq, xs = K.quantize(x)
        hq, hs = K.quantize(torch.randn(m, h, device="cuda", dtype=torch.bfloat16))
        for bm, bn, warps, stages in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (64, 128, 8, 3),
                                      (128, 128, 4, 3), (64, 64, 4, 4)):
            def cfg(mm, nn, q, gated, bm=bm, bn=bn, warps=warps, stages=stages):
                return bm, (128 if q else bn), 8, warps, stages
            K._gemm_config = cfg
            try:
                t1 = triton.testing.do_bench(lambda: K.fp8_gemm(xq, xs, w["g"].values, w["g"].scale_inv, w["u"].values,
                                                                w["u"].scale_inv, activation=3, quant_out=True),
                                             warmup=5, rep=30) * 1e3
                t2 = triton.testing.do_bench(lambda: K.fp8_gemm(hq, hs, w["d"].values, w["d"].scale_inv, activation=0,
                                                                quant_out=False), warmup=5, rep=30) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  m={m} bm={bm} bn={bn} w={warps} s={stages}: {type(e).__name__} {str(e)[:80]}")
                continue
            print(f"  m={m:5d} bm={bm:3d} bn={bn:3d} w={warps} s={stages}: gated {t1:8.1f} "
                  f"({4 * m * h * d / t1 / 1e6:6.0f} TF/s) | down {t2:8.1f} ({2 * m * h * d / t2 / 1e6:6.0f} TF/s)",
                  flush=True)
    K._gemm_config = orig_g


if __name__ == "__main__":
    main()
