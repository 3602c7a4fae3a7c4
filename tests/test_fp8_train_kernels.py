"""FP8 training on mlpfuse's kernels (ops/fp8_train.py) and the two kernel features it adds (kernels/fp8_gemm.py):
the gated GEMM's epilogue writing g and u in e4m3 (save_gu), and its output stored transposed (out_transposed, the
down weight's gradient). Oracles: float64 products of the same quantized operands, float64 autograd
of the MLP, and the recipe's reference path (reference.gated_mlp_fp8_train). On the CPU through Triton's
interpreter (fp32 inputs: its bf16 dot is wrong), on a GPU as they are."""

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TRITON
from mlpfuse import activations, fp8, reference
from test_fp8_kernels import ACC, DEVICE, SUB, U, _k, _same_bits_or_both_nan

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def _rand(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def test_the_gated_epilogue_writes_g_and_u_each_within_one_rounding():
    """g = x·Wgᵀ + bg and u = x·Wuᵀ + bu from the epilogue (1×128, partial last group) against float64 sums of the
    same quantized operands: each scale amax/448 up to the fp32 sums' rounding, each value one e4m3 rounding; h is
    what the call without save_gu returns, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    kern = _k()
    x = _rand(gen, 33, 300)
    wg, wu = (fp8.quantize_weight(_rand(gen, 260, 300, scale=300**-0.5)) for _ in range(2))
    bg, bu = _rand(gen, 260, scale=0.1), _rand(gen, 260, scale=0.1)
    xq, xs = kern.quantize(x)
    silu = activations.get("silu").id
    hq, hs, gq, gs, uq, us = kern.fp8_gemm(xq, xs, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu,
                                           activation=silu, quant_out=True, save_gu=True)
    hq2, hs2 = kern.fp8_gemm(xq, xs, wg.values, wg.scale_inv, wu.values, wu.scale_inv, bg, bu, activation=silu,
                             quant_out=True)
    assert torch.equal(hq.view(torch.uint8), hq2.view(torch.uint8)) and torch.equal(hs, hs2)
    xd = fp8.dequantize_activation(xq, xs, torch.float64)
    for q, s, w, b in ((gq, gs, wg, bg), (uq, us, wu, bu)):
        w64 = w.dequantize(torch.float64)
        ref = xd @ w64.T + b.double()
        slack = (ACC or 310 * 2.0**-24) * (xd.abs() @ w64.abs().T + b.double().abs())
        amax = F.pad(ref.abs(), (0, -ref.shape[1] % 128)).unflatten(1, (-1, 128)).amax(-1)
        room = F.pad(slack, (0, -ref.shape[1] % 128)).unflatten(1, (-1, 128)).amax(-1)
        assert q.dtype == fp8.DTYPE and q.shape == ref.shape and s.shape == amax.shape
        assert bool(((s.double() - amax / 448).abs() <= (amax * 2.0**-23 + room) / 448 + 1e-300).all())
        got = fp8.dequantize_activation(q, s, torch.float64)
        sc = s.double().repeat_interleave(128, 1)[:, :ref.shape[1]]
        assert bool(((got - ref).abs() <= U * ref.abs() + SUB * sc + slack * (1 + U)).all())


@pytest.mark.parametrize("act,m,n", [("silu", 200, 300), ("gelu_tanh", 130, 128), ("relu", 64, 260), ("silu", 70, 256)])
def test_the_quantized_glu_backward_is_the_unfused_one_bit_for_bit(act, m, n):
    """fp8_glu_backward: dg and du written quantized along the channels and dgᵀ, duᵀ, hᵀ along the tokens,
    against glu_backward_split's fp32 dg, du, h quantized by fp8_gemm.quantize (the views transposed for the token
    groups): the same e4m3 bits and scales, partial tiles both ways; a NaN in dh reaches its row's and column's
    groups and no other; the bias parts sum to the columns of dg and du. With N whole blocks, dg and du written side
    by side into one operand (`joined`) are the same bits."""
    from mlpfuse.kernels import glu_backward

    gen = torch.Generator().manual_seed(9)
    kern = _k()
    dh = _rand(gen, m, n)
    dh[5, 7] = float("nan")
    gq, gs = kern.quantize(_rand(gen, m, n, scale=2.0))
    uq, us = kern.quantize(_rand(gen, m, n))
    a_id = activations.get(act).id
    dg, du, dg_t, du_t, h_t, dbg, dbu = glu_backward.fp8_glu_backward(dh, gq, gs, uq, us, activation=a_id,
                                                                      bias_sums=True)
    dg32, du32, h32 = glu_backward.glu_backward_split(dh, gq, uq, activation=a_id, want_h=True, g_scale=gs,
                                                      u_scale=us)[:3]

    def same(got, want):
        return (torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                and torch.equal(torch.nan_to_num(got[1], 7.0), torch.nan_to_num(want[1], 7.0)))

    assert same(dg, kern.quantize(dg32)) and same(du, kern.quantize(du32))
    assert same(dg_t, kern.quantize(dg32.t())) and same(du_t, kern.quantize(du32.t()))
    assert same(h_t, kern.quantize(h32.t()))
    assert bool(dg[1][5].isnan()[0]) and int(dg[1].isnan().sum()) == 1  # row 5's first channel group only
    assert bool(dg_t[1][7].isnan()[0]) and int(dg_t[1].isnan().sum()) == 1  # channel 7's first token group only
    finite = torch.ones(n, dtype=torch.bool, device=dh.device)
    finite[7] = False
    assert torch.allclose(dbg[finite].double(), dg32[:, finite].double().sum(0), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dbu[finite].double(), du32[:, finite].double().sum(0), rtol=1e-5, atol=1e-5)
    assert bool(dbg[7].isnan()) and bool(dbu[7].isnan())
    if n % 128 == 0:
        both = (torch.empty(m, 2 * n, device=dh.device, dtype=fp8.DTYPE),
                torch.empty(m, 2 * n // 128, device=dh.device, dtype=torch.float32))
        got = glu_backward.fp8_glu_backward(dh, gq, gs, uq, us, activation=a_id, joined=both)
        assert same((both[0][:, :n], both[1][:, :n // 128]), dg) and same((both[0][:, n:], both[1][:, n // 128:]), du)
        assert all(same(a, b) for a, b in zip(got[2:5], (dg_t, du_t, h_t)))
    else:
        with pytest.raises(Exception, match="joined: expected"):
            glu_backward.fp8_glu_backward(dh, gq, gs, uq, us, activation=a_id, joined=(dh, dh))


_GLU_COMPILE = r"""
from mlpfuse.kernels import glu_backward as G

