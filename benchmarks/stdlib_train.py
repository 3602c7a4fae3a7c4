"""FP8 training on a real run: the small Llama-shaped model of benchmarks/stdlib_lm.py (bytes of the Python standard
library's sources), trained from the same seed on the same windows in each variant, side by side.

    PYTHONPATH=src python3 benchmarks/stdlib_train.py OUT [--layers 4 --hidden 768 --intermediate 2048 --steps 600]
        [--variants bf16,mlpfuse-bf16,mlpfuse-save-fp8,mlpfuse-fp8,torchao-fp8]

Variants (fp32 master weights, AdamW, bf16 autocast on CUDA as stdlib_lm trains):
    bf16              the model as transformers builds it
    mlpfuse-bf16      mlpfuse.patch(model) in train mode: the fused bf16 MLP blocks
    mlpfuse-save-fp8  mlpfuse.patch(model, save="fp8"): bf16 training keeping g and u in FP8 for the backward
    mlpfuse-fp8       mlpfuse.patch(model, precision="fp8") in train mode: every MLP GEMM in e4m3, masters kept
    torchao-fp8       torchao float8 training (rowwise) on the MLP projections, compiled (torchao's own advice)
    mlpfuse-fp8-reference  (named only) mlpfuse-fp8 on the recipe's reference path (backend="torch")
    bf16-compile      (named only) bf16, compiled: the baseline of a compiled variant (compile's own numerics)
Per variant: the loss at every step, the held-out next-byte loss after training (bf16 autocast), tokens per second
over the steps after the first tenth (the compiled variant's compilation falls in that tenth), the peak CUDA memory
of training, and — before training, on one fixed batch — each MLP weight's gradient cosine similarity with the
bf16 model's, and every step's gradient norm before clipping. Writes OUT/stdlib_train.json and OUT/loss_curves.png;
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stdlib_lm  # noqa: E402  (the corpus, the model and the held-out evaluation)

import mlpfuse  # noqa: E402

VARIANTS = ("bf16", "mlpfuse-bf16", "mlpfuse-save-fp8", "mlpfuse-fp8", "torchao-fp8")
# by name only: mlpfuse FP8 training on the recipe's reference path (PyTorch ops, backend="torch") — the same numbers
# as the kernels by design, to tell the recipe's effect on training from the kernels'; bf16 compiled
EXTRA = ("mlpfuse-fp8-reference", "bf16-compile")


def prepare(variant: str, model: nn.Module, device: str) -> tuple[nn.Module, str]:
    """The model as the variant trains it, and a note (the patch report, or why the variant cannot run here)."""
    model.train()
    if variant == "bf16":
        return model, ""
    if variant == "bf16-compile":  # the baseline of the compiled variants (torchao's): compile's own numerics
        return torch.compile(model), "bf16, compiled"
    if variant.startswith("mlpfuse"):
        kw = {"mlpfuse-fp8": {"precision": "fp8"}, "mlpfuse-fp8-reference": {"precision": "fp8", "backend": "torch"},
              "mlpfuse-save-fp8": {"save": "fp8"}}.get(variant, {})
        report = mlpfuse.patch(model, **kw)
        if not report.swapped:
            raise SystemExit(f"{variant}: no block swapped: {report.summary()}")
        if "precision" in kw and not all(s.precision == "fp8-train" for s in report.swapped):
            raise SystemExit(f"{variant}: not every block trains in FP8: {report.summary()}")
        return model, report.summary()
    if variant == "torchao-fp8":
        if not device.startswith("cuda"):
            return model, "skipped: torchao float8 training needs CUDA"
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as e:
            return model, f"skipped: torchao not importable ({e})"
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda m, fqn: ".mlp." in f".{fqn}.")
        return torch.compile(model), "torchao float8 rowwise on the MLP projections, compiled"
    raise SystemExit(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")


def mlp_grads(model: nn.Module, w: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    """Every MLP weight's gradient of the loss on batch w (the model's parameters by name, as built)."""
    model.zero_grad(set_to_none=True)
    stdlib_lm.loss_of(model, w, device).backward()
    # names as built: a compiled model's carry torch.compile's "_orig_mod." prefix
    grads = {n.replace("_orig_mod.", ""): p.grad.detach().float().clone() for n, p in model.named_parameters()
             if ".mlp." in n and n.endswith("weight") and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        k = max(1, len(losses) // 50)  # a running mean over ~2 % of the run
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte, running mean)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The model's shape, the schedule, the corpus, the seed and the device: the flags of a training run here
    (benchmarks/fp8_train_bisect.py takes the same)."""
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-windows", type=int, default=1024)
    ap.add_argument("--limit-bytes", type=int, default=None, help="read at most this many bytes of each split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS + EXTRA]
    if bad or "bf16" not in variants:
        ap.error(f"--variants: expected names from {', '.join(VARIANTS + EXTRA)}, bf16 among them (the baseline); "
                 f"got {bad}")
    for name in ("hidden", "intermediate"):
        if getattr(a, name) % 128:
            ap.error(f"--{name} must be a multiple of 128 (the FP8 recipe's groups)")
    os.makedirs(a.out, exist_ok=True)
    train_files, held_files = stdlib_lm.split(stdlib_lm.corpus_files())
    data, held = stdlib_lm.read_bytes(train_files, a.limit_bytes), stdlib_lm.read_bytes(held_files, a.limit_bytes)
    print(f"Python {sys.version.split()[0]}: {data.numel() / 1e6:.1f} MB to train, {held.numel() / 1e6:.1f} MB "
          f"held out; {a.layers} layers, {a.hidden}/{a.intermediate}, {a.steps} steps of {a.batch}×{a.seq}",
          flush=True)
    probe = stdlib_lm.windows(data, a.batch, a.seq, torch.Generator().manual_seed(a.seed + 1)).to(a.device)
    rows: dict[str, dict] = {}
    base_grads = None
    for variant in variants:
        model = stdlib_lm.build_model(a.layers, a.hidden, a.intermediate, a.heads, a.seq, a.seed).to(a.device)
        model, note = prepare(variant, model, a.device)
        if note.startswith("skipped"):
            rows[variant] = {"note": note}
            print(f"{variant}: {note}", flush=True)
            continue
        grads = mlp_grads(model, probe, a.device)
        if variant == "bf16":
            base_grads = grads
        cos = {n: float(nn.functional.cosine_similarity(g.flatten(), base_grads[n].flatten(), dim=0))
               for n, g in grads.items() if n in base_grads}
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        norms: list[float] = []
        losses, tps = stdlib_lm.train(model, data, a.steps, a.batch, a.seq, a.lr, a.seed, a.device, norms)
        peak = torch.cuda.max_memory_allocated() / 2**20 if a.device.startswith("cuda") else float("nan")
        with stdlib_lm.autocast(a.device):
            held_loss = stdlib_lm.evaluate(model, held, a.seq, a.batch, a.eval_windows, a.device)
        rows[variant] = {"note": note, "losses": losses, "held_out_loss": held_loss, "tokens_per_s": tps,
                         "peak_mib": peak, "grad_cosine": cos, "grad_norms": norms}
        print(f"{variant}: loss {losses[0]:.3f} -> {sum(losses[-20:]) / min(20, len(losses)):.3f}, held out "
              f"{held_loss:.4f}, {tps:,.0f} tokens/s, peak {peak:.0f} MiB, min MLP grad cosine "
              f"{min(cos.values()) if cos else float('nan'):.5f}, gradient norm before clipping (median of steps "
              f"0-49 / all) {statistics.median(norms[:50]):.3f} / {statistics.median(norms):.3f}", flush=True)
        del model
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    base = rows["bf16"]
    result = {"python": sys.version.split()[0], "args": vars(a), "variants": rows}
    with open(os.path.join(a.out, "stdlib_train.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    curves = {v: r["losses"] for v, r in rows.items() if "losses" in r}
    plot(curves, os.path.join(a.out, "loss_curves.png"))
    print(f"\n{'variant':18s} {'held-out':>9s} {'× bf16':>7s} {'tokens/s':>10s} {'× bf16':>7s} {'peak MiB':>9s} "
          f"{'× bf16':>7s} {'min grad cos':>12s}")
    for v, r in rows.items():
        if "losses" not in r:
            print(f"{v:18s} {r['note']}")
            continue
        print(f"{v:18s} {r['held_out_loss']:9.4f} {r['held_out_loss'] / base['held_out_loss']:7.4f} "
              f"{r['tokens_per_s']:10,.0f} {r['tokens_per_s'] / base['tokens_per_s']:7.3f} {r['peak_mib']:9.0f} "
              f"{r['peak_mib'] / base['peak_mib']:7.3f} {min(r['grad_cosine'].values(), default=float('nan')):12.5f}")
    return result


if __name__ == "__main__":
    main()
