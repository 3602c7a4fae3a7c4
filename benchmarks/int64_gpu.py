"""Tensors past 2**31 elements on a GPU: the fused MLP forward and backward against a float32 reference in chunks.

    PYTHONPATH=src python3 benchmarks/int64_gpu.py [--tokens 163840 --dim 1024 --hidden 14336] [--out FILE]

At 163840 tokens × 14336 hidden the saved g, u, h ([M, hidden], bf16) hold 2.35e9 elements each and the backward's
dg|du buffer ([M, 2·hidden]) 4.7e9: every index past row 149,796 (resp. 74,898) needs 64-bit offsets. The reference
is computed in fp32, CHUNK tokens at a time, and every chunk is compared on its own: an indexing error shows as one
chunk far off while the rest agree. bf16 eager (the unfused PyTorch module) runs beside it in the same chunks, so
each error has its eager counterpart. Kernels checked: the gated GEMM (TMA loads; its g/u/h stores are pointer
stores), the same with pointer loads, the GLU backward pass into the [M, 2·hidden] buffer, and GEMM+activation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import mlpfuse
from mlpfuse import activations as A
from mlpfuse.kernels import _common as C
from mlpfuse.kernels.configs import pick
from mlpfuse.kernels.gated_gemm import gated_gemm
from mlpfuse.kernels.gemm_act import gemm_act

CHUNK = 16384


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=163840)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--out", default=None, help="JSON file for the per-chunk errors")
    a = p.parse_args()
    m, d, n = a.tokens, a.dim, a.hidden
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, d, device=dev, dtype=dt, generator=gen)
    wg = (torch.randn(n, d, device=dev, generator=gen) * d**-0.5).to(dt)
    wu = (torch.randn(n, d, device=dev, generator=gen) * d**-0.5).to(dt)
    wd = (torch.randn(d, n, device=dev, generator=gen) * n**-0.5).to(dt)
    dy = torch.randn(m, d, device=dev, dtype=dt, generator=gen)
    act = A.get("silu")
    print(f"x [{m}, {d}], hidden {n}: g/u/h {m * n / 2**31:.2f}×2**31 elements, dg|du {2 * m * n / 2**31:.2f}×2**31",
          flush=True)

    t0 = time.perf_counter()
    xr = x.detach().requires_grad_(True)
    ws = [w.detach().requires_grad_(True) for w in (wg, wu, wd)]
    y = mlpfuse.ops.gated_mlp(xr, *ws, activation="silu", backend="triton")
    y.backward(dy)
    torch.cuda.synchronize()
    fused_s = time.perf_counter() - t0
    grads = [xr.grad, *(w.grad for w in ws)]
    peak = torch.cuda.max_memory_allocated() / 2**30

    # Direct kernel calls: the pointer-load forward path (no TMA) and GEMM+activation, chunk-checked below.
    cfg = pick("gated", dt, m, n, device=x.device, num_sms=C.num_sms(x.device), arch=C.arch_major(x.device))
    h_ptr = gated_gemm(x, wg, wu, activation=act.id, config=cfg.with_(tma=False, tma_store=False))
    z_act = gemm_act(x, wg, activation=act.id)

    wgf, wuf, wdf = wg.float(), wu.float(), wd.float()
    rows = []
    dwg = torch.zeros_like(wgf)
    dwu = torch.zeros_like(wuf)
    dwd = torch.zeros_like(wdf)
    dwg_e = torch.zeros_like(wgf)
    dwu_e = torch.zeros_like(wuf)
    dwd_e = torch.zeros_like(wdf)
    for s in range(0, m, CHUNK):
        e = min(m, s + CHUNK)
        xf, dyf = x[s:e].float(), dy[s:e].float()
        g, u = xf @ wgf.T, xf @ wuf.T
        h = act.forward(g) * u
        yf = h @ wdf.T
        dh = dyf @ wdf
        dg, du = dh * u * act.grad(g), dh * act.forward(g)
        dxf = dg @ wgf + du @ wuf
        dwg += dg.T @ xf
        dwu += du.T @ xf
        dwd += dyf.T @ h
        # Eager bf16 on the same chunk: the error a user accepts today.
        xe = x[s:e].detach().requires_grad_(True)
        we = [w.detach().requires_grad_(True) for w in (wg, wu, wd)]
        ye = F.linear(F.silu(F.linear(xe, we[0])) * F.linear(xe, we[1]), we[2])
        ye.backward(dy[s:e])
        dwg_e += we[0].grad.float()
        dwu_e += we[1].grad.float()
        dwd_e += we[2].grad.float()
        rows.append({
            "rows": [s, e], "y": rel(y[s:e], yf), "y_eager": rel(ye, yf), "dx": rel(grads[0][s:e], dxf),
            "dx_eager": rel(xe.grad, dxf), "h_pointer": rel(h_ptr[s:e], h), "gemm_act": rel(z_act[s:e], act.forward(g)),
        })
    dws = {"dWg": (rel(grads[1], dwg), rel(dwg_e, dwg)), "dWu": (rel(grads[2], dwu), rel(dwu_e, dwu)),
           "dWd": (rel(grads[3], dwd), rel(dwd_e, dwd))}

    worst = {k: max(r[k] for r in rows) for k in ("y", "y_eager", "dx", "dx_eager", "h_pointer", "gemm_act")}
    # Pass: no chunk of ours further from fp32 than 1.5× eager's worst chunk (or 2e-2 for kernels eager has no twin
    # of), every weight gradient likewise.
    bound = {"y": 1.5 * worst["y_eager"], "dx": 1.5 * worst["dx_eager"], "h_pointer": 2e-2, "gemm_act": 2e-2}
    ok = all(worst[k] <= v for k, v in bound.items()) and all(ours <= 1.5 * eager for ours, eager in dws.values())
    print(f"fused forward+backward {fused_s:.2f} s (first call: includes compiles), peak {peak:.1f} GiB")
    print(f"{'quantity':<12} {'worst chunk, ours':>18} {'eager bf16':>12}")
    for k, ke in (("y", "y_eager"), ("dx", "dx_eager")):
        print(f"{k:<12} {worst[k]:>18.3e} {worst[ke]:>12.3e}")
    for k in ("h_pointer", "gemm_act"):
        print(f"{k:<12} {worst[k]:>18.3e} {'-':>12}")
    for k, (ours, eager) in dws.items():
        print(f"{k:<12} {ours:>18.3e} {eager:>12.3e}")
    print("PASS" if ok else "FAIL")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"tokens": m, "dim": d, "hidden": n, "chunks": rows, "weights": dws, "pass": ok}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
