"""Tile configs and modes of the decode MLP kernels on this card, against cuBLAS's decode MLP (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/tune_decode.py [--out DIR] [--rows 1,8] [--dim 4096] [--hidden 14336]

Per row count: every candidate (mode, BLOCK_H, BLOCK_D, BLOCK_O, num_warps, num_stages) of
`kernels.decode_mlp.decode_gated_mlp` (SwiGLU, bf16, the RMSNorm prologue on, as a patched Llama calls it) and the
shipped default, beside what torch.compile's decode runs (cuBLAS packed gate_up GEMM, silu·mul, cuBLAS down GEMM),
each captured as 20 back-to-back calls in one CUDA graph and replayed; GPU µs per call = CUDA events / 20. The weights
(hundreds of MB at Llama scale) stream from HBM on every call. Three interleaved passes after a clock spin-up: the
median pass and min–max. Every candidate's output is checked against the default's first. What a card's decode rows
in kernels/decode_mlp.py come from; tune_decode.json under --out. Candidates that fail to compile are skipped.
"""

import argparse
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F

from mlpfuse import activations as A
from mlpfuse.kernels import decode_mlp as K

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.environ.get("OUT", "."))
ap.add_argument("--rows", default="1,8")
ap.add_argument("--dim", type=int, default=4096)
ap.add_argument("--hidden", type=int, default=14336)
ap.add_argument("--passes", type=int, default=3)
args = ap.parse_args()

dev = torch.cuda.get_device_name()
print(dev, torch.cuda.get_device_properties(0).multi_processor_count, "SMs", flush=True)
D, H, dt = args.dim, args.hidden, torch.bfloat16
torch.manual_seed(0)
wgu = torch.randn(2 * H, D, device="cuda", dtype=dt) * D ** -0.5
wg, wu = wgu[:H], wgu[H:]
wd = torch.randn(D, H, device="cuda", dtype=dt) * H ** -0.5
nw = 1 + 0.1 * torch.randn(D, device="cuda", dtype=dt)
REPS = 20


def graph_of(fn):
    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    return g


def time_graph(g, n=5):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    out = []
    for _ in range(n):
        e0.record(); g.replay(); e1.record(); e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1e3 / REPS)
    return statistics.median(out)


def candidates(bucket):
    one = []
    for bh, bd, bo, (w, s) in itertools.product((32, 64, 128), (128, 256), (64, 128), ((4, 3), (8, 3), (8, 4))):
        if bh * bd * 2 * 2 * s > 200_000 or (bh == 32 and bd == 128):  # two weight tiles per stage in shared memory
            continue
        one.append((bh, bd, bo, w, s))
    modes = (0, 3) if bucket <= 16 else (3,)
    out = [(m, c) for m in modes for c in one]
    for bh, bd, (w, s), bo, bk, (w2, s2) in itertools.product(
            (64, 128), (64,), ((4, 4), (8, 4)), (16, 32), (256,), ((4, 3),)):
        out.append((4, (bh, bd, 0, w, s, bo, bk, w2, s2)))
    return out


a = torch.randn(8192, 8192, device="cuda", dtype=dt)
for _ in range(200):
    a @ a
torch.cuda.synchronize()
del a

res = {"device": dev, "dim": D, "hidden": H, "rows": {}}
summary = []
for m in [int(r) for r in args.rows.split(",")]:
    x = torch.randn(m, D, device="cuda", dtype=dt)
    bucket = K._bucket(m)
    default_mode = K._policy_mode(wd, bucket, False)
    kw = dict(activation=A.SILU, norm_weight=nw, norm_eps=1e-5, norm_kind=K.NORM_WEIGHT_AFTER)
    ref = K.decode_gated_mlp(x, wg, wu, wd, **kw).float()
    xn = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt) * nw

    def cublas():
        gu = xn @ wgu.T
        return (F.silu(gu[:, :H]) * gu[:, H:]) @ wd.T

    graphs = {"cublas (compile's kernels)": graph_of(cublas),
              f"default mode {default_mode}": graph_of(lambda: K.decode_gated_mlp(x, wg, wu, wd, **kw))}
    skipped = []
    for mode, cfg in candidates(bucket):
        name = f"mode {mode} {cfg}"
        try:
            y = K.decode_gated_mlp(x, wg, wu, wd, **kw, _mode=mode, _config=cfg)
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                skipped.append(f"{name}: rel err {err:.2e}")
                continue
            graphs[name] = graph_of(lambda mode=mode, cfg=cfg: K.decode_gated_mlp(x, wg, wu, wd, **kw, _mode=mode,
                                                                                   _config=cfg))
        except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
            skipped.append(f"{name}: {type(e).__name__}")
    print(f"rows {m}: {len(graphs)} timed, {len(skipped)} skipped", flush=True)
    passes = {k: [] for k in graphs}
    for _ in range(args.passes):
        for k, g in graphs.items():
            passes[k].append(time_graph(g))
    table = {k: {"us": statistics.median(v), "min": min(v), "max": max(v)} for k, v in passes.items()}
    ranked = sorted(table.items(), key=lambda kv: kv[1]["us"])
    res["rows"][m] = {"table": table, "skipped": skipped, "gb_per_s_best": 3 * H * D * 2 / ranked[0][1]["us"] / 1e3}
    base = table["cublas (compile's kernels)"]["us"]
    print(f"\nrows {m} ({dev}), GPU µs per call (20-call graph), vs cuBLAS:", flush=True)
    for k, v in ranked[:12] + [kv for kv in ranked[12:] if not kv[0].startswith("mode ")]:
        print(f"  {k:48s} {v['us']:8.2f}  [{v['min']:.2f}–{v['max']:.2f}]  {v['us'] / base:.3f}×", flush=True)
    dflt = next(v for k, v in table.items() if k.startswith("default"))
    summary.append(f"rows {m}: cuBLAS {base:.1f} µs, default {dflt['us']:.1f} ({dflt['us'] / base:.3f}×), best "
                   f"{ranked[0][0]} {ranked[0][1]['us']:.1f} ({ranked[0][1]['us'] / base:.3f}×)")
    del graphs

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "tune_decode.json"), "w") as f:
    json.dump(res, f, indent=1)
print("\n" + "\n".join(summary))
