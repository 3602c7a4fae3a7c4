"""How much of a Llama-3-8B-shaped training step the MLP blocks are, and what FP8 peers make of the step.

    PYTHONPATH=src python3 benchmarks/train_share.py [--layers 4] [--tokens 2x2048] [--rounds 3] [--no-torchao]

One bf16 model (random init, seeded), forward + cross-entropy + backward of every parameter, timed per variant
with CUDA events (median of `--steps` steps per round, rounds interleaved), peak memory beside it (the variant's
own: its weights and its step's peak, above what the variants built before it hold):

    eager, compile                  the model as is
    eager-no-mlp, compile-no-mlp    every layer's MLP replaced by the identity (its input, the post-attention
                                    norm's output, goes on): the step without the MLPs' own work
    torchao-fp8-compile             torchao float8 training (rowwise scales) on every nn.Linear, compiled
    torchao-fp8-mlp-compile         the same on the MLP projections only

The MLP share s = 1 − T(no-mlp) / T(full) bounds what any MLP-only change can give the step: with the MLPs' work
made twice as fast (FP8's tensor-core rate, nothing lost to quantization) the step is 1 − s/2 of its time.
Needs CUDA and transformers; torchao (pip wheel) for its rows.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, "src")
from mlpfuse.bench import models  # noqa: E402


class _PassThrough(nn.Module):
    def forward(self, x, *args, **kwargs):
        return x


def _without_mlps(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.mlp = _PassThrough()
    return model


def _torchao(model: nn.Module, mlp_only: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(module, fqn):
        return ".mlp." in f".{fqn}." if mlp_only else True

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"), module_filter_fn=keep)
    return model


def _step_fn(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach()

    return step


def _time(step, n: int) -> float:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="2x2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args()
    batch, seq = (int(v) for v in args.tokens.split("x"))
    dev = torch.device("cuda")
    built = models.build("llama3-8b", layers=args.layers, tiny=False, device=dev, dtype=torch.bfloat16)
    base = built.model.train()
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, built.vocab, (batch, seq), generator=gen).to(dev)

    makers = {
        "eager": lambda m: m,
        "eager-no-mlp": _without_mlps,
        "compile": lambda m: torch.compile(m, dynamic=False),
        "compile-no-mlp": lambda m: torch.compile(_without_mlps(m), dynamic=False),
    }
    if not args.no_torchao and importlib.util.find_spec("torchao") is not None:
        makers["torchao-fp8-compile"] = lambda m: torch.compile(_torchao(m, False), dynamic=False)
        makers["torchao-fp8-mlp-compile"] = lambda m: torch.compile(_torchao(m, True), dynamic=False)
    steps, peaks, losses = {}, {}, {}
    for name, make in makers.items():
        before = torch.cuda.memory_allocated()  # the variants built so far stay alive (interleaved rounds)
        step = _step_fn(make(copy.deepcopy(base)), ids)
        for _ in range(3):  # compile, autotune, allocator warm
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        losses[name] = step().item()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20  # its weights + its step's peak
        steps[name] = step
        print(f"ready {name}: loss {losses[name]:.4f} peak {peaks[name]:.0f} MiB", flush=True)
    rounds = {name: [] for name in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]
        for name in order:
            rounds[name].append(_time(steps[name], args.steps))
    med = {name: statistics.median(v) for name, v in rounds.items()}
    spread = {name: (max(v) - min(v)) / med[name] for name, v in rounds.items()}
    print(f"\n{built.label}, train {batch}x{seq}, bf16, {args.rounds} interleaved rounds of {args.steps} steps "
          f"(median ms, spread = (max-min)/median)")
    print(f"{'variant':26} {'ms':>8} {'spread':>7} {'vs eager':>9} {'vs compile':>11} {'peak MiB':>9} {'loss':>8}")
    for name in steps:
        print(f"{name:26} {med[name]:8.2f} {spread[name] * 100:6.1f}% {med[name] / med['eager']:8.3f}x "
              f"{med[name] / med['compile']:10.3f}x {peaks[name]:9.0f} {losses[name]:8.4f}")
    for mode in ("eager", "compile"):
        share = 1 - med[f"{mode}-no-mlp"] / med[mode]
        print(f"{mode}: the MLPs are {share * 100:.1f}% of the step; MLPs twice as fast -> at best "
              f"{1 - share / 2:.3f}x the step")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"label": built.label, "tokens": args.tokens, "rounds": rounds, "peak_mib": peaks,
                       "loss": losses}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
