"""How exactly mlpfuse's FP8 GEMMs sum: each kernel's output against a float64 GEMM of the very same dequantized
operands (so the quantization itself is no part of the error), beside PyTorch's fp32 GEMM of them — relative error,
and whether the error leans one way (the signed error's mean along the oracle's sign, the fitted slope − 1).

    PYTHONPATH=src python3 benchmarks/fp8_accum_probe.py [--json OUT.json]

Shapes: the stdlib model's MLP GEMMs (16384 tokens, 768 ↔ 2048) and a Llama-3-8B block's (4096 tokens, 4096 ↔
14336); x normal with 1 % of channels ×8 (activation outliers), W normal ×0.02. Both GEMM kernels (the
warp-specialized one and the Triton one) promote each 128-K block's tensor-core sum to fp32 with its scales: the
error left is the tensor cores' own accumulation inside a block.
"""

from __future__ import annotations

import argparse
import json

import torch

from mlpfuse import activations, fp8
from mlpfuse.kernels import fp8_gemm as k


def stats(y: torch.Tensor, o: torch.Tensor) -> dict:
    y, o = y.double(), o.double()
    e = y - o
    return {"rel": float(e.norm() / o.norm()), "lean": float((e * o.sign()).mean() / o.abs().mean()),
            "slope_minus_1": float((y * o).sum() / (o * o).sum() - 1),
            "mean_err_over_rms": float(e.mean() / o.pow(2).mean().sqrt())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for m, kk, n in ((16384, 768, 2048), (16384, 2048, 768), (4096, 4096, 14336), (4096, 14336, 4096)):
        x = torch.randn(m, kk, device="cuda")
        x[:, torch.randperm(kk, device="cuda")[: kk // 100]] *= 8
        w = torch.randn(n, kk, device="cuda") * 0.02
        xq, xs = fp8.quantize_activation(x)
        qw = fp8.quantize_weight(w)
        xd, wd = fp8.dequantize_activation(xq, xs), qw.dequantize(torch.float32)
        oracle = xd.double() @ wd.double().T
        for ws in (True, False):
            k.WS = ws
            y = k.fp8_gemm(xq, xs, qw.values, qw.scale_inv, activation=activations.IDENTITY, quant_out=False,
                           out_dtype=torch.float32)
            rows.append({"shape": [m, kk, n], "form": "ws" if ws else "triton", **stats(y, oracle)})
        k.WS = True
        rows.append({"shape": [m, kk, n], "form": "torch fp32", **stats(xd @ wd.T, oracle)})
        # the quantization's own error, for scale: the fp32 GEMM of the unquantized operands against the oracle
        rows.append({"shape": [m, kk, n], "form": "quantization", **stats(x @ w.T, oracle)})
    for r in rows:
        print(f"{str(r['shape']):22s} {r['form']:13s} rel {r['rel']:.3e}  lean {r['lean']:+.3e}  slope-1 "
              f"{r['slope_minus_1']:+.3e}  mean/rms {r['mean_err_over_rms']:+.3e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
