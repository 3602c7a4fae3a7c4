"""FP8 decode forms on one GPU, each captured in a CUDA graph (as decode runs): mlpfuse's bf16 block, the FP8
weight-only pair of GEMMs (h through HBM) and the FP8 decode kernel (h on chip; ops.fp8_mlp.DECODE_KERNEL), at
4096×14336 SwiGLU, 1–16 tokens; error of each against the float64 MLP on the bf16 weights, and the FP8 forms against
the recipe's weight-only reference.

    PYTHONPATH=src python3 benchmarks/fp8_decode_gpu.py OUT [--dim 4096 --hidden 14336 --tokens 1,4,8,16]

Timing: graph replays, CUDA events over interleaved rounds (median [min-max]) and triton.testing.do_bench of the same
replays; the weights' bytes over the time give the bandwidth each form reaches.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

import torch

import mlpfuse
from mlpfuse import reference
from mlpfuse.bench import decode_step
from mlpfuse.ops import fp8_mlp


def rel(y, y64):
    return float((y.double() - y64).norm() / y64.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--tokens", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from triton.testing import do_bench

    torch.manual_seed(0)
    dev = torch.device("cuda")
    bf = mlpfuse.GatedMLP(a.dim, a.hidden, "silu", device="cuda", dtype=torch.bfloat16)
    for p in bf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    f8 = copy.deepcopy(bf).to_fp8()
    ws = [f8.gate_proj.fp8_weight(), f8.up_proj.fp8_weight(), f8.down_proj.fp8_weight()]
    wg, wu, wd = (w.detach().double() for w in (bf.gate_proj.weight, bf.up_proj.weight, bf.down_proj.weight))
    weight_bytes = 3 * a.dim * a.hidden + 4 * sum(w.scale_inv.numel() for w in ws)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "weight_bytes": weight_bytes,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "rows": {}}
    for m in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(m, a.dim, device="cuda", dtype=torch.bfloat16)
        y64 = reference.gated_mlp(x.double(), wg, wu, wd, "silu")
        with torch.no_grad():
            ref = reference.gated_mlp_fp8_weight_only(x, *ws, "silu")

        def fp8_form(kernel):
            def call():
                fp8_mlp.DECODE_KERNEL = kernel
                return f8(x)
            return call

        forms = {"bf16 mlpfuse": lambda: bf(x), "fp8 two GEMMs": fp8_form(False), "fp8 decode kernel": fp8_form(True)}
        replays, errs = {}, {}
        for name, fn in forms.items():
            with torch.no_grad():
                y = fn()
                errs[name] = {"vs_float64": rel(y, y64)}
                if name != "bf16 mlpfuse":
                    errs[name]["vs_recipe_max_abs_over_max"] = float((y.float() - ref.float()).abs().max()
                                                                     / ref.float().abs().max())
                replays[name] = decode_step.capture(decode_step.inference(fn), dev)[0]
        fp8_mlp.DECODE_KERNEL = False
        vals = {k: [] for k in replays}
        for _ in range(a.rounds):
            for k, r in replays.items():
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(100):
                    r()
                e.record()
                torch.cuda.synchronize()
                vals[k].append(s.elapsed_time(e) * 10)
        base = statistics.median(vals["bf16 mlpfuse"])
        row = {}
        for k, v in vals.items():
            med = statistics.median(v)
            db = do_bench(replays[k], warmup=25, rep=200, return_mode="median") * 1e3
            nbytes = weight_bytes if k != "bf16 mlpfuse" else 6 * a.dim * a.hidden
            row[k] = {"us": med, "min": min(v), "max": max(v), "do_bench_us": db, "vs_bf16_mlpfuse": med / base,
                      "gbps": nbytes / med / 1e3, **errs[k]}
        out["rows"][m] = row
        print(m, json.dumps(row), flush=True)
    with open(os.path.join(a.out, "fp8_decode.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{out['device']} {a.dim}x{a.hidden} SwiGLU decode, graph replays: µs median [min-max] | do_bench | "
          "x bf16 mlpfuse | GB/s of weights | rel. err vs float64")
    for m, row in out["rows"].items():
        print(f"-- {m} tokens")
        for k, v in row.items():
            print(f"  {k:20s} {v['us']:7.1f} [{v['min']:.1f}-{v['max']:.1f}] | {v['do_bench_us']:7.1f} | "
                  f"{v['vs_bf16_mlpfuse']:.3f}x | {v['gbps']:6.0f} | {v['vs_float64']:.2e}"
                  + (f" (vs recipe {v['vs_recipe_max_abs_over_max']:.1e})" if "vs_recipe_max_abs_over_max" in v
                     else ""))


if __name__ == "__main__":
    main()
