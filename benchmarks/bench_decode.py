"""Check and time mlpfuse's one-launch decode MLP on a CUDA GPU against eager PyTorch, CUDA graphs, torch.compile
and Liger.

    PYTHONPATH=src python3 benchmarks/bench_decode.py [--out DIR] [--sweep] [--rounds N]

1. Numerics (bf16 for every M in 1..64 on both shapes, fp16/fp32 and odd shapes on a few M, every activation,
   biases, all three reduction modes) against a float64 reference; outputs poisoned with NaN. Determinism
   (bit-identical reruns) and CUDA-graph capture + replay with fresh inputs. Exit 1 on any failure.
2. Ceilings: device-to-device copy bandwidth (bytes read + written).
3. Optional (--sweep): tile configs for the atomic kernel, GPU time per call from a 20-call CUDA graph.
4. Timing, bf16, GeGLU (gelu_tanh, no bias), tokens × dim × hidden for dim×hidden in 768×3072 and 4096×14336:
   after spinning the clocks up, variants are interleaved in rounds; medians over rounds.
     wall  = host clock over N back-to-back calls after a synchronize (host overhead included)
     gpu   = CUDA events over one replay of a CUDA graph holding 20 calls, / 20 (launch gaps removed)
     graph = host clock over N back-to-back replays of a one-call CUDA graph
Prints a short table last; writes JSON + log under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from mlpfuse import activations as A
from mlpfuse.kernels import decode_mlp as K

SHAPES = ((768, 3072), (4096, 14336))
TOKENS = (1, 4, 16, 32, 64)
CUTOVER_TOKENS = (96, 128)
LOG: list[str] = []
FAILURES: list[str] = []


LOG_PATH: list[str] = []


def log(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)
    if LOG_PATH:  # written as we go, so a run cut off at its time limit still leaves its log
        with open(LOG_PATH[0], "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------------------------------- numerics


def reference(x, wg, wu, wd, bg, bu, bd, act):
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    g = x @ wg.T + (bg.double() if bg is not None else 0)
    u = x @ wu.T + (bu.double() if bu is not None else 0)
    y = (A._TABLE[act].forward(g) * u) @ wd.T
    return y + (bd.double() if bd is not None else 0)


def make_weights(d, h, dtype, bias=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)

    wg, wu, wd = r(h, d, scale=d**-0.5), r(h, d, scale=d**-0.5), r(d, h, scale=h**-0.5)
    bg, bu, bd = (r(h, scale=0.5), r(h, scale=0.5), r(d, scale=0.5)) if bias else (None, None, None)
    return wg, wu, wd, bg, bu, bd


def poisoned_call(fn, m, d, dtype):
    # The output comes from the caching allocator: hand it a NaN-filled block of the same size first, so that an
    # element the kernel fails to write shows up as NaN.
    junk = torch.full((m, d), float("nan"), dtype=dtype, device="cuda")
    del junk
    return fn()


def rel_err(y, ref):
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name, y, ref, tol):
    err = rel_err(y, ref)
    if not err <= tol:
        FAILURES.append(f"{name}: rel err {err:.3g} > {tol}")
        log(f"FAIL {name}: rel err {err:.3g} > {tol}")
    return err


def numerics():
    tol = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-3}
    worst = {}
    for d, h in SHAPES:
        w = make_weights(d, h, torch.bfloat16)
        for m in range(1, 65):
            x = torch.randn(m, d, device="cuda").to(torch.bfloat16)
            ref = reference(x, *w, A.GELU_TANH)
            for mode in (0, 1, 2):
                y = poisoned_call(lambda: K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=mode), m, d,
                                  torch.bfloat16)
                e = check(f"bf16 {m}x{d}x{h} mode{mode}", y, ref, tol[torch.bfloat16])
                worst[f"bf16 {d}x{h} mode{mode}"] = max(worst.get(f"bf16 {d}x{h} mode{mode}", 0), e)
    # Other dtypes, odd shapes, biases, every activation, M past 64 (few combinations: each one compiles).
    cases = [(torch.float16, 760, 3000, True, [A.GELU_TANH], (1, 33, 64, 128)),
             (torch.float32, 17, 33, True, range(6), (7, 64)),
             (torch.float32, 768, 3072, False, [A.SILU], (1, 50)),
             (torch.bfloat16, 4096, 14336, True, [A.GELU_TANH], (3, 100, 128)),
             (torch.bfloat16, 760, 3000, False, [A.RELU2], (5, 64))]
    for dtype, d, h, bias, acts, ms in cases:
        w = make_weights(d, h, dtype, bias=bias, seed=d + h)
        for act in acts:
            for m in ms:
                x = torch.randn(m, d, device="cuda").to(dtype)
                ref = reference(x, *w, act)
                for det in (False, True):
                    y = poisoned_call(lambda: K.decode_gated_mlp(x, *w, activation=act, deterministic=det,
                                                                 allow_tf32=False), m, d, dtype)
                    k = f"{str(dtype)[6:]} {d}x{h} bias={bias} det={det}"
                    worst[k] = max(worst.get(k, 0), check(f"{k} act{act} m{m}", y, ref, tol[dtype]))
    for k, v in worst.items():
        log(f"numerics worst rel err {k}: {v:.2e}")
    # Strided (non-contiguous) x and a packed gate_up weight viewed as two halves.
    d, h, m = 768, 3072, 9
    packed = torch.randn(2 * h, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    wd = torch.randn(d, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    xbig = torch.randn(m, 2 * d, device="cuda", dtype=torch.bfloat16)
    x = xbig[:, ::2]
    y = K.decode_gated_mlp(x, packed[:h], packed[h:], wd, activation=A.SILU)
    log(f"numerics strided x + packed weights: {check('strided', y, reference(x, packed[:h], packed[h:], wd, None, None, None, A.SILU), 1e-2):.2e}")
    # Determinism: deterministic modes bit-identical over reruns; atomics differ only by rounding.
    w = make_weights(4096, 14336, torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    for mode in (1, 2):
        ys = [K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=mode) for _ in range(5)]
        same = all(torch.equal(ys[0], y) for y in ys[1:])
        log(f"determinism mode{mode}: {'bit-identical' if same else 'DIFFERENT'} over 5 runs")
        if not same:
            FAILURES.append(f"mode{mode} not deterministic")
    ys = [K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=0) for _ in range(5)]
    log(f"atomic mode: {sum(not torch.equal(ys[0], y) for y in ys[1:])}/4 reruns differ bitwise from the first")


def graph_capture_test():
    for mode in (0, 1, 2):
        d, h, m = 4096, 14336, 16
        w = make_weights(d, h, torch.bfloat16, bias=True, seed=3)
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=mode)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=mode)
        errs = []
        for _ in range(3):
            x.copy_(torch.randn(m, d, device="cuda", dtype=torch.bfloat16))
            y.fill_(float("nan"))
            g.replay()
            errs.append(check(f"graph mode{mode}", y, reference(x, *w, A.GELU_TANH), 1e-2))
        # An eager call on the same stream afterwards must still see zeroed scratch.
        errs.append(check(f"eager after graph mode{mode}", K.decode_gated_mlp(x, *w, activation=A.GELU_TANH, _mode=mode),
                          reference(x, *w, A.GELU_TANH), 1e-2))
        log(f"cuda graph capture+replay mode{mode}: max rel err {max(errs):.2e}")


# ---------------------------------------------------------------------------------------------------------- timing


def copy_bandwidth():
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3)
    bw = 2 * n / statistics.median(times)
    del a, b
    return bw


def spin_clocks(seconds=1.5):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def eager_geglu(x, wg, wu, wd):
    return F.linear(F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd)


def make_variants(d, h):
    wg, wu, wd, *_ = make_weights(d, h, torch.bfloat16, seed=7)
    v = {"eager": lambda x: eager_geglu(x, wg, wu, wd)}
    compiled = torch.compile(eager_geglu)
    v["compile"] = lambda x: compiled(x, wg, wu, wd)
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        v["liger"] = lambda x: F.linear(LigerGELUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)
    except Exception as exc:  # noqa: BLE001
        log(f"liger unavailable: {exc!r}")
    v["ours"] = lambda x: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH)
    v["ours_det1"] = lambda x: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH, _mode=1)
    v["ours_det2"] = lambda x: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH, _mode=2)
    return v, (wg, wu, wd)


def capture(fn, x, calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(x)
    return g


def wall_us(fn, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def event_us(fn, div):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / div


def time_shape(d, h, tokens, rounds, results):
    variants, _ = make_variants(d, h)
    n_wall = 200 if d * h < 4e6 else 40
    for m in tokens:
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        runners = {}
        for name, fn in variants.items():
            try:
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
                g20 = capture(fn, x, 20)
                g1 = capture(fn, x, 1)
                runners[name] = (fn, g20, g1)
            except Exception as exc:  # noqa: BLE001
                log(f"{name} {m}x{d}x{h}: setup failed: {exc!r}")
        samples = {(name, k): [] for name in runners for k in ("wall", "gpu", "graph")}
        for _ in range(rounds):
            for name, (fn, g20, g1) in runners.items():
                samples[(name, "wall")].append(wall_us(lambda: fn(x), n_wall))
                samples[(name, "gpu")].append(event_us(g20.replay, 20))
                samples[(name, "graph")].append(wall_us(g1.replay, n_wall))
        for (name, k), vals in samples.items():
            med = statistics.median(vals)
            results.append({"d": d, "h": h, "m": m, "variant": name, "metric": k, "median_us": med,
                            "spread": (max(vals) - min(vals)) / med, "rounds": len(vals)})
        line = "  ".join(f"{name}: wall {statistics.median(samples[(name, 'wall')]):.1f} gpu "
                         f"{statistics.median(samples[(name, 'gpu')]):.1f} graph "
                         f"{statistics.median(samples[(name, 'graph')]):.1f}" for name in runners)
        log(f"{m}x{d}x{h}: {line}")
        del runners
        torch.cuda.empty_cache()


def sweep(rounds):
    """GPU time per call (20-call graph) of candidate atomic-mode configs; best per (shape, M bucket)."""
    cands = [(16, 128, 64, 4, 3), (32, 128, 64, 4, 3), (32, 256, 128, 4, 2), (64, 128, 64, 4, 3),
             (64, 64, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 64, 32, 8, 4)]
    det_cands = {(32, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3)}
    best = {}
    for d, h in SHAPES:
        wg, wu, wd, *_ = make_weights(d, h, torch.bfloat16, seed=11)
        for m in (1, 16, 32, 64):
            x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
            ref = reference(x, wg, wu, wd, None, None, None, A.GELU_TANH)
            res = []
            for cfg in cands:
                for mode in (0, 2) if cfg in det_cands else (0,):
                    fn = lambda: K.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH, _mode=mode, _config=cfg)  # noqa: E731
                    try:
                        if rel_err(fn(), ref) > 1e-2:
                            log(f"sweep {m}x{d}x{h} {cfg} mode{mode}: WRONG")
                            continue
                        g = capture(lambda _x: fn(), x, 20)
                        t = statistics.median(event_us(g.replay, 20) for _ in range(rounds))
                        res.append((t, cfg, mode))
                    except Exception as exc:  # noqa: BLE001
                        log(f"sweep {m}x{d}x{h} {cfg} mode{mode}: {type(exc).__name__}: {str(exc)[:200]}")
            res.sort()
            for mode in (0, 2):
                top = [r for r in res if r[2] == mode][:4]
                log(f"sweep {m}x{d}x{h} mode{mode} best: " + "; ".join(f"{c} {t:.2f}us" for t, c, _ in top))
                if top:
                    best[f"{d}x{h} m{m} mode{mode}"] = [top[0][0], list(top[0][1])]
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "mlpfuse-results"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-numerics", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    LOG_PATH.append(os.path.join(args.out, "decode.log"))
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    log(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    t0 = time.time()
    for stage in ("numerics", "graph") if not args.skip_numerics else ():
        try:
            numerics() if stage == "numerics" else graph_capture_test()
        except Exception:  # noqa: BLE001
            FAILURES.append(f"{stage} crashed")
            log(traceback.format_exc())
        log(f"[{stage} done at {time.time() - t0:.0f}s]")
    out["copy_bw"] = copy_bandwidth()
    log(f"device copy bandwidth {out['copy_bw'] / 1e12:.2f} TB/s (read + write)")
    spin_clocks()
    if args.sweep:
        try:
            out["sweep"] = sweep(args.rounds)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        log(f"[sweep done at {time.time() - t0:.0f}s]")
    results = []
    for d, h in SHAPES:
        spin_clocks(0.5)
        try:
            time_shape(d, h, TOKENS + CUTOVER_TOKENS, args.rounds, results)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        log(f"[timing {d}x{h} done at {time.time() - t0:.0f}s]")
    out["results"] = results
    out["failures"] = FAILURES
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(out, f, indent=1)
    summary(out)
    return 1 if FAILURES else 0


def summary(out):
    med = {(r["d"], r["h"], r["m"], r["variant"], r["metric"]): r["median_us"] for r in out["results"]}
    names = ("eager", "compile", "liger", "ours", "ours_det1", "ours_det2")
    print(f"\nGPU {out['gpu']}; copy {out['copy_bw'] / 1e12:.2f} TB/s; bf16 gelu_tanh GeGLU; median us per call")
    print("wall = host clock per call, eager launches; graph = replay of a one-call CUDA graph; gpu = 20-call graph / 20")
    hdr = "tokens x dim x hidden | " + " | ".join(f"{n} wall" for n in names) + " | eager graph | ours graph | " \
          "eager gpu | ours gpu | weights TB/s"
    print(hdr)
    for d, h in SHAPES:
        for m in TOKENS + CUTOVER_TOKENS:
            cells = [f"{med[(d, h, m, n, 'wall')]:.1f}" if (d, h, m, n, "wall") in med else "-" for n in names]
            g = [med.get((d, h, m, n, k)) for n, k in (("eager", "graph"), ("ours", "graph"), ("eager", "gpu"),
                                                     ("ours", "gpu"))]
            bw = 3 * d * h * 2 / (g[3] * 1e-6) / 1e12 if g[3] else float("nan")
            print(f"{m}x{d}x{h} | " + " | ".join(cells) + " | " +
                  " | ".join(f"{v:.1f}" if v else "-" for v in g) + f" | {bw:.2f}")
    print("failures:", out["failures"] or "none")


if __name__ == "__main__":
    sys.exit(main())
