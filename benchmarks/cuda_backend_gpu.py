"""The CUDA backend (backend="cuda") on a GPU: numerics against fp64, then its kernels' bandwidth and its host cost.

    PYTHONPATH=src python3 benchmarks/cuda_backend_gpu.py [--quick] [--only decode] [--out FILE]

1. numerics: every op (gated_mlp forward at decode and GEMM sizes, its gradients, linear_act), every activation,
   bf16/fp16/fp32, against mlpfuse.reference in fp64 (fp32 with TF32 off). Prints `numerics: PASS` or the failures.
2. GLU forward (reads g, u; writes h) and backward (reads dh, g, u; writes dg, du; fp32 bias sums) at the
   walkthrough's 8192×3072 bf16, as GB/s against this GPU's measured device copy (target ≥ 90 %); Liger's GELU·mul
   kernel beside them where liger-kernel is importable.
3. The decode kernel (whole MLP) at 1, 2, 4, 8, 16 tokens × 4096 × 14336 bf16: weight bytes streamed per second
   against the copy bandwidth (target ≥ 90 %), beside eager and the Triton backend's decode kernels (atomics and
   deterministic) timed in the same rounds, and a triton.testing.do_bench figure (which zeroes a 256 MB buffer
   before every call: its dirty lines are written back during the call); then each of its two kernels alone, from a
   profiler trace (gate/up: 2·hidden·dim weights, down: dim·hidden; the down kernel starts early as a programmatic
   dependent launch, so its span includes its wait for the first kernel — at 16 tokens on sm_90 its blocks start
   beside gate/up's and the span covers most of gate/up); and the allocator's peak above the inputs for one call
   of the CUDA backend and of eager. `--only decode` runs this section alone.
4. Host µs per call at 64×768×3072 bf16 (small enough that the host decides): the cuda backend, triton, torch.
GPU times: CUDA events, median of interleaved rounds after a clock warm-up. The short table comes last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _median_us(fns: dict, rounds: int, reps: int) -> dict:
    """Median GPU µs per call of each fn, timed interleaved (A B C A B C ...) so clock drift hits all alike."""
    import torch

    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) * 1e3 / reps)
    return {k: statistics.median(v) for k, v in times.items()}


def _host_us(fn, calls: int, bursts: int) -> float:
    """Host µs per call: short bursts on an idle GPU (the queue never fills), median over bursts."""
    import torch

    out = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(out)


def numerics(quick: bool) -> list[str]:
    import torch

    from mlpfuse import ops, reference
    from mlpfuse.activations import NAMES

    torch.backends.cuda.matmul.allow_tf32 = False
    # Fixed inputs: relu's derivative jumps at 0, so a pre-activation within fp32 rounding of 0 (about one run in
    # twenty of 142k random elements) flips one dg element between the fp32 kernels and the fp64 reference and
    # shows as a ~1e-2 gradient error that says nothing about the kernels.
    torch.manual_seed(0)
    tol = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    failures, worst = [], {}

    def err(got, want):
        if not torch.isfinite(got).all():
            return float("inf")
        return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

    def check(name, dtype, e, factor=1.0):
        worst[dtype] = max(worst.get(dtype, 0.0), e / factor)
        if not e < tol[dtype] * factor:
            failures.append(f"{name} {dtype}: error {e:.3g} > {tol[dtype] * factor:.3g}")

    dims = [(1, 256, 512), (16, 264, 712), (300, 264, 712)] + ([] if quick else [(8, 4096, 14336), (4096, 768, 3072)])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for act in NAMES:
            for m, dim, hidden in dims:
                w = [torch.randn(*s, device="cuda", dtype=torch.float64) for s in
                     ((hidden, dim), (hidden, dim), (dim, hidden), (hidden,), (hidden,), (dim,))]
                w = [t / (t.shape[-1] ** 0.5 if t.dim() == 2 else 2) for t in w]
                w = [t.to(dtype) for t in w]
                x = torch.randn(m, dim, device="cuda", dtype=dtype)
                y = ops.gated_mlp(x, *w[:3], act, *w[3:], backend="cuda")
                want = reference.gated_mlp(x, *w[:3], act, *w[3:])
                check(f"gated_mlp fwd {act} {m}x{dim}x{hidden}", dtype, err(y, want))
            params = [t.detach().requires_grad_() for t in w]
            xg = torch.randn(200, dim, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn(200, dim, device="cuda", dtype=dtype)
            ops.gated_mlp(xg, *params[:3], act, *params[3:], backend="cuda").backward(dy)
            ref = [t.detach().double().requires_grad_() for t in (xg, *params)]
            reference.gated_mlp(ref[0], *ref[1:4], act, *ref[4:]).backward(dy.double())
            for name, got, want in zip(("dx", "dWg", "dWu", "dWd", "dbg", "dbu", "dbd"), (xg, *params), ref):
                check(f"gated_mlp {name} {act}", dtype, err(got.grad, want.grad), 2.0)
            for act_l in (None, act):
                xl = torch.randn(333, 200, device="cuda", dtype=dtype)
                wl = (torch.randn(328, 200, device="cuda", dtype=dtype) / 200**0.5)
                bl = torch.randn(328, device="cuda", dtype=dtype)
                y = ops.linear_act(xl, wl, bl, act_l, backend="cuda")
                check(f"linear_act {act_l}", dtype, err(y, reference.linear_act(xl, wl, bl, act_l)))
    torch.backends.cuda.matmul.allow_tf32 = True
    print("worst error / bound factor:", ", ".join(f"{str(k).replace('torch.', '')} {v:.3g}" for k, v in worst.items()))
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small numerics set and fewer timing rounds")
    p.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (default 10)")
    p.add_argument("--out", help="also write the final table (markdown) here")
    p.add_argument("--only", choices=("decode",), help="only the decode section (after the copy bandwidth)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("cuda_backend_gpu: error: needs a CUDA device", file=sys.stderr)
        return 2
    from mlpfuse import activations, csrc, ops
    from mlpfuse.bench import roofline

    t0 = time.perf_counter()
    ext = csrc.extension()
    print(f"extension ready in {time.perf_counter() - t0:.1f} s ({csrc.build_dir()})")
    failures = numerics(args.quick) if not args.only else []
    if not args.only:
        print("numerics: PASS" if not failures else "numerics: FAIL\n  " + "\n  ".join(failures))
    rounds = 3 if args.quick else args.rounds
    dev = torch.device("cuda")
    bf = torch.bfloat16
    # Spin the clocks up before timing anything.
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    for _ in range(100 if not args.quick else 10):
        a @ a
    torch.cuda.synchronize()
    src = torch.empty(1 << 28, device=dev, dtype=torch.uint8)  # 256 MiB: far beyond L2
    dst = torch.empty_like(src)
    copy_us = _median_us({"copy": lambda: dst.copy_(src)}, rounds, 5)["copy"]
    copy_gbs = 2 * src.numel() / copy_us / 1e3
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write, 256 MiB)")
    rows = [("device copy", f"{copy_gbs:.0f} GB/s", "100 %", "")]

    gelu = activations.get("gelu_tanh").id
    if not args.only:
        rows += glu_rows(ext, gelu, copy_gbs, rounds)
    rows += decode_rows(ext, gelu, copy_gbs, rounds)
    if not args.only:
        rows += host_rows(ext, ops, gelu)

    table = ["| what | measured | of copy bandwidth | note |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text = "\n".join(table)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {roofline.device_name(dev)}\n{text}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if not failures else 1


def glu_rows(ext, gelu, copy_gbs, rounds):
    import torch

    dev, bf, rows = torch.device("cuda"), torch.bfloat16, []
    m, n = 8192, 3072
    g, u, dh = (torch.randn(m, n, device=dev, dtype=bf) for _ in range(3))
    fns = {
        "cuda glu fwd": lambda: ext.glu_forward(g, u, gelu),
        "cuda glu bwd": lambda: ext.glu_backward(dh, g, u, gelu, False, True),
        "eager gelu*mul": lambda: torch.nn.functional.gelu(g, approximate="tanh") * u,
    }
    moved = {"cuda glu fwd": 3, "cuda glu bwd": 5, "eager gelu*mul": 5}  # [m, n] tensors read + written
    try:
        from mlpfuse import kernels

        if kernels.available():
            from mlpfuse.kernels import glu_backward

            fns["triton glu bwd"] = lambda: glu_backward.glu_backward_split(dh, g, u, activation=gelu, bias_sums=True)
            moved["triton glu bwd"] = 5
    except ImportError:
        pass
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        fns["liger gelu*mul"] = lambda: LigerGELUMulFunction.apply(g, u)
        moved["liger gelu*mul"] = 3
    except ImportError:
        print("liger-kernel not importable: its GELU·mul is left out")
    us = _median_us(fns, rounds, 20)
    for k, t in us.items():
        gbs = moved[k] * m * n * 2 / t / 1e3
        rows.append((f"{k} {m}x{n} bf16", f"{t:.1f} µs, {gbs:.0f} GB/s", f"{100 * gbs / copy_gbs:.0f} %",
                     "target ≥ 90 %" if k.startswith("cuda") else ""))
    return rows


def decode_rows(ext, gelu, copy_gbs, rounds):
    import torch
    import triton.testing

    from mlpfuse.kernels import decode_mlp

    dev, bf, rows = torch.device("cuda"), torch.bfloat16, []
    dim, hidden = 4096, 14336
    w = [torch.randn(*s, device=dev, dtype=bf) / 64 for s in ((hidden, dim), (hidden, dim), (dim, hidden))]
    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, dim, device=dev, dtype=bf)
        fns = {
            "cuda": lambda: ext.gated_mlp_forward(x, *w, None, None, None, gelu, False, True),
            # The Triton backend's decode kernels beside it: atomics (its default) and the deterministic split.
            "triton": lambda: decode_mlp.decode_gated_mlp(x, *w, activation=gelu),
            "triton det.": lambda: decode_mlp.decode_gated_mlp(x, *w, activation=gelu, deterministic=True),
            "eager": lambda: torch.nn.functional.linear(
                torch.nn.functional.gelu(torch.nn.functional.linear(x, w[0]), approximate="tanh")
                * torch.nn.functional.linear(x, w[1]), w[2]),
        }
        us = _median_us(fns, rounds, 20)
        gbs = 3 * hidden * dim * 2 / us["cuda"] / 1e3
        # A second harness: triton's do_bench (L2 flushed before each call, median of its own event times).
        checked = triton.testing.do_bench(fns["cuda"], warmup=25, rep=200, return_mode="median") * 1e3
        peak = {name: _peak_kib(fns[name]) for name in ("cuda", "eager")}
        rows.append((f"decode {tokens}x{dim}x{hidden} bf16", f"{us['cuda']:.1f} µs (do_bench {checked:.1f}; eager "
                     f"{us['eager']:.1f}; triton {us['triton']:.1f}, deterministic {us['triton det.']:.1f}), "
                     f"{gbs:.0f} GB/s", f"{100 * gbs / copy_gbs:.1f} %",
                     f"target ≥ 90 %; peak +{peak['cuda']:.0f} KiB (eager +{peak['eager']:.0f})"))
        for name, (n, mean_us) in sorted(_kernel_spans(fns["cuda"], 20).items()):
            weights = (2 if name == "gate/up" else 1) * hidden * dim * 2
            gbs = weights / mean_us / 1e3
            rows.append((f"  decode {tokens} tokens: {name} kernel alone", f"{mean_us:.1f} µs ({n} calls), "
                         f"{gbs:.0f} GB/s", f"{100 * gbs / copy_gbs:.0f} %", ""))
    return rows


def _peak_kib(fn):
    """KiB the allocator's peak rises above what was allocated before one call of fn (its output included)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 1024


