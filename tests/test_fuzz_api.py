"""Property-based tests over the public API's inputs (hypothesis, derandomized: the same examples every run).

Every call either returns what the float64 oracle computes, or raises InputError (a ValueError) whose one line
starts with the name of a bad argument. Never another exception type, never a silent wrong value.

The oracle is tests/oracle.py's plain forms in float64 on the same (exactly upcast) inputs. The tolerance is a
first-order bound on the rounding error per element, from magnitudes propagated with absolute values
(|x|·|W|ᵀ + |b|, ...) times the dtype's epsilon and the reduction lengths, so a cancellation in the result never
makes a correct answer look wrong, and a wrong one is off by far more. Non-finite results must match the oracle's
exactly (NaN where it has NaN, ±Inf with the same sign).

Backends: "torch" for most examples; "triton" (Triton's interpreter on a CPU, so few and tiny, fp32 only: the
interpreter's bf16 dot is not exact) for a handful.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlpfuse import FusedLinear, GatedMLP, MLP, activations, kernels, ops
from mlpfuse.errors import InputError
from mlpfuse.modules import PackedGatedMLP
from mlpfuse.ops import dispatch
from oracle import PLAIN

TRITON = kernels.available()
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
EPS = {dt: torch.finfo(dt).eps for dt in FLOATS}
# Every spelling the API takes for an activation, with what it means in the oracle.
ACT_SPELLINGS = {None: "identity", "identity": "identity", "gelu_tanh": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                 "gelu_new": "gelu_tanh", "GELU": "gelu", "silu": "silu", "swish": "silu", "relu": "relu",
                 "relu2": "relu2"}


def fuzz(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


# ---- building inputs: values from a seeded generator, layouts chosen by hypothesis ------------------------------


def _values(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _laid_out(t64: torch.Tensor, dtype, layout: str) -> torch.Tensor:
    """t64's values in `dtype`, stored as asked: contiguous, transposed storage, a strided slice, or a view into a
    larger buffer (rows offset, as a packed weight's second half)."""
    t = t64.to(dtype)
    if t.dim() < 2 or layout == "contiguous":
        return t.clone()
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    big = torch.zeros(t.shape[0] + 3, *t.shape[1:], dtype=dtype)
    big[3:] = t
    return big[3:]


LAYOUTS = st.sampled_from(["contiguous", "transposed", "strided", "offset"])


def _poison(t: torch.Tensor, seed: int, count: int) -> None:
    """Put NaN, +Inf or -Inf at `count` positions of t (in place)."""
    if t.numel() == 0 or count == 0:
        return
    g = torch.Generator().manual_seed(seed)
    flat_idx = torch.randint(t.numel(), (count,), generator=g)
    kinds = torch.randint(3, (count,), generator=g)
    specials = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)[kinds].to(t.dtype)
    index = np.unravel_index(flat_idx.numpy(), tuple(t.shape))
    t[tuple(torch.as_tensor(i) for i in index)] = specials


# ---- the oracle and its error bound --------------------------------------------------------------------------


def _abs_linear(x, w, b):
    out = x.abs() @ w.abs().t()
    return out + b.abs() if b is not None else out


def _act_magnitude(act: str, m: torch.Tensor) -> torch.Tensor:
    """A bound on |act(z)| and on |act'(z)|·|z| for |z| <= m (the activations' slopes are at most 1.13)."""
    if act == "relu2":
        return 2 * m * m
    return m if act in ("identity", "relu") else 1.2 * m


