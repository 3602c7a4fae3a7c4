"""FP8's accuracy on a trained model: a small Llama-shaped model trained here, in a few minutes on one GPU, on text
every machine has — the Python standard library's own source files, bytes as tokens — then evaluated on held-out
files in bf16, with mlpfuse's bf16 blocks, with mlpfuse's FP8 blocks and (where torchao imports) with torchao's
float8 rowwise MLP projections.

    PYTHONPATH=src python3 benchmarks/stdlib_lm.py OUT [--layers 8 --hidden 768 --intermediate 2048 --steps 1500]

Deterministic: files sorted by path, every tenth file held out, a seeded generator for the initial weights and the
training windows, no download. The corpus is whatever standard library the running Python has (its version is
printed: two machines with different Pythons train on different text). Widths are multiples of 128 (the FP8
recipe's groups). Prints one table (held-out loss in nats per byte, perplexity, bits per byte, each variant's
perplexity over bf16's) and writes OUT/stdlib_lm.json with the training curve.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn

import mlpfuse


def corpus_files() -> list[str]:
    """The standard library's .py files, sorted; installed packages (site-/dist-packages) left out."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f)


def split(files: list[str], every: int = 10) -> tuple[list[str], list[str]]:
    """(train, held out): every `every`-th file of the sorted list is held out."""
    return ([f for i, f in enumerate(files) if i % every], [f for i, f in enumerate(files) if i % every == 0])


