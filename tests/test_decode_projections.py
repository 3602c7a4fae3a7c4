"""The decode projections (kernels/decode_linear.py, ops/projections.py) and the attention rewrite that uses them
(mlpfuse.patching.attention). Oracles: float64 products of the same operands; the model's own modules (unpatched
twin, its norm's own forward). On the CPU the kernel runs through Triton's interpreter (fp32 and fp16: its bf16 dot
is wrong), on a GPU in bf16 too."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse.errors import InputError

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def _kernel():
    from mlpfuse.kernels import decode_linear

    return decode_linear


def _reference(x, ws, bs, norm_weight, eps, kind, residual):
    """float64: the RMSNorm's formula (no rounding), each product, and |terms| sums for the rounding bound."""
    xd = x.double()
    if kind:
        r = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        xd = xd * r * (norm_weight.double() if kind == 1 else 1 + norm_weight.double())
    outs, sizes = [], []
    for i, (w, b) in enumerate(zip(ws, bs)):
        o = xd @ w.double().T + (0 if b is None else b.double())
        s = xd.abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        if residual is not None and i == 0:
            o, s = o + residual.double(), s + residual.double().abs()
        outs.append(o)
        sizes.append(s)
    return outs, sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts,kind,bias,m", [(3, 1, False, 1), (3, 2, True, 5), (2, 0, True, 16), (1, 0, False, 3),
                                               (3, 0, False, 16), (1, 1, True, 2)])
def test_each_projection_is_the_float64_product_within_the_dtypes_roundings(dtype, parts, kind, bias, m):
    """Every output element against float64 (the norm's exact formula, K not a multiple of the K step, row counts
    not multiples of the row tile, weights of different heights): within the roundings of x·w to the dtype (the
    norm's), the products' fp32 sums and the output's one rounding."""
    gen = torch.Generator().manual_seed(parts * 10 + kind + m)
    k = 200
    heights = [72, 40, 24][:parts]
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, dtype)
    ws = [(torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype) for n in heights]
    bs = [(torch.randn(n, generator=gen) * 0.1).to(DEVICE, dtype) if bias else None for n in heights]
    nw = (1 + torch.randn(k, generator=gen) / 4).to(DEVICE, dtype) if kind else None
    res = torch.randn(m, heights[0], generator=gen).to(DEVICE, dtype) if parts == 1 else None
    outs = _kernel().decode_linear(x, ws, bs, norm_weight=nw, norm_eps=1e-5, norm_kind=kind, residual=res)
    want, sizes = _reference(x, ws, bs, nw, 1e-5, kind, res)
    eps = torch.finfo(dtype).eps
    for o, w, s in zip(outs, want, sizes):
        assert o.dtype == dtype and o.shape == w.shape and o.is_contiguous()
        # x·w rounded once to the dtype (norm) and the MMA's operands; fp32 sums (tf32 for fp32 on a GPU)
        slack = (2 * eps if kind else 0) + (2**-10 if dtype == torch.float32 and HAS_CUDA else 2**-20)
        assert bool(((o.double() - w).abs() <= slack * s * 2 + eps * w.abs() + 1e-6).all())


def test_a_repeated_layout_computes_each_calls_own_input():
    """Calls repeating a layout (on a GPU the compiled kernel kept from the first, launched directly) give each
    call's own product: new x, new residual, a norm weight changed in place."""
    gen = torch.Generator().manual_seed(9)
    ws = [(torch.randn(n, 96, generator=gen) / 10).to(DEVICE) for n in (48, 16)]
    nw = torch.ones(96, device=DEVICE)
    for i in range(3):
        x = torch.randn(2, 96, generator=gen).to(DEVICE)
        nw.mul_(1.5)
        outs = _kernel().decode_linear(x, ws, norm_weight=nw, norm_eps=1e-6, norm_kind=1)
        want, sizes = _reference(x, ws, [None, None], nw, 1e-6, 1, None)
        for o, w, s_ in zip(outs, want, sizes):
            assert bool(((o.double() - w).abs() <= 1e-3 * s_ + 1e-6).all()), i
        res = torch.randn(2, 48, generator=gen).to(DEVICE)
        (o,) = _kernel().decode_linear(x, ws[:1], residual=res)
        want, sizes = _reference(x, ws[:1], [None], None, 0.0, 0, res)
        assert bool(((o.double() - want[0]).abs() <= 1e-3 * sizes[0] + 1e-6).all()), i


