"""Where mlpfuse's FP8 training loses accuracy: the stdlib model of benchmarks/stdlib_train.py trained (same seed,
same windows, 600 steps of 32×512) in bf16 and with every MLP in FP8, each "split" one way of running the FP8 step.

    PYTHONPATH=src python3 benchmarks/fp8_train_bisect.py OUT [--splits bf16,kernels,reference,...]
        [--compare-steps 0,1,10,50,150,300,599] [--seeds 0,1,2] [--stop-after N]

Splits:
    kernels, reference          the step on the FP8 kernels / on the recipe's reference path (PyTorch ops)
    kernel-forward              the kernels' forward with the reference path's backward
    kernel-backward             the reference path's forward with the kernels' backward
    abl-none                    the recipe in PyTorch ops written out here (the reference path's numbers)
    abl-forward, abl-x, abl-w, abl-h, abl-save, abl-dgrad, abl-wgrad, abl-all
                                the same with one part of the recipe in full precision (Ablation says which)
    rowwise-forward             the same with the forward's x, weights and h quantized per row (one scale over the
                                whole row, as rowwise FP8 recipes do) instead of in 128-groups
    pow2                        the recipe with every scale a power of two
    rowwise-all, rowwise-all-amax
                                a rowwise recipe throughout (torchao's float8 "rowwise" as written here: per row and
                                per channel, g and u kept for the backward), with power-of-two scales / without
While the kernels train, at the steps named, every MLP call's outputs are compared with the reference path's on the
very same inputs: the forward's y and the e4m3 codes it keeps (x, g, u: the fraction of codes that differ, the scale
ratios), the backward's dx, dWg, dWu, dWd (relative Frobenius error). Writes OUT/fp8_train_bisect.json; prints each
split's held-out loss, the comparison's worst rows and the held-out losses over bf16's (of the same seed; with
--seeds, every split is trained from each seed and the ratios are summarised: single runs spread about ±1 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stdlib_lm  # noqa: E402
import stdlib_train  # noqa: E402  (the run's flags)

import mlpfuse  # noqa: E402
from mlpfuse import activations, fp8  # noqa: E402
from mlpfuse import reference as R  # noqa: E402
from mlpfuse.ops import fp8_train  # noqa: E402

# (forward, backward) backends per variant: "" is the kernels' (auto on an FP8 GPU), "torch" the reference path
SPLITS = {"kernels": ("", ""), "reference": ("torch", "torch"), "kernel-forward": ("", "torch"),
          "kernel-backward": ("torch", "")}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _codes(qa, sa, qb, sb) -> dict:
    diff = (qa.view(torch.uint8) != qb.view(torch.uint8)).double().mean()
    ratio = (sa.double() / sb.double()).nan_to_num(nan=1.0)
    return {"code_mismatch": float(diff), "scale_ratio_max": float(ratio.max()), "scale_ratio_min": float(ratio.min())}


class _Route:
    """While entered, ops.fp8_train's forward and backward are this object's `_routed()` pair (restored on exit);
    `step`, `compare` and `rows` are what train() sets and run_split() reads."""

    def __init__(self):
        self.compare, self.step, self.rows = False, -1, []
        self._orig = (fp8_train._forward, fp8_train._backward)

    def __enter__(self):
        fp8_train._forward, fp8_train._backward = self._routed()
        return self

    def __exit__(self, *exc):
        fp8_train._forward, fp8_train._backward = self._orig


class Split(_Route):
    """Routes fp8_train's forward and backward to the backends of one variant, and compares the kernels' outputs
    with the reference path's on the same inputs while `compare` is on."""

    def __init__(self, forward: str, backward: str):
        super().__init__()
        self.forward, self.backward = forward, backward

    def _routed(self):
        orig_fwd, orig_bwd = self._orig

        def fwd(x, wg, wu, wd, bg, bu, bd, activation, backend):
            out = orig_fwd(x, wg, wu, wd, bg, bu, bd, activation, self.forward)
            if self.compare and self.forward == "":
                ref = orig_fwd(x, wg, wu, wd, bg, bu, bd, activation, "torch")
                row = {"step": self.step, "pass": "forward", "x_dtype": str(x.dtype), "x_amax": float(x.abs().max()),
                       "y": _rel(out[0], ref[0])}
                for name, i in (("x", 1), ("g", 3), ("u", 5)):
                    row.update({f"{name}_{k}": v for k, v in _codes(out[i], out[i + 1], ref[i], ref[i + 1]).items()})
                self.rows.append(row)
            return out

        def bwd(dy, xq, xs, gq, gs, uq, us, wg, wu, wd, activation, backend):
            out = orig_bwd(dy, xq, xs, gq, gs, uq, us, wg, wu, wd, activation, self.backward)
            if self.compare and self.backward == "":
                ref = orig_bwd(dy, xq, xs, gq, gs, uq, us, wg, wu, wd, activation, "torch")
                row = {"step": self.step, "pass": "backward", "dy_dtype": str(dy.dtype),
                       "dy_amax": float(dy.abs().max()), "dy_norm": float(dy.float().norm())}
                for name, i in (("dx", 0), ("dwg", 1), ("dwu", 2), ("dwd", 3)):
                    row[name] = _rel(out[i], ref[i])
                    row[name + "_ref_norm"] = float(ref[i].double().norm())
                self.rows.append(row)
            return out

        return fwd, bwd