def read_bytes(files: list[str], limit: int | None = None) -> torch.Tensor:
    """The files' bytes, each followed by a 0 byte (a separator no source file holds), as one uint8 tensor."""
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        chunks.append(data + b"\0")
        total += len(data) + 1
        if limit is not None and total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def build_model(layers: int, hidden: int, intermediate: int, heads: int, seq: int, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of seq + 1 bytes (inputs and their next bytes)."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


def autocast(device: str):
    """The bf16 autocast region training runs in (on CUDA; off on the CPU)."""
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu")


def loss_of(model: nn.Module, w: torch.Tensor, device: str) -> torch.Tensor:
    """The next-byte cross-entropy of windows w [batch, seq + 1] (the model under autocast, the loss in fp32)."""
    with autocast(device):
        logits = model(input_ids=w[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))


def optimizer(model: nn.Module, lr: float, steps: int):
    """(AdamW, its schedule) of a run of `steps` steps: linear warm-up over the first twentieth, then cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    return opt, sched


def train(model: nn.Module, data: torch.Tensor, steps: int, batch: int, seq: int, lr: float, seed: int,
          device: str, grad_norms: list | None = None) -> tuple[list[float], float]:
    """AdamW with warm-up and cosine decay, fp32 master weights under bf16 autocast (on CUDA): the loss per step,
    and the tokens per second over the steps after the first tenth (warm-up and any compilation fall before).
    `grad_norms`: a list to append each step's gradient norm to (before clipping)."""
    gen = torch.Generator().manual_seed(seed)
    opt, sched = optimizer(model, lr, steps)
    losses, norms, skip, t0 = [], [], max(1, steps // 10), None
    cuda = device.startswith("cuda")
    model.train()
    for step in range(steps):
        if step == skip:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = loss_of(model, windows(data, batch, seq, gen).to(device), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())  # read after the loop: an .item() a step would wait on the GPU each step
        norms.append(norm.detach())
    if cuda:
        torch.cuda.synchronize()
    timed = steps - skip
    tps = timed * batch * seq / (time.perf_counter() - t0) if t0 is not None and timed > 0 else float("nan")
    model.eval()
    if grad_norms is not None:
        grad_norms.extend(float(x) for x in norms)
    return [float(x) for x in losses], tps


@torch.inference_mode()
def evaluate(model: nn.Module, data: torch.Tensor, seq: int, batch: int, max_windows: int, device: str) -> float:
    """Mean next-byte loss (nats) over consecutive, non-overlapping windows of the held-out bytes."""
    n = min(max_windows, (data.numel() - 1) // seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = [data[j * seq:j * seq + seq + 1].long() for j in range(i, min(n, i + batch))]
        w = torch.stack(rows).to(device)
        logits = model(input_ids=w[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    return total / count


def torchao_fp8(model: nn.Module) -> nn.Module | str:
    """The MLP projections in torchao's float8 (dynamic activations, rowwise scales), or why not."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as e:
        return f"torchao not importable ({e})"
    try:
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and ".mlp." in f".{fqn}.")
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
        return f"torchao float8 failed: {type(e).__name__}: {str(e)[:120]}"
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-windows", type=int, default=2048)
    ap.add_argument("--limit-bytes", type=int, default=None, help="read at most this many bytes of each split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    for name in ("hidden", "intermediate"):
        if getattr(a, name) % 128:
            ap.error(f"--{name} must be a multiple of 128 (the FP8 recipe's groups)")
    os.makedirs(a.out, exist_ok=True)
    files = corpus_files()
    if len(files) < 20:
        ap.error(f"found only {len(files)} standard-library files under {sysconfig.get_paths()['stdlib']}")
    train_files, held_files = split(files)
    train_data, held = read_bytes(train_files, a.limit_bytes), read_bytes(held_files, a.limit_bytes)
    print(f"Python {sys.version.split()[0]}: {len(train_files)} files / {train_data.numel() / 1e6:.1f} MB to train, "
          f"{len(held_files)} / {held.numel() / 1e6:.1f} MB held out", flush=True)

    model = build_model(a.layers, a.hidden, a.intermediate, a.heads, a.seq, a.seed).to(a.device)
    t0 = time.perf_counter()
    losses, _ = train(model, train_data, a.steps, a.batch, a.seq, a.lr, a.seed, a.device)
    train_s = time.perf_counter() - t0
    print(f"trained {a.steps} steps in {train_s:.0f} s: loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f}",
          flush=True)
    base = model.to(torch.bfloat16)
    rows, notes = {}, {}
    rows["bf16"] = evaluate(base, held, a.seq, a.batch, a.eval_windows, a.device)
    fused = copy.deepcopy(base)
    notes["mlpfuse bf16"] = mlpfuse.patch(fused).summary()
    rows["mlpfuse bf16"] = evaluate(fused, held, a.seq, a.batch, a.eval_windows, a.device)
    del fused
    f8 = copy.deepcopy(base)
    report = mlpfuse.patch(f8, precision="fp8")
    notes["mlpfuse fp8"] = report.summary()
    if not any(s.precision == "fp8" for s in report.swapped):
        raise SystemExit(f"no block ran in FP8: {report.summary()}")
    rows["mlpfuse fp8"] = evaluate(f8, held, a.seq, a.batch, a.eval_windows, a.device)
    del f8
    if a.device.startswith("cuda"):
        ao = torchao_fp8(copy.deepcopy(base))
        if isinstance(ao, str):
            notes["torchao fp8 rowwise"] = ao
        else:
            rows["torchao fp8 rowwise"] = evaluate(ao, held, a.seq, a.batch, a.eval_windows, a.device)
    result = {"python": sys.version.split()[0], "args": vars(a), "train_files": len(train_files),
              "held_files": len(held_files), "train_seconds": train_s, "losses": losses, "held_out_loss": rows,
              "notes": notes}
    with open(os.path.join(a.out, "stdlib_lm.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nheld-out next-byte loss ({min(a.eval_windows, (held.numel() - 1) // a.seq)} windows of {a.seq} bytes)")
    print(f"{'variant':22s} {'nats/byte':>10s} {'perplexity':>11s} {'bits/byte':>10s} {'x bf16 ppl':>11s}")
    for k, v in rows.items():
        print(f"{k:22s} {v:10.4f} {math.exp(v):11.4f} {v / math.log(2):10.4f} {math.exp(v - rows['bf16']):11.4f}")
    for k, v in notes.items():
        print(f"  {k}: {v}")
    return result


if __name__ == "__main__":
    main()