def _assert_matches(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, dtype, depth: int, what: str):
    """got (in dtype) equals the float64 `want` within the first-order rounding bound; specials exactly."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == dtype, (what, got.dtype)
    g = got.double()
    for name, fn in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        assert torch.equal(fn(g), fn(want)), f"{what}: {name} at other positions than float64's"
    finite = torch.isfinite(want)
    bound = 8 * EPS[dtype] * (depth + 4) * magnitude + 1e3 * torch.finfo(dtype).tiny
    bound = torch.nan_to_num(bound, nan=math.inf)  # where the magnitude itself is not finite: no claim
    err = (g - want).abs()
    bad = finite & ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, worst {err[bad].max().item():.3g} "
                           f"vs bound {bound[bad].min().item():.3g} ({dtype})")


def _gated_oracle(act, x, wg, wu, wd, bg, bu, bd):
    """(y, magnitude of y) in float64 from the plain unfused form."""
    g, u = F.linear(x, wg, bg), F.linear(x, wu, bu)
    y = F.linear(PLAIN[act](g) * u, wd, bd)
    mg, mu = _abs_linear(x, wg, bg), _abs_linear(x, wu, bu)
    return y, _abs_linear(_act_magnitude(act, mg) * mu, wd, bd)


def _linear_oracle(act, x, w, b):
    z = F.linear(x, w, b)
    return PLAIN[act](z), _act_magnitude(act, _abs_linear(x, w, b))


# ---- valid inputs: a result equal to the oracle ------------------------------------------------------------------


@st.composite
def problems(draw, dtypes=FLOATS, max_lead=3, max_size=9, allow_poison=True):
    lead = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=max_lead)))
    lead = lead or (draw(st.integers(0, 5)),)  # at least one leading dimension unless 1-D x is drawn below
    one_d = draw(st.booleans()) and len(lead) == 1 and lead[0] == 1
    return dict(
        lead=() if one_d else lead,
        dim=draw(st.integers(0, max_size)),
        hidden=draw(st.integers(0, max_size)),
        dtype=draw(st.sampled_from(dtypes)),
        bias=draw(st.booleans()),
        act=draw(st.sampled_from(list(ACT_SPELLINGS))),
        x_layout=draw(LAYOUTS),
        w_layouts=[draw(LAYOUTS) for _ in range(3)],
        seed=draw(st.integers(0, 2**20)),
        poison=draw(st.integers(0, 3)) if allow_poison and draw(st.booleans()) else 0,
        poison_weight=allow_poison and draw(st.booleans()),
    )


def _gated_inputs(p):
    d, h, seed = p["dim"], p["hidden"], p["seed"]
    t64 = [_values((*p["lead"], d), seed), _values((h, d), seed + 1, max(d, 1) ** -0.5),
           _values((h, d), seed + 2, max(d, 1) ** -0.5), _values((d, h), seed + 3, max(h, 1) ** -0.5)]
    b64 = [_values((h,), seed + 4), _values((h,), seed + 5), _values((d,), seed + 6)] if p["bias"] else [None] * 3
    x = _laid_out(t64[0], p["dtype"], p["x_layout"])
    ws = [_laid_out(w, p["dtype"], lay) for w, lay in zip(t64[1:], p["w_layouts"])]
    bs = [b.to(p["dtype"]) if b is not None else None for b in b64]
    _poison(x, seed + 7, p["poison"])
    if p["poison"] and p["poison_weight"]:
        _poison(ws[0], seed + 8, 1)
    return x, ws, bs


def _eager_specials(want: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """want, with the unfused model's own NaN / ±Inf (computed in the input dtype) where either is not finite. The
    torch backend is eager PyTorch's ops, and those can disagree with float64 at specials: on CPU, float32
    F.gelu(+Inf) is NaN where float64's is +Inf (torch 2.13)."""
    e = eager.double()
    special = ~torch.isfinite(e) | ~torch.isfinite(want)
    return torch.where(special, e, want)


def _check_gated(p, backend):
    x, (wg, wu, wd), (bg, bu, bd) = _gated_inputs(p)
    act = ACT_SPELLINGS[p["act"]]
    with torch.no_grad():
        y = ops.gated_mlp(x, wg, wu, wd, p["act"], bg, bu, bd, backend=backend)
    up = [t.double() if t is not None else None for t in (x, wg, wu, wd, bg, bu, bd)]
    want, magnitude = _gated_oracle(act, *up)
    if backend == "torch":
        with torch.no_grad():
            want = _eager_specials(want, _gated_oracle(act, x, wg, wu, wd, bg, bu, bd)[0])
    _assert_matches(y, want, magnitude, p["dtype"], p["dim"] + p["hidden"], "gated_mlp y")