def _round_trip(t: torch.Tensor, dim: int, group: int | None, pow2: bool) -> torch.Tensor:
    """t quantized to e4m3 in groups of `group` consecutive elements along `dim` (None: the whole of it), one scale
    a group — amax / 448, or with `pow2` the power of two at or above it (the values then scaled exactly) — and
    dequantized, in fp32."""
    t = t.float().movedim(dim, -1)
    n = t.shape[-1]
    g = group or n
    pad = -n % g
    grouped = F.pad(t, (0, pad)).unflatten(-1, (-1, g))
    amax = grouped.abs().amax(-1, keepdim=True)
    scale = amax / 448.0
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    back = ((grouped / scale).to(fp8.DTYPE).float() * scale).flatten(-2)[..., :n]
    return back.movedim(-1, dim)


def _blocks_pow2(w: torch.Tensor) -> torch.Tensor:
    """W's 128×128 blocks quantized with power-of-two scales and dequantized, fp32."""
    n, k = w.shape
    wp = F.pad(w.float(), (0, -k % 128, 0, -n % 128))
    b = wp.unflatten(1, (-1, 128)).unflatten(0, (-1, 128))  # [N/128, 128, K/128, 128]
    amax = b.abs().amax((1, 3), keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))), torch.ones_like(amax))
    return ((b / scale).to(fp8.DTYPE).float() * scale).flatten(2).flatten(0, 1)[:n, :k]


class Ablation(_Route):
    """The recipe in PyTorch ops (the reference path's formulas) with the quantizations named in `exact` left out:
    "x" (the forward's x), "w" (the forward's weights), "h" (the down GEMM's input), "save" (g and u as the backward
    reads them), "dy" (dh's dy), "wb" (the backward's weights), "dgu" (dx's dg and du), "wgrad" (all the weight
    gradients' operands). Other groupings: `rowwise` (the forward's x, h per token over all channels, its weights per
    output row), `rowwise_backward` (dy, dg, du per token; the backward's weights per column; the weight gradients'
    operands all per channel over all tokens, x's from x itself), `pow2` (every scale a power of two). Exact x, g and
    u travel to the backward on a stack (the layers' backwards run in reverse order), beside the e4m3 tensors the
    op's signature carries."""

    def __init__(self, exact: set[str], rowwise: bool = False, rowwise_backward: bool = False, pow2: bool = False):
        super().__init__()
        self.exact, self.stack = exact, []
        self.rowwise, self.rowwise_backward, self.pow2 = rowwise, rowwise_backward, pow2

    def on(self, name: str) -> bool:
        return name not in self.exact

    # the round trips, each left out when its part is exact; the recipe's own where no other grouping is asked
    def _rows(self, t, name, rowwise):
        if not self.on(name):
            return t.float()
        if not (rowwise or self.pow2):
            return R._round_trip_rows(t)
        return _round_trip(t, -1, None if rowwise else 128, self.pow2)

    def _tokens(self, t):
        if not self.on("wgrad"):
            return t.float()
        if not (self.rowwise_backward or self.pow2):
            return R._round_trip_tokens(t)
        return _round_trip(t, 0, None if self.rowwise_backward else 128, self.pow2)

    def _channels(self, t):
        if not self.on("wgrad"):
            return t.float()
        return R._round_trip_channels(t) if not self.pow2 else _round_trip(t, 0, None, True)

    def _w(self, w, name):
        w = w.detach()
        if not self.on(name):
            return w.float()
        if name == "w" and self.rowwise:
            return _round_trip(w, -1, None, self.pow2)  # per output row, over the contracted K
        if name == "wb" and self.rowwise_backward:
            return _round_trip(w, 0, None, self.pow2)  # per column, over the contracted dimension
        return _blocks_pow2(w) if self.pow2 else fp8.quantize_weight(w).dequantize(torch.float32)

    def forward(self, x, wg, wu, wd, bg, bu, bd, activation, backend):
        act = activations.get(activation)
        with torch.autocast(x.device.type, enabled=False):
            xq, xs = fp8.quantize_activation(x)
            xd = self._rows(x, "x", self.rowwise)
            g, u = F.linear(xd, self._w(wg, "w")), F.linear(xd, self._w(wu, "w"))
            y = F.linear(self._rows(act.forward(g) * u, "h", self.rowwise), self._w(wd, "w"))
            if not torch.is_inference_mode_enabled():  # a training call: its backward pops them
                self.stack.append((x.detach().float(), g, u))
            return (y.to(x.dtype), xq, xs, *fp8.quantize_activation(g), *fp8.quantize_activation(u))

    def backward(self, dy, xq, xs, gq, gs, uq, us, wg, wu, wd, activation, backend):
        act = activations.get(activation)
        x, g, u = self.stack.pop()
        rows_b = self.rowwise_backward
        with torch.autocast(dy.device.type, enabled=False):
            if self.on("save"):
                g, u = fp8.dequantize_activation(gq, gs), fp8.dequantize_activation(uq, us)
            a_ = act.forward(g)
            h = a_ * u
            d = dy.float()
            dh = self._rows(d, "dy", rows_b) @ self._w(wd, "wb")
            dwd = (self._tokens(h).t() @ self._channels(d)).t()
            dg, du = dh * u * act.grad(g), dh * a_
            dx = self._rows(dg, "dgu", rows_b) @ self._w(wg, "wb") + self._rows(du, "dgu", rows_b) @ self._w(wu, "wb")
            xw = fp8.dequantize_activation(xq, xs) if self.on("x") and not rows_b else x
            xc = self._channels(xw)
            dwg = self._tokens(dg).t() @ xc
            dwu = self._tokens(du).t() @ xc
        return (dx.to(dy.dtype), dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype), dg.sum(0), du.sum(0),
                d.sum(0))

    def _routed(self):
        return self.forward, self.backward


