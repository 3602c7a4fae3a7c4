import sys, torch
sys.path.insert(0, "src")
from mlpfuse import fp8, activations, reference
from mlpfuse.kernels import fp8_gemm as k
from mlpfuse.ops import fp8_train as T
torch.manual_seed(0)
dev = "cuda"
def rel(a, b): a, b = a.double(), b.double(); return float((a - b).norm() / b.norm())
def deq(q, s): return fp8.dequantize_activation(q, s, torch.float64)
for (m, d, h) in [(96, 256, 384), (256, 512, 1024), (4096, 4096, 14336)]:
    x = torch.randn(m, d, device=dev); wg = torch.randn(h, d, device=dev) * d**-0.5
    wu = torch.randn(h, d, device=dev) * d**-0.5; wd = torch.randn(d, h, device=dev) * h**-0.5
    dy = torch.randn(m, d, device=dev)
    ident = activations.IDENTITY
    # single GEMM a·wᵀ, fp32 out, various configs
    for name, (a, w) in {"dh=dy·Wd": (dy, wd.t()), "dx=dg·Wg": (torch.randn(m, h, device=dev), wg.t())}.items():
        aq, as_ = k.quantize(a)
        qw = fp8.quantize_weight(w.contiguous())
        ref = deq(aq, as_) @ qw.dequantize(torch.float64).T
        for od in (torch.float32, torch.bfloat16):
            out = k.fp8_gemm(aq, as_, qw.values, qw.scale_inv, activation=ident, quant_out=False, out_dtype=od)
            out2 = k.fp8_gemm(aq, as_, qw.values, qw.scale_inv, activation=ident, quant_out=False, out_dtype=od)
            print(m, d, h, name, od, "rel", rel(out, ref), "again", rel(out2, ref))
        wt = T._transposed(fp8.quantize_weight(w.t().contiguous()))
        out = k.fp8_gemm(aq, as_, *wt, activation=ident, quant_out=False, out_dtype=torch.float32)
        ref2 = deq(aq, as_) @ fp8.quantize_weight(w.t().contiguous()).dequantize(torch.float64).T.T
        print("   via _transposed", rel(out, ref2))
    # w_rows
    a = torch.randn(d, m, device=dev); b = torch.randn(h, m, device=dev)
    aq, as_ = T._along_tokens(a.t()); bq, bs = T._along_tokens(b.t())
    out = k.fp8_gemm(aq, as_, bq, bs, activation=ident, quant_out=False, out_dtype=torch.float32, w_rows=True)
    print("   w_rows", rel(out, deq(aq, as_) @ deq(bq, bs).T))
    # full train vs reference
    ws = [t.clone().requires_grad_() for t in (wg, wu, wd)]; xx = x.clone().requires_grad_()
    y = T.fp8_gated_mlp_train(xx, *ws, activation="silu", backend="triton")
    g = torch.autograd.grad(y, [xx, *ws], dy)
    ws2 = [t.clone().requires_grad_() for t in (wg, wu, wd)]; xx2 = x.clone().requires_grad_()
    y2 = reference.gated_mlp_fp8_train(xx2, *ws2, "silu")
    g2 = torch.autograd.grad(y2, [xx2, *ws2], dy)
    print("   train y", rel(y, y2), "grads", [round(rel(a, b), 5) for a, b in zip(g, g2)])
    with torch.no_grad():
        xq, xs = k.quantize(x)
        qg, qu, qd = (fp8.quantize_weight(w) for w in (wg, wu, wd))
        outs = k.fp8_gemm(xq, xs, qg.values, qg.scale_inv, qu.values, qu.scale_inv, activation=activations.get("silu").id, quant_out=True, save_gu=True)
        gref = deq(xq, xs) @ qg.dequantize(torch.float64).T
        print("   save_gu g", rel(deq(outs[2], outs[3]), gref))