def test_rows_past_a_nan_stay_their_own_and_empty_calls_return_empty():
    """A NaN in one row of x reaches that row's outputs only (the norm's sum of squares is per row); no rows, or no
    K, gives the biases (plus the residual)."""
    k = _kernel()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen).to(DEVICE)
    x[2, 5] = float("nan")
    ws = [torch.randn(32, 64, generator=gen).to(DEVICE), torch.randn(16, 64, generator=gen).to(DEVICE)]
    nw = torch.ones(64, device=DEVICE)
    for o in k.decode_linear(x, ws, norm_weight=nw, norm_eps=1e-6, norm_kind=1):
        assert bool(o[2].isnan().all()) and not bool(o[[0, 1, 3]].isnan().any())
    assert k.decode_linear(x[:0], ws)[0].shape == (0, 32)
    b = torch.randn(8, generator=gen).to(DEVICE)
    res = torch.randn(3, 8, generator=gen).to(DEVICE)
    (o,) = k.decode_linear(torch.empty(3, 0, device=DEVICE), [torch.empty(8, 0, device=DEVICE)], [b], residual=res)
    assert torch.equal(o, b + res)


@pytest.mark.parametrize("call,match", [
    (lambda k, x, w: k.decode_linear(x.repeat(20, 1), [w]), "at most 16 rows"),
    (lambda k, x, w: k.decode_linear(x, [w, w, w, w]), "1 to 3 weights"),
    (lambda k, x, w: k.decode_linear(x, [w.half()]), r"weights\[0\]"),
    (lambda k, x, w: k.decode_linear(x, [w, w[:, :32]]), r"weights\[1\]"),
    (lambda k, x, w: k.decode_linear(x, [w, w], [w[0], None]), "every weight or for none"),
    (lambda k, x, w: k.decode_linear(x, [w, w], residual=x), "one weight only"),
    (lambda k, x, w: k.decode_linear(x, [w], residual=x[:, :8]), "residual"),
    (lambda k, x, w: k.decode_linear(x, [w], norm_weight=x[0, :8], norm_eps=1e-6, norm_kind=1), "norm_weight"),
    (lambda k, x, w: k.decode_linear(x.t(), [w]), "x:"),
])
def test_bad_input_is_one_clear_error(call, match):
    x = torch.randn(2, 64, device=DEVICE)
    w = torch.randn(16, 64, device=DEVICE)
    with pytest.raises(InputError, match=match):
        call(_kernel(), x, w)


# ---------------------------------------------------------------------------------------------------------------
# The attention rewrite.

def _llama(layers=2, **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300, **kw)
    return transformers.LlamaForCausalLM(cfg).to(DEVICE).eval()


