"""Tile configs of the gated GEMM at mid-size token counts, against the eager pieces it replaces (CUDA GPU).

    PYTHONPATH=src python3 benchmarks/tune_mid_m.py [--rounds 15] [--shapes 64x4096x14336,...] [--compile] [--out DIR]

At 128–4096 tokens the size-class table gives the gated kernel the tiles tuned at 8192 tokens; these runs decided
`auto`'s inference threshold (ops/dispatch.py) and its GEMM+activation rule. This times, per shape, h = act(x·Wgᵀ)·
(x·Wuᵀ) by eager's three kernels (two cuBLAS GEMMs + GELU·mul), by cuBLAS on the packed [2·hidden, dim] weight
(+ GELU·mul), and by the gated kernel under each candidate config. Each call alone, L2 flushed before it and
bracketed by CUDA events, twice: as `mlpfuse bench` times it (the GPU waits for the host's launches: host time
between launches is in the figure, as in an eager-mode step) and as pure GPU time (a 1 ms GPU sleep before the start
event lets the host queue every launch first, as a CUDA graph would). Variants interleaved per round; median over
rounds with min–max. The down projection is the same GEMM for every variant and left out of those rows; the
`MLP:` rows time the whole block (down projection included) as `auto` may run it — eager's four kernels, the gated
GEMM + cuBLAS down, cuBLAS's three GEMMs around the Triton GLU pass (the SPLIT path), the decode kernels where the
shape is within their token range, and with --compile
torch.compile's graph of eager's block — and are compared with each other (ratios against `MLP: eager`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from mlpfuse import activations as A
from mlpfuse.kernels import decode_mlp
from mlpfuse.kernels.configs import KernelConfig as K
from mlpfuse.kernels.gated_gemm import gated_gemm
from mlpfuse.kernels.gemm_act import gemm_act
from mlpfuse.kernels.glu import glu_forward

SHAPES = ((128, 768, 3072), (256, 768, 3072), (512, 768, 3072), (1024, 768, 3072), (2048, 768, 3072),
          (4096, 768, 3072), (512, 4096, 14336), (1024, 4096, 14336))
CANDIDATES = {
    "128x64x64 s3w4 x2 flatten (table)": K(128, 64, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    "128x64x64 s4w4 x2 flatten": K(128, 64, 64, num_stages=4, num_warps=4, programs_per_sm=2, flatten=True),
    "128x64x64 s3w4 x2": K(128, 64, 64, num_stages=3, num_warps=4, programs_per_sm=2),
    "128x64x64 s3w4 one per tile": K(128, 64, 64, num_stages=3, num_warps=4, persistent=False),
    "64x64x64 s4w4 x2 flatten": K(64, 64, 64, num_stages=4, num_warps=4, programs_per_sm=2, flatten=True),
    "64x128x64 s3w4 x2 flatten": K(64, 128, 64, num_stages=3, num_warps=4, programs_per_sm=2, flatten=True),
    "128x128x64 s3w8 flatten": K(128, 128, 64, num_stages=3, num_warps=8, flatten=True),
    "128x64x64 s3w4 x2 flatten g4": K(128, 64, 64, group_m=4, num_stages=3, num_warps=4, programs_per_sm=2,
                                      flatten=True),
}


def time_calls(variants: dict, rounds: int, pure: bool) -> dict:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        events = []
        for k, fn in variants.items():
            flush.zero_()
            if pure:
                torch.cuda._sleep(2_000_000)  # ~1 ms at H100/H200 clocks: the host runs ahead of the GPU
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((k, s, e))
        torch.cuda.synchronize()
        for k, s, e in events:
            times[k].append(s.elapsed_time(e) * 1e3)
    return {k: {"us": statistics.median(t), "min": min(t), "max": max(t)} for k, t in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shapes", default=None, help="comma-separated MxDIMxHIDDEN (default: the built-in list)")
    ap.add_argument("--compile", action="store_true", help="add torch.compile's block to the MLP rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # clocks up
        a @ a
    del a
    results = {}
    for m, d, hdim in shapes:
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        wgu = torch.randn(2 * hdim, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
        wg, wu = wgu[:hdim], wgu[hdim:]
        hbuf = torch.empty(m, hdim, device="cuda", dtype=torch.bfloat16)
        v = {
            "eager: 2 GEMMs + gelu*mul": lambda: F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu),
            "cuBLAS packed GEMM + gelu*mul": lambda: (lambda gu: F.gelu(gu[:, :hdim], approximate="tanh")
                                                      * gu[:, hdim:])(F.linear(x, wgu)),
        }
        for name, cfg in CANDIDATES.items():
            def fn(cfg=cfg):
                return gated_gemm(x, wg, wu, activation=A.GELU_TANH, config=cfg, out=hbuf)
            try:
                fn()
                torch.cuda.synchronize()
                v[f"gated {name}"] = fn
            except Exception as e:  # a config that does not fit is reported, not fatal
                print(f"{m}x{d}x{hdim} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        v["gated default (as called)"] = lambda: gated_gemm(x, wg, wu, activation=A.GELU_TANH)
        # FusedLinear's kernel at the same M (dim → hidden + bias + GELU, BERT's intermediate layer) beside
        # eager's addmm + GELU: the linear_act threshold's evidence.
        b = torch.zeros(hdim, device="cuda", dtype=torch.bfloat16)
        v["linear+act: eager addmm + gelu"] = lambda: F.gelu(F.linear(x, wg, b))
        v["linear+act: gemm_act (as called)"] = lambda: gemm_act(x, wg, b, activation=A.GELU)
        # The whole block, down projection included: what `auto` chooses between at this size.
        wd = torch.randn(d, hdim, device="cuda", dtype=torch.bfloat16) * hdim**-0.5

        def eager_mlp():
            return F.linear(F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd)

        v["MLP: eager"] = eager_mlp
        v["MLP: gated GEMM + down"] = lambda: F.linear(gated_gemm(x, wg, wu, activation=A.GELU_TANH), wd)
        v["MLP: cuBLAS gate, up + GLU pass + down"] = lambda: F.linear(
            glu_forward(F.linear(x, wg), F.linear(x, wu), activation=A.GELU_TANH), wd)
        if m <= decode_mlp.MAX_M:
            v["MLP: decode kernels"] = lambda: decode_mlp.decode_gated_mlp(x, wg, wu, wd, activation=A.GELU_TANH)
        if args.compile:
            compiled = torch.compile(eager_mlp)
            compiled()
            v["MLP: torch.compile"] = compiled
        shape = f"{m}x{d}x{hdim}"
        for pure in (False, True):
            r = time_calls(v, args.rounds, pure)
            results[f"{shape} {'pure' if pure else 'host gaps'}"] = r
            how = "pure GPU time" if pure else "GPU waits for the host's launches"
            print(f"\n== {shape} bf16, µs per call (L2 flushed; {how}), median [min, max] of {args.rounds} rounds")
            for group, base_name in (("", "eager: 2 GEMMs + gelu*mul"), ("MLP:", "MLP: eager")):
                base = r[base_name]["us"]  # the linear+act rows: compare them with each other
                rows_ = [kv for kv in r.items() if kv[0].startswith("MLP:") == bool(group)]
                for k, t in sorted(rows_, key=lambda kv: kv[1]["us"]):
                    print(f"  {k:44s} {t['us']:8.1f} [{t['min']:.1f}, {t['max']:.1f}]  {t['us'] / base:.3f}x "
                          f"'{base_name}'")
        del x, wgu, hbuf, wd, v
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_mid_m.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