def _check_linear(p, backend):
    x, (w, _, _), (b, _, _) = _gated_inputs(p)
    act = ACT_SPELLINGS[p["act"]]
    with torch.no_grad():
        y = ops.linear_act(x, w, b, p["act"], backend=backend)
    want, magnitude = _linear_oracle(act, *(t.double() if t is not None else None for t in (x, w, b)))
    if backend == "torch":
        with torch.no_grad():
            want = _eager_specials(want, _linear_oracle(act, x, w, b)[0])
    _assert_matches(y, want, magnitude, p["dtype"], p["dim"], "linear_act y")


@fuzz(500)
@given(problems())
def test_gated_mlp_torch_backend_equals_the_oracle(p):
    _check_gated(p, "torch")


@fuzz(500)
@given(problems())
def test_linear_act_torch_backend_equals_the_oracle(p):
    _check_linear(p, "torch")


def _grad_tolerance(dtype, depth: int, want: torch.Tensor) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    return 64 * EPS[dtype] * (depth + 4) * (scale + 1.0)


def _check_training(p, gated: bool, backend: str):
    """Forward under autograd, then every gradient against float64 autograd of the plain form."""
    x, ws, bs = _gated_inputs(p)
    act = ACT_SPELLINGS[p["act"]]
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, *ws, *bs)]
    if not gated:
        leaves = [leaves[0], leaves[1], leaves[4]]
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    if gated:
        y = ops.gated_mlp(leaves[0], *leaves[1:4], p["act"], *leaves[4:], backend=backend)
        want, magnitude = _gated_oracle(act, *leaves64)
    else:
        y = ops.linear_act(*leaves, p["act"], backend=backend)
        want, magnitude = _linear_oracle(act, *leaves64)
    _assert_matches(y.detach(), want.detach(), magnitude.detach(), p["dtype"], p["dim"] + p["hidden"], "y")
    dy = _values(want.shape, p["seed"] + 9)
    y.backward(dy.to(y.dtype))
    want.backward(dy)
    depth = p["dim"] + p["hidden"] + max(1, math.prod(p["lead"]))
    for name, t, t64 in zip(("x", "w1", "w2", "w3", "b1", "b2", "b3") if gated else ("x", "w", "b"), leaves, leaves64):
        if t is None:
            continue
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, name
        err = (t.grad.double() - t64.grad).abs().max().item() if t.numel() else 0.0
        assert err <= _grad_tolerance(p["dtype"], depth, t64.grad), (name, err, t.shape)


@fuzz(150)
@given(problems(dtypes=(torch.float64, torch.float32), allow_poison=False), st.booleans())
def test_gradients_equal_float64_autograd(p, gated):
    _check_training(p, gated, "torch")


@st.composite
def tiny_fp32(draw):
    """Triton interpreter cases: fp32, tiny, with rows enough for each kernel path (decode <= 64 rows < gated GEMM)."""
    p = draw(problems(dtypes=(torch.float32,), max_size=6))
    p["lead"] = draw(st.sampled_from([(1,), (3,), (2, 3), (70,)]))
    p["dim"], p["hidden"] = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    p["train"] = draw(st.booleans())
    return p


@pytest.mark.skipif(not TRITON, reason="Triton kernels cannot run here")
@fuzz(25)
@given(tiny_fp32())
def test_gated_mlp_triton_backend_equals_the_oracle(p):
    if p["train"]:
        p["poison"] = 0
        _check_training(p, True, "triton")
    else:
        _check_gated(p, "triton")


@pytest.mark.skipif(not TRITON, reason="Triton kernels cannot run here")
@fuzz(20)
@given(tiny_fp32())
def test_linear_act_triton_backend_equals_the_oracle(p):
    if p["train"]:
        p["poison"] = 0
        _check_training(p, False, "triton")
    else:
        _check_linear(p, "triton")


