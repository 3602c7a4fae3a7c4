"""The decode projections kernel (kernels/decode_linear.py) against cuBLAS at a Llama-3-8B layer's attention shapes.

    PYTHONPATH=src python3 benchmarks/decode_linear_probe.py [--configs]

Each case is captured in a CUDA graph as 8 calls on 8 different weight sets (so no call finds its weights in L2,
as in a decode step where the layers' weights follow each other), replayed 20 times per round, 5 rounds; the time per
call is the median round's. Rows: q, k, v as three cuBLAS GEMMs (F.linear, as the model runs them; without the norm),
and the kernel with the three weights in one launch, with and without the RMSNorm prologue; the output projection
alone, cuBLAS against the kernel. GB/s counts the weights read once, against the copy rate of mlpfuse's roofline
(bench.roofline.measure_copy_gbps).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from mlpfuse.bench.roofline import measure_copy_gbps  # noqa: E402
from mlpfuse.kernels import decode_linear as DL  # noqa: E402

SETS = 8


def graph_time(fn, rounds: int = 5, replays: int = 20) -> float:
    """µs per call: fn() makes SETS calls; captured once, replayed. NaN for a config the card cannot run."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a tile config past the card's shared memory: no row
        print(f"  skipped: {str(exc).splitlines()[0][:100]}")
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        g.replay()
        e0.record()
        for _ in range(replays):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / replays / SETS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", action="store_true", help="sweep (BLOCK_N, BLOCK_K, warps, stages)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    d, nq, nkv = 4096, 4096, 1024
    copy_gbs, how = measure_copy_gbps(dev)
    print(f"copy rate {copy_gbs:.0f} GB/s ({how})")
    qkv = [[(torch.randn(n, d, device=dev) * 0.02).to(dt) for n in (nq, nkv, nkv)] for _ in range(SETS)]
    wo = [(torch.randn(d, nq, device=dev) * 0.02).to(dt) for _ in range(SETS)]
    nw = (1 + torch.randn(d, device=dev) * 0.1).to(dt)
    cfgs = [None]
    if args.configs:
        cfgs += [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8) for st in (3, 5)]
    for m in ((1, 16) if args.configs else (1, 8, 16)):
        x = torch.randn(m, d, device=dev).to(dt)
        qkv_bytes = (nq + 2 * nkv) * d * 2
        o_bytes = nq * d * 2
        rows = []
        t = graph_time(lambda: [[F.linear(x, w) for w in ws] for ws in qkv])
        rows.append(("q,k,v cuBLAS x3", t, qkv_bytes))
        for cfg in cfgs:
            t = graph_time(lambda: [DL.decode_linear(x, ws, _config=cfg) for ws in qkv])
            rows.append((f"q,k,v kernel {cfg or 'default'}", t, qkv_bytes))
        for cfg in cfgs:
            t = graph_time(lambda: [DL.decode_linear(x, ws, norm_weight=nw, norm_eps=1e-5, norm_kind=1, _config=cfg)
                                    for ws in qkv])
            rows.append((f"q,k,v kernel + norm {cfg or 'default'}", t, qkv_bytes))
        xo = torch.randn(m, nq, device=dev).to(dt)
        res = torch.randn(m, d, device=dev).to(dt)
        t = graph_time(lambda: [F.linear(xo, w) for w in wo])
        rows.append(("o cuBLAS", t, o_bytes))
        t = graph_time(lambda: [res + F.linear(xo, w) for w in wo])
        rows.append(("o cuBLAS + residual add", t, o_bytes))
        for cfg in cfgs:
            t = graph_time(lambda: [DL.decode_linear(xo, [w], _config=cfg) for w in wo])
            rows.append((f"o kernel {cfg or 'default'}", t, o_bytes))
        t = graph_time(lambda: [DL.decode_linear(xo, [w], residual=res) for w in wo])
        rows.append(("o kernel + residual", t, o_bytes))
        for name, t, b in rows:
            print(f"m={m:2d} {name:40s} {t:7.2f} us  {b / t / 1e3:6.0f} GB/s  {b / t / 1e3 / copy_gbs:5.1%} of copy")
    # numbers: kernel vs float64 at bf16
    x = torch.randn(16, d, device=dev).to(dt)
    outs = DL.decode_linear(x, qkv[0], norm_weight=nw, norm_eps=1e-5, norm_kind=1)
    xd = x.double()
    xn = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    for o, w in zip(outs, qkv[0]):
        ref = xn @ w.double().T
        print("rel err vs float64", float((o.double() - ref).norm() / ref.norm()))


if __name__ == "__main__":
    main()