m, n = 4096, 14336
f8 = torch.float8_e4m3fn
dh, g, s = torch.empty(m, n), torch.empty(m, n, dtype=f8), torch.empty(m, n // 128)
t, ts, sums = torch.empty(n, m, dtype=f8), torch.empty(n, m // 128), torch.empty(2, m // 128, n)
out = []
for along in (False, True):
    bm, bn = (128, G._FP8_NARROW) if along else (G._FP8_NARROW, 128)
    so, sos = (m, m // 128) if along else (n, n // 128)
    args = dict(dh=dh, gq=g, gs=s, uq=g, us=s, o1=t, s1=ts, o2=t, s2=ts, o3=t, s3=ts, sums=sums, M=m, N=n, s_dh=n,
                s_g=n, s_gs=n // 128, s_o=so, s_os=sos)
    for act in (1, 2, 3):
        r = compile_sm90(G.mlpfuse_fp8_glu_backward_kernel, args, dict(ACT=act, ALONG_TOKENS=along, SUMS=along, BM=bm,
                         BN=bn, EMULATE=False, I64=False), num_warps=4, num_stages=1)
        out.append(dict(along=along, act=act, spills=r["spills"], regs=r["regs"]))
print(json.dumps(out))
"""


def test_the_quantized_glu_backward_compiles_for_hopper_without_spilling():
    """Both passes, as launched, for sm_90a (tests/sm90_compile.py): a one-pass [128, 128] form spilled 9–20 KB a
    thread through its divisions' calls; a spill would come back as local-memory traffic on every element."""
    import sm90_compile

    for r in sm90_compile.run(_GLU_COMPILE):
        assert r["spills"] == 0, r


@pytest.mark.parametrize("m", [40] + ([1100] if DEVICE == "cuda" else []))
def test_a_transposed_output_is_the_dequantized_product_stored_transposed(m):
    """out_transposed: the epilogue stores zᵀ [N, M] (the down weight's gradient comes out so): against the float64
    product of the dequantized operands (a 1×128 along K, w in 128×128 blocks), K not a multiple of 128, rows of
    very different scales; bit for bit the row-major call's output transposed. On a GPU also past WS_MIN_ROWS (the
    warp-specialized kernel on Hopper)."""
    gen = torch.Generator().manual_seed(6)
    kern = _k()
    a = _rand(gen, m, 330) * torch.logspace(-6, 6, m, device=DEVICE)[:, None]
    w = fp8.quantize_weight(_rand(gen, 200, 330))
    aq, as_ = kern.quantize(a)
    kw = dict(activation=activations.IDENTITY, quant_out=False, out_dtype=torch.float32)
    out_t = kern.fp8_gemm(aq, as_, w.values, w.scale_inv, out_transposed=True, **kw)
    assert out_t.shape == (200, m) and out_t.is_contiguous()
    ad = fp8.dequantize_activation(aq, as_, torch.float64)
    wd = w.dequantize(torch.float64)
    ref = ad @ wd.T
    bound = (ACC or 340 * 2.0**-24) * (ad.abs() @ wd.abs().T) + 2.0**-24 * ref.abs()
    assert bool(((out_t.t().double() - ref).abs() <= bound).all())
    assert torch.equal(out_t.t(), kern.fp8_gemm(aq, as_, w.values, w.scale_inv, **kw))
    with pytest.raises(Exception, match="out_transposed: needs quant_out=False"):
        kern.fp8_gemm(aq, as_, w.values, w.scale_inv, activation=activations.IDENTITY, quant_out=True,
                      out_transposed=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantizing_a_transposed_view_is_the_recipe_on_its_copy(dtype):
    """quantize(t.t()) (the weight gradients' operands, grouped along the tokens) reads the view as it is: bit for
    bit fp8.quantize_activation of the contiguous copy, with NaN, zero and partial groups; a strided slice too."""
    gen = torch.Generator().manual_seed(8)
    # token counts (the views' K) from one scale group to several, in that order: on a GPU each launch's compiled
    # form is cached by a key that must tell their scale strides apart (1 against 2 and 3)
    for tokens in (70, 96, 256, 300):
        t = torch.randn(tokens, 70, generator=gen) * 2.0 ** torch.randint(-10, 10, (tokens, 1), generator=gen)
        t[5, 3] = float("nan")
        t[:, 9] = 0
        t = t.to(DEVICE, dtype)
        for view in (t.t(), t[::2, 1::3].t()):
            q, s = _k().quantize(view)
            rq, rs = fp8.quantize_activation(view.contiguous())
            assert q.is_contiguous() and torch.equal(s.nan_to_num(7.0), rs.nan_to_num(7.0)), tokens
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_quantizing_a_weight_in_one_pass_is_the_recipe_and_its_transpose_too(dtype):
    """kernels.fp8_gemm.quantize_weight: bit for bit fp8.quantize_weight's values and 128×128 scales (partial blocks,
    a NaN block, a zero block, rows of very different scales), in W's layout and in Wᵀ's (the backward's operand);
    a transposed view as input reads it as it is."""
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(300, 260, generator=gen) * 2.0 ** torch.randint(-8, 8, (300, 1), generator=gen)
    w[5, 7] = float("nan")
    w[130:256, 128:256] = 0
    w = w.to(DEVICE, dtype)
    for src, transposed in ((w, False), (w, True), (w.t(), False)):
        q, s = _k().quantize_weight(src, transposed=transposed)
        ref = fp8.quantize_weight(src.contiguous())
        rv, rs = (ref.values.t().contiguous(), ref.scale_inv.t().contiguous()) if transposed else \
            (ref.values, ref.scale_inv)
        assert q.is_contiguous() and torch.equal(q.view(torch.uint8), rv.view(torch.uint8))
        assert torch.equal(s.nan_to_num(7.0), rs.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_quantizing_per_channel_is_the_recipe(dtype):
    """kernels.fp8_gemm.quantize_channels: bit for bit fp8.quantize_channels — values transposed and one scale per
    column over all the rows — with a NaN column, a zero column, partial blocks and a transposed view as input."""
    gen = torch.Generator().manual_seed(14)
    t = torch.randn(300, 260, generator=gen) * 2.0 ** torch.randint(-8, 8, (1, 260), generator=gen)
    t[5, 7] = float("nan")
    t[:, 9] = 0
    t = t.to(DEVICE, dtype)
    for src in (t, t[:, 1:200].t()):
        q, s = _k().quantize_channels(src)
        rq, rs = fp8.quantize_channels(src)
        assert q.shape == src.shape[::-1] and q.is_contiguous()
        assert torch.equal(s.nan_to_num(7.0), rs.nan_to_num(7.0))
        nan = s.isnan().nonzero().flatten().tolist()  # the NaN's channel, and only it, all NaN
        assert len(nan) == 1 and bool(q[nan[0]].float().isnan().all()) and int(q.float().isnan().sum()) == q.shape[1]
        assert _same_bits_or_both_nan(q, rq)


def test_quantizing_into_the_halves_of_one_operand_is_quantizing_each_weight():
    """quantize_weight(out=...): Wgᵀ and Wuᵀ written side by side into one [D, 2H] operand and its scales (what the
    backward's one dx GEMM reads) are each weight's own bits; a wrong shape is one error."""
    gen = torch.Generator().manual_seed(13)
    kern = _k()
    wg, wu = _rand(gen, 256, 200), _rand(gen, 256, 200, scale=3.0)
    q = torch.empty(200, 512, device=DEVICE, dtype=fp8.DTYPE)
    s = torch.empty(2, 4, device=DEVICE, dtype=torch.float32)
    for half, w in enumerate((wg, wu)):
        kern.quantize_weight(w, transposed=True, out=(q[:, 256 * half:256 * (half + 1)], s[:, 2 * half:2 * half + 2]))
    for half, w in enumerate((wg, wu)):
        rq, rs = kern.quantize_weight(w, transposed=True)
        assert torch.equal(q[:, 256 * half:256 * (half + 1)].view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s[:, 2 * half:2 * half + 2], rs)
    with pytest.raises(Exception, match="out: expected"):
        kern.quantize_weight(wg, transposed=True, out=(q, s))


def test_save_gu_needs_a_gated_quantized_call():
    gen = torch.Generator().manual_seed(7)
    kern = _k()
    xq, xs = kern.quantize(_rand(gen, 8, 128))
    w = fp8.quantize_weight(_rand(gen, 128, 128))
    with pytest.raises(Exception, match="save_gu: needs a gated call"):
        kern.fp8_gemm(xq, xs, w.values, w.scale_inv, activation=activations.IDENTITY, quant_out=True, save_gu=True)


def _case(seed, m=96, d=256, h=384, bias=True):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return _rand(gen, *shape, scale=scale).requires_grad_()

    x = r(m, d)
    ws = [r(h, d, scale=d**-0.5), r(h, d, scale=d**-0.5), r(d, h, scale=h**-0.5)]
    bs = [r(h, scale=0.1), r(h, scale=0.1), r(d, scale=0.1)] if bias else [None] * 3
    return x, ws, bs, _rand(gen, m, d)


def _grads(fn, x, ws, bs, dy):
    inputs = [x, *ws, *[b for b in bs if b is not None]]
    y = fn(x, *ws, *bs)
    return y, torch.autograd.grad(y, inputs, dy)


def _train(act):
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    return lambda x, wg, wu, wd, bg, bu, bd: fp8_gated_mlp_train(x, wg, wu, wd, bg, bu, bd, act, backend="triton")


@pytest.mark.parametrize("act,bias,h", [("silu", True, 384), ("gelu_tanh", False, 384), ("silu", False, 320)])
def test_fp8_training_on_the_kernels_is_the_recipe(act, bias, h):
    """Forward and every gradient against float64 autograd (the training target: cosine ≥ 0.99, a few e4m3
    roundings norm-wise, as the reference path) and against the reference path itself: the same roundings, so the
    two differ only where an fp32 sum in another order rounds across an e4m3 boundary — far less than FP8's own
    error (a backward in another precision or recipe would differ by about that error). H = 384: dx as one GEMM over
    [dg | du]; H = 320 (not whole blocks): two GEMMs added."""
    x, ws, bs, dy = _case(1, bias=bias, h=h)
    y, grads = _grads(_train(act), x, ws, bs, dy)
    yr, grads_r = _grads(lambda x, *p: reference.gated_mlp_fp8_train(x, *p[:3], act, *p[3:]), x, ws, bs, dy)
    y64, grads64 = _grads(lambda x, *p: reference.gated_mlp(x, *p[:3], act, *p[3:]), x, ws, bs, dy.double())
    names = ["x", "gate", "up", "down", "gate bias", "up bias", "down bias"]
    for name, g, gr, g64 in zip(names, grads, grads_r, grads64):
        assert g.dtype == gr.dtype and g.shape == gr.shape
        cos = float(F.cosine_similarity(g.double().flatten(), g64.flatten(), dim=0))
        rel = float((g.double() - g64).norm() / g64.norm())
        rel_ref = float((g.double() - gr.double()).norm() / gr.double().norm())
        assert cos >= 0.99, (name, cos)
        assert rel < 4 * U, (name, rel)
        assert rel_ref < U / 4, (name, rel_ref, rel)
    assert float((y.detach().double() - y64.detach()).norm() / y64.detach().norm()) < 2 * U
    assert float((y.detach() - yr.detach()).norm() / yr.detach().norm()) < U / 4


def test_fp8_training_keeps_x_g_and_u_in_e4m3_for_the_backward():
    """What the step keeps (saved-tensor hooks): x, g and u in e4m3 with their fp32 1×128 scales, and the master
    weights (references to the parameters, not copies): no weight-sized FP8 tensor, no [tokens, hidden] tensor in a
    16-bit or 32-bit dtype."""
    x, ws, bs, _ = _case(2)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _train("silu")(x, *ws, *bs)
    m, d, h = x.shape[0], x.shape[1], ws[0].shape[0]
    acts = sorted((tuple(t.shape), t.dtype) for t in kept if t.shape[0] == m)
    assert acts == sorted([((m, d), fp8.DTYPE), ((m, d // 128), torch.float32), ((m, h), fp8.DTYPE),
                           ((m, h // 128), torch.float32), ((m, h), fp8.DTYPE), ((m, h // 128), torch.float32)])
    weights = [t for t in kept if t.shape[0] != m]
    assert len(weights) == 3 and {t.data_ptr() for t in weights} == {w.data_ptr() for w in ws}


def test_nan_in_the_output_gradient_reaches_the_gradients():
    """A NaN in dy is not zeroed on its way (scales propagate NaN by the recipe's rule): dx's row and every weight
    gradient that sums over that token see it."""
    x, ws, bs, dy = _case(3, m=32, d=128, h=256, bias=False)
    dy[4, 7] = float("nan")
    _, (dx, dwg, dwu, dwd) = _grads(_train("silu"), x, ws, bs, dy)
    assert bool(dx[4].isnan().any()) and not bool(dx[torch.arange(32) != 4].isnan().any())
    assert bool(dwd.isnan().any()) and bool(dwg.isnan().any()) and bool(dwu.isnan().any())


def test_patch_on_a_model_in_train_mode_trains_its_mlps_in_fp8_on_their_own_weights():
    """patch(precision="fp8") on a Llama in train mode: each MLP checked on numbers and kept on its parameters (the
    same objects: the optimizer's masters; state_dict unchanged), its steps in FP8 — the loss within FP8's error of the
    unpatched model's, every MLP gradient aligned with it (cosine ≥ 0.99) but not equal (FP8 is really on); the other
    parameters' gradients flow as before; unpatch gives the untouched modules back."""
    import copy

    transformers = pytest.importorskip("transformers")
    import mlpfuse

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300)
    model = transformers.LlamaForCausalLM(cfg).to(DEVICE).train()
    ref = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    report = mlpfuse.patch(model, precision="fp8", backend="triton")  # the kernels (on a CPU: the interpreter)
    assert [s.precision for s in report.swapped] == ["fp8-train", "fp8-train"]
    assert all(0 < s.fp8_error < 2 * U for s in report.swapped) and "2 in fp8" in report.summary()
    assert "precision=fp8 (training)" in repr(model.model.layers[0].mlp)
    # the report says where the handed-over norm and residual add run: outside any kernel, in the block's forward
    assert len(report.residuals) == 2 and all("FP8 training" in r.by for r in report.residuals)
    assert sum("FP8 training" in n.by for n in report.norms) == 2
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref = ref(input_ids=ids, labels=ids).loss
    loss_ref.backward()
    assert abs(float(loss.detach()) - float(loss_ref.detach())) < 1e-2 * float(loss_ref.detach())
    ref_params = dict(ref.named_parameters())
    for name, p in params.items():
        g, g_ref = p.grad.double().flatten(), ref_params[name].grad.double().flatten()
        cos = float(F.cosine_similarity(g, g_ref, dim=0))
        assert cos >= 0.99, (name, cos)
        if ".mlp." in name:
            assert not torch.equal(g, g_ref), name
    mlpfuse.unpatch(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "LlamaMLP" and mlp.gate_proj.weight is params["model.layers.0.mlp.gate_proj.weight"]


def test_fp8_training_takes_the_reference_path_where_the_backend_says_torch():
    """backend="torch" (what auto takes on a CPU) trains on the recipe's reference path: the same numbers as
    reference.gated_mlp_fp8_train, bit for bit."""
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    x, ws, bs, dy = _case(4, m=40, d=128, h=256)
    y, grads = _grads(lambda x, *p: fp8_gated_mlp_train(x, *p[:3], *p[3:], "silu", backend="torch"), x, ws, bs, dy)
    yr, grads_r = _grads(lambda x, *p: reference.gated_mlp_fp8_train(x, *p[:3], "silu", *p[3:]), x, ws, bs, dy)
    assert torch.equal(y, yr) and all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def test_fp8_training_compiles_whole_to_the_same_numbers():
    """torch.compile(fullgraph=True) over a step that calls it (aot_eager: the graph AOTAutograd records, the same
    ops run): two custom-op nodes, no graph break, output and every gradient bit for bit the eager step's."""
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    x, ws, bs, dy = _case(5, m=64, d=128, h=256)

    def step(x, *p):
        return fp8_gated_mlp_train(x * 1.0, *p[:3], *p[3:], "gelu_tanh", backend="triton")

    y, grads = _grads(step, x, ws, bs, dy)
    torch._dynamo.reset()
    yc, grads_c = _grads(torch.compile(step, backend="aot_eager", fullgraph=True), x, ws, bs, dy)
    assert torch.equal(y, yc) and all(torch.equal(a, b) for a, b in zip(grads, grads_c))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_fp8_training_under_activation_checkpointing_is_the_same_step(backend, reentrant):
    """torch.utils.checkpoint around the FP8 block (the kernels, and the reference path a CPU takes): the
    recomputed forward is the same quantized forward, so output and every gradient equal the plain step's."""
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    x, ws, bs, dy = _case(6, m=64, d=128, h=256)

    def fn(*a):
        return fp8_gated_mlp_train(*a[:4], *a[4:], activation="silu", backend=backend)

    def step(f):  # .backward(), as a reentrant checkpoint needs (it refuses autograd.grad)
        inputs = [x, *ws, *[b for b in bs if b is not None]]
        for t in inputs:
            t.grad = None
        y = f(x, *ws, *bs)
        y.backward(dy)
        return [y.detach(), *(t.grad for t in inputs)]

    plain = step(fn)
    ckpt = step(lambda *a: torch.utils.checkpoint.checkpoint(fn, *a, use_reentrant=reentrant))
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp8_training_under_autocast_is_the_fp8_step_unchanged(backend):
    """Under torch.autocast (bf16) with fp32 master weights the FP8 block computes its own recipe, not autocast's
    bf16 GEMMs: output and gradients equal the step outside autocast bit for bit, in the inputs' and weights' dtypes
    (the optimizer's masters keep fp32 gradients)."""
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    x, ws, bs, dy = _case(7, m=64, d=128, h=256)

    def fn(*a):
        return fp8_gated_mlp_train(*a[:4], *a[4:], activation="silu", backend=backend)

    plain = _grads(fn, x, ws, bs, dy)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        auto = _grads(fn, x, ws, bs, dy)
    assert auto[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in auto[1])
    for a, b in zip([plain[0], *plain[1]], [auto[0], *auto[1]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_gated_mlp_built_for_fp8_training_trains_its_own_weights_in_fp8(backend):
    """GatedMLP(precision="fp8-train"): its nn.Linear weights stay the optimizer's masters (state_dict unchanged,
    parameters in their dtype), its forward and backward are ops.fp8_train's — bit for bit the functional call on
    the same weights; an optimizer step moves them; to_fp8() then makes the inference module; misuse is one line."""
    from mlpfuse.modules import GatedMLP
    from mlpfuse.ops.fp8_train import fp8_gated_mlp_train

    torch.manual_seed(8)
    m = GatedMLP(128, 256, "silu", bias=True, device=DEVICE, precision="fp8-train", backend=backend)
    assert "precision=fp8-train" in repr(m)
    assert set(m.state_dict()) == {f"{p}.{t}" for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in m.parameters())
    x = torch.randn(64, 128, device=DEVICE, requires_grad=True)
    dy = torch.randn(64, 128, device=DEVICE)
    y = m(x)
    y.backward(dy)
    grads = [x.grad, *(p.grad for p in m.parameters())]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    x2 = x.detach().clone().requires_grad_()
    wg, bg, wu, bu, wd, bd = params
    y2 = fp8_gated_mlp_train(x2, wg, wu, wd, bg, bu, bd, "silu", backend=backend)
    y2.backward(dy)
    assert torch.equal(y, y2)
    for a, b in zip(grads, [x2.grad, *(p.grad for p in params)]):
        assert torch.equal(a, b)
    before = m.gate_proj.weight.detach().clone()
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert not torch.equal(before, m.gate_proj.weight)
    m.to_fp8()
    assert m.precision == "fp8" and m.gate_proj.weight.dtype == fp8.DTYPE
    for bad, match in ((dict(save="fp8"), "keeps g and u in FP8 already"),
                       (dict(recompute=True), "'fp8-train' keeps x, g and u"),
                       (dict(precision="fp4"), "'fp8' or 'fp8-train'")):
        kw = dict(precision="fp8-train") | bad
        with pytest.raises(Exception, match=match):
            GatedMLP(128, 256, "silu", **kw)