# ---- bad inputs: InputError naming the argument ------------------------------------------------------------------


def _not_a_tensor(t):
    return [t.tolist(), t.numpy() if t.dtype != torch.bfloat16 else 1.0, 3, "x", None]


def _mutations(x, wg, wu, wd, bg, bu, bd):
    """(argument named, call arguments) pairs: one thing wrong each."""
    d, h = wg.shape[1], wg.shape[0]
    other = torch.float64 if x.dtype != torch.float64 else torch.float32
    wide = torch.zeros(*x.shape[:-1], d + 1, dtype=x.dtype)
    out = [
        ("x", dict(x=wide)),
        ("x", dict(x=torch.tensor(1.0, dtype=x.dtype))),
        ("x", dict(x=x.to(torch.int32), gate_weight=wg.to(torch.int32), up_weight=wu.to(torch.int32),
                   down_weight=wd.to(torch.int32))),
        ("x", dict(x=x.to(torch.bool))),
        ("x", dict(x=x.to(torch.complex64))),
        ("gate_weight", dict(gate_weight=wg.reshape(-1))),
        ("gate_weight", dict(gate_weight=wg[None])),
        ("gate_weight", dict(x=x.to(other))),
        ("up_weight", dict(up_weight=torch.zeros(h + 1, d, dtype=x.dtype))),
        ("up_weight", dict(up_weight=wu.to(other))),
        ("up_weight", dict(up_weight=wu.to(torch.int64))),
        ("down_weight", dict(down_weight=torch.zeros(d + 1, h, dtype=x.dtype))),
        ("down_weight", dict(down_weight=wd.to("meta"))),
        ("gate_bias", dict(gate_bias=torch.zeros(h + 1, dtype=x.dtype))),
        ("up_bias", dict(up_bias=torch.zeros(1, h, dtype=x.dtype))),
        ("down_bias", dict(down_bias=torch.zeros(d, dtype=other))),
        ("down_bias", dict(down_bias=[0.0] * d)),
        ("activation", dict(activation="gelu_fast")),
        ("activation", dict(activation=3)),
        ("activation", dict(activation=["silu"])),
        ("backend", dict(backend="cudnn")),
        ("backend", dict(backend=1)),
    ]
    out += [("x", dict(x=v)) for v in _not_a_tensor(x)]
    out += [("up_weight", dict(up_weight=v)) for v in _not_a_tensor(wu)]
    if x.dim() >= 1 and x.numel() and x.dtype != torch.float16:
        out.append(("x", dict(x=x.to_sparse())))
    return out


def _assert_input_error(call, argument: str):
    with pytest.raises(ValueError) as info:
        call()
    assert type(info.value) is InputError, repr(info.value)
    message = str(info.value)
    assert message.startswith(f"{argument}:") and "\n" not in message, message


@fuzz(250)
@given(problems(dtypes=(torch.float32, torch.float16, torch.float64), max_size=5, allow_poison=False),
       st.integers(0, 10_000), st.sampled_from(["torch", None]))
def test_bad_gated_mlp_arguments_name_the_argument(p, which, backend):
    x, (wg, wu, wd), (bg, bu, bd) = _gated_inputs(p)
    mutations = _mutations(x, wg, wu, wd, bg, bu, bd)
    argument, change = mutations[which % len(mutations)]
    args = dict(x=x, gate_weight=wg, up_weight=wu, down_weight=wd, activation="silu", gate_bias=bg, up_bias=bu,
                down_bias=bd, backend=backend)
    args.update(change)
    if argument.endswith("_bias") and args[argument] is None:
        return
    _assert_input_error(lambda: ops.gated_mlp(**args), argument)


