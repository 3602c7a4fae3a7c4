"""Where a training step's host time and peak memory go (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/train_anatomy.py [--out DIR]

1. Host: the step of `mlpfuse bench --mode fwd+bwd` (forward + torch.autograd.grad of x and every weight) for
   eager and mlpfuse (triton backend) at 64 tokens × 768 × 3072, where every kernel takes a few µs, so back-to-back
   steps measure host time; then the mlpfuse step under cProfile, the functions with the most own time first.
2. Memory: one step of each variant under torch.cuda.memory._record_memory_history; the allocator's events are
   replayed to find the step's peak, and the blocks live at that instant are listed with the Python line that
   allocated them (the step's outputs — y, dx, the weight gradients — are part of every variant's peak).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from host_overhead import per_call_rounds  # noqa: E402  (this folder is on sys.path when run)
from host_profile import profile  # noqa: E402
from mlpfuse.bench import presets, variants

NAMES = ("eager", "compile", "liger", "mlpfuse", "mlpfuse-triton")


def case(tokens, dim, hidden, act="silu"):
    return presets.Case("swiglu" if act == "silu" else "geglu", act, tokens, dim, hidden, "bf16", "fwd+bwd")


def build(name, c, dev):
    v = variants.VARIANTS[name]
    if v.missing():
        return None, v.missing()
    problem = variants.make_problem(c, dev)
    return (problem, v.build(problem)), None


def host_rows(dev, out):
    rows = []
    for tokens, dim, hidden in ((64, 768, 3072), (8192, 768, 3072)):
        c = case(tokens, dim, hidden, "gelu_tanh")
        for name in ("eager", "mlpfuse-triton", "mlpfuse"):
            built, why = build(name, c, dev)
            if built is None:
                continue
            _, step = built
            for _ in range(3):
                step()
            r = per_call_rounds(step, n=50 if tokens > 64 else 200, rounds=7)
            rows.append((f"{c.label} {name}", r[len(r) // 2], r[0], r[-1]))
            print(f"host/wall per step {c.label:40s} {name:16s} {r[len(r) // 2]:8.1f} us (min {r[0]:.1f} max {r[-1]:.1f})",
                  flush=True)
    built, _ = build("mlpfuse-triton", case(64, 768, 3072, "gelu_tanh"), dev)
    _, step = built
    text = profile(step, 500, top=30)
    print(text[:6000])
    with open(os.path.join(out, "cprofile_train_step.txt"), "w") as f:
        f.write(text)
    return rows


def peak_blocks(snapshot, stream_filter=None):
    """Replay the allocator trace: (peak bytes above the start, live blocks at the peak as (size, frame))."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            a = e["action"]
            if a == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                total += e["size"]
            elif a == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
            if total > peak:
                peak, at_peak = total, dict(live)
    return peak, at_peak


def where(frames):
    for f in frames:
        fn = f.get("filename", "")
        if ("mlpfuse" in fn or "liger" in fn or "variants" in fn) and "bench/timing" not in fn:
            return f"{os.path.basename(fn)}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if "torch/" in f.get("filename", "") and "autograd" in f.get("filename", ""):
            return f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def memory_rows(dev, out):
    rows = []
    for tokens, dim, hidden, act in ((1024, 4096, 14336, "silu"), (4096, 4096, 14336, "silu"),
                                     (8192, 4096, 14336, "silu"), (8192, 768, 3072, "gelu_tanh")):
        c = case(tokens, dim, hidden, act)
        for name in NAMES:
            built, why = build(name, c, dev)
            if built is None:
                print(f"{c.label} {name}: {why}")
                continue
            problem, step = built
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            res = step()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            measured = (torch.cuda.max_memory_allocated() - base) / 2**20
            peak, blocks = peak_blocks(snap)
            del res
            groups = {}
            for size, frames in blocks.values():
                k = where(frames)
                groups[k] = groups.get(k, 0) + size
            top = sorted(groups.items(), key=lambda kv: -kv[1])[:8]
            print(f"\n{c.label} {name}: peak {measured:.1f} MiB (replayed {peak / 2**20:.1f}); live at the peak:")
            for k, v in top:
                print(f"    {v / 2**20:9.1f} MiB  {k}")
            rows.append({"case": c.label, "variant": name, "peak_mib": measured,
                         "live": [(k, v / 2**20) for k, v in top]})
            del problem, step, snap
            torch.cuda.empty_cache()
    with open(os.path.join(out, "memory_at_peak.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="host,memory", help="comma list: host, memory")
    args = ap.parse_args()
    parts = args.parts.split(",")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    host = host_rows(dev, args.out) if "host" in parts else []
    mem = memory_rows(dev, args.out) if "memory" in parts else []
    print("\n| step | host/wall µs median | min | max |\n|---|---|---|---|")
    for name, med, lo, hi in host:
        print(f"| {name} | {med:.1f} | {lo:.1f} | {hi:.1f} |")
    print("\n| case | variant | peak MiB |\n|---|---|---|")
    for r in mem:
        print(f"| {r['case']} | {r['variant']} | {r['peak_mib']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
