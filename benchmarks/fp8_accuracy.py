"""Output error against float64 of mlpfuse's FP8 block and of the rowwise FP8 recipe the peers run, on the same
inputs, over token counts and layer sizes.

    PYTHONPATH=src python3 benchmarks/fp8_accuracy.py [--tokens 64,256,1024,4096,16384]
        [--sizes 2048x8192,4096x14336,5120x13824,8192x28672] [--json FILE]

mlpfuse's recipe: e4m3 values, one scale per token and 128 consecutive channels for x and h, one per 128×128 block
of each weight (`mlpfuse.fp8`); at decode sizes the kernels run weight-only (x and h unquantized). The rowwise
recipe (torchao's float8 with PerRow granularity, the `_scaled_mm` chain of `mlpfuse bench --precision fp8`): one
scale per token for x and h, one per output channel for each weight, g and u rounded to the model's dtype between
the GEMMs. Both from the same bf16 SwiGLU block (weights N(0, 0.02²)); x two ways: N(0, 1), and the same with 1 % of
its channels ×20 (the outlier channels of real activations, which a whole-row scale must cover).

Error: ‖y − y64‖ / ‖y64‖, y64 the block in float64 from the same bf16 x and weights (beside them, the plain bf16
block's). On a GPU: mlpfuse's kernels, the
`_scaled_mm` chain (cuBLAS's rowwise FP8 GEMMs) and torchao where it imports. On a CPU: mlpfuse's reference path
(`backend="torch"`) and the rowwise recipe in PyTorch ops (its quantization exactly, the products in fp32); keep the
sizes small there (the float64 oracle is the cost).
"""

import argparse
import json

import torch
import torch.nn.functional as F

from mlpfuse import fp8
from mlpfuse.ops.fp8_mlp import fp8_gated_mlp
from mlpfuse.workloads import rowwise_fp8_chain

OUTLIER_FRACTION, OUTLIER_GAIN = 0.01, 20.0


def inputs(tokens: int, dim: int, hidden: int, outliers: bool, device: str, seed: int = 0):
    """x [tokens, dim] and the three weights, bf16, seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    if outliers:
        channels = torch.randperm(dim, generator=g)[:max(1, int(dim * OUTLIER_FRACTION))]
        x[:, channels] *= OUTLIER_GAIN
    ws = [torch.randn(*s, generator=g) * 0.02 for s in ((hidden, dim), (hidden, dim), (dim, hidden))]
    return [t.to(device=device, dtype=torch.bfloat16) for t in (x, *ws)]


def float64_block(x, wg, wu, wd):
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def mlpfuse_fp8(x, wg, wu, wd, backend: str):
    qg, qu, qd = (fp8.quantize_weight(w) for w in (wg, wu, wd))
    return fp8_gated_mlp(x, qg.values, qg.scale_inv, qu.values, qu.scale_inv, qd.values, qd.scale_inv,
                         activation="silu", backend=backend)


def _dequantized_gemm(xq, xs, wq, ws, dtype):
    """scaled_mm's product of rowwise-quantized operands, in PyTorch ops: the dequantized values multiplied in fp32,
    rounded to `dtype` as cuBLAS's FP8 GEMMs return them."""
    return ((xq.float() * xs) @ (wq.float() * ws).T).to(dtype)


def rowwise_emulated(x, wg, wu, wd):
    """The rowwise recipe on a CPU: the peers' chain (`workloads.rowwise_fp8_chain`, its quantization exactly) with
    the products in fp32 PyTorch ops instead of cuBLAS's FP8 GEMMs."""
    return rowwise_fp8_chain(wg, wu, wd, F.silu, x.dtype, gemm=_dequantized_gemm)(x)


def torchao_block(x, wg, wu, wd):
    """torchao's float8 (dynamic activations, PerRow) on nn.Linear copies of the block's projections; None where
    torchao does not import."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError:
        return None
    lins = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=x.device, dtype=x.dtype)
                               for w in (wg, wu, wd))
    with torch.no_grad():
        for lin, w in zip(lins, (wg, wu, wd)):
            lin.weight.copy_(w)
    quantize_(lins, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    with torch.no_grad():
        return lins[2](F.silu(lins[0](x)) * lins[1](x))


def rel(y, y64) -> float:
    return float((y.double() - y64).norm() / y64.norm())


def sweep(tokens, sizes, device: str) -> list[dict]:
    rows = []
    cuda = device.startswith("cuda")
    for dim, hidden in sizes:
        for outliers in (False, True):
            for m in tokens:
                x, wg, wu, wd = inputs(m, dim, hidden, outliers, device)
                y64 = float64_block(x, wg, wu, wd)
                row = dict(dim=dim, hidden=hidden, tokens=m, x="outlier channels" if outliers else "gaussian",
                           bf16=rel(F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd), y64),
                           mlpfuse_fp8=rel(mlpfuse_fp8(x, wg, wu, wd, "" if cuda else "torch"), y64))
                if cuda:
                    row["rowwise_scaled_mm"] = rel(rowwise_fp8_chain(wg, wu, wd, F.silu, x.dtype)(x), y64)
                    ao = torchao_block(x, wg, wu, wd)
                    row["torchao_rowwise"] = None if ao is None else rel(ao, y64)
                else:
                    row["rowwise_emulated"] = rel(rowwise_emulated(x, wg, wu, wd), y64)
                peers = [v for k, v in row.items() if k.startswith(("rowwise", "torchao")) and v is not None]
                row["mlpfuse_vs_best_rowwise"] = row["mlpfuse_fp8"] / min(peers)
                rows.append(row)
                print(_line(row), flush=True)
                del x, wg, wu, wd, y64
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def _line(row: dict) -> str:
    cells = [f"{row['dim']}×{row['hidden']}", str(row["tokens"]), row["x"]]
    for k in ("bf16", "mlpfuse_fp8", "rowwise_scaled_mm", "torchao_rowwise", "rowwise_emulated"):
        if k in row:
            cells.append("–" if row[k] is None else f"{row[k]:.2e}")
    cells.append(f"{row['mlpfuse_vs_best_rowwise']:.3f}×")
    return "| " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256,1024,4096,16384")
    ap.add_argument("--sizes", default="2048x8192,4096x14336,5120x13824,8192x28672")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    cuda = a.device.startswith("cuda")
    peers = ["rowwise `_scaled_mm` chain", "torchao float8 PerRow"] if cuda else ["rowwise, emulated"]
    print(f"| layer | tokens | x | bf16 | mlpfuse FP8 | {' | '.join(peers)} | mlpfuse / best rowwise |")
    print("|" + "---|" * (6 + len(peers)))
    rows = sweep(tokens, sizes, a.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
