"""Capture one training step (forward + backward) of the GeGLU MLP, eager vs mlpfuse, with mlpfuse's own profiler,
and print `mlpfuse analyze` for each and `mlpfuse diff` between them.

    PYTHONPATH=src python3 benchmarks/profile_training.py --out DIR [--tokens 8192 --dim 768 --hidden 3072]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import mlpfuse
from mlpfuse.cli import main as cli


class EagerGeGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=3072)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    eager = EagerGeGLU(args.dim, args.hidden).to(dev, dt)
    fused = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh")
    x = torch.randn(args.tokens, args.dim, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(args.tokens, args.dim, device=dev, dtype=dt)

    def step(model):
        for p in (x, *model.parameters()):
            p.grad = None
        model(x).backward(dy)

    paths = {}
    for name, model in (("eager", eager), ("mlpfuse", fused)):
        paths[name] = os.path.join(args.out, f"{name}-train.json.gz")
        mlpfuse.profile(step, model, label=f"{name}-train", trace_path=paths[name])
    for name in paths:
        print(f"===== mlpfuse analyze {name}", flush=True)
        cli(["analyze", paths[name]])
    print("===== mlpfuse diff eager mlpfuse", flush=True)
    cli(["diff", paths["eager"], paths["mlpfuse"]])


if __name__ == "__main__":
    main()
