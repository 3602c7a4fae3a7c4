"""mlpfuse.patch on plain torch.nn models: the swap, the report, unpatching, and every reason to leave a module alone.

The transformers families are in test_patching_models.py; here the candidates are torch.nn modules (an
nn.Sequential MLP, and classes that carry a transformers class name so the table's rows apply to them).
"""

import copy

import pytest
import torch
import torch.nn as nn

import mlpfuse
from mlpfuse.patching import GatedBlock, TwoLayerBlock
from mlpfuse.patching.report import fold_paths


class Net(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = mlp
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.mlp(self.norm(x)))


def sequential(act=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 40), act or nn.GELU(approximate="tanh"), nn.Linear(40, 16))


class LlamaMLP(nn.Module):
    """Named like transformers' class (the table matches class names); the same forward."""

    def __init__(self, dim=16, hidden=24, kind="llama"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()
        self.kind = kind

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.kind == "up-gated":  # not what the table says; the structure reads it (gate = up_proj)
            return self.down_proj(self.act_fn(u) * g)
        if self.kind == "extra-term":  # no fused reading computes it
            return self.down_proj(self.act_fn(g) * u) + x
        return self.down_proj(self.act_fn(g) * u)


class Layers(nn.Module):
    def __init__(self, n=3, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(LlamaMLP(**kw) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def grads_of(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_sequential_mlp_is_swapped_with_the_same_parameters_and_outputs():
    model = Net(sequential())
    x = torch.randn(3, 5, 16)
    y_ref, g_ref = grads_of(model, x)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    report = mlpfuse.patch(model, backend="torch")
    assert isinstance(model.mlp, TwoLayerBlock) and report.changed
    assert [(s.path, s.source, s.layout, s.activation) for s in report.swapped] == [
        ("mlp", "Sequential", "two-layer", "gelu_tanh")]
    assert report.left == [] and report.already_patched == []
    # Same Parameter objects under the same names: nothing copied, state_dict keys unchanged.
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(model.state_dict()[k].data_ptr() == params[k].data_ptr() for k in params)
    assert list(model.state_dict()) == keys
    y, g = grads_of(model, x)
    torch.testing.assert_close(y, y_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], msg=name)


def test_patch_twice_is_a_no_op_and_unpatch_restores_the_originals():
    model = Layers()
    originals = list(model.layers)
    first = mlpfuse.patch(model, backend="torch")
    assert len(first.swapped) == 3 and all(isinstance(m, GatedBlock) for m in model.layers)
    blocks = list(model.layers)
    second = mlpfuse.patch(model, backend="torch")
    assert second.swapped == [] and second.left == [] and second.already_patched == [f"layers.{i}" for i in range(3)]
    assert list(model.layers) == blocks  # the same objects: nothing rebuilt
    assert "3 already patched" in second.summary()
    assert mlpfuse.unpatch(model) == [f"layers.{i}" for i in range(3)]
    assert list(model.layers) == originals
    assert mlpfuse.unpatch(model) == []


def test_checkpoint_loads_before_or_after_patching():
    x = torch.randn(4, 16)
    donor = Layers()
    for p in donor.parameters():
        nn.init.normal_(p)  # different weights from a fresh Layers()
    expected = donor(x)
    saved = copy.deepcopy(donor.state_dict())

    patched_then_loaded = Layers()
    mlpfuse.patch(patched_then_loaded, backend="torch")
    patched_then_loaded.load_state_dict(saved, strict=True)
    torch.testing.assert_close(patched_then_loaded(x), expected)

    loaded_then_patched = Layers()
    loaded_then_patched.load_state_dict(saved, strict=True)
    mlpfuse.patch(loaded_then_patched, backend="torch")
    torch.testing.assert_close(loaded_then_patched(x), expected)
    # A patched model's state_dict loads into an unpatched one, and unpatching keeps the loaded weights.
    plain = Layers()
    plain.load_state_dict(patched_then_loaded.state_dict(), strict=True)
    torch.testing.assert_close(plain(x), expected)
    mlpfuse.unpatch(patched_then_loaded)
    torch.testing.assert_close(patched_then_loaded(x), expected)


def test_block_follows_moves_and_casts_of_the_model():
    model = Layers(n=1)
    mlpfuse.patch(model, backend="torch")
    model.to(torch.float64)
    x = torch.randn(2, 16, dtype=torch.float64)
    assert model(x).dtype == torch.float64
    mlpfuse.unpatch(model)
    assert model.layers[0].gate_proj.weight.dtype == torch.float64  # the original saw the cast too


def test_deepcopy_of_a_patched_model_is_independent():
    model = Layers(n=2)
    mlpfuse.patch(model, backend="torch")
    twin = copy.deepcopy(model)
    x = torch.randn(3, 16)
    torch.testing.assert_close(twin(x), model(x))
    with torch.no_grad():
        twin.layers[0].gate_proj.weight.add_(1.0)
    assert not torch.equal(twin(x), model(x))
    assert twin.layers[0].fused_source.gate_proj is twin.layers[0].gate_proj  # the copy's source shares its children
    mlpfuse.unpatch(twin)
    assert type(twin.layers[0]).__name__ == "LlamaMLP" and isinstance(model.layers[0], GatedBlock)


def test_a_forward_that_is_not_what_the_table_says_is_read_from_its_structure():
    model = Layers(n=2, kind="up-gated")
    x = torch.randn(3, 16)
    before = model(x)
    report = mlpfuse.patch(model, backend="torch")
    assert [(s.matched, s.roles) for s in report.swapped] == [
        ("structure", "gate=up_proj up=gate_proj down=down_proj")] * 2
    torch.testing.assert_close(model(x), before)


def test_a_forward_no_fused_reading_computes_is_left_alone():
    model = Layers(n=2, kind="extra-term")
    x = torch.randn(3, 16)
    before = model(x)
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [] and len(report.left) == 2
    assert all("differs from the module's own" in item.reason for item in report.left)
    assert type(model.layers[0]).__name__ == "LlamaMLP"
    torch.testing.assert_close(model(x), before)
    # Without the check the table's word is taken: the block computes the table's function, not this forward.
    unchecked = mlpfuse.patch(model, backend="torch", verify=False)
    assert len(unchecked.swapped) == 2


def test_patch_leaves_the_random_state_alone():
    model = Layers(n=2)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    mlpfuse.patch(model, backend="torch")
    torch.testing.assert_close(torch.rand(3), expected)


def _reason(model) -> str:
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [], report.summary()
    assert len(report.left) >= 1, report.summary()
    return report.left[0].reason


class Linear8bit(nn.Linear):
    pass


def _set_weight(lin: nn.Linear, tensor):
    lin.weight = nn.Parameter(tensor, requires_grad=False)


@pytest.mark.parametrize(
    "spoil, expected",
    [
        (lambda m: m.register_forward_hook(lambda *a: None), "hooks on the MLP (forward hooks)"),
        (lambda m: m.register_forward_pre_hook(lambda *a: None), "hooks on the MLP (forward pre hooks)"),
        (lambda m: m.register_full_backward_hook(lambda *a: None), "hooks on the MLP (backward hooks)"),
        (lambda m: m.up_proj.register_forward_hook(lambda *a: None), "hooks on up_proj (forward hooks)"),
        (lambda m: m._register_state_dict_hook(lambda *a: None), "hooks on the MLP (state_dict hooks)"),
        (lambda m: setattr(m, "forward", lambda x: x), "its forward is replaced on the instance"),
        (lambda m: setattr(m, "gate_proj", Linear8bit(16, 24, bias=False)),
         "gate_proj is Linear8bit, not a plain nn.Linear"),
        (lambda m: _set_weight(m.gate_proj, torch.zeros(24, 16, dtype=torch.int8)),
         "gate_proj.weight is int8 (quantized weights)"),
        (lambda m: _set_weight(m.down_proj, torch.zeros(16, 24, dtype=torch.float8_e4m3fn)),
         "down_proj.weight is float8_e4m3fn (fp8 weights)"),
        (lambda m: _set_weight(m.down_proj, torch.zeros(16, 24, dtype=torch.float16)),
         "down_proj.weight is float16 on cpu, gate_proj.weight float32 on cpu"),
        (lambda m: _set_weight(m.up_proj, torch.zeros(24, 15)), "projection shapes do not chain"),
        (lambda m: setattr(m, "act_fn", nn.Tanh()), "unknown activation Tanh"),
        (lambda m: setattr(m, "extra", nn.Linear(2, 2)), "extra holds parameters the fused block would not use"),
        (lambda m: m.register_buffer("scale", torch.ones(1)), "tensors of its own (scale)"),
        (lambda m: delattr(m, "up_proj"), "no up_proj child"),
        (lambda m: torch.nn.utils.parametrizations.weight_norm(m.gate_proj), "gate_proj is parametrized"),
    ],
)
def test_reasons_to_leave_a_module(spoil, expected):
    model = Layers(n=1)
    spoil(model.layers[0])
    assert _reason(model).startswith(expected)


def test_meta_weights_are_left_with_the_reason():
    with torch.device("meta"):
        model = Layers(n=2)
    report = mlpfuse.patch(model)
    reason = "gate_proj.weight is on the meta device (weights not loaded yet)"
    assert [item.reason for item in report.left] == [reason] * 2
    assert all(type(m).__name__ == "LlamaMLP" for m in model.layers)


def test_tensor_subclass_weights_are_left():
    class Marked(torch.Tensor):
        pass

    model = Layers(n=1)
    lin = model.layers[0].gate_proj
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(Marked))
    assert _reason(model) == "gate_proj.weight is a Marked (a tensor subclass: quantized or sharded weights)"


def test_model_without_an_mlp_reports_so_and_changes_nothing():
    inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), inner)
    before = [id(m) for m in model.modules()]
    report = mlpfuse.patch(model)
    assert not report.changed and report.left == [] and report.swapped == []
    assert report.summary().endswith("no MLP block mlpfuse recognises; nothing changed")
    assert [id(m) for m in model.modules()] == before