_ALL = {"x", "w", "h", "save", "dy", "wb", "dgu", "wgrad"}
# the recipe with one part in full precision (which quantization costs the training its accuracy), or grouped
# otherwise: Ablation's arguments per split
ABLATIONS = {
    "abl-none": {"exact": set()}, "abl-forward": {"exact": {"x", "w", "h"}}, "abl-save": {"exact": {"save"}},
    "abl-dgrad": {"exact": {"dy", "wb", "dgu"}}, "abl-wgrad": {"exact": {"wgrad"}}, "abl-x": {"exact": {"x"}},
    "abl-w": {"exact": {"w"}}, "abl-h": {"exact": {"h"}}, "abl-all": {"exact": _ALL},
    "rowwise-forward": {"exact": set(), "rowwise": True},
    "pow2": {"exact": set(), "pow2": True},
    # torchao's rowwise float8 training as this harness writes it: everything per row / per channel, power-of-two
    # scales, g and u (bf16 activations there) not quantized for the backward
    "rowwise-all": {"exact": {"save"}, "rowwise": True, "rowwise_backward": True, "pow2": True},
    "rowwise-all-amax": {"exact": {"save"}, "rowwise": True, "rowwise_backward": True},
}


def train(model, data, a, seed: int, split, compare_steps: set[int]):
    """stdlib_lm.train's loop (its optimizer and schedule, clipping at 1), with the comparison switched on at the
    named steps."""
    gen = torch.Generator().manual_seed(seed)
    opt, sched = stdlib_lm.optimizer(model, a.lr, a.steps)
    losses, norms = [], []
    model.train()
    for step in range(a.steps if a.stop_after is None else min(a.steps, a.stop_after)):
        split.step, split.compare = step, step in compare_steps
        if isinstance(split, Ablation):
            split.stack.clear()
        loss = stdlib_lm.loss_of(model, stdlib_lm.windows(data, a.batch, a.seq, gen).to(a.device), a.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        split.compare = False
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).detach())
        opt.step()
        sched.step()
        losses.append(loss.detach())
    model.eval()
    return [float(x) for x in losses], [float(x) for x in norms]


