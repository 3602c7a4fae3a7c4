"""GatedMLP / PackedGatedMLP / FusedLinear / MLP: state_dicts of the modules they replace, shared parameters,
outputs and gradients equal to the replaced modules (float64, torch backend)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mlpfuse import FusedLinear, GatedMLP, MLP
from mlpfuse.errors import InputError
from mlpfuse.modules import PackedGatedMLP

F64 = torch.float64


# Stand-ins written the way transformers writes these MLPs (same attribute names and forward).
class LlamaMLP(nn.Module):
    def __init__(self, dim, hidden, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=F64)
        self.up_proj = nn.Linear(dim, hidden, bias=False, dtype=F64)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=F64)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PytorchGELUTanh(nn.Module):  # the name transformers' ACT2FN["gelu_pytorch_tanh"] has
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class Mish(nn.Module):  # an activation mlpfuse does not compute
    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


class Config:
    hidden_act = "gelu_pytorch_tanh"


class Phi3MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False, dtype=F64)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=F64)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class MixtralExpert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=F64)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=F64)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=F64)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class GPTMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=F64)
        self.fc2 = nn.Linear(hidden, dim, dtype=F64)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def assert_same_function(ours, theirs, dim, lead=(2, 5)):
    """Equal outputs and equal gradients: for every shared parameter, or else for parameters of the same name."""
    x = torch.randn(*lead, dim, dtype=F64, requires_grad=True)
    theirs_p = list(theirs.parameters())
    if storages(ours) == storages(theirs):
        ours_p = theirs_p
    else:
        names = [n for n, _ in theirs.named_parameters()]
        ours_p = [ours.get_parameter(n) for n in names]
    y_theirs = theirs(x)
    dy = torch.randn_like(y_theirs)
    g_theirs = torch.autograd.grad(y_theirs, [x, *theirs_p], dy)
    y_ours = ours(x)
    g_ours = torch.autograd.grad(y_ours, [x, *ours_p], dy)
    torch.testing.assert_close(y_ours, y_theirs)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b)


def storages(module):
    return {p.data_ptr() for p in module.parameters()}


def test_gated_mlp_loads_a_llama_state_dict_as_is():
    src = LlamaMLP(12, 20)
    ours = GatedMLP(12, 20, activation="silu", dtype=F64, backend="torch")
    assert set(ours.state_dict()) == set(src.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    ours.load_state_dict(src.state_dict())
    assert_same_function(ours, src, 12)
    src2 = LlamaMLP(12, 20)
    src2.load_state_dict(ours.state_dict())
    assert_same_function(ours, src2, 12)


def test_gated_mlp_with_bias_keys():
    m = GatedMLP(8, 16, bias=True)
    assert set(m.state_dict()) == {f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "bias")}
    assert "dim=8, hidden=16, activation=gelu_tanh, bias=True" in repr(m)


@pytest.mark.parametrize(
    "act_fn, expected",
    [(nn.SiLU(), "silu"), (PytorchGELUTanh(), "gelu_tanh"), (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh"),
     (F.silu, "silu"), (nn.ReLU(), "relu")],
)
def test_from_module_shares_parameters_and_reads_the_activation(act_fn, expected):
    src = LlamaMLP(12, 20, act_fn)
    ours = GatedMLP.from_module(src, backend="torch")
    assert ours.activation == expected
    assert storages(ours) == storages(src)
    assert ours.gate_proj.weight is src.gate_proj.weight
    assert_same_function(ours, src, 12)


def test_from_module_reads_config_when_there_is_no_act_fn():
    src = LlamaMLP(6, 10)
    del src.act_fn
    src.config = Config()
    assert GatedMLP.from_module(src).activation == "gelu_tanh"


def test_from_module_refuses_to_guess():
    with pytest.raises(InputError, match="^activation: .*Mish"):
        GatedMLP.from_module(LlamaMLP(6, 10, Mish()))
    # An explicit activation is the way out.
    assert GatedMLP.from_module(LlamaMLP(6, 10, Mish()), activation="gelu").activation == "gelu"


def test_from_module_tells_the_activation_by_its_numbers_not_its_name():
    # A class named like none of torch's or transformers' activations: its float64 values on probe points decide.
    src = LlamaMLP(6, 10, QuickGELU())
    ours = GatedMLP.from_module(src, backend="torch")
    assert ours.activation == "quick_gelu"
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(ours.double()(x), src.double()(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError, match="^module: "):
        GatedMLP.from_module(GPTMLP(6, 10))


def test_from_module_mixtral_expert():
    src = MixtralExpert(10, 14)
    ours = GatedMLP.from_module(src, backend="torch")
    assert ours.up_proj.weight is src.w3.weight and ours.down_proj.weight is src.w2.weight
    assert_same_function(ours, src, 10)


def test_packed_gate_up_is_used_in_place():
    src = Phi3MLP(10, 14)
    ours = GatedMLP.from_module(src, backend="torch")
    assert isinstance(ours, PackedGatedMLP) and isinstance(ours, GatedMLP)
    assert ours.gate_up_proj.weight is src.gate_up_proj.weight
    assert set(ours.state_dict()) == set(src.state_dict())
    assert storages(ours) == storages(src)
    assert_same_function(ours, src, 10)
    assert "packed=True" in repr(ours)
    # A fresh packed module loads a Phi-3 state_dict as is.
    fresh = PackedGatedMLP(10, 14, activation="silu", dtype=F64, backend="torch")
    fresh.load_state_dict(src.state_dict())
    assert_same_function(fresh, src, 10)


def test_packed_with_bias_and_from_packed():
    fused = nn.Linear(6, 16, dtype=F64)
    down = nn.Linear(8, 6, dtype=F64)
    ours = GatedMLP.from_packed(fused, down, "gelu", backend="torch")
    x = torch.randn(3, 6, dtype=F64)
    g, u = fused(x).chunk(2, dim=-1)
    torch.testing.assert_close(ours(x), down(F.gelu(g) * u))
    with pytest.raises(InputError, match="^gate_up_proj: "):
        GatedMLP.from_packed(nn.Linear(6, 15), nn.Linear(7, 6))
    with pytest.raises(InputError, match="^module: expected .*\\[6, 8\\]"):
        GatedMLP.from_packed(fused, nn.Linear(7, 6, dtype=F64))


def test_from_module_rejects_mixed_dtypes():
    src = LlamaMLP(6, 10)
    src.up_proj.float()
    with pytest.raises(InputError, match="^module: expected up_proj.weight in torch.float64"):
        GatedMLP.from_module(src)


def test_fused_linear_is_an_nn_linear_with_an_activation():
    torch.manual_seed(7)
    ref = nn.Linear(9, 5)
    torch.manual_seed(7)
    ours = FusedLinear(9, 5, activation="gelu_tanh")
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)  # nn.Linear's initialisation
    torch.testing.assert_close(ours.bias, ref.bias, rtol=0, atol=0)
    assert set(ours.state_dict()) == {"weight", "bias"}
    assert repr(ours) == "FusedLinear(in_features=9, out_features=5, bias=True, activation=gelu_tanh)"
    assert FusedLinear(3, 4, bias=False).bias is None


@pytest.mark.parametrize("activation", [None, "relu2", "gelu"])
def test_fused_linear_from_module(activation):
    lin = nn.Linear(9, 5, dtype=F64)
    ours = FusedLinear.from_module(lin, activation, backend="torch")
    assert ours.weight is lin.weight and ours.bias is lin.bias

    class Ref(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            z = self.lin(x)
            return {None: z, "relu2": F.relu(z) ** 2, "gelu": F.gelu(z)}[activation]

    assert_same_function(ours, Ref(), 9)


def test_mlp_matches_gpt_mlp_and_from_module():
    src = GPTMLP(8, 12)
    ours = MLP.from_module(src, backend="torch")
    assert ours.fc1.weight is src.fc1.weight and ours.fc2.bias is src.fc2.bias
    assert ours.fc1.activation == "gelu_tanh"
    assert_same_function(ours, src, 8)
    fresh = MLP(8, 12, dtype=F64)
    assert set(fresh.state_dict()) == set(src.state_dict())
    fresh.load_state_dict(src.state_dict())
    assert_same_function(fresh, src, 8)
    two = MLP.from_module(src.fc1, src.fc2, activation="gelu_tanh")
    assert storages(two) == storages(src)
    with pytest.raises(InputError, match="^activation: "):
        MLP.from_module(src.fc1, src.fc2)
    with pytest.raises(InputError, match="^fc1: "):
        MLP.from_module(LlamaMLP(8, 12))


def test_bad_constructor_arguments():
    with pytest.raises(InputError, match="^activation: "):
        GatedMLP(4, 8, activation="gelu_fast")
    with pytest.raises(InputError, match="^backend: "):
        FusedLinear(4, 8, backend="cudnn")
    with pytest.raises(InputError, match="^x: expected last dimension 4"):
        GatedMLP(4, 8)(torch.randn(2, 5))


class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: a [in, out] weight, transposed from nn.Linear's, and no in_features."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


@pytest.mark.parametrize(
    "build, argument",
    [
        (lambda: GatedMLP(-1, 8), "dim"),
        (lambda: GatedMLP(4, 0), "hidden"),
        (lambda: MLP(0, 8), "dim"),
        (lambda: MLP(4, -8), "hidden"),
        (lambda: PackedGatedMLP(4, 2.0), "hidden"),
        (lambda: FusedLinear(3, -2), "out_features"),
        (lambda: FusedLinear("3", 2), "in_features"),
        (lambda: FusedLinear(True, 2), "in_features"),
        (lambda: FusedLinear(None, 2), "in_features"),
        (lambda: FusedLinear(2**70, 2), "in_features"),
        (lambda: GatedMLP(2**32, 2**32, device="meta"), "hidden"),
        (lambda: FusedLinear(torch.arange(3), 2), "in_features"),
        (lambda: GatedMLP(4, 8, bias="no"), "bias"),
        (lambda: MLP(4, 8, bias=None), "bias"),
        (lambda: GatedMLP(4, 8, dtype=torch.int32), "dtype"),
        (lambda: FusedLinear(4, 8, dtype="float32"), "dtype"),
        (lambda: GatedMLP(4, 8, device="nope"), "device"),
        (lambda: MLP(4, 8, activation="tanh"), "activation"),
        (lambda: FusedLinear(4, 8, activation=3), "activation"),
        (lambda: FusedLinear.from_module(nn.Embedding(4, 8)), "module"),
        (lambda: FusedLinear.from_module(Conv1D(4, 6)), "module"),
        (lambda: FusedLinear.from_module(nn.Linear(0, 4)), "module"),
        (lambda: FusedLinear.from_module(nn.LayerNorm(4)), "module"),
        (lambda: FusedLinear.from_module("fc1"), "module"),
        (lambda: GatedMLP.from_module(nn.Linear(4, 8)), "module"),
        (lambda: GatedMLP.from_module(None, activation="silu"), "module"),
        (lambda: GatedMLP.from_linears(nn.Embedding(8, 4), nn.Embedding(8, 4), nn.Embedding(4, 8)), "module"),
        (lambda: MLP.from_module(nn.Linear(4, 8)), "fc1"),
        (lambda: MLP.from_module(nn.Embedding(4, 8), nn.Linear(8, 4), activation="relu"), "module"),
        (lambda: MLP.from_module(nn.Linear(4, 8), Conv1D(4, 8), activation="relu"), "module"),
    ],
)
def test_bad_module_arguments_name_the_argument(build, argument):
    with pytest.raises(InputError) as info:
        build()
    message = str(info.value)
    assert message.startswith(f"{argument}: ") and "\n" not in message and len(message) < 300, message


def test_integer_like_sizes_are_taken_as_ints():
    import numpy as np

    m = GatedMLP(np.int64(4), torch.tensor(6), dtype=F64, backend="torch")
    assert (m.dim, m.hidden) == (4, 6) and type(m.dim) is int and type(m.hidden) is int
    assert m.gate_proj.weight.shape == (6, 4)


def test_a_linear_like_module_is_accepted():
    class LinearLike(nn.Module):  # e.g. a quantized or adapter Linear that is not an nn.Linear subclass
        def __init__(self):
            super().__init__()
            self.in_features, self.out_features = 6, 4
            self.weight = nn.Parameter(torch.randn(4, 6, dtype=F64))
            self.bias = nn.Parameter(torch.randn(4, dtype=F64))

    src = LinearLike()
    ours = FusedLinear.from_module(src, "relu", backend="torch")
    assert ours.weight is src.weight and ours.bias is src.bias
    x = torch.randn(3, 6, dtype=F64)
    torch.testing.assert_close(ours(x), F.relu(F.linear(x, src.weight, src.bias)))


def test_module_backend_none_follows_the_environment(monkeypatch):
    m = GatedMLP(4, 8)
    monkeypatch.setenv("MLPFUSE_BACKEND", "bogus")
    with pytest.raises(InputError, match="^MLPFUSE_BACKEND: "):
        m(torch.randn(2, 4))
    monkeypatch.setenv("MLPFUSE_BACKEND", "torch")
    assert m(torch.randn(2, 4)).shape == (2, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode kernels run on CUDA")
def test_module_call_plan_on_gpu_matches_the_reference():
    torch.manual_seed(0)
    dim, hidden = 768, 3072
    m = GatedMLP(dim, hidden, activation="gelu_tanh", bias=True, device="cuda", dtype=torch.bfloat16)
    w64 = [t.double() for t in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, m.gate_proj.bias,
                                m.up_proj.bias, m.down_proj.bias)]

    def ref(x):
        x = x.double()
        g, u = x @ w64[0].T + w64[3], x @ w64[1].T + w64[4]
        return (F.gelu(g, approximate="tanh") * u) @ w64[2].T + w64[5]

    with torch.inference_mode():
        for shape in ((1, dim), (7, dim), (2, 8, dim), (64, dim), (65, dim), (300, dim)):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            y = m(x)
            assert y.shape == shape and y.dtype == torch.bfloat16
            r = ref(x)
            assert ((y.double() - r).norm() / r.norm()).item() < 1e-2, shape
    from mlpfuse.ops import dispatch

    if dispatch.decode_max_m() and torch.cuda.get_device_capability()[0] >= dispatch.MIN_ARCH:
        paths = {tuple(key[1][0][:-1]): entry.path for key, entry in m._plan.entries.items()}  # x's leading dims
        assert paths[(1,)] == paths[(64,)] == dispatch.DECODE  # this layer takes the decode path up to its limit
        assert paths[(65,)] == paths[(300,)] == dispatch.GATED  # and the gated GEMM past it (a small layer)
    # With autograd on, the training path runs (no decode kernel), with gradients.
    x = torch.randn(4, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("make", [lambda: GatedMLP(8, 12), lambda: FusedLinear(8, 12, activation="gelu"),
                                  lambda: MLP(8, 12)])
def test_module_calls_check_x_first_in_the_module_terms(make):
    import numpy as np

    m = make()
    for bad, name in (([0.5] * 8, "list"), (np.ones((2, 8), dtype=np.float32), "ndarray"), (None, "NoneType")):
        with pytest.raises(InputError, match=rf"^x: expected a torch.Tensor, got {name}$"):
            m(bad)
    with pytest.raises(InputError, match=r"^x: dtype torch.float16 does not match the module's weights "
                                         r"\((gate_proj\.)?weight: torch.float32\); cast x"):
        m(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(InputError, match=r"^x: expected last dimension 8 \(the module's input features\), got shape "
                                         r"\[2, 9\]$"):
        m(torch.randn(2, 9))
    with torch.no_grad():  # once refused, the same module still serves good input
        assert m(torch.randn(2, 8)).shape[-1] == (8 if not isinstance(m, FusedLinear) else 12)


def test_fused_linear_with_an_activation_auto_never_fuses_is_eager_math_under_its_own_span():
    """The erf GELU on `auto`: eager's F.linear + GELU bit for bit, no plan entry, and under the profiler the kernels
    sit inside a `mlpfuse::linear_act` CPU op, as every eager mlpfuse call's do."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 12)
    m = FusedLinear.from_module(ref, activation="gelu", backend="auto")
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = m(x)
        assert torch.equal(got, torch.nn.functional.gelu(ref(x)))
    spans = [e for e in prof.events() if e.name == "mlpfuse::linear_act"]
    assert len(spans) == 1
    inside = {e.name for e in prof.events() if e.cpu_parent is not None and e.cpu_parent.name == "mlpfuse::linear_act"}
    assert {"aten::linear", "aten::gelu"} <= inside, inside
    assert len(m._plan.entries) == 0
    with pytest.raises(InputError, match="^x: "):
        m(torch.randn(3, 9))  # refused by F.linear, then named by the op layer's checks


