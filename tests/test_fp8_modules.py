"""precision="fp8" from the user's side: GatedMLP / Fp8Linear, state_dict, compile, and patch(precision="fp8").

The CPU runs the torch path (the recipe's reference, reference.gated_mlp_fp8 and its weight-only form) under
`auto`, and the Triton kernels through the interpreter with backend="triton"; both are held to the recipe's error
bound against float64 (reference.gated_mlp_fp8_bound), and the torch path to the reference bit for bit.
"""

import io

import pytest
import torch
import torch.nn as nn

import mlpfuse
from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse import fp8, reference
from mlpfuse.errors import InputError
from mlpfuse.modules import Fp8Linear, GatedMLP
from mlpfuse.ops import fp8_mlp

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])


def _mlp(seed=0, dim=256, hidden=384, act="silu", bias=True, dtype=torch.float32):
    torch.manual_seed(seed)
    m = GatedMLP(dim, hidden, act, bias=bias, device=DEVICE, dtype=dtype)
    for p in m.parameters():
        nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1)
    return m


def _high(m):
    return [t.detach().double() for t in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight,
                                          m.gate_proj.bias, m.up_proj.bias, m.down_proj.bias)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [3, 40])  # weight-only (decode) and FP8 GEMMs
def test_an_fp8_gated_mlp_is_within_the_recipe_bound_and_the_torch_path_is_the_reference(backend, rows):
    m = _mlp()
    w64 = _high(m)
    m.backend = backend
    m.to_fp8()
    x = torch.randn(2, rows // 2 + 1, 256, device=DEVICE)
    with torch.no_grad():
        y = m(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    y64, bound = reference.gated_mlp_fp8_bound(x.double(), *w64[:3], "silu", *w64[3:], out_roundoff=2.0**-24,
                                               accumulation=reference.FP8_MMA_ACCUMULATION)
    assert bool(((y.double() - y64).abs() <= bound).all())
    if backend == "torch":
        ws = [c.fp8_weight() for c in (m.gate_proj, m.up_proj, m.down_proj)]
        small = x.shape[0] * x.shape[1] <= fp8_mlp.WEIGHT_ONLY_MAX_M
        fn = reference.gated_mlp_fp8_weight_only if small else reference.gated_mlp_fp8
        assert torch.equal(y, fn(x, *ws, "silu", m.gate_proj.bias, m.up_proj.bias, m.down_proj.bias))


def test_to_fp8_drops_the_high_precision_weights_and_the_state_dict_round_trips():
    m = _mlp(dtype=torch.bfloat16).to_fp8()
    assert list(m.parameters()) == [m.gate_proj.bias, m.up_proj.bias, m.down_proj.bias]
    state = m.state_dict()
    assert state["gate_proj.weight"].dtype == fp8.DTYPE and state["gate_proj.weight_scale_inv"].shape == (3, 2)
    assert state["down_proj.weight_scale_inv"].shape == (2, 3) and state["down_proj.bias"].dtype == torch.bfloat16
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = GatedMLP(256, 384, "silu", bias=True, device=DEVICE, dtype=torch.bfloat16, precision="fp8")
    fresh.load_state_dict(torch.load(buf))
    x = torch.randn(20, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), m(x))


def test_a_wrong_checkpoint_tensor_is_one_error_naming_it():
    m = GatedMLP(256, 384, "silu", precision="fp8", device=DEVICE)
    good = m.state_dict()
    with pytest.raises(InputError, match=r"up_proj.weight_scale_inv: shape \[2, 2\] does not match"):
        m.load_state_dict({**good, "up_proj.weight_scale_inv": torch.ones(2, 2, device=DEVICE)})
    with pytest.raises(InputError, match="down_proj.weight: expected dtype torch.float8_e4m3fn, got torch.float32"):
        m.load_state_dict({**good, "down_proj.weight": torch.ones(256, 384, device=DEVICE)})


def test_dequantize_gives_linears_holding_the_fp8_values():
    m = _mlp(dtype=torch.bfloat16).to_fp8()
    deq = m.up_proj.fp8_weight().dequantize()
    m.dequantize()
    assert type(m.up_proj) is nn.Linear and torch.equal(m.up_proj.weight, deq)
    assert m.up_proj.weight.dtype == torch.bfloat16


def test_fp8_is_inference_only_and_other_misuse_is_one_line():
    m = _mlp().to_fp8()
    with pytest.raises(InputError, match="inference-only"):
        m(torch.randn(4, 256, device=DEVICE, requires_grad=True))
    with torch.no_grad():
        m(torch.randn(4, 256, device=DEVICE, requires_grad=True))  # no_grad: autograd's rule says no gradient
    with pytest.raises(InputError, match="precision: expected None"):
        GatedMLP(8, 16, precision="fp4")
    m.backend = "cuda"
    with pytest.raises(InputError, match="not 'cuda'"), torch.no_grad():
        m(torch.randn(4, 256, device=DEVICE))
    m.backend = "auto"
    with pytest.raises(InputError, match="x: expected last dimension 256"), torch.no_grad():
        m(torch.randn(4, 255, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_blocks_under_autocast_give_their_own_numbers(backend):
    """Inside torch.autocast (bf16) the FP8 block and linear compute the recipe as outside it — the same output,
    bit for bit, in x's dtype — at a decode size and a prefill size (the reference path's F.linear would otherwise
    be recast to bf16 inside the op)."""
    m = _mlp(4)
    m.backend = backend
    m.to_fp8()
    f = Fp8Linear.from_linear(nn.Linear(256, 130, device=DEVICE), activation="silu")
    for rows in (4, 40):
        x = torch.randn(rows, 256, device=DEVICE)
        with torch.no_grad():
            want = m(x), f(x)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                got = m(x), f(x)
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_fp8_linear_matches_its_reference():
    torch.manual_seed(3)
    lin = nn.Linear(300, 130, device=DEVICE)
    f = Fp8Linear.from_linear(lin, activation="gelu_tanh")
    for rows in (4, 50):
        x = torch.randn(rows, 300, device=DEVICE)
        with torch.no_grad():
            y = f(x)
        fn = reference.linear_fp8_weight_only if rows <= fp8_mlp.WEIGHT_ONLY_MAX_M else reference.linear_fp8
        if DEVICE == "cpu":
            assert torch.equal(y, fn(x, f.fp8_weight(), f.bias, "gelu_tanh"))
    assert type(f.to_linear()) is nn.Linear


@pytest.mark.slow
def test_compiled_fp8_equals_eager_bit_for_bit_without_a_graph_break():
    m = _mlp().to_fp8()
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    for rows in (3, 40):
        x = torch.randn(rows, 256, device=DEVICE)
        with torch.no_grad():
            assert torch.equal(compiled(x), m(x))


def _tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, **kw)
    return LlamaForCausalLM(cfg).to(DEVICE, torch.bfloat16).eval()


def test_patch_fp8_quantizes_verifies_reports_and_unpatch_dequantizes():
    pytest.importorskip("transformers")
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    report = mlpfuse.patch(model, precision="fp8")
    assert [s.precision for s in report.swapped] == ["fp8", "fp8"]
    assert all(0 < s.fp8_error < 2 * fp8.UNIT_ROUNDOFF for s in report.swapped)
    assert "2 in fp8" in report.summary() and "4 norms fused" in report.summary()  # the attentions' input norms too
    assert "applied by mlp's FP8 quantization pass" in report.summary()
    assert report.to_dict()["swapped"][0]["fp8_error"] == report.swapped[0].fp8_error
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj, Fp8Linear) and mlp.fused_source.gate_proj is mlp.gate_proj  # nothing else holds
    state = model.state_dict()
    assert state["model.layers.1.mlp.down_proj.weight"].dtype == fp8.DTYPE
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" in state
    ids = torch.randint(0, 300, (1, 24), device=DEVICE)
    with torch.no_grad():
        model(ids)
    mlpfuse.unpatch(model)
    layer = model.model.layers[0].mlp
    assert type(layer.gate_proj) is nn.Linear
    w = fp8.quantize_weight(before["model.layers.0.mlp.gate_proj.weight"]).dequantize()
    assert torch.equal(layer.gate_proj.weight, w)


def test_patch_fp8_keeps_what_it_cannot_quantize_with_why():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                vocab_size=100)).eval()
    report = mlpfuse.patch(bert, precision="fp8")  # linear-act and post-norm blocks: not an MLP FP8 covers
    assert report.swapped and len(report.fp8_kept) == len(report.swapped)
    assert all("FP8 covers gated and two-layer MLPs" in k.reason for k in report.fp8_kept)
    with pytest.raises(InputError, match="recompute"):
        mlpfuse.patch(_tiny_llama(), precision="fp8", recompute=True)


