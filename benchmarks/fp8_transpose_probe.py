"""Why quantizing a weight into Wᵀ's layout (128×128 blocks, what FP8 training's dh and dx GEMMs read) takes ~4× the
time of quantizing it in place: variants of the one pass, timed on one GPU.

    PYTHONPATH=src python3 benchmarks/fp8_transpose_probe.py [--shapes 14336x4096,4096x4096]

Variants (each: W [N, K] bf16 → e4m3 values and one fp32 scale per 128×128 block; µs by do_bench, and GB/s on the
bytes read and written once):
    in place            kernels.fp8_gemm.quantize_weight(w)                   (the bound to reach)
    transposed          kernels.fp8_gemm.quantize_weight(w, transposed=True)  (as FP8 training runs it)
    t-after             the same, the e4m3 values transposed instead of the fp32 ones
    t-4warps            transposed at 4 warps
    t-halves            the block's scale first, then two [128, 64] halves transposed and stored one after the other
    bytes               in place, then a second kernel transposing the e4m3 bytes
    torch               w.t().contiguous() in PyTorch, then in place
Every variant's values and scales are checked bit for bit against `transposed`.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, "src")
from mlpfuse import fp8  # noqa: E402
from mlpfuse.kernels import fp8_gemm as K  # noqa: E402


@triton.jit
def _t_after(w, q, s, N, K_, s_wn, s_qn, s_sn):
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    rn = bn * 128 + tl.arange(0, 128)
    rk = bk * 128 + tl.arange(0, 128)
    mask = (rn[:, None] < N) & (rk[None, :] < K_)
    v = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = K._scale_inv(tl.max(tl.max(tl.abs(v), axis=1), axis=0),
                         tl.max(tl.max((v != v).to(tl.int32), axis=1), axis=0) > 0)
    values = tl.trans(K._e4m3(tl.math.div_rn(v, scale), False))
    tl.store(q + rk[:, None] * s_qn + rn[None, :], values, mask=(rk[:, None] < K_) & (rn[None, :] < N))
    tl.store(s + bk * s_sn + bn, scale)


@triton.jit
def _t_halves(w, q, s, N, K_, s_wn, s_qn, s_sn):
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    rn = bn * 128 + tl.arange(0, 128)
    amax = 0.0
    nan = 0
    for h in tl.static_range(2):
        rk = bk * 128 + h * 64 + tl.arange(0, 64)
        v = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K_),
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(v), axis=1), axis=0))
        nan = tl.maximum(nan, tl.max(tl.max((v != v).to(tl.int32), axis=1), axis=0))
    scale = K._scale_inv(amax, nan > 0)
    for h in tl.static_range(2):
        rk = bk * 128 + h * 64 + tl.arange(0, 64)
        v = tl.load(w + rn[:, None] * s_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K_),
                    other=0.0).to(tl.float32)
        values = K._e4m3(tl.math.div_rn(tl.trans(v), scale), False)
        tl.store(q + rk[:, None] * s_qn + rn[None, :], values, mask=(rk[:, None] < K_) & (rn[None, :] < N))
    tl.store(s + bk * s_sn + bn, scale)


@triton.jit
def _bytes_t(src, dst, R, C, s_src, s_dst):
    br = tl.program_id(0)
    bc = tl.program_id(1)
    rr = br * 128 + tl.arange(0, 128)
    rc = bc * 128 + tl.arange(0, 128)
    v = tl.load(src + rr[:, None] * s_src + rc[None, :], mask=(rr[:, None] < R) & (rc[None, :] < C))
    tl.store(dst + rc[:, None] * s_dst + rr[None, :], tl.trans(v), mask=(rc[:, None] < C) & (rr[None, :] < R))


def _empty(w):
    n, k = w.shape
    return (torch.empty(k, n, device=w.device, dtype=fp8.DTYPE),
            torch.empty(-(-k // 128), -(-n // 128), device=w.device, dtype=torch.float32))


def _grid(w):
    return (triton.cdiv(w.shape[0], 128), triton.cdiv(w.shape[1], 128))


def variants(w):
    n, k = w.shape

    def t_after():
        q, s = _empty(w)
        _t_after[_grid(w)](w, q, s, n, k, w.stride(0), q.stride(0), s.stride(0), num_warps=8, num_stages=1)
        return q, s

    def t_halves():
        q, s = _empty(w)
        _t_halves[_grid(w)](w, q, s, n, k, w.stride(0), q.stride(0), s.stride(0), num_warps=8, num_stages=1)
        return q, s

    def t_4warps():
        q, s = _empty(w)
        K.mlpfuse_fp8_weight_quantize_kernel[_grid(w)](w, q, s, n, k, w.stride(0), w.stride(1), q.stride(0),
                                                        s.stride(0), True, False, False, num_warps=4, num_stages=1)
        return q, s

    def bytes_t():
        q0, s0 = K.quantize_weight(w)
        q = torch.empty(k, n, device=w.device, dtype=fp8.DTYPE)
        _bytes_t[_grid(w)](q0.view(torch.uint8), q.view(torch.uint8), n, k, q0.stride(0), q.stride(0), num_warps=8)
        return q, s0.t().contiguous()

    return {
        "in place": lambda: K.quantize_weight(w),
        "transposed": lambda: K.quantize_weight(w, transposed=True),
        "t-after": t_after,
        "t-4warps": t_4warps,
        "t-halves": t_halves,
        "bytes": bytes_t,
        "torch": lambda: K.quantize_weight(w.t().contiguous()),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="14336x4096,4096x14336,4096x4096")
    a = ap.parse_args()
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        vs = variants(w)
        ref_q, ref_s = vs["transposed"]()
        moved = n * k * 3
        print(f"\n{n}x{k} bf16 -> e4m3 ({moved / 1e6:.0f} MB moved)", flush=True)
        for name, fn in vs.items():
            q, s = fn()
            same = "" if name == "in place" else (
                "ok" if torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
                else "DIFFERS")
            us = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200)
            print(f"  {name:12s} {us:8.1f} µs {moved / us / 1e3:7.0f} GB/s  {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