def test_unknown_mlp_classes_are_reported_not_patched():
    class FancyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x):
            return self.w(x)

    model = nn.Sequential(FancyMLP())
    report = mlpfuse.patch(model)
    left = [(i.path, i.source, i.reason) for i in report.left]
    assert left == [("0", "FancyMLP", "no layout mlpfuse fuses: one projection and no activation mlpfuse knows on "
                                      "the module")]
    assert "left 1" in report.summary()


def test_an_mlp_as_the_model_itself_is_left_with_advice():
    report = mlpfuse.patch(LlamaMLP())
    assert report.left[0].path == "" and "the model itself is an MLP block" in report.left[0].reason


@pytest.mark.parametrize("bad, expected", [
    ("not a module", "model: expected a torch.nn.Module, got str"),
    (None, "model: expected a torch.nn.Module, got NoneType"),
])
def test_bad_model_argument_is_one_input_error(bad, expected):
    with pytest.raises(mlpfuse.InputError, match=expected):
        mlpfuse.patch(bad)
    with pytest.raises(mlpfuse.InputError, match=expected):
        mlpfuse.unpatch(bad)


def test_bad_backend_is_one_input_error():
    with pytest.raises(mlpfuse.InputError, match="backend: unknown backend 'cudnn'"):
        mlpfuse.patch(Layers(n=1), backend="cudnn")


