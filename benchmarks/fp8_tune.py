"""Tile candidates for the FP8 kernels (kernels/fp8_gemm.py) on one GPU, timed with triton.testing.do_bench (median of
its repetitions, the L2 cleared before each).

    PYTHONPATH=src python3 benchmarks/fp8_tune.py [--dim 4096 --hidden 14336] [--gemm-only | --weight-only]

Prints, per kernel and shape, each candidate's µs and the GB/s (weight-only: row slices, warps, K splits) or TFLOP/s
(the block-scaled GEMMs at prefill sizes, beside cuBLAS's rowwise FP8 GEMMs, with each compiled variant's registers
and spills and, at the smallest size, the gated sum's error against float64)."""

import argparse
import itertools

import torch
import triton.testing

from mlpfuse import fp8
from mlpfuse.kernels import fp8_gemm as K


# (BM, BN, GROUP_M, num_warps, num_stages): candidates for the FP8 GEMM at prefill sizes (BN divides 128)
GEMM_CANDIDATES = [
    (128, 128, 8, 8, 4), (128, 128, 8, 8, 3), (128, 128, 8, 8, 5), (128, 128, 4, 8, 4), (64, 128, 8, 4, 4),
    (128, 64, 8, 4, 4), (64, 64, 8, 4, 4),
]


def _compiled() -> dict:
    """The FP8 GEMM kernel's compiled variants so far, by id (from Triton's cache; empty if not reachable)."""
    try:
        return {id(k): k for c in K.mlpfuse_fp8_gemm_kernel.device_caches.values() for k in c[0].values()}
    except Exception:  # noqa: BLE001 - the report is a convenience
        return {}


def _spills(before: dict) -> str:
    """Registers and spills of the variants compiled since `before`."""
    new = [k for i, k in _compiled().items() if i not in before]
    return ", ".join(f"regs {k.n_regs} spills {k.n_spills}" for k in new if hasattr(k, "n_regs")) or "cached"


def _weights(d: int, h: int) -> dict:
    """The block's three weights (bf16 ×0.02, seeded) in the FP8 recipe: g, u [h, d] and d [d, h]."""
    torch.manual_seed(0)
    return {n: fp8.quantize_weight(torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02)
            for n, s in (("g", (h, d)), ("u", (h, d)), ("d", (d, h)))}


