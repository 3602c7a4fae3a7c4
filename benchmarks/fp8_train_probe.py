"""Where one gated MLP's FP8 training step spends its time: forward + backward of a 4096×14336 SwiGLU block on
4096 tokens (one layer of the 4-layer train step at 2×2048), kernel by kernel, beside the bf16 and torchao blocks.

    PYTHONPATH=src python3 benchmarks/fp8_train_probe.py [--tokens 4096] [--rounds 5] [--json OUT.json]

Rows (forward + backward of x and the three weights; do_bench medians of interleaved rounds, ms, with spread):
    eager bf16        silu(x·Wgᵀ)·(x·Wuᵀ)·Wdᵀ in PyTorch ops
    mlpfuse bf16      mlpfuse.ops.gated_mlp (the fused bf16 training path)
    mlpfuse fp8       mlpfuse.ops.fp8_train.fp8_gated_mlp_train (every GEMM in e4m3)
    torchao fp8       torchao float8 training (rowwise), compiled, on three nn.Linear (when torchao imports)
Then the FP8 step's kernels from torch.profiler: calls, µs per step, share, and TFLOP/s for the GEMMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn
import triton.testing

sys.path.insert(0, "src")
from mlpfuse.ops import fp8_train, gated_mlp  # noqa: E402  (gated_mlp: the function ops exports)


def _eager(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _fused(x, wg, wu, wd):
    return gated_mlp(x, wg, wu, wd, activation="silu")


def _fp8(x, wg, wu, wd):
    return fp8_train.fp8_gated_mlp_train(x, wg, wu, wd, activation="silu")


class _Block(nn.Module):
    def __init__(self, wg, wu, wd):
        super().__init__()
        self.g, self.u, self.d = (nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
                                  for w in (wg, wu, wd))
        with torch.no_grad():
            for lin, w in zip((self.g, self.u, self.d), (wg, wu, wd)):
                lin.weight.copy_(w)

    def forward(self, x):
        return self.d(F.silu(self.g(x)) * self.u(x))


def _torchao(wg, wu, wd):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as exc:  # noqa: BLE001 - the peer is optional
        print(f"torchao: not available ({type(exc).__name__})")
        return None
    block = _Block(wg, wu, wd)
    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name("rowwise"))
    block = torch.compile(block)

    def run(x, *_):
        return block(x)

    return run, list(block.parameters())


def _step(fn, x, ws, dy, params):
    def step():
        for t in [x, *params]:
            t.grad = None
        fn(x, *ws).backward(dy)
    return step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    a = p.parse_args()
    torch.manual_seed(0)
    m, d, h = a.tokens, a.dim, a.hidden
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(m, d, device=dev, dtype=bf, requires_grad=True)
    ws = [(torch.randn(*s, device=dev, dtype=bf) * 0.02).requires_grad_() for s in ((h, d), (h, d), (d, h))]
    dy = torch.randn(m, d, device=dev, dtype=bf) * 1e-2
    rows = {"eager bf16": _step(_eager, x, ws, dy, ws), "mlpfuse bf16": _step(_fused, x, ws, dy, ws),
            "mlpfuse fp8": _step(_fp8, x, ws, dy, ws)}
    ao = _torchao(*(w.detach() for w in ws))
    if ao is not None:
        rows["torchao fp8"] = _step(ao[0], x, ws, dy, ao[1])
    # accuracy of the FP8 gradients against the bf16 eager ones (same inputs)
    grads = {}
    for name in ("eager bf16", "mlpfuse fp8"):
        rows[name]()
        grads[name] = [t.grad.float().clone() for t in [x, *ws]]
    cos = [F.cosine_similarity(a_.flatten(), b_.flatten(), dim=0).item()
           for a_, b_ in zip(grads["eager bf16"], grads["mlpfuse fp8"])]
    print("gradient cosine fp8 vs bf16 (dx, dWg, dWu, dWd):", " ".join(f"{c:.5f}" for c in cos))
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(a.rounds):
        for name, fn in rows.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=200))
    base = statistics.median(times["eager bf16"])
    print(f"\nforward + backward, {m} tokens, {d}×{h}: do_bench ms, median of {a.rounds} interleaved rounds")
    table = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        table[name] = {"ms": med, "spread": (max(ts) - min(ts)) / med, "vs_eager": med / base, "rounds": ts}
        print(f"  {name:14s} {med:8.3f} ms  ±{100 * (max(ts) - min(ts)) / med:4.1f} %  {med / base:6.3f}× eager")
    # the FP8 step's kernels
    fn = rows["mlpfuse fp8"]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kern: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kern.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                else ev.cuda_time_total)
    total = sum(sum(v) for v in kern.values()) / steps
    print(f"\nmlpfuse fp8 step's kernels (torch.profiler, {steps} steps): {total:.0f} µs of kernels per step")
    ktab = []
    for name, ds in sorted(kern.items(), key=lambda kv: -sum(kv[1])):
        per = sum(ds) / steps
        ktab.append({"kernel": name, "calls": len(ds) // steps, "us": per, "each_us": sorted(ds)})
        print(f"  {per:8.1f} µs {100 * per / total:5.1f} %  ×{len(ds) // steps:<3d} {name[:110]}")
    # the GLU backward's two passes alone, by the narrow side of their tiles
    from mlpfuse import activations
    from mlpfuse.kernels import fp8_gemm, glu_backward

    dh = torch.randn(m, h, device=dev) * 1e-3
    gq, gs = fp8_gemm.quantize(torch.randn(m, h, device=dev, dtype=bf))
    uq, us = fp8_gemm.quantize(torch.randn(m, h, device=dev, dtype=bf))
    moved = m * h * (2 * (4 + 1 + 1) + 5)  # both passes read dh, g, u; five e4m3 outputs
    glu = {}
    saved = glu_backward._FP8_NARROW, glu_backward._FP8_WARPS
    print(f"\nfp8_glu_backward alone, {m}×{h} (both passes; GB/s on {moved / 1e6:.0f} MB), by the tiles' narrow "
          "side and the warps of the channel and token passes:")
    for narrow, warps in ((8, (2, 2)), (8, (4, 4)), (8, (2, 1)), (8, (1, 1)), (8, (1, 2)), (16, (2, 2)),
                          (4, (2, 2)), (4, (1, 1))):
        glu_backward._FP8_NARROW, glu_backward._FP8_WARPS = narrow, warps
        us_ = 1e3 * triton.testing.do_bench(lambda: glu_backward.fp8_glu_backward(
            dh, gq, gs, uq, us, activation=activations.get("silu").id, bias_sums=True), warmup=25, rep=100)
        glu[f"{narrow} {warps[0]}/{warps[1]}"] = us_
        print(f"  narrow {narrow:2d}, warps {warps[0]}/{warps[1]}: {us_:7.1f} µs  {moved / us_ / 1e3:6.0f} GB/s")
    glu_backward._FP8_NARROW, glu_backward._FP8_WARPS = saved
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": [m, d, h], "times": table, "grad_cosine": cos, "kernels": ktab, "glu_us": glu}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
