"""The warp-specialized FP8 GEMM (kernels/fp8_gemm_ws.py) against the Triton kernel (kernels/fp8_gemm.py) and
cuBLAS's rowwise FP8 GEMM, on one Hopper GPU.

    PYTHONPATH=src python3 benchmarks/fp8_ws_probe.py --check     # outputs against the Triton kernel's
    PYTHONPATH=src python3 benchmarks/fp8_ws_probe.py --bench     # do_bench µs and TFLOP/s, tiles and ring depths

--check compares, on the same quantized operands, every output of the two kernels (h's values and scales, or the
GEMM's output, g and u with save_gu in both forms, the output stored transposed): the largest relative
difference of the dequantized results, and the fraction of e4m3 values that differ. Both kernels sum each 128-wide
K block on the tensor cores and promote it with the same scales, so they should agree to fp32 rounding.
"""

import argparse
import sys

import torch
import triton.testing

from mlpfuse import activations, fp8
from mlpfuse.kernels import fp8_gemm as K
from mlpfuse.kernels import fp8_gemm_ws as W

SILU = activations.get("silu").id
IDENT = activations.IDENTITY


def _operands(m, n, k, gated, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = K.quantize(x)
    ws = []
    for _ in range(2 if gated else 1):
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        ws.extend(K.quantize_weight(w))
    return xq, xs, ws


def _deq(v, s):
    return fp8.dequantize_activation(v, s, torch.float64)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check() -> bool:
    ok = True
    cases = [  # (m, n, k, gated, quant_out, save_gu, out_transposed, bias)
        (256, 256, 256, True, True, False, False, False),
        (300, 384, 640, True, True, False, False, True),
        (8192, 14336, 4096, True, True, False, False, False),
        (8192, 4096, 14336, False, False, False, False, False),
        (1000, 1000, 1008, False, False, False, False, True),
        (96, 256, 384, True, True, True, False, False),
        (2048, 4096, 14336, True, True, True, False, False),
        (4096, 1024, 2048, False, False, False, True, False),
        (70, 200, 160, False, False, False, True, False),
    ]
    for m, n, k, gated, quant, save, trans, bias in cases:
        xq, xs, ws = _operands(m, n, k, gated)
        b = (torch.randn(n, device="cuda") * 0.1,) * 2 if bias else (None, None)
        kw = dict(activation=SILU if gated else IDENT, quant_out=quant, out_dtype=torch.float32 if trans else
                  torch.bfloat16, save_gu=save, out_transposed=trans)
        w2 = (ws[2], ws[3]) if gated else (None, None)
        ref = K.fp8_gemm(xq, xs, ws[0], ws[1], *w2, *b, **kw)
        for pair in (False, True):
            got = W.gemm(xq, xs, ws[0], ws[1], *w2, *b, pair=pair, **kw)
            torch.cuda.synchronize()
            ok &= _compare(got, ref, quant, f"m={m} n={n} k={k} gated={gated} quant={quant} save_gu={save} "
                                           f"out_transposed={trans} bias={bias} pair={pair}")
    print("CHECK", "OK" if ok else "FAILED", flush=True)
    return ok


def _compare(got, ref, quant, what) -> bool:
    ok = True
    ref = ref if isinstance(ref, tuple) else (ref,)
    got = got if isinstance(got, tuple) else (got,)
    parts = []
    if quant:
        for i in range(0, len(ref), 2):
            gv, gs, rv, rs = got[i], got[i + 1], ref[i], ref[i + 1]
            err = _rel(_deq(gv, gs), _deq(rv, rs))
            diff = float((gv.view(torch.uint8) != rv.view(torch.uint8)).float().mean())
            parts.append(f"rel {err:.2e} values differ {diff:.2e}")
            ok &= err < 1e-2 and diff < 1e-2
    else:
        err = _rel(got[0], ref[0])
        parts.append(f"rel {err:.2e}")
        ok &= err < 1e-3
    print(f"check {what}: " + "; ".join(parts), flush=True)
    return ok


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60) * 1e3


