"""Why the FP8 weight-only decode GEMM streams its weights at ~2 TB/s, and what lifts it: one probe kernel with the
production kernel's structure (weight rows as the MMA's left operand, one 128-wide scale block per K step) and
switches for each suspect, timed at 1 and 16 tokens on the gate+up (two e4m3 [14336, 4096] weights, GLU epilogue)
and the down projection (e4m3 [4096, 14336], K split) shapes.

    WIDEN   0  e4m3 → bf16 in registers, bf16 MMA (the production kernel: F2FP to f16, then F2F per element)
            1  e4m3 → f16 in registers (one F2FP per two weights), x·2⁻⁸ rounded to f16, f16 MMA, sums ×2⁸
            2  x quantized to e4m3 beforehand (1×128 scales), FP8 MMA: no widening at all (W8A8's ceiling)
            3  x as two e4m3 terms (x ≈ s₁q₁ + s₂q₂, q₂ the first term's rounding error), two FP8 MMAs per step
    SCALES  0  the block scale loaded in the step that uses it (a dependent global load per step)
            1  the next step's scale loaded one step ahead (carried)
    TMA     weight tiles through host TMA descriptors instead of pointer loads

Local reading (sm_90 SASS from Triton 3.6, compiled without a GPU): the production loop is 465 instructions per
thread per step, 128 of them F2F (f16 → bf16) and 67 two-byte shared loads; WIDEN=1 is 273-314, WIDEN=2 122.

    PYTHONPATH=src python3 benchmarks/fp8_stream_probe.py [--quick | --unroll]

UNROLL (--unroll): two 128-wide scale blocks per loop step (each its own MMA and scale), so each pipeline stage
carries twice the weight bytes, as the bf16 decode kernel's 128×128 bf16 tiles do.

Prints µs (do_bench median), GB/s of weight bytes and the error against the float64 product of the same e4m3
weights, then the best per WIDEN, and the production kernel (kernels.fp8_gemm.fp8_weight_gemm) and a device copy
of the same bytes for reference."""

import argparse
import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from mlpfuse import activations, fp8
from mlpfuse.kernels import _common as C
from mlpfuse.kernels import fp8_gemm as K


