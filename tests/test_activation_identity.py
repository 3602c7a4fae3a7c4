"""Activations are told apart on numbers in float64, never by name and never in the model's dtype: CLIP's QuickGELU
is patched as quick_gelu in fp32, fp16 and bf16 alike, an activation that equals none of mlpfuse's exactly is left
in every dtype, and `patch --dry-run` decides what `patch` does."""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mlpfuse
from mlpfuse import activations as A
from mlpfuse.modules import activation_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_every_activation_identifies_as_itself_and_as_no_other():
    for name in [*A.NAMES, "identity"]:
        assert A.identify(A.get(name).forward) == name


@pytest.mark.parametrize("fn", [
    lambda x: x * torch.sigmoid(1.6 * x),  # between the tanh GELU's 1.5958 and QuickGELU's 1.702
    lambda x: F.gelu(x).clamp(-10, 10),  # transformers' gelu_10: equal to gelu up to 10
    lambda x: F.gelu(x) * (1 + 1e-6),  # a relative 1e-6 off: far below bf16's rounding, far above float64's
    lambda x: x * torch.tanh(F.softplus(x)),  # mish
    torch.tanh, torch.sigmoid, F.leaky_relu, F.relu6,
    lambda x: F.silu(x.float()),  # silu, but in float32: not exactly anything
    lambda x: 1 / 0,  # raises
    lambda x: x[:3],  # another shape
])
def test_functions_that_equal_none_exactly_are_none(fn):
    assert A.identify(fn) is None


def test_transformers_activations_by_their_numbers():
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN

    expected = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "gelu_accurate": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu",
                "relu": "relu", "relu2": "relu2", "quick_gelu": "quick_gelu", "linear": "identity",
                "gelu_10": None, "mish": None, "tanh": None, "sigmoid": None, "relu6": None, "leaky_relu": None}
    assert transformers.__version__
    got = {key: activation_name(ACT2FN[key]) for key in expected if key in ACT2FN}
    assert got == {key: expected[key] for key in got}
    assert "quick_gelu" in got


def test_a_module_is_evaluated_on_a_copy():
    class Counting(nn.Module):
        def forward(self, x):
            self.seen = getattr(self, "seen", 0) + 1  # state a call changes: the model's module must keep its own
            return F.silu(x)

    act = Counting()
    assert activation_name(act) == "silu"
    assert not hasattr(act, "seen")


def test_quick_gelu_grad_and_kernels_forms_agree_in_float64():
    act = A.get("quick_gelu")
    x = torch.linspace(-30, 30, 2001, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad((x * torch.sigmoid(1.702 * x)).sum(), x)
    torch.testing.assert_close(act.grad(x.detach()), dx, rtol=1e-12, atol=1e-12)
    assert A.get("QuickGELU").name == "quick_gelu"


def _clip(dtype):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=99, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return transformers.CLIPTextModel(cfg).eval().to(dtype)


def _out(model, ids):
    with torch.no_grad():
        return model(ids).last_hidden_state


def _relative(a, b):
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clip_is_patched_with_quick_gelu_in_every_dtype(dtype):
    model = _clip(dtype)
    exact = copy.deepcopy(model).double()
    ids = torch.randint(2, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    before = _out(model, ids)
    report = mlpfuse.patch(model, backend="torch")
    assert [(s.path, s.activation) for s in report.swapped] == [
        (f"encoder.layers.{i}.mlp", "quick_gelu") for i in range(2)], report.summary()
    # The math: a float64 copy of the patched model computes what a float64 copy of the original does.
    reference = _out(exact, ids)
    assert _relative(_out(copy.deepcopy(model).double(), ids), reference) <= 1e-12
    # The rounding: no further from float64 than the original in its own dtype, plus one epsilon.
    own = _relative(before, reference)
    assert _relative(_out(model, ids), reference) <= 2 * own + torch.finfo(dtype).eps


# The kernels' dtypes where they run: on a GPU every one (bf16 too); through the CPU interpreter fp32 and fp16 (its
# bf16 dot products are wrong).
KERNEL_DTYPES = DTYPES if torch.cuda.is_available() else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_clip_patched_on_the_kernels_matches(dtype):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _clip(dtype).to(device)
    exact = copy.deepcopy(model).double()
    ids = torch.randint(2, 99, (2, 9), generator=torch.Generator().manual_seed(2)).to(device)
    before = _out(model, ids)
    report = mlpfuse.patch(model, backend="triton")
    assert {s.activation for s in report.swapped} == {"quick_gelu"} and len(report.swapped) == 2
    reference = _out(exact, ids)
    assert _relative(_out(model, ids), reference) <= 2 * _relative(before, reference) + torch.finfo(dtype).eps


class NearGELU(nn.Module):
    """x·σ(1.6x): closer to the tanh GELU (x·σ(1.5958x)) than QuickGELU is; in bf16 the two agree to rounding."""

    def forward(self, x):
        return x * torch.sigmoid(1.6 * x)


class Block(nn.Module):
    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), NearGELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Block()

    def forward(self, x):
        return x + self.mlp(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_activation_equal_to_none_exactly_is_left_in_every_dtype(dtype):
    model = Net().to(dtype)
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [] and [item.path for item in report.left] == ["mlp"], report.summary()
    assert "NearGELU" in report.left[0].reason


def test_dry_run_decides_what_patch_does_on_the_bf16_model(tmp_path):
    from mlpfuse.patching import dry_run

    model = _clip(torch.float32)
    model.save_pretrained(tmp_path / "clip")
    planned = dry_run(str(tmp_path / "clip"))
    done = mlpfuse.patch(_clip(torch.bfloat16), backend="torch")
    assert [(s.path, s.layout, s.activation) for s in planned.report.swapped] == \
        [(s.path, s.layout, s.activation) for s in done.swapped]
    assert json.loads(json.dumps(planned.to_dict()))["swapped"]
