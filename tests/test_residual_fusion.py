"""The residual add after a decoder layer's MLP, handed to the fused block (mlpfuse.patching.residual) and added in
the down projection's epilogue by the decode kernels (kernels.decode_mlp) or as cuBLAS's C operand.

Oracles: a float64 gated MLP plus the residual for the kernels; the unpatched model's own logits, and the same
model patched without the hand-over, for the layers (prefill and one decode step from a cache, where the decode
kernels run)."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_models
import mlpfuse
from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse.errors import InputError
from mlpfuse.patching import blocks, residual

DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("mode", [0, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_kernels_add_the_residual_in_their_epilogue(dtype, m, mode, bias):
    from mlpfuse import activations
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp

    g = torch.Generator().manual_seed(m * 10 + mode + 100 * bias)
    d, h = 40, 72  # not multiples of the tiles
    x = torch.randn(m, d, generator=g).to(DEVICE, dtype)
    wg, wu = [(torch.randn(h, d, generator=g) / 6).to(DEVICE, dtype) for _ in range(2)]
    wd = (torch.randn(d, h, generator=g) / 8).to(DEVICE, dtype)
    bd = torch.randn(d, generator=g).to(DEVICE, dtype) if bias else None
    res = (torch.randn(m, d, generator=g) * 3).to(DEVICE, dtype)
    mlp = F.linear(F.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T), wd.double(),
                   None if bd is None else bd.double())
    ref = mlp + res.double()
    y = decode_gated_mlp(x, wg, wu, wd, b_down=bd, activation=activations.SILU, allow_tf32=False, _mode=mode,
                         residual=res)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-3), err
    # The residual is really in there: without it the same call is off by the residual's whole size.
    plain = decode_gated_mlp(x, wg, wu, wd, b_down=bd, activation=activations.SILU, allow_tf32=False, _mode=mode)
    assert ((plain.double() - ref).norm() / ref.norm()).item() > 0.5
    # Rounded once: never further from float64 than the two-step sum (plain rounded, then the add rounded).
    two_step = (plain + res).double()
    assert (y.double() - ref).abs().max() <= (two_step - ref).abs().max() + torch.finfo(dtype).eps * ref.abs().max()


@needs_triton
def test_decode_kernels_reject_a_residual_they_cannot_add():
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp

    x = torch.randn(2, 16, device=DEVICE)
    w, wd = torch.randn(32, 16, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    for bad in (torch.randn(2, 8, device=DEVICE), torch.randn(2, 16, device=DEVICE, dtype=torch.float64),
                torch.randn(16, 2, device=DEVICE).t(), "x"):
        with pytest.raises(InputError, match="^residual: expected a contiguous tensor of \\(2, 16\\)"):
            decode_gated_mlp(x, w, w, wd, activation=3, residual=bad)


# --- the layer's forward ------------------------------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _TwoStatements(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MLP()

    def forward(self, h):
        residual = h
        h = torch.tanh(h)
        h = self.mlp(h)
        h = residual + h
        return h


class _OneLine(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MLP()

    def forward(self, h, flag: bool = True):
        if flag:
            return self.mlp(torch.tanh(h)) + h
        h = h * 2 + self.mlp(h)  # not a plain residual: left as it is
        return h


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MLP()

    def forward(self, h):
        residual = h
        h = self.mlp(h)
        h = h * 0.5
        h = residual + h
        return h


class _Super(_TwoStatements):
    def forward(self, h):
        residual = h
        h = self.mlp(h)
        h = residual + h
        return super().forward(h)


class _Stack(nn.Module):
    def __init__(self, layer_cls, n=2):
        super().__init__()
        self.layers = nn.ModuleList(layer_cls() for _ in range(n))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _pair(layer_cls, **patch):
    torch.manual_seed(0)
    model = _Stack(layer_cls).to(DEVICE)
    patched = copy.deepcopy(model)
    report = mlpfuse.patch(patched, backend="torch", **patch)
    return model, patched, report


@pytest.mark.parametrize("layer_cls", [_TwoStatements, _OneLine])
def test_matching_layers_hand_their_add_to_the_block(layer_cls):
    model, patched, report = _pair(layer_cls)
    assert [r.path for r in report.residuals] == ["layers.0", "layers.1"]
    assert [r.into for r in report.residuals] == ["layers.0.mlp", "layers.1.mlp"]
    assert type(patched.layers[0])._mlpfuse_residual_of is layer_cls
    seen = []
    real = blocks.GatedBlock.forward

    def spy(self, x, residual=None):
        seen.append(residual is not None)
        return real(self, x, residual)

    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        try:
            blocks.GatedBlock.forward = spy
            got = patched(x)
        finally:
            blocks.GatedBlock.forward = real
        assert seen == [True, True]
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)  # the torch backend: the layer's own ops
    assert "2 residual adds fused" in report.summary()
    assert report.to_dict()["residuals"][0] == {"path": "layers.0", "into": "layers.0.mlp",
                                                "by": "its down projection's epilogue"}


def test_the_other_branch_of_a_matching_forward_keeps_its_own_math():
    model, patched, _ = _pair(_OneLine)
    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(patched.layers[0](x, flag=False), model.layers[0](x, flag=False), rtol=0, atol=0)


@pytest.mark.parametrize("layer_cls,why", [
    (_Scaled, "`h = h \\* 0.5` follows the MLP's call"),
    (_Super, "closes over __class__"),
])
def test_layers_with_something_between_keep_their_add_and_say_why(layer_cls, why):
    model, patched, report = _pair(layer_cls)
    assert report.residuals == []
    assert [k.path for k in report.residuals_kept] == ["layers.0", "layers.1"]
    assert all(__import__("re").search(why, k.reason) for k in report.residuals_kept), report.residuals_kept
    assert type(patched.layers[0]) is layer_cls
    assert "keeps its add" in report.summary()
    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), model(x), rtol=0, atol=0)


def test_switch_off_unpatch_and_patch_twice():
    _, patched, report = _pair(_TwoStatements, fuse_residuals=False)
    assert report.residuals == [] and type(patched.layers[0]) is _TwoStatements
    _, patched, report = _pair(_TwoStatements)
    assert mlpfuse.patch(patched, backend="torch").residuals == []  # nothing swapped the second time
    assert type(patched.layers[0])._mlpfuse_residual_of is _TwoStatements
    mlpfuse.unpatch(patched)
    assert type(patched.layers[0]) is _TwoStatements and type(patched.layers[0].mlp) is _MLP
    with pytest.raises(InputError, match="fuse_residuals"):
        mlpfuse.patch(patched, fuse_residuals="yes")


def test_a_hooked_block_is_called_alone_and_its_hook_sees_the_mlp_output():
    model, patched, _ = _pair(_TwoStatements)
    outputs = []
    patched.layers[0].mlp.register_forward_hook(lambda mod, inp, out: outputs.append(out))
    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        got = patched(x)
        mlp_alone = model.layers[0].mlp(torch.tanh(x))
    torch.testing.assert_close(outputs[0], mlp_alone, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)


def test_gradients_flow_through_the_handed_over_add():
    model, patched, _ = _pair(_TwoStatements)
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    patched(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(patched.layers[1].mlp.down_proj.weight.grad, model.layers[1].mlp.down_proj.weight.grad)


def test_pickle_and_deepcopy_keep_the_hand_over():
    model, patched, _ = _pair(_TwoStatements)
    for twin in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
        assert type(twin.layers[0])._mlpfuse_residual_of is _TwoStatements
        x = torch.randn(2, 32, device=DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.layers[1])._mlpfuse_residual_of is _TwoStatements


# --- real transformers layers -------------------------------------------------------------------------------------

def _tiny(family):
    return hf_models.tiny_decoder(family, DEVICE)


_logits = hf_models.prefill_and_step


@pytest.mark.parametrize("family,fused", [("llama", True), ("qwen3", True), ("mistral", True), ("phi3", False),
                                          ("gemma2", False), ("olmo2", False)])
def test_transformers_layers(family, fused):
    model = _tiny(family)
    patched = copy.deepcopy(model)
    report = mlpfuse.patch(patched, backend="torch")
    layer_cls = type(model.model.layers[0])
    if fused:
        assert [r.path for r in report.residuals] == ["model.layers.0", "model.layers.1"]
        assert type(patched.model.layers[0])._mlpfuse_residual_of is layer_cls
    else:  # a dropout (Phi-3), a post-norm (Gemma 2, OLMo 2) between the MLP and the add
        assert report.residuals == [] and len(report.residuals_kept) == 2
        assert type(patched.model.layers[0]) is layer_cls
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for got, ref in zip(_logits(patched, ids), _logits(model, ids)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    mlpfuse.unpatch(patched)
    assert type(patched.model.layers[0]) is layer_cls


@needs_triton
def test_llama_decode_step_on_the_kernels_with_the_add_in_their_epilogue():
    """backend="triton": the decode step runs the decode kernels with the norm in their prologue and the residual in
    their epilogue; logits match the unpatched model and the model patched without the hand-over."""
    model = _tiny("llama")
    with_add, without = copy.deepcopy(model), copy.deepcopy(model)
    assert mlpfuse.patch(with_add, backend="triton").residuals
    assert not mlpfuse.patch(without, backend="triton", fuse_residuals=False).residuals
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref, plain, got = (_logits(m, ids) for m in (model, without, with_add))
    for a, b, c in zip(ref, plain, got):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-4)


@needs_triton
def test_fp8_decode_step_on_the_kernels_with_the_add_in_their_epilogue():
    """precision="fp8", backend="triton": at decode sizes the weight-only down projection adds the residual in its
    epilogue (one rounding less than the layer's add after it); logits match the model patched without the hand-over
    to that rounding."""
    model = _tiny("llama")
    with_add, without = copy.deepcopy(model), copy.deepcopy(model)
    assert mlpfuse.patch(with_add, backend="triton", precision="fp8").residuals
    assert not mlpfuse.patch(without, backend="triton", precision="fp8", fuse_residuals=False).residuals
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for got, want in zip(_logits(with_add, ids), _logits(without, ids)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_triton
def test_compiled_equals_eager_with_the_hand_over():
    """The block's call with the residual: one op in the compiled graph, bit-equal to the eager call (under the
    decode kernels' fixed-order reduction: their atomic modes add in whatever order the programs finish); the whole
    model compiled matches eager."""
    model = _tiny("llama")
    patched = copy.deepcopy(model)
    mlpfuse.patch(patched, backend="triton")
    block = patched.model.layers[0].mlp
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(1, 3, 32, generator=g).to(DEVICE) for _ in range(2))
    compiled_block = torch.compile(lambda a, b: block(a, residual=b), backend="aot_eager", fullgraph=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.no_grad():
            assert torch.equal(compiled_block(x, r), block(x, residual=r))
    finally:
        torch.use_deterministic_algorithms(False)
    ids = torch.randint(0, 64, (1, 4), generator=g).to(DEVICE)
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, patched(ids).logits, rtol=1e-5, atol=1e-5)


def test_residual_rewrite_is_cached_per_class_and_block():
    assert residual.rewritten(_TwoStatements, "mlp") is residual.rewritten(_TwoStatements, "mlp")
    assert residual.rewritten(_TwoStatements, "other") is None  # the forward never calls it


def test_the_hand_over_is_checked_on_numbers_before_it_is_kept():
    _, patched, report = _pair(_TwoStatements)
    block = patched.layers[0].mlp
    assert residual.verify_residual(block) is None

    class _Twice(type(block)):  # a block that adds the residual twice: a wrong epilogue
        def forward(self, hidden_states, residual=None):
            y = super().forward(hidden_states, residual)
            return y if residual is None else y + residual

    block.__class__ = _Twice
    assert "differs from residual + its output" in residual.verify_residual(block)
    torch.manual_seed(0)
    fresh = _Stack(_TwoStatements).to(DEVICE)
    swaps = mlpfuse.patch(fresh, backend="torch", fuse_residuals=False)
    for s in swaps.swapped:
        fresh.get_submodule(s.path).__class__ = _Twice
    report = type(swaps)(swaps.model, swaps.backend, swapped=swaps.swapped)
    residual.fuse_residuals(fresh, report)
    assert report.residuals == [] and all("differs" in k.reason for k in report.residuals_kept)
    assert type(fresh.layers[0]) is _TwoStatements


def test_a_layer_whose_source_changed_on_disk_keeps_its_add(tmp_path, monkeypatch):
    """The rewrite compiles the layer's forward from its file: if that file no longer matches the loaded code, the
    layer is left as it is (a forward built from other source would silently run other code)."""
    import importlib
    import linecache
    import sys

    src = '''import torch.nn as nn


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, h):
        residual = h
        h = h * 2.0
        h = self.mlp(h)
        h = residual + h
        return h
'''
    path = tmp_path / "mlpfuse_layer_on_disk.py"
    path.write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("mlpfuse_layer_on_disk")
    try:
        assert isinstance(residual.rewritten(module.Layer, "mlp"), type)  # source and loaded code agree
        residual.rewritten.cache_clear()
        path.write_text(src.replace("h * 2.0", "h * 3.0"))
        linecache.checkcache(str(path))
        assert "no longer compiles to the loaded forward" in residual.rewritten(module.Layer, "mlp")
    finally:
        residual.rewritten.cache_clear()
        sys.modules.pop("mlpfuse_layer_on_disk", None)


def test_fp8_blocks_take_the_add_and_the_report_says_where():
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    patched = copy.deepcopy(model)
    mlpfuse.patch(ref, backend="torch", precision="fp8", fuse_residuals=False)
    report = mlpfuse.patch(patched, backend="torch", precision="fp8")
    assert [r.by for r in report.residuals] == [
        "its down projection's epilogue at decode sizes (added to its output above them)"] * 2
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for got, want in zip(_logits(patched, ids), _logits(ref, ids)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