def gemm_tune(d: int, h: int, sizes) -> None:
    """Each candidate on the gated GEMM (quantized h out) and the down GEMM, with cuBLAS's rowwise FP8 GEMMs
    (torch._scaled_mm, operands already quantized) on the same shapes as the floor."""
    w = _weights(d, h)
    orig = K._gemm_config
    gu = torch.cat([w["g"].values, w["u"].values])
    gus = torch.ones(2 * h, 1, device="cuda")
    ds = torch.ones(d, 1, device="cuda")
    print("FP8 GEMM (gated with quantized h | down), µs and TFLOP/s", flush=True)
    for m in sizes:
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        xq, xs = K.quantize(x)
        hq, hs = K.quantize(torch.randn(m, h, device="cuda", dtype=torch.bfloat16))
        xs1 = torch.ones(m, 1, device="cuda")
        t1 = triton.testing.do_bench(lambda: torch._scaled_mm(xq, gu.t(), scale_a=xs1, scale_b=gus.t(),
                                                              out_dtype=torch.bfloat16), warmup=5, rep=30) * 1e3
        t2 = triton.testing.do_bench(lambda: torch._scaled_mm(hq, w["d"].values.t(), scale_a=xs1, scale_b=ds.t(),
                                                              out_dtype=torch.bfloat16), warmup=5, rep=30) * 1e3
        print(f"  m={m:5d} cuBLAS rowwise _scaled_mm:               gated {t1:8.1f} "
              f"({4 * m * h * d / t1 / 1e6:6.0f} TF/s) | down {t2:8.1f} ({2 * m * h * d / t2 / 1e6:6.0f} TF/s)",
              flush=True)
        for cand in GEMM_CANDIDATES:
            K._gemm_config = lambda mm, nn, q, gated, cand=cand: (cand[0], 128 if q else cand[1], *cand[2:])
            K._plans.clear()
            row = []
            for name, fn in (("gated", lambda: K.fp8_gemm(xq, xs, w["g"].values, w["g"].scale_inv, w["u"].values,
                                                          w["u"].scale_inv, activation=3, quant_out=True)),
                             ("down", lambda: K.fp8_gemm(hq, hs, w["d"].values, w["d"].scale_inv, activation=0,
                                                         quant_out=False))):
                if name == "gated" and cand[1] != 128:
                    row.append(f"{name}        -")
                    continue
                before = _compiled()
                try:
                    t = triton.testing.do_bench(fn, warmup=5, rep=30) * 1e3
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
                    row.append(f"{name} {type(e).__name__} {str(e)[:60]}")
                    continue
                flops = (4 if name == "gated" else 2) * m * h * d
                row.append(f"{name} {t:8.1f} ({flops / t / 1e6:6.0f} TF/s, {_spills(before)})")
            if m == min(sizes):  # the gated sum's error against float64 on the same quantized operands
                z = K.fp8_gemm(xq, xs, w["g"].values, w["g"].scale_inv, w["u"].values, w["u"].scale_inv,
                               activation=0, quant_out=False, out_dtype=torch.float32).double()
                xd = fp8.dequantize_activation(xq, xs, torch.float64)
                ref = (xd @ w["g"].dequantize(torch.float64).T) * (xd @ w["u"].dequantize(torch.float64).T)
                row.append(f"rel err {float((z - ref).norm() / ref.norm()):.2e}")
            print(f"  m={m:5d} {cand}: " + " | ".join(row), flush=True)
    K._gemm_config = orig
    K._plans.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--gemm-only", action="store_true", help="only the FP8 GEMM candidates at prefill sizes")
    ap.add_argument("--weight-only", action="store_true", help="only the weight-only (decode) candidates")
    a = ap.parse_args()
    d, h = a.dim, a.hidden
    if a.gemm_only:
        gemm_tune(d, h, (8192, 2048, 512))
        return
    weight_tune(d, h)
    if not a.weight_only:
        gemm_tune(d, h, (8192, 2048, 512, 64))


def weight_tune(d: int, h: int) -> None:
    w = _weights(d, h)
    orig_w = K._weight_config
    print("weight-only (gate+up gated | down), µs and GB/s of weight bytes", flush=True)
    for m in (1, 16):
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        hx = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        for bn, warps, splits, stages in itertools.product((64, 128), (4, 8), (1, 2, 4, 8, 16), (3,)):
            K._weight_config = lambda mm, nn, kk, gated, sms, c=(bn, warps, stages, splits): (
                c[0], max(16, mm), *c[1:])
            K._plans.clear()
            try:
                t1 = triton.testing.do_bench(lambda: K.fp8_weight_gemm(x, w["g"].values, w["g"].scale_inv,
                                                                       w["u"].values, w["u"].scale_inv,
                                                                       activation=3), warmup=10, rep=50) * 1e3
                t2 = triton.testing.do_bench(lambda: K.fp8_weight_gemm(hx, w["d"].values, w["d"].scale_inv,
                                                                       activation=0), warmup=10, rep=50) * 1e3
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
                print(f"  m={m} bn={bn} w={warps} splits={splits} s={stages}: {type(e).__name__} {str(e)[:80]}")
                continue
            print(f"  m={m:3d} bn={bn:3d} w={warps} splits={splits:2d} s={stages}: gated {t1:7.1f} "
                  f"({2 * h * d / t1 / 1e3:5.0f} GB/s) | down {t2:7.1f} ({h * d / t2 / 1e3:5.0f} GB/s)", flush=True)
    K._weight_config = orig_w
    K._plans.clear()


if __name__ == "__main__":
    main()