def run_split(name: str, seed: int, data, held, a, compare_steps: set[int]) -> dict:
    """One split trained from `seed`: its held-out loss, losses, gradient norms and comparison rows."""
    model = stdlib_lm.build_model(a.layers, a.hidden, a.intermediate, a.heads, a.seq, seed).to(a.device)
    model.train()
    if name == "bf16":
        split = Split("", "")
    else:
        report = mlpfuse.patch(model, precision="fp8")
        if not all(s.precision == "fp8-train" for s in report.swapped):
            raise SystemExit(f"{name}: not every block trains in FP8: {report.summary()}")
        split = Ablation(**ABLATIONS[name]) if name in ABLATIONS else Split(*SPLITS[name])
    with split:
        losses, norms = train(model, data, a, seed, split, compare_steps)
        with stdlib_lm.autocast(a.device):
            held_loss = stdlib_lm.evaluate(model, held, a.seq, a.batch, a.eval_windows, a.device)
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"held_out_loss": held_loss, "losses": losses, "grad_norms": norms, "comparison": split.rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stdlib_train.add_run_args(ap)
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds: every split trained from each (initial weights and windows), the "
                         "held-out losses over bf16's of the same seed summarised; default: --seed alone")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="train only this many steps of the --steps schedule (its warm-up and decay unchanged)")
    ap.add_argument("--splits", default="bf16," + ",".join(SPLITS))
    ap.add_argument("--compare-steps", default="0,1,10,50,150,300,599")
    a = ap.parse_args(argv)
    compare_steps = {int(s) for s in a.compare_steps.split(",") if s.strip()}
    names = [n.strip() for n in a.splits.split(",") if n.strip()]
    known = ("bf16", *SPLITS, *ABLATIONS)
    if not names or any(n not in known for n in names):
        ap.error(f"--splits: expected names from {', '.join(known)}; got {a.splits!r}")
    os.makedirs(a.out, exist_ok=True)
    train_files, held_files = stdlib_lm.split(stdlib_lm.corpus_files())
    data, held = stdlib_lm.read_bytes(train_files, a.limit_bytes), stdlib_lm.read_bytes(held_files, a.limit_bytes)
    seeds = [int(x) for x in a.seeds.split(",") if x.strip()] if a.seeds else [a.seed]
    result = {"args": vars(a), "variants": {}, "repeats": {}}
    for seed in seeds:
        for name in names:
            compare = compare_steps if seed == seeds[0] and name == "kernels" else set()
            row = run_split(name, seed, data, held, a, compare)
            if seed == seeds[0]:
                result["variants"][name] = row
            result["repeats"].setdefault(name, []).append({"seed": seed, "held_out_loss": row["held_out_loss"],
                                                            "losses": row["losses"]})
            around = "/".join(f"{_mean(row['losses'][s - 10:s + 10]):.3f}" for s in (100, 200, 300))
            print(f"{name:16s} seed {seed}: held out {row['held_out_loss']:.4f}  train loss (last 20) "
                  f"{_mean(row['losses'][-20:]):.4f}  loss at 100/200/300 {around}  grad norm median 0-49 "
                  f"{statistics.median(row['grad_norms'][:50]):.3f}", flush=True)
    with open(os.path.join(a.out, "fp8_train_bisect.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    rows = result["variants"].get("kernels", {}).get("comparison", [])
    keys_f = ("y", "x_code_mismatch", "g_code_mismatch", "u_code_mismatch", "g_scale_ratio_max", "g_scale_ratio_min")
    keys_b = ("dx", "dwg", "dwu", "dwd")
    print("\nkernels vs reference path on the same inputs (worst over the MLPs of each step):")
    for step in sorted({r["step"] for r in rows}):
        f = [r for r in rows if r["step"] == step and r["pass"] == "forward"]
        b = [r for r in rows if r["step"] == step and r["pass"] == "backward"]
        fs = " ".join(f"{k} {max(r[k] for r in f):.3g}" for k in keys_f) if f else ""
        bs = " ".join(f"{k} {max(r[k] for r in b):.3g}" for k in keys_b) if b else ""
        print(f"step {step:4d}: x {f[0]['x_dtype'] if f else '?'} | {fs} | dy {b[0]['dy_dtype'] if b else '?'} | {bs}")
    if "bf16" in result["repeats"]:
        base = {r["seed"]: r["held_out_loss"] for r in result["repeats"]["bf16"]}
        print("\nheld-out × bf16 of the same seed" + (f" (seeds {', '.join(map(str, seeds))}: mean, min–max)"
                                                      if len(seeds) > 1 else "") + ":")
        for n, runs in result["repeats"].items():
            ratios = [r["held_out_loss"] / base[r["seed"]] for r in runs]
            spread = f" ({min(ratios):.4f}–{max(ratios):.4f})" if len(ratios) > 1 else ""
            print(f"  {n:16s} {_mean(ratios):.4f}{spread}")
    return result


if __name__ == "__main__":
    main()
