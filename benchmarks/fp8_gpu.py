"""FP8 on one GPU: the kernels' numerics against the recipe's reference, compiled = eager, CUDA-graph replay, then the
block at prefill and decode sizes beside bf16 and the FP8 peers, with the error of every row.

    PYTHONPATH=src python3 benchmarks/fp8_gpu.py OUT [--dim 4096 --hidden 14336 --tokens 8192 --decode 1,4,16,32,64]

Timing: CUDA events per call over interleaved rounds (every variant once per round, in turn; median over rounds and
the spread min–max), host time per call beside it, and triton.testing.do_bench of the same callables as a second
harness. Rows (SwiGLU, bf16 weights ×0.02):
  bf16 eager              three F.linear + silu·mul
  bf16 mlpfuse            mlpfuse.GatedMLP (bf16)
  fp8 GEMMs alone         torch._scaled_mm rowwise with operands quantized beforehand (the floor)
  fp8 _scaled_mm eager    the same chain with its quantization ops (rowwise amax, scale, cast) in eager
  fp8 _scaled_mm compile  that chain under torch.compile
  fp8 mlpfuse             mlpfuse.GatedMLP(precision="fp8")
Error: ‖y − y64‖ / ‖y64‖ against the float64 MLP on the bf16 weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mlpfuse
from mlpfuse import fp8, reference
from mlpfuse.workloads import rowwise_fp8 as rowwise
from mlpfuse.ops import fp8_mlp


def scaled_mm_chain(x, qws):
    (gq, gs), (uq, us), (dq, ds) = qws
    xq, xs = rowwise(x)
    g = torch._scaled_mm(xq, gq.t(), scale_a=xs, scale_b=gs.t(), out_dtype=torch.bfloat16)
    u = torch._scaled_mm(xq, uq.t(), scale_a=xs, scale_b=us.t(), out_dtype=torch.bfloat16)
    h = F.silu(g) * u
    hq, hs = rowwise(h)
    return torch._scaled_mm(hq, dq.t(), scale_a=hs, scale_b=ds.t(), out_dtype=torch.bfloat16)


def gemms_alone(pre, qws):
    xq, xs, hq, hs = pre
    (gq, gs), (uq, us), (dq, ds) = qws
    torch._scaled_mm(xq, gq.t(), scale_a=xs, scale_b=gs.t(), out_dtype=torch.bfloat16)
    torch._scaled_mm(xq, uq.t(), scale_a=xs, scale_b=us.t(), out_dtype=torch.bfloat16)
    return torch._scaled_mm(hq, dq.t(), scale_a=hs, scale_b=ds.t(), out_dtype=torch.bfloat16)


def rel(y, y64):
    return float((y.double() - y64).norm() / y64.norm())


def clocks() -> tuple:
    """(SM clock MHz, power W) now, from NVML through torch; (None, None) where NVML does not answer."""
    try:
        return torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000
    except Exception:  # noqa: BLE001 - a record beside the timing, never a reason to stop it
        return None, None


def time_rounds(fns: dict, rounds: int, calls: int, state: dict | None = None):
    """CUDA-event GPU µs and host µs per call, `calls` back to back per variant per round; `state` (optional)
    receives each variant's SM clock and power right after each of its batches (the harnesses disagreed for the FP8
    block at 8192 tokens: clocks under the power limit are one suspect)."""
    gpu = {k: [] for k in fns}
    host = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            t1 = time.perf_counter()
            if state is not None:
                state.setdefault(name, []).append(clocks())
            torch.cuda.synchronize()
            gpu[name].append(start.elapsed_time(end) * 1000 / calls)
            host[name].append((t1 - t0) * 1e6 / calls)
    return gpu, host


def spin_up():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    torch.cuda.synchronize()


def checks(out: dict):
    """Numerics of the kernels against the reference path on the same GPU tensors."""
    torch.manual_seed(0)
    res = {}
    x = torch.randn(300, 4096 + 64, device="cuda", dtype=torch.bfloat16) * 3
    x[3, 5] = float("nan")
    x[7, 200] = float("inf")
    x[9] = 0
    kern = fp8_mlp._kernels()
    q, s = kern.quantize(x)
    rq, rs = fp8.quantize_activation(x)
    same_s = torch.equal(s.nan_to_num(7.0), rs.nan_to_num(7.0))
    qf, rqf = q.float(), rq.float()
    same_q = bool(((qf == rqf) | (qf.isnan() & rqf.isnan())).all())
    res["quantize bitwise (scales, values)"] = [same_s, same_q]
    for m in (1, 16, 17, 300, 2048):
        for act, bias in (("silu", False), ("gelu_tanh", True)):
            d, hdn = 512, 1408  # 1408 = 11 groups: partial tiles at BN=128 multiples fine; K=512
            mod = mlpfuse.GatedMLP(d, hdn, act, bias=bias, device="cuda", dtype=torch.bfloat16)
            for p in mod.parameters():
                torch.nn.init.normal_(p, std=0.02 if p.dim() == 2 else 0.1)
            mod = mod.to_fp8()
            xx = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                y = mod(xx)
                ws = [mod.gate_proj.fp8_weight(), mod.up_proj.fp8_weight(), mod.down_proj.fp8_weight()]
                bs = [mod.gate_proj.bias, mod.up_proj.bias, mod.down_proj.bias]
                fn = (reference.gated_mlp_fp8_weight_only if m <= fp8_mlp.WEIGHT_ONLY_MAX_M
                      else reference.gated_mlp_fp8)
                r = fn(xx, *ws, act, *bs)
                y64 = fn(xx.double(), *[fp8.Fp8Weight(w.values, w.scale_inv, torch.float64) for w in ws], act,
                         *[None if b is None else b.double() for b in bs])
                row = {"vs reference, max abs / ref max": float((y.float() - r.float()).abs().max()
                                                                 / r.float().abs().max()),
                       "vs the recipe in float64, rel": rel(y, y64), "reference's own rel": rel(r, y64)}
                if act == "silu" and m in (16, 300):
                    torch._dynamo.reset()
                    row["compiled == eager"] = torch.equal(torch.compile(mod, fullgraph=True, dynamic=False)(xx), y)
                    g = torch.cuda.CUDAGraph()
                    static = xx.clone()
                    with torch.cuda.graph(g):
                        yg = mod(static)
                    g.replay()
                    row["graph == eager"] = torch.equal(yg, y)
            res[f"m={m} {act} bias={bias}"] = row
    out["checks"] = res
    return res


def bench(out: dict, dim: int, hidden: int, tokens: int, decode: list[int], rounds: int, peers: bool = True):
    torch.manual_seed(0)
    bf = mlpfuse.GatedMLP(dim, hidden, "silu", device="cuda", dtype=torch.bfloat16)
    for p in bf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    wg, wu, wd = bf.gate_proj.weight.detach(), bf.up_proj.weight.detach(), bf.down_proj.weight.detach()
    f8 = copy.deepcopy(bf).to_fp8()
    qws = [rowwise(w) for w in (wg, wu, wd)]
    compiled_chain = torch.compile(scaled_mm_chain)
    rows = {}
    for m in ([tokens] if tokens else []) + decode:
        x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y64 = reference.gated_mlp(x.double(), wg.double(), wu.double(), wd.double(), "silu")
            xq, xs = rowwise(x)
            hq, hs = rowwise(F.silu(F.linear(x, wg)) * F.linear(x, wu))
            pre = (xq, xs, hq, hs)
            fns = {
                "bf16 eager": lambda: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd),
                "bf16 mlpfuse": lambda: bf(x),
                "fp8 GEMMs alone": lambda: gemms_alone(pre, qws),
                "fp8 _scaled_mm eager": lambda: scaled_mm_chain(x, qws),
                "fp8 _scaled_mm compile": lambda: compiled_chain(x, qws),
                "fp8 mlpfuse": lambda: f8(x),
            }
            if not peers:  # the `_scaled_mm` chains' rows (their compile is most of a short run's time)
                del fns["fp8 _scaled_mm eager"], fns["fp8 _scaled_mm compile"]
            errs = {k: rel(fn(), y64) for k, fn in fns.items() if k != "fp8 GEMMs alone"}
            for fn in fns.values():  # warm: compile and autotune outside the timing
                fn()
            calls = 5 if m >= 4096 else 50
            state: dict = {}
            gpu, host = time_rounds(fns, rounds, calls, state)
            import triton.testing
            dob = {k: triton.testing.do_bench(fn, warmup=25, rep=100) * 1000 for k, fn in fns.items()}
        base = statistics.median(gpu["bf16 eager"])
        rows[m] = {k: {"gpu_us": statistics.median(v), "min": min(v), "max": max(v),
                       "host_us": statistics.median(host[k]), "do_bench_us": dob[k],
                       "vs_bf16_eager": statistics.median(v) / base, "err": errs.get(k),
                       "sm_mhz_power_w": state.get(k)} for k, v in gpu.items()}
        print(f"[{m} tokens] " + "  ".join(f"{k}: {rows[m][k]['gpu_us']:.1f}us" for k in rows[m]), flush=True)
    out["bench"] = {"dim": dim, "hidden": hidden, "rows": rows, "weight_bytes_fp8": 3 * dim * hidden,
                    "weight_bytes_scales": 4 * sum(s.numel() for s in (f8.gate_proj.weight_scale_inv,
                                                                       f8.up_proj.weight_scale_inv,
                                                                       f8.down_proj.weight_scale_inv))}
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--tokens", type=int, default=8192, help="the prefill row's tokens (0: none)")
    ap.add_argument("--decode", default="1,4,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-peers", action="store_true", help="leave out the _scaled_mm chains (eager, compiled)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    if not a.skip_checks:
        for k, v in checks(out).items():
            print(k, v, flush=True)
    spin_up()
    rows = bench(out, a.dim, a.hidden, a.tokens, [int(t) for t in a.decode.split(",")], a.rounds, not a.no_peers)
    with open(os.path.join(a.out, "fp8.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\n{out['device']}  {a.dim}x{a.hidden} SwiGLU, GPU µs per call: median [min-max] of {a.rounds} interleaved "
          f"rounds | do_bench | host µs | ×bf16 eager | rel. error vs float64 | SM MHz, W under the events' batches")
    for m, r in rows.items():
        print(f"-- {m} tokens")
        for k, v in r.items():
            err = "" if v["err"] is None else f"{v['err']:.2e}"
            gbs = ""
            if k == "fp8 mlpfuse":
                gbs = f"  weights at {out['bench']['weight_bytes_fp8'] / v['gpu_us'] / 1e3:.0f} GB/s"
            seen = [c for c in v.get("sm_mhz_power_w") or () if c[0] is not None]
            clk = (f" | {statistics.median(c[0] for c in seen):.0f} MHz, {statistics.median(c[1] for c in seen):.0f} W"
                   if seen else "")
            print(f"  {k:24s} {v['gpu_us']:9.1f} [{v['min']:.1f}-{v['max']:.1f}] | {v['do_bench_us']:9.1f} | "
                  f"{v['host_us']:7.1f} | {v['vs_bf16_eager']:.3f}x | {err}{gbs}{clk}")


if __name__ == "__main__":
    main()