def _decode_logits(model, ids, steps=2):
    """Greedy tokens and each step's last logits: a prompt then `steps` single-token calls on the model's cache."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits = [out.logits[:, -1]]
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


def test_patch_fuses_a_llamas_attention_projections_and_its_input_norm():
    """patch(model): each attention computes q, k, v in one call that applies the input RMSNorm (its module passes
    its input through), o_proj on the decode kernel; the decode logits equal the unpatched twin's within a few
    roundings; parameters and state_dict keys unchanged; unpatch gives every class back."""
    import mlpfuse

    model = _llama()
    twin = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    report = mlpfuse.patch(model, backend="triton")
    attn = model.model.layers[0].self_attn
    assert [p.path for p in report.projections] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert {p.names for p in report.projections} == {"q_proj+k_proj+v_proj"} and report.projections[0].outputs == "o_proj"
    assert {n.path for n in report.norms} >= {f"model.layers.{i}.input_layernorm" for i in range(2)}
    assert "q_proj+k_proj+v_proj in one decode call" in report.summary()
    assert type(attn).__name__ == "LlamaAttention" and hasattr(type(attn), "_mlpfuse_projections")
    assert model.state_dict().keys() == twin.state_dict().keys()
    assert all(p is params[n] for n, p in model.named_parameters())
    again = mlpfuse.patch(model, backend="triton")  # a second call changes nothing
    assert not again.projections and not again.norms and type(model.model.layers[0].self_attn) is type(attn)
    ids = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got, want = _decode_logits(model, ids), _decode_logits(twin, ids)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # the norm's module passes its input through; the projections apply it
    x = torch.randn(1, 1, 256, device=DEVICE)
    norm = model.model.layers[0].input_layernorm
    assert torch.equal(norm(x), x)
    restored = mlpfuse.unpatch(model)
    assert restored and type(attn) is type(twin.model.layers[0].self_attn)
    assert type(attn.o_proj) is nn.Linear and type(norm) is type(twin.model.layers[0].input_layernorm)
    assert torch.allclose(_decode_logits(model, ids), want, rtol=0, atol=1e-6)


def test_deepcopy_and_torch_save_keep_the_rewrite_on_the_copys_own_modules():
    """A deep copy and a torch.save round trip of a patched model: the same rewritten classes, the copy's handed-over
    norm its own module, the same logits; unpatch on the copy restores its classes."""
    import io

    import mlpfuse

    model = _llama(layers=1)
    mlpfuse.patch(model, backend="triton")
    ids = torch.randint(0, 300, (1, 4), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = _decode_logits(model, ids, steps=1)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        layer = other.model.layers[0]
        assert type(layer.self_attn) is type(model.model.layers[0].self_attn)
        assert layer.self_attn.__dict__["_mlpfuse_projections_state"].norm.module is layer.input_layernorm
        got = _decode_logits(other, ids, steps=1)  # the MLP's decode kernels sum with atomics on a GPU
        assert float((got - want).norm() / want.norm()) < 1e-5
        mlpfuse.unpatch(other)
        assert not hasattr(type(layer.self_attn), "_mlpfuse_projections") and type(layer.self_attn.o_proj) is nn.Linear


@pytest.mark.parametrize("family,norm_hand_over", [("qwen3", True), ("gemma2", True), ("mistral", True),
                                                    ("olmo2", False), ("phi3", None)])
def test_families_get_q_k_v_in_source_order_with_equal_outputs(family, norm_hand_over):
    """Qwen3 (q and k inside their own norms), Gemma 2 (Gemma's norm convention), Mistral: q, k, v in one call in
    source order, the input norm handed over (perturbed norm weights, so a norm skipped or applied twice shows);
    OLMo 2 normalises q and k after their projections and its layer norms after the attention: projections fused,
    no input norm to hand; Phi-3's one qkv_proj: nothing to group. Prefill and decode logits as the unpatched twin's."""
    import mlpfuse
    from hf_models import prefill_and_step, tiny_decoder

    pytest.importorskip("transformers")
    model = tiny_decoder(family, DEVICE, perturb_norms=True)
    twin = copy.deepcopy(model)
    report = mlpfuse.patch(model, backend="triton")
    attn_norms = [n for n in report.norms if n.into.endswith("self_attn")]
    if norm_hand_over is None:
        assert not report.projections and not attn_norms
    else:
        assert [p.names for p in report.projections] == ["q_proj+k_proj+v_proj"] * 2
        assert len(attn_norms) == (2 if norm_hand_over else 0)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for got, want in zip(prefill_and_step(model, ids), prefill_and_step(twin, ids)):
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_a_hooked_projection_runs_its_own_call_with_the_norm_applied():
    """A forward hook on k_proj after patch: the fused call gives way to each child's own call (on the normalised
    input, the norm module now passing through), so the hook sees what it saw before and the logits do not move."""
    import mlpfuse

    model = _llama(layers=1)
    twin = copy.deepcopy(model)
    mlpfuse.patch(model, backend="triton")
    seen = {}

    def keep(name):
        def hook(module, inputs, output):
            seen.setdefault(name, inputs[0])  # returns None: the output stays

        return hook

    model.model.layers[0].self_attn.k_proj.register_forward_hook(keep("k"))
    twin.model.layers[0].self_attn.k_proj.register_forward_hook(keep("k_twin"))
    ids = torch.randint(0, 300, (1, 4), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got, want = _decode_logits(model, ids, steps=1), _decode_logits(twin, ids, steps=1)
    assert torch.allclose(seen["k"], seen["k_twin"], rtol=0, atol=1e-6)
    assert float((got - want).norm() / want.norm()) < 1e-5


class _Reads(nn.Module):
    """An attention-like module whose forward also reads its input beyond the projections (a gate on it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)

    def forward(self, hidden_states):
        return self.a(hidden_states) + self.b(hidden_states) * hidden_states.mean()


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + torch.randn(64) / 4)
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.attn = _Reads()

    def forward(self, h):
        h = self.norm(h)
        h = self.attn(h)
        return h