@fuzz(150)
@given(problems(dtypes=(torch.float32, torch.float64), max_size=5, allow_poison=False), st.integers(0, 10_000))
def test_bad_linear_act_arguments_name_the_argument(p, which):
    x, (w, _, wd), (b, _, _) = _gated_inputs(p)
    d, n = w.shape[1], w.shape[0]
    other = torch.float64 if x.dtype != torch.float64 else torch.float32
    mutations = [
        ("x", dict(x=torch.zeros(*x.shape[:-1], d + 1, dtype=x.dtype))),
        ("x", dict(x=x.to(torch.int64), weight=w.to(torch.int64))),
        ("x", dict(x=torch.tensor(2.0, dtype=x.dtype))),
        ("weight", dict(weight=w.reshape(-1))),
        ("weight", dict(weight=w.to(other))),
        ("weight", dict(weight=w.to(torch.int32))),
        ("weight", dict(weight=w.to_sparse())),
        ("bias", dict(bias=torch.zeros(n + 1, dtype=x.dtype))),
        ("bias", dict(bias=torch.zeros(n, dtype=other))),
        ("bias", dict(bias=w)),
        ("activation", dict(activation="tanh")),
        ("backend", dict(backend="Triton2")),
        *[("x", dict(x=v)) for v in _not_a_tensor(x)],
        *[("weight", dict(weight=v)) for v in _not_a_tensor(w)],
    ]
    argument, change = mutations[which % len(mutations)]
    args = dict(x=x, weight=w, bias=b, activation="relu", backend="torch")
    args.update(change)
    _assert_input_error(lambda: ops.linear_act(**args), argument)


# ---- modules: constructor arguments and from_module sources -----------------------------------------------------

SIZES = st.one_of(st.integers(-3, 12), st.sampled_from([0.5, 2.0, "4", None, True, np.int64(3), torch.tensor(5)]))


def _valid_size(v) -> bool:
    if isinstance(v, bool):
        return False
    try:
        return int(v.__index__()) >= 1
    except (AttributeError, TypeError):
        return False


@fuzz(250)
@given(
    st.sampled_from(["GatedMLP", "PackedGatedMLP", "FusedLinear", "MLP"]),
    SIZES, SIZES,
    st.one_of(st.sampled_from(list(ACT_SPELLINGS)), st.text(max_size=12)),
    st.sampled_from([True, False, 0, 1, "yes", None, 2]),
    st.sampled_from([None, torch.float32, torch.float64, torch.int32, "float32"]),
    st.sampled_from([None, "cpu", torch.device("cpu"), "meta", "nope", 7]),
    st.integers(0, 2**16),
)
def test_module_constructors_build_a_working_module_or_name_the_argument(kind, a, b, act, bias, dtype, device, seed):
    cls = {"GatedMLP": GatedMLP, "PackedGatedMLP": PackedGatedMLP, "FusedLinear": FusedLinear, "MLP": MLP}[kind]
    names = ("in_features", "out_features") if kind == "FusedLinear" else ("dim", "hidden")
    problems_ = [n for n, v in zip(names, (a, b)) if not _valid_size(v)]
    if not (isinstance(bias, int) and bias in (0, 1)):
        problems_.append("bias")
    if dtype not in (None, torch.float32, torch.float64):
        problems_.append("dtype")
    if device in ("nope", 7):
        problems_.append("device")
    try:
        activations.get(act)
    except InputError:
        problems_.append("activation")
    kwargs = dict(bias=bias, device=device, dtype=dtype, backend="torch")
    if problems_:
        with pytest.raises(InputError) as info:
            cls(a, b, activation=act, **kwargs)
        assert str(info.value).split(":")[0] in problems_ and "\n" not in str(info.value), str(info.value)
        return
    torch.manual_seed(seed)
    m = cls(a, b, activation=act, **kwargs)
    if device == "meta":
        return
    n_in = int(a.__index__())
    x = _values((3, n_in), seed).to(dtype or torch.get_default_dtype())
    with torch.no_grad():
        got = m(x)
        m64 = _reference_module(m).double()
        want = m64(x.double())
    assert got.shape == want.shape and got.dtype == x.dtype
    tol = 1e-9 if x.dtype == torch.float64 else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _reference_module(m):
    """The plain PyTorch module mlpfuse's module replaces, holding copies of its parameters."""
    act = PLAIN[m.activation] if not isinstance(m, MLP) else PLAIN[m.fc1.activation]

    class Plain(nn.Module):
        def __init__(self, params, fn):
            super().__init__()
            self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.detach().clone()) for k, v in params})
            self.fn = fn

        def forward(self, x):
            return self.fn(self.p, x)

    def lin(p, name, x):
        return F.linear(x, p[f"{name}_weight"], p[f"{name}_bias"] if f"{name}_bias" in p else None)

    if isinstance(m, PackedGatedMLP):
        def fn(p, x):
            g, u = lin(p, "gate_up_proj", x).chunk(2, dim=-1)
            return lin(p, "down_proj", act(g) * u)
    elif isinstance(m, GatedMLP):
        def fn(p, x):
            return lin(p, "down_proj", act(lin(p, "gate_proj", x)) * lin(p, "up_proj", x))
    elif isinstance(m, FusedLinear):
        def fn(p, x):
            return act(F.linear(x, p["weight"], p["bias"] if "bias" in p else None))
    else:
        def fn(p, x):
            return lin(p, "fc2", act(lin(p, "fc1", x)))
    return Plain(m.named_parameters(), fn)