@triton.jit
def probe(x, xq, xs, xq2, xs2, w1, s1, w2, s2, out, M, N, K, K_PER, s_w, s_s,
          BN: tl.constexpr, BM: tl.constexpr, WIDEN: tl.constexpr, SCALES: tl.constexpr, TMA: tl.constexpr,
          GATED: tl.constexpr, SPLIT: tl.constexpr, UNROLL: tl.constexpr = 1, TILED: tl.constexpr = 0):
    pid = tl.program_id(0)
    off_n = pid * BN
    rn = off_n + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk0 = tl.arange(0, 128)
    mmask = rm < M
    nkb = K // 128
    srow = off_n // 128
    k_lo = tl.program_id(1) * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    acc1 = tl.zeros((BN, BM), dtype=tl.float32)
    acc2 = tl.zeros((BN, BM), dtype=tl.float32)
    n1 = tl.load(s1 + srow * s_s + k_lo // 128)
    n2 = tl.load(s2 + srow * s_s + k_lo // 128)
    for kk in range(k_lo, k_hi, 128 * UNROLL):
        for u in tl.static_range(UNROLL):
            k0 = kk + 128 * u
            rk = k0 + rk0
            kb = k0 // 128
            if SCALES == 1:
                a1 = n1
                a2 = n2
                nxt = tl.minimum(kb + 1, nkb - 1)
                n1 = tl.load(s1 + srow * s_s + nxt)
                n2 = tl.load(s2 + srow * s_s + nxt)
            else:
                a1 = tl.load(s1 + srow * s_s + kb)
                a2 = tl.load(s2 + srow * s_s + kb)
            if TILED:  # [N/BN, K/128, BN, 128] contiguous: each step's tile is one run of BN·128 bytes
                row = (pid * nkb + kb) * BN
                if TMA:
                    wt = w1.load([row, 0])
                    wt2 = w2.load([row, 0])
                else:
                    tile = (row + tl.arange(0, BN))[:, None] * 128 + rk0[None, :]
                    wt = tl.load(w1 + tile)
                    wt2 = tl.load(w2 + tile)
            elif TMA:
                wt = w1.load([off_n, k0])
                wt2 = w2.load([off_n, k0])
            else:
                wt = tl.load(w1 + rn[:, None] * s_w + rk[None, :])
                wt2 = tl.load(w2 + rn[:, None] * s_w + rk[None, :])
            if WIDEN >= 2:
                qt = tl.load(xq + rm[None, :] * K + rk[:, None], mask=mmask[None, :], other=0.0)
                qs = tl.load(xs + rm * nkb + kb, mask=mmask, other=0.0)[None, :]
                d1 = tl.dot(wt, qt) * qs
                if GATED:
                    d2 = tl.dot(wt2, qt) * qs
                if WIDEN == 3:
                    qt2 = tl.load(xq2 + rm[None, :] * K + rk[:, None], mask=mmask[None, :], other=0.0)
                    qs2 = tl.load(xs2 + rm * nkb + kb, mask=mmask, other=0.0)[None, :]
                    d1 += tl.dot(wt, qt2) * qs2
                    if GATED:
                        d2 += tl.dot(wt2, qt2) * qs2
            else:
                xt = tl.load(x + rm[None, :] * K + rk[:, None], mask=mmask[None, :], other=0.0)
                if WIDEN == 0:
                    d1 = tl.dot(wt.to(tl.bfloat16), xt)
                    if GATED:
                        d2 = tl.dot(wt2.to(tl.bfloat16), xt)
                else:
                    xh = (xt.to(tl.float32) * 0.00390625).to(tl.float16)
                    d1 = tl.dot(wt.to(tl.float16), xh) * 256.0
                    if GATED:
                        d2 = tl.dot(wt2.to(tl.float16), xh) * 256.0
            acc1 += d1 * a1
            if GATED:
                acc2 += d2 * a2
    omask = mmask[None, :] & (rn[:, None] < N)
    if SPLIT:
        at = (tl.program_id(1) * 2 * M + rm[None, :]) * N + rn[:, None]
        tl.store(out + at, acc1, mask=omask)
        if GATED:
            tl.store(out + at + M * N, acc2, mask=omask)
    else:
        if GATED:
            acc1 = acc1 / (1.0 + tl.exp(-acc1)) * acc2
        tl.store(out + rm[None, :] * N + rn[:, None], acc1, mask=omask)


def _two_terms(x):
    """x ≈ s₁q₁ + s₂q₂ in the activation recipe: q₂ quantizes what q₁ rounded away."""
    q1, t1 = fp8.quantize_activation(x)
    r = x.float() - fp8.dequantize_activation(q1, t1)
    q2, t2 = fp8.quantize_activation(r)
    return q1, t1, q2, t2


def _dense(w):
    return (w.values.double() * w.scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
            [:w.values.shape[0], :w.values.shape[1]])


def _tiled(v, bn):
    """e4m3 [N, K] as [N/bn, K/128, bn, 128] contiguous, seen as [N·K/128, 128]."""
    n, k = v.shape
    t = v.view(torch.uint8).view(n // bn, bn, k // 128, 128).permute(0, 2, 1, 3).contiguous()
    return t.view(-1, 128).view(v.dtype)


def _hot(fn, n=50):
    """µs per call, n calls back to back replayed from one CUDA graph (no host time between them, nothing flushed:
    L2 keeps what fits); the median of 5 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n * 1e3)
    return sorted(times)[2]


def sweep(name, m, x, wa, wb, gated, configs, bw, log, flush=True):
    n, k = wa.values.shape
    x = x[:m]
    q1, t1, q2, t2 = _two_terms(x)
    ref = x.double() @ _dense(wa).T
    if gated:
        ref = torch.nn.functional.silu(ref) * (x.double() @ _dense(wb).T)
    nbytes = (2 if gated else 1) * n * k
    best = {}
    for widen, scales, tma, bn, warps, stages, splits, *rest in configs:
        unroll = rest[0] if rest else 1
        tiled = rest[1] if len(rest) > 1 else 0
        k_per = triton.cdiv(k // (128 * unroll), splits) * 128 * unroll
        out = torch.full((splits, 2, m, n) if splits > 1 else (m, n), float("nan"), device="cuda")
        va, vb = (_tiled(wa.values, bn), _tiled(wb.values, bn)) if tiled else (wa.values, wb.values)
        if tma:
            wd1, wd2 = C.desc(va, [bn, 128]), C.desc(vb, [bn, 128])
        else:
            wd1, wd2 = va, vb

        def call():
            probe[(triton.cdiv(n, bn), splits)](x, q1, t1, q2, t2, wd1, wa.scale_inv, wd2, wb.scale_inv, out, m, n, k,
                                                k_per, k, wa.scale_inv.stride(0), bn, 16, widen, scales, tma, gated,
                                                splits > 1, unroll, tiled, num_warps=warps, num_stages=stages)
        tag = (f"{name} m={m:2d} widen={widen} scales={scales} tma={tma} bn={bn:3d} w={warps} s={stages} "
               f"split={splits} unroll={unroll} tiled={tiled}{'' if flush else ' hot'}")
        try:
            call()
            if flush:
                t = triton.testing.do_bench(call, warmup=10, rep=40, return_mode="median") * 1e3
            else:
                t = _hot(call)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is reported and skipped
            log(f"{tag}: {type(e).__name__} {str(e)[:100]}")
            continue
        got = out.double()
        if splits > 1:
            s = got.sum(0)
            got = torch.nn.functional.silu(s[0]) * s[1] if gated else s[0]
        err = float((got - ref).norm() / ref.norm())
        log(f"{tag}: {t:7.1f} us {nbytes / t / 1e3:6.0f} GB/s ({100 * nbytes / t / 1e3 / bw:3.0f} % of copy)  "
            f"err {err:.2e}")
        key = (widen, tiled)
        if key not in best or t < best[key][0]:
            best[key] = (t, tag, err)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a handful of candidates (a smoke run)")
    ap.add_argument("--unroll", action="store_true",
                    help="fp16 widening only: two scale blocks per step (twice the bytes per pipeline stage) or one")
    ap.add_argument("--l2", action="store_true", help="only the --tiled run's L2 part")
    ap.add_argument("--tiled", action="store_true",
                    help="fp16 widening: the weights in the [N, K] layout against pre-tiled (each step's tile one "
                         "contiguous run), with TMA and pointer loads; then the same loop on weights that fit in L2 "
                         "(gate+up 2×2048×4096), timed back to back: the loop's own ceiling")
    a = ap.parse_args()
    d, h = 4096, 14336
    torch.manual_seed(0)
    wg, wu, wd = (fp8.quantize_weight(torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02)
                  for s in ((h, d), (h, d), (d, h)))
    src = torch.empty(2 * h * d, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=40, return_mode="median") * 1e3
    bw = 2 * src.numel() / t_copy / 1e3
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    log(f"copy of {src.numel() / 1e6:.0f} MB: {t_copy:.1f} us, {bw:.0f} GB/s (read + write)")
    xs = {m: torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for m in (1, 16)}
    hx = {m: torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for m in (1, 16)}
    for m in (1, 16):
        gate_up = (xs[m], wg.values, wg.scale_inv, wu.values, wu.scale_inv)
        for nm, fn in (("gate+up", lambda: K.fp8_weight_gemm(*gate_up, activation=activations.SILU)),
                       ("down", lambda: K.fp8_weight_gemm(hx[m], wd.values, wd.scale_inv,
                                                          activation=activations.IDENTITY))):
            fn()
            t = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
            nb = (2 if nm == "gate+up" else 1) * h * d
            log(f"production {nm} m={m:2d}: {t:7.1f} us {nb / t / 1e3:6.0f} GB/s")
    if a.tiled:
        pairs = ((64, 4), (128, 8))
        gu = [(1, 1, t, bn, wp, st, 1, 1, ti)
              for t, ti, (bn, wp), st in itertools.product((0, 1), (0, 1), pairs, (3, 4))]
        dn = [(1, 1, t, bn, wp, st, sp, 1, ti)
              for t, ti, (bn, wp), st, sp in itertools.product((0, 1), (0, 1), pairs, (3, 4), (4, 8))]
    elif a.unroll:
        pairs = ((64, 4), (128, 8))
        gu = [(1, 1, 1, bn, wp, st, sp, un)
              for (bn, wp), st, sp, un in itertools.product(pairs, (2, 3, 4), (1, 2), (1, 2))]
        dn = [(1, 1, 1, bn, wp, st, sp, un)
              for (bn, wp), st, sp, un in itertools.product(pairs, (3, 4), (4, 8), (1, 2))]
    elif a.quick:
        gu = [(w, 1, 1, 64, 4, 3, 1) for w in (0, 1, 2, 3)]
        dn = [(w, 1, 1, 64, 4, 3, 4) for w in (0, 1, 2)]
    else:
        pairs = ((64, 4), (128, 8))  # (row slice, warps)
        gu = [(0, 0, 0, 64, 4, 3, 1)] + [(w, 1, t, bn, wp, s, sp) for w, t, (bn, wp), s, sp in
                                         itertools.product((0, 1, 2, 3), (0, 1), pairs, (3, 5), (1, 2))]
        dn = [(w, 1, t, bn, wp, 4, sp) for w, t, (bn, wp), sp in itertools.product((0, 1, 2), (0, 1), pairs, (2, 4, 8))]
    summary = []
    for m in (1, 16) if not a.l2 else ():
        for name, x, wa, wb, gated, cfgs in (("gate+up", xs[m], wg, wu, True, gu), ("down", hx[m], wd, wd, False, dn)):
            best = sweep(name, m, x, wa, wb, gated, cfgs, bw, log)
            for _, (t, tag, err) in sorted(best.items()):
                summary.append(f"best {tag}: {t:.1f} us err {err:.2e}")
    if a.tiled or a.l2:  # weights that stay in L2 between calls: what the loop itself can stream
        h2 = 2048
        w2 = [fp8.quantize_weight(torch.randn(h2, d, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
        cfgs = [(1, 1, t, 64, 4, st, sp, 1, ti) for t, ti, st, sp in itertools.product((0, 1), (0, 1), (3, 4), (2, 4))]
        for m in (1, 16):
            # the full 117 MB (more than L2 holds) in the same harness, then the 16 MB that stay in L2
            sweep("gate+up-HBM", m, xs[m], wg, wu, True, [(1, 1, t, 64, 4, 4, 1, 1, 0) for t in (0, 1)], bw, log,
                  flush=False)
            best = sweep("gate+up-L2", m, xs[m], w2[0], w2[1], True, cfgs, bw, log, flush=False)
            for _, (t, tag, err) in sorted(best.items()):
                summary.append(f"best {tag}: {t:.1f} us err {err:.2e}")
    log("\n".join(summary))


if __name__ == "__main__":
    main()