def _finegrained_llama(block_size=(128, 128)):
    """A tiny Llama whose MLP projections are transformers' FineGrainedFP8 linears holding the recipe's values and
    scales (a checkpoint quantized that way), and the float64 dequantized weights they stand for."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = _tiny_llama()
    dequantized = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            q = fp8.quantize_weight(lin.weight.detach())
            f = FP8Linear(lin.in_features, lin.out_features, block_size=block_size).to(DEVICE)
            f.weight.data, f.weight_scale_inv.data = q.values, q.scale_inv if block_size else q.scale_inv[0, 0]
            setattr(layer.mlp, name, f)
            dequantized[(i, name)] = q.dequantize(torch.float64)
    return model, dequantized


def test_patch_fp8_runs_a_finegrained_fp8_checkpoint_as_it_is():
    pytest.importorskip("transformers")
    model, dequantized = _finegrained_llama()
    fp8_linears = {n: m for n, m in model.named_modules() if type(m).__name__ == "FP8Linear"}
    report = mlpfuse.patch(model)  # in its own dtype it cannot run: left, saying what can
    assert not report.swapped and "patch(model, precision='fp8')" in report.left[0].reason
    report = mlpfuse.patch(model, precision="fp8")
    assert [(s.precision, s.fp8_checkpoint) for s in report.swapped] == [("fp8", True)] * 2
    assert "the checkpoint's FP8 weights as they are" in report.summary()
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate_proj, Fp8Linear)
    held = mlp.fused_source.gate_proj
    assert held is fp8_linears["model.layers.1.mlp.gate_proj"]  # the module it replaced keeps the checkpoint's
    assert mlp.gate_proj.weight.data_ptr() == held.weight.data_ptr()  # the same values: nothing quantized or copied
    x = torch.randn(5, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x).double()
    g, u, d = (dequantized[(1, n)] for n in ("gate_proj", "up_proj", "down_proj"))
    y64 = reference.gated_mlp(x.double(), g, u, d, "silu")  # the MLP the checkpoint's weights stand for
    assert float((y - y64).norm() / y64.norm()) < 2 * fp8.UNIT_ROUNDOFF
    mlpfuse.unpatch(model)
    assert model.model.layers[1].mlp.gate_proj is held  # unpatch gives back the checkpoint's own modules


def test_a_finegrained_fp8_checkpoint_outside_the_recipe_is_left_with_why():
    pytest.importorskip("transformers")
    model, _ = _finegrained_llama(block_size=None)  # one scale per tensor
    report = mlpfuse.patch(model, precision="fp8")
    assert not report.swapped and "block size None, mlpfuse runs 128×128 blocks" in report.left[0].reason
    model, _ = _finegrained_llama()
    proj = model.model.layers[0].mlp.up_proj
    proj.weight_scale_inv = nn.Parameter(proj.weight_scale_inv.detach()[:, :1].clone())  # scales of another shape
    report = mlpfuse.patch(model, precision="fp8")
    assert [s.path for s in report.swapped] == ["model.layers.1.mlp"]
    assert report.left[0].path == "model.layers.0.mlp" and "up_proj.weight_scale_inv" in report.left[0].reason
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"  # put back as it was


@pytest.mark.parametrize("tokens", [3, 40])
def test_patch_fp8_hands_the_norm_to_the_fp8_block_and_applies_it_once(tokens):
    """With the RMSNorm in front handed over, a layer's FP8 MLP sees norm(h) exactly once (at a weight-only and a
    quantized size): the same output as the model patched without norm fusion, whose norm runs as its module."""
    pytest.importorskip("transformers")
    fused, plain = _tiny_llama(), _tiny_llama()
    r1 = mlpfuse.patch(fused, precision="fp8")
    r2 = mlpfuse.patch(plain, precision="fp8", fuse_norms=False)
    assert len([n for n in r1.norms if n.into.endswith(".mlp")]) == 2 and not r2.norms
    layer_f, layer_p = fused.model.layers[1], plain.model.layers[1]
    h = torch.randn(1, tokens, 256, device=DEVICE, dtype=torch.bfloat16) * 3
    with torch.no_grad():
        out_f = layer_f.mlp(layer_f.post_attention_layernorm(h))  # the norm passes h through, the block applies it
        out_p = layer_p.mlp(layer_p.post_attention_layernorm(h))
        assert torch.equal(layer_f.post_attention_layernorm(h), h)
    if DEVICE == "cpu":  # the reference path: the norm's own ops, then the recipe, in both
        assert torch.equal(out_f, out_p)
    else:  # the kernels round the norm inside (weight-only: x·w first, the row scale at the end)
        assert float((out_f.float() - out_p.float()).norm() / out_p.float().norm()) < 2 * fp8.UNIT_ROUNDOFF


def test_patch_fp8_quantizes_gpt2s_conv1d_mlp_and_unpatch_gives_the_conv1d_back():
    """GPT-2's MLP (Conv1D projections, weights [in, out]) in FP8: each block within the recipe's bound against the
    float64 two-layer MLP of its own weights (checked by patch, and here on the block), its state_dict holding e4m3
    [out, in] weights with their scales; unpatch gives Conv1D modules back with the dequantized weights in their
    own [in, out] layout (one e4m3 rounding from the originals)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=300, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg).to(DEVICE, torch.bfloat16).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    report = mlpfuse.patch(model, precision="fp8")
    assert [s.precision for s in report.swapped] == ["fp8", "fp8"] and "2 in fp8" in report.summary()
    block = model.transformer.h[0].mlp
    assert isinstance(block.c_fc, Fp8Linear) and block.c_fc.weight.shape == (1024, 256)
    assert model.state_dict()["transformer.h.1.mlp.c_proj.weight"].dtype == fp8.DTYPE
    x = torch.randn(7, 256, device=DEVICE, dtype=torch.bfloat16)
    w1 = before["transformer.h.0.mlp.c_fc.weight"].double().T  # Conv1D: [in, out]
    w2 = before["transformer.h.0.mlp.c_proj.weight"].double().T
    b1, b2 = before["transformer.h.0.mlp.c_fc.bias"].double(), before["transformer.h.0.mlp.c_proj.bias"].double()
    with torch.no_grad():
        y = block(x)
    y64, bound = reference.gated_mlp_fp8_bound(x.double(), w1, None, w2, "gelu_tanh", b1, None, b2,
                                               out_roundoff=2.0**-8, accumulation=reference.FP8_MMA_ACCUMULATION
                                               if DEVICE == "cuda" else reference.FP32_ACCUMULATION)
    assert bool(((y.double() - y64).abs() <= bound).all())
    mlpfuse.unpatch(model)
    c_fc = model.transformer.h[0].mlp.c_fc
    assert type(c_fc).__name__ == "Conv1D" and c_fc.weight.shape == (256, 1024)
    for name, old in before.items():
        new = dict(model.named_parameters())[name].detach()
        assert new.shape == old.shape and new.dtype == old.dtype
        if name.endswith("weight"):  # within one e4m3 rounding of its block's scale
            assert bool(((new.double() - old.double()).abs() <= fp8.UNIT_ROUNDOFF * old.double().abs()
                         + float(old.abs().max()) / 448 * 2.0**-9).all())