class _Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        q = self.a(x)
        x = x * 2
        return q + self.b(x)


def test_the_norm_stays_where_the_attention_reads_its_input_otherwise_and_reassigned_inputs_are_left():
    """A module reading its input beyond the projections gets them fused but keeps its norm in front (its forward
    reads the normalised value); a forward that reassigns the input between two projections is left as it is."""
    import mlpfuse

    torch.manual_seed(0)
    model = nn.Sequential(_Layer(), _Reassigns()).to(DEVICE).eval()
    twin = copy.deepcopy(model)
    report = mlpfuse.patch(model, backend="triton")
    assert [p.path for p in report.projections] == ["0.attn"] and not report.norms
    assert type(model[0].norm) is _Norm and type(model[1]) is _Reassigns
    x = torch.randn(2, 3, 64, device=DEVICE)
    with torch.no_grad():
        assert float((model(x) - twin(x)).norm() / twin(x).norm()) < 1e-5


def test_training_and_prefill_run_the_models_own_projections():
    """In train mode (a gradient is needed) and past decode sizes the projections are the children's GEMMs on the
    normalised input: the loss and every attention gradient equal the unpatched twin's to fp32 rounding."""
    import mlpfuse

    model = _llama(layers=1)
    twin = copy.deepcopy(model)
    mlpfuse.patch(model, backend="triton")
    model.train(), twin.train()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    losses = []
    for m in (model, twin):
        out = m(ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-5)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        g = getattr(model.model.layers[0].self_attn, name).weight.grad
        g2 = getattr(twin.model.layers[0].self_attn, name).weight.grad
        assert float((g - g2).norm() / g2.norm()) < 1e-4, name


def test_compiled_projections_equal_eager_ones_and_the_model_compiles_whole():
    """torch.compile(fullgraph=True, backend="aot_eager"): the attention's fused call (norm handed over) records one
    mlpfuse::decode_projections node running the same kernel, bit for bit the eager call; the patched model's decode
    call compiles without a graph break to the eager logits (its MLP's decode kernels sum with atomics: not bit for
    bit run to run)."""
    import mlpfuse

    model = _llama(layers=1)
    mlpfuse.patch(model, backend="triton")
    attn = model.model.layers[0].self_attn
    assert attn.__dict__["_mlpfuse_projections_state"].norm is not None
    x = torch.randn(1, 2, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids = torch.randint(0, 300, (1, 1), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        want = attn._mlpfuse_projections(x)
        torch._dynamo.reset()
        got = torch.compile(attn._mlpfuse_projections, backend="aot_eager", fullgraph=True)(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        logits = model(ids, use_cache=False).logits
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: model(t, use_cache=False).logits, backend="aot_eager", fullgraph=True)(ids)
    assert float((compiled - logits).norm() / logits.norm()) < 1e-5