def test_env_backend_is_read_at_call_time(monkeypatch):
    model = Layers(n=1)
    report = mlpfuse.patch(model, backend=None)
    assert report.backend == "env" and model.layers[0].fused_backend == ""
    monkeypatch.setenv("MLPFUSE_BACKEND", "nonsense")
    with pytest.raises(mlpfuse.InputError, match="MLPFUSE_BACKEND: unknown backend"):
        model(torch.randn(2, 16))


def test_report_dict_and_folded_paths():
    model = Layers(n=4)
    report = mlpfuse.patch(model, backend="torch")
    d = report.to_dict()
    assert d["model"] == "Layers" and d["backend"] == "torch" and len(d["swapped"]) == 4
    assert d["swapped"][0] == {"path": "layers.0", "source": "LlamaMLP", "layout": "gated",
                               "family": "swiglu/geglu", "activation": "silu", "matched": "name",
                               "roles": "gate=gate_proj up=up_proj down=down_proj", "precision": "",
                               "fp8_error": None, "fp8_checkpoint": False}
    assert ("layers.{0..3}  LlamaMLP -> gated (silu, by name: gate=gate_proj up=up_proj down=down_proj)  [4x]"
            in report.summary())
    assert fold_paths(["a.1.b", "a.3.b", "a.4.b"]) == "a.{1,3,4}.b"
    assert fold_paths(["x.0.y.2", "x.1.y.2"]) == "x.{0..1}.y.2"
    assert fold_paths(["a.0", "b"]) == "a.0, b"


def test_sequential_with_other_middles_is_a_container():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.0), nn.Linear(8, 4))
    assert mlpfuse.patch(model).summary().endswith("nothing changed")
    inner = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    outer = nn.Sequential(inner, nn.LayerNorm(4))
    x = torch.randn(2, 4)
    expected = outer(x)
    assert len(mlpfuse.patch(outer, backend="torch").swapped) == 1
    torch.testing.assert_close(outer(x), expected)


def test_inference_under_no_grad_and_autocast_matches_eager():
    model = Layers(n=2)
    x = torch.randn(3, 7, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        mlpfuse.patch(model, backend="torch")
        got = model(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)