class _Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D layout: a [in, out] weight (transposed from nn.Linear's)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


class _LinearLike(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.randn(n_out, n_in))
        self.bias = None

    def forward(self, x):
        return F.linear(x, self.weight)


SOURCES = {
    "Linear": lambda: nn.Linear(6, 4),
    "Linear no bias": lambda: nn.Linear(6, 4, bias=False),
    "Linear-like": lambda: _LinearLike(6, 4),
    "Embedding": lambda: nn.Embedding(6, 4),
    "Conv1D": lambda: _Conv1D(4, 6),
    "Conv1d": lambda: nn.Conv1d(6, 4, 1),
    "Bilinear": lambda: nn.Bilinear(6, 6, 4),
    "LayerNorm": lambda: nn.LayerNorm(6),
    "Sequential": lambda: nn.Sequential(nn.Linear(6, 4)),
    "Linear 0 in": lambda: nn.Linear(0, 4),
    "None": lambda: None,
    "int": lambda: 3,
    "tensor": lambda: torch.randn(4, 6),
}
LINEAR_LIKE = {"Linear", "Linear no bias", "Linear-like"}


@fuzz(100)
@given(st.sampled_from(list(SOURCES)), st.sampled_from(["FusedLinear", "GatedMLP", "MLP", "MLP two"]),
       st.sampled_from([None, "silu", "nope"]))
def test_from_module_takes_linear_layouts_only(source, target, act):
    torch.manual_seed(0)
    module = SOURCES[source]()
    if target == "FusedLinear":
        call = lambda: FusedLinear.from_module(module, act, backend="torch")  # noqa: E731
    elif target == "GatedMLP":
        call = lambda: GatedMLP.from_module(module, act, backend="torch")  # noqa: E731
    elif target == "MLP":
        call = lambda: MLP.from_module(module, activation=act, backend="torch")  # noqa: E731
    else:
        call = lambda: MLP.from_module(module, nn.Linear(4, 6), activation=act, backend="torch")  # noqa: E731
    ok = source in LINEAR_LIKE and target in ("FusedLinear", "MLP two") and act != "nope"
    ok = ok and not (target == "MLP two" and act is None)
    if not ok:
        with pytest.raises(InputError) as info:
            call()
        assert str(info.value).split(":")[0] in ("module", "activation", "fc1") and "\n" not in str(info.value)
        return
    fused = call()
    x = torch.randn(5, 6)
    with torch.no_grad():
        if target == "FusedLinear":
            want = PLAIN[ACT_SPELLINGS.get(act, "identity")](F.linear(x, module.weight, module.bias))
        else:
            want = fused.fc2(PLAIN["silu"](F.linear(x, module.weight, module.bias)))
        torch.testing.assert_close(fused(x), want)
