"""How an FP8 weight stream is best widened at decode sizes, on one GPU: the gate+up weight-only GEMM (two e4m3
weights [H, D] with 128×128 scales, x [M, D] bf16) in one probe kernel, the widening chosen by MODE:

    0  e4m3 -> bf16 with Triton's conversion, bf16 MMA (today's kernels)
    1  e4m3 -> fp16 with Triton's conversion, x cast to fp16, fp16 MMA
    2  e4m3 -> fp16 by shifting the bits (exact: the value times 2^-8), fp16 MMA
    3  x quantized to e4m3 beforehand (1x128 scales), FP8 MMA (no widening of the weights at all)
    4  e4m3 -> bf16 by shifting the bits (the value times 2^-120), x times 2^64 before the MMA, bf16 MMA

    PYTHONPATH=src python3 benchmarks/fp8_convert_probe.py

Then `probe2`, the scales folded into x instead of into the accumulator (x·s per K row, in x's dtype or fp16, then
one chained MMA: no multiply-add of the accumulator per K block), K steps of BK = 128 or 256 (two scale groups):
    MODE 0  e4m3 -> bf16, x·s in bf16          1  e4m3 -> fp16, x·s·2^10 in fp16 (the range ignored: a ceiling)
    MODE 2  x quantized to e4m3, FP8 MMA, BK wide (the structure's ceiling without any widening)

Prints µs (do_bench median), GB/s of weight bytes and the error against the float64 product of the same e4m3 weights.
"""

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from mlpfuse import fp8