def test_fused_linear_without_activation_under_auto_is_nn_linear_itself():
    """Nothing to fuse: the call returns nn.Linear's bits with no mlpfuse span; for 3-D x it records exactly
    nn.Linear's ops, for 2-D x only the one op F.linear runs there (addmm), over the held weight.t()."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 12)
    m = FusedLinear.from_module(ref, backend="auto")

    def ops(fn, x):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn(x)
        return out, sorted(e.name for e in prof.events())

    x3, x2 = torch.randn(2, 3, 8), torch.randn(3, 8)
    (want, want_ops), (got, got_ops) = ops(ref, x3), ops(m, x3)
    assert torch.equal(got, want)
    assert got_ops == want_ops and not any(name.startswith("mlpfuse::") for name in got_ops), got_ops
    m(x2)  # the first 2-D call makes the held view
    (want, want_ops), (got, got_ops) = ops(ref, x2), ops(m, x2)
    assert torch.equal(got, want)
    assert "aten::linear" in want_ops and "aten::t" in want_ops
    assert [n for n in got_ops if n in ("aten::linear", "aten::t", "aten::transpose", "aten::addmm")] == ["aten::addmm"]
    assert set(got_ops) < set(want_ops), got_ops
    with pytest.raises(InputError, match="^x: "):
        m(torch.randn(3, 9))  # bad input still gets the module's one-line error
