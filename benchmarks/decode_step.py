"""One decode step of a transformers model, eager against mlpfuse.patch, with where its host time goes (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/decode_step.py [--model llama3-8b] [--layers 32] [--prompt 128]
                                                     [--rounds 15] [--steps 20] [--out DIR]

`generate` adds its own per-token work (logits processors, stopping criteria, cache bookkeeping) to each step, the
same for every variant, and the model lab's per-token figure is a difference of two whole generate calls. This
times the step itself: the model's forward on one new token with a DynamicCache holding the prompt, the cache cropped
back to the prompt after each step, `--steps` steps back to back per round, variants interleaved, `--rounds` rounds
(median with min–max). Per step: wall time (host and GPU, as generate sees it) and CUDA-event time around the steps
(transformers synchronizes inside a step, so its host time cannot be queued ahead of the GPU and measured alone).
Then the patched MLP's and the eager MLP's host µs per call on the step's input (the GPU held back by a sleep, so no
launch waits), and a profile of three steps per variant (CPU ops by self time) to show where any difference sits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import mlpfuse
from mlpfuse.bench import model_lab, models


def _stats(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import DynamicCache

    dev = torch.device("cuda")
    built = models.build(args.model, layers=args.layers, tiny=False, device=dev, dtype=torch.bfloat16)
    variants = {"eager": model_lab.twin(built.model), "mlpfuse": model_lab.twin(built.model)}
    report = mlpfuse.patch(variants["mlpfuse"])
    print(f"patched {len(report.swapped)} blocks; left {len(report.left)}")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, built.vocab, (1, args.prompt), generator=g).to(dev)
    tok = ids[:, -1:]
    state = {}
    for name, model in variants.items():
        model.eval()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        state[name] = (model, cache)

    def step(name):
        model, cache = state[name]
        with torch.no_grad():
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)  # back to the prompt
        return out.logits

    for name in variants:  # warm: every kernel compiled, the plans hold their entries
        for _ in range(3):
            step(name)
    torch.cuda.synchronize()
    same = (step("eager").float() - step("mlpfuse").float()).norm() / step("eager").float().norm()
    print(f"last-token logits, mlpfuse vs eager: relative difference {same.item():.2e}")

    wall = {n: [] for n in variants}
    gpu = {n: [] for n in variants}
    for _ in range(args.rounds):
        for name in variants:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            for _ in range(args.steps):
                step(name)
            e.record()
            torch.cuda.synchronize()
            wall[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            gpu[name].append(s.elapsed_time(e) / args.steps)
    results = {"device": torch.cuda.get_device_name(), "args": vars(args), "ms_per_step": {}}
    print(f"\n== {args.model}, {args.layers} layers, one decode step after a {args.prompt}-token prompt, ms per step, "
          f"median [min, max] of {args.rounds} rounds x {args.steps} steps")
    for what, table in (("wall", wall), ("GPU (events)", gpu)):
        base = statistics.median(table["eager"])
        for name, vals in table.items():
            st = _stats(vals)
            results["ms_per_step"][f"{what} {name}"] = st
            print(f"  {what:14s} {name:8s} {st['median']:8.3f} [{st['min']:.3f}, {st['max']:.3f}]  "
                  f"{st['median'] / base:.3f}x eager")

    # The MLP block alone on the step's input: host µs per call (the GPU held back) for eager's and the patched one.
    x = torch.randn(1, 1, built.model.config.hidden_size, device=dev, dtype=torch.bfloat16)
    blocks = {n: m.model.layers[0].mlp for n, m in variants.items()}
    print(f"\n== layer 0's MLP on [1, 1, {x.shape[-1]}]: host µs per call with the GPU held back, median [min, max]")
    for name, block in blocks.items():
        vals = []
        with torch.no_grad():
            for _ in range(3):
                block(x)
            for _ in range(args.rounds):
                torch.cuda.synchronize()
                torch.cuda._sleep(40_000_000)  # ~20 ms: longer than the 50 calls' host time, and few enough
                t0 = time.perf_counter()      # launches that the queue never fills (the host never waits)
                for _ in range(50):
                    block(x)
                vals.append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
        st = _stats(vals)
        results[f"mlp host us {name}"] = st
        print(f"  {type(block).__name__:24s} {name:8s} {st['median']:7.1f} [{st['min']:.1f}, {st['max']:.1f}]")

    from torch.profiler import ProfilerActivity, profile

    for name in variants:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(name)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(f"\n== profile of 3 decode steps, {name}: CPU ops by self time")
        print(table)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
                f.write(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_step.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