def _kernel_spans(fn, reps):
    """{"gate/up" | "down": (calls, mean µs)} of the decode kernels from a profiler trace of `reps` calls of fn."""
    import re

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    spans = {}
    for e in prof.key_averages():
        # decode_gate_up_tma_kernel<T, NT, ...> is gate/up; decode_gemv_{mma,bulk}_kernel<T, NMAT, ...> gate/up at
        # NMAT 2, down at 1.
        found = re.search(r"decode_gemv_(?:mma|bulk)_kernel<[^,>]+,\s*(\d+)", e.key)
        if "decode_gate_up_tma_kernel" in e.key:
            name = "gate/up"
        elif found:
            name = "gate/up" if found.group(1) == "2" else "down"
        else:
            continue
        if e.count:
            n, total = spans.get(name, (0, 0.0))
            spans[name] = (n + e.count, total + e.device_time_total)
    return {k: (n, total / n) for k, (n, total) in spans.items()}


def host_rows(ext, ops, gelu):
    import torch

    dev, bf, rows = torch.device("cuda"), torch.bfloat16, []
    x = torch.randn(64, 768, device=dev, dtype=bf)
    ws = [torch.randn(*s, device=dev, dtype=bf) / 30 for s in ((3072, 768), (3072, 768), (768, 3072))]
    with torch.no_grad():
        for backend in ("cuda", "triton", "torch"):
            try:
                ops.gated_mlp(x, *ws, backend=backend)
            except ValueError as e:
                rows.append((f"host 64x768x3072 {backend}", "unavailable", "", str(e)))
                continue
            host = _host_us(lambda: ops.gated_mlp(x, *ws, backend=backend), 20, 50)
            rows.append((f"host µs/call 64x768x3072 {backend}", f"{host:.1f} µs", "", ""))
        direct = _host_us(lambda: ext.gated_mlp_forward(x, *ws, None, None, None, gelu, False, True), 20, 50)
        rows.append(("host µs/call 64x768x3072 cuda entry alone", f"{direct:.1f} µs", "", "C++ checks + launches"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