def bench(d: int, h: int, sizes) -> None:
    rows = []
    for m in sizes:
        xq, xs, (wg, sg, wu, su) = _operands(m, h, d, True)
        hq, hs, (wd, sd) = _operands(m, d, h, False, seed=1)
        gu = torch.cat([wg, wu])
        ones_m = torch.ones(m, 1, device="cuda")
        ones_gu = torch.ones(1, 2 * h, device="cuda")
        ones_d = torch.ones(1, d, device="cuda")
        fl_g, fl_d = 4 * m * h * d, 2 * m * h * d
        t = {}
        t["cublas gated"] = _bench(lambda: torch._scaled_mm(xq, gu.t(), scale_a=ones_m, scale_b=ones_gu,
                                                            out_dtype=torch.bfloat16))
        t["cublas down"] = _bench(lambda: torch._scaled_mm(hq, wd.t(), scale_a=ones_m, scale_b=ones_d,
                                                           out_dtype=torch.bfloat16))
        ws_on, K.WS = K.WS, False  # the Triton kernel itself (fp8_gemm takes the warp-specialized one from 1024 rows)
        t["triton gated"] = _bench(lambda: K.fp8_gemm(xq, xs, wg, sg, wu, su, activation=SILU, quant_out=True))
        t["triton down"] = _bench(lambda: K.fp8_gemm(hq, hs, wd, sd, activation=IDENT, quant_out=False))
        K.WS = ws_on
        for pair, st, gm in ((False, 4, 16), (True, 3, 16), (True, 4, 8), (True, 4, 16)):
            t[f"ws gated{' pair' if pair else ''} s{st} g{gm}"] = _bench(
                lambda: W.gemm(xq, xs, wg, sg, wu, su, activation=SILU, quant_out=True, stages_=st, group_m=gm,
                               pair=pair))
        # FP8 training's forward: g and u kept (save_gu), one weight tile a stage (as launched) or paired
        for pair, st in ((False, 4), (True, 3)):
            t[f"ws gated save_gu{' pair' if pair else ''} s{st}"] = _bench(
                lambda: W.gemm(xq, xs, wg, sg, wu, su, activation=SILU, quant_out=True, save_gu=True, stages_=st,
                               pair=pair))
        for pair, st, gm in ((False, 6, 16), (True, 3, 16), (True, 4, 8), (True, 4, 16)):
            t[f"ws down{' pair' if pair else ''} s{st} g{gm}"] = _bench(
                lambda: W.gemm(hq, hs, wd, sd, activation=IDENT, quant_out=False, out_dtype=torch.bfloat16,
                               stages_=st, group_m=gm, pair=pair))
        for name, us in t.items():
            fl = fl_g if "gated" in name else fl_d
            line = f"m={m:5d} {name:22s} {us:9.1f} µs {fl / us / 1e6:7.0f} TFLOP/s"
            print(line, flush=True)
            rows.append(line)
        del xq, xs, wg, sg, wu, su, hq, hs, wd, sd, gu
        torch.cuda.empty_cache()
    # Training's weight gradients (K = 4096 tokens; the second operand in 128×128 blocks): dWg, dWu [h, d] and dWd
    # stored transposed ([d, h] from an [h, d] product), bf16 out.
    for (mm, nn, kk, trans) in ((h, d, 4096, False), (h, d, 4096, True)):
        aq, asc, (bq, bs) = _operands(mm, nn, kk, False)
        kw = dict(activation=IDENT, quant_out=False, out_dtype=torch.bfloat16, out_transposed=trans)
        tt = _bench(lambda: K.fp8_gemm(aq, asc, bq, bs, **kw))
        tw = _bench(lambda: W.gemm(aq, asc, bq, bs, **kw))
        for name, us in ((f"triton wgrad{' T' if trans else ''}", tt), (f"ws wgrad{' T' if trans else ''}", tw)):
            line = f"{mm}x{nn}x{kk} {name:22s} {us:9.1f} µs {2 * mm * nn * kk / us / 1e6:7.0f} TFLOP/s"
            print(line, flush=True)
            rows.append(line)
    print("\n=== summary ===")
    print("\n".join(rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=14336)
    ap.add_argument("--sizes", default="8192,2048,512")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if a.check and not check():
        sys.exit(1)
    if a.bench:
        bench(a.dim, a.hidden, [int(s) for s in a.sizes.split(",")])


if __name__ == "__main__":
    main()