@triton.jit
def probe(x, xq, sx, wg, wu, sg, su, out, M, N, K, BN: tl.constexpr, BM: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk0 = tl.arange(0, 128)
    nk = K // 128
    srow = (pid * BN) // 128
    accg = tl.zeros((BN, BM), tl.float32)
    accu = tl.zeros((BN, BM), tl.float32)
    for kb in range(0, nk):
        rk = kb * 128 + rk0
        mmask = rm[None, :] < M
        w1 = tl.load(wg + rn[:, None] * K + rk[None, :])
        w2 = tl.load(wu + rn[:, None] * K + rk[None, :])
        s1 = tl.load(sg + srow * nk + kb)
        s2 = tl.load(su + srow * nk + kb)
        if MODE == 3:
            xt = tl.load(xq + rm[None, :] * K + rk[:, None], mask=mmask, other=0.0)
            xs = tl.load(sx + rm * nk + kb, mask=rm < M, other=0.0)
            d1 = tl.dot(w1, xt) * xs[None, :]
            d2 = tl.dot(w2, xt) * xs[None, :]
        else:
            xt = tl.load(x + rm[None, :] * K + rk[:, None], mask=mmask, other=0.0)
            if MODE == 0:
                d1 = tl.dot(w1.to(tl.bfloat16), xt)
                d2 = tl.dot(w2.to(tl.bfloat16), xt)
            elif MODE == 1:
                x16 = xt.to(tl.float16)
                d1 = tl.dot(w1.to(tl.float16), x16)
                d2 = tl.dot(w2.to(tl.float16), x16)
            elif MODE == 2:
                x16 = xt.to(tl.float16)
                b1 = w1.to(tl.uint8, bitcast=True).to(tl.uint16)
                b2 = w2.to(tl.uint8, bitcast=True).to(tl.uint16)
                f1 = (((b1 & 0x80) << 8) | ((b1 & 0x7F) << 7)).to(tl.float16, bitcast=True)
                f2 = (((b2 & 0x80) << 8) | ((b2 & 0x7F) << 7)).to(tl.float16, bitcast=True)
                d1 = tl.dot(f1, x16) * 256.0
                d2 = tl.dot(f2, x16) * 256.0
            else:
                xb = (xt.to(tl.float32) * 18446744073709551616.0).to(tl.bfloat16)  # x * 2^64
                b1 = w1.to(tl.uint8, bitcast=True).to(tl.uint16)
                b2 = w2.to(tl.uint8, bitcast=True).to(tl.uint16)
                f1 = (((b1 & 0x80) << 8) | ((b1 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
                f2 = (((b2 & 0x80) << 8) | ((b2 & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
                d1 = tl.dot(f1, xb) * 72057594037927936.0  # 2^56
                d2 = tl.dot(f2, xb) * 72057594037927936.0
        accg += d1 * s1
        accu += d2 * s2
    z = accg / (1.0 + tl.exp(-accg)) * accu
    tl.store(out + rm[None, :] * N + rn[:, None], z.to(tl.bfloat16), mask=rm[None, :] < M)


@triton.jit
def probe2(x, xq, sx, wg, wu, sg, su, out, M, N, K, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
           MODE: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk0 = tl.arange(0, BK)
    nk = K // 128
    srow = (pid * BN) // 128
    accg = tl.zeros((BN, BM), tl.float32)
    accu = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + rk0
        mmask = rm[None, :] < M
        w1 = tl.load(wg + rn[:, None] * K + rk[None, :])
        w2 = tl.load(wu + rn[:, None] * K + rk[None, :])
        s1 = tl.load(sg + srow * nk + rk // 128)  # [BK]: each K row's block scale
        s2 = tl.load(su + srow * nk + rk // 128)
        if MODE == 2:
            xt = tl.load(xq + rm[None, :] * K + rk[:, None], mask=mmask, other=0.0)
            xs = tl.load(sx + rm * nk + k0 // 128, mask=rm < M, other=0.0)  # BK = 128 here
            accg += tl.dot(w1, xt) * (xs[None, :] * tl.max(s1, 0))
            accu += tl.dot(w2, xt) * (xs[None, :] * tl.max(s2, 0))
        else:
            xt = tl.load(x + rm[None, :] * K + rk[:, None], mask=mmask, other=0.0).to(tl.float32)
            if MODE == 0:
                accg = tl.dot(w1.to(tl.bfloat16), (xt * s1[:, None]).to(tl.bfloat16), accg)
                accu = tl.dot(w2.to(tl.bfloat16), (xt * s2[:, None]).to(tl.bfloat16), accu)
            else:
                accg = tl.dot(w1.to(tl.float16), (xt * s1[:, None] * 1024.0).to(tl.float16), accg)
                accu = tl.dot(w2.to(tl.float16), (xt * s2[:, None] * 1024.0).to(tl.float16), accu)
    if MODE == 1:
        accg = accg / 1024.0
        accu = accu / 1024.0
    z = accg / (1.0 + tl.exp(-accg)) * accu
    tl.store(out + rm[None, :] * N + rn[:, None], z.to(tl.bfloat16), mask=rm[None, :] < M)


def main():
    d, h = 4096, 14336
    torch.manual_seed(0)
    wg = fp8.quantize_weight(torch.randn(h, d, device="cuda", dtype=torch.bfloat16) * 0.02)
    wu = fp8.quantize_weight(torch.randn(h, d, device="cuda", dtype=torch.bfloat16) * 0.02)
    for m in (1, 16):
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        xq, sx = fp8.quantize_activation(x)
        g64 = x.double() @ (wg.values.double() * wg.scale_inv.double().repeat_interleave(128, 0)
                            .repeat_interleave(128, 1)[:h, :d]).T
        u64 = x.double() @ (wu.values.double() * wu.scale_inv.double().repeat_interleave(128, 0)
                            .repeat_interleave(128, 1)[:h, :d]).T
        y64 = torch.nn.functional.silu(g64) * u64
        for mode, bn, bk, warps, stages in itertools.product((0, 1, 2), (64, 128), (128, 256), (4, 8), (3, 4, 6)):
            if mode == 2 and bk != 128:
                continue
            out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)

            def call2():
                probe2[(h // bn,)](x, xq, sx, wg.values, wu.values, wg.scale_inv, wu.scale_inv, out, m, h, d, bn, 16,
                                   bk, mode, num_warps=warps, num_stages=stages)
            try:
                call2()
                t = triton.testing.do_bench(call2, warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
                print(f"m={m} probe2 mode={mode} bn={bn} bk={bk} w={warps} s={stages}: {type(e).__name__} "
                      f"{str(e)[:120]}")
                continue
            err = float((out.double() - y64).norm() / y64.norm())
            print(f"m={m:2d} probe2 mode={mode} bn={bn:3d} bk={bk} w={warps} s={stages}: {t:7.1f} us "
                  f"{2 * h * d / t / 1e3:6.0f} GB/s  err {err:.2e}", flush=True)
        for mode, bn, warps, stages in itertools.product((0, 1, 3), (64,), (4, 8), (3, 5)):
            out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
            bm = 16

            def call():
                probe[(h // bn,)](x, xq, sx, wg.values, wu.values, wg.scale_inv, wu.scale_inv, out, m, h, d, bn, bm,
                                  mode, num_warps=warps, num_stages=stages)
            try:
                call()
                t = triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
                print(f"m={m} mode={mode} bn={bn} w={warps} s={stages}: {type(e).__name__} {str(e)[:120]}")
                continue
            err = float((out.double() - y64).norm() / y64.norm())
            print(f"m={m:2d} mode={mode} bn={bn:3d} w={warps} s={stages}: {t:7.1f} us {2 * h * d / t / 1e3:6.0f} GB/s"
                  f"  err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
