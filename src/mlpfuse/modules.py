"""Drop-in modules: GatedMLP (Llama/Gemma MLP), PackedGatedMLP (Phi-3's gate_up_proj), FusedLinear, MLP, and
Fp8Linear (a projection held in the FP8 recipe, which GatedMLP(precision="fp8") is made of).

Parameter names match the modules they replace, so state_dicts load as is: `gate_proj.weight`, `up_proj.weight`,
`down_proj.weight` (+ `.bias`) for GatedMLP; `gate_up_proj.weight`, `down_proj.weight` for PackedGatedMLP;
`weight`, `bias` for FusedLinear; `fc1.*`, `fc2.*` for MLP. Each `from_module` reuses the source's Parameter objects
(same storage, no copies), so a model can be converted in place of its MLPs without growing its memory.

Forwards are TorchScript-compatible: they call the `torch.ops.mlpfuse.*` custom ops through functions with typed
signatures, and keep the activation and backend as plain strings. Under tensor parallelism (parameters made DTensors
by `parallelize_module` or `mlpfuse.parallel.tensor_parallel`) they run the same ops on each rank's local shards
(`mlpfuse.ops.sharded`).
"""

import copy
import functools
import operator
import types
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from mlpfuse import activations, fp8
from mlpfuse.errors import InputError
from mlpfuse.ops import _checks, dispatch, fp8_mlp
from mlpfuse.ops._util import plain_linear
from mlpfuse.ops.gated_mlp import CallPlan, gated_mlp_call, registered_call
from mlpfuse.ops.linear_act import LinearActPlan, linear_act_call
from mlpfuse.ops.linear_act import registered_call as linear_registered_call

_ACTIVATION_ATTRS = ("act_fn", "activation_fn", "act", "activation")
# Parameter types of the plain (single-process) path; anything else (a DTensor) is looked at more closely.
_PLAIN = (nn.Parameter, torch.Tensor)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _show(value) -> str:
    """A value for a one-line message: repr, on one line, cut short."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _size(name: str, value) -> int:
    """A layer size: an integer >= 1 (numpy and torch integers too, bool not)."""
    n = None
    if not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.dim() != 0):
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None or not 1 <= n < 2**63:
        raise InputError(f"{name}: expected an integer >= 1, got {type(value).__name__} {_show(value)}")
    return n


def _check_init(sizes: tuple, bias, device, dtype) -> tuple[int, ...]:
    """Constructor arguments, checked before anything is allocated (construction is not the hot path); the sizes
    come back as plain ints."""
    ints = tuple(_size(name, value) for name, value in sizes)
    if ints[0] * ints[1] * 2 >= 2**63:  # x2: PackedGatedMLP's [2·hidden, dim]; torch's own error is an overflow
        raise InputError(f"{sizes[1][0]}: {sizes[0][0]}·{sizes[1][0]} = {ints[0] * ints[1]} weights is more than "
                         f"a tensor holds")
    if not (isinstance(bias, int) and bias in (0, 1)):
        raise InputError(f"bias: expected True or False, got {_show(bias)}")
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise InputError(f"dtype: expected None or torch.bfloat16, float16, float32 or float64, got {_show(dtype)}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InputError(f"device: expected None, a torch.device or a name like 'cpu' or 'cuda:0', "
                             f"got {_show(device)}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device: {device} was asked for but torch sees no CUDA device")
    return ints


def activation_name(fn) -> Optional[str]:
    """Our name for the activation an object computes, or None when it is not one of ours: a name looked up as
    such; an activation module without tensors of its own (torch.nn's, transformers' ACT2FN) or a plain function
    (F.silu, torch.relu) decided on numbers in float64 (activations.identify), never by its class name — a module
    is evaluated on a copy. Verdicts are cached by class and plain attributes (a function: by itself)."""
    if isinstance(fn, str):
        try:
            return activations.get(fn).name
        except InputError:
            return None
    if isinstance(fn, nn.Module):
        if isinstance(fn, nn.modules.dropout._DropoutNd):
            return None  # the identity in eval mode, random in training: no activation
        if any(True for _ in fn.parameters()) or any(True for _ in fn.buffers()):
            return None  # a learned activation (PReLU) is none of ours
        attrs = tuple(sorted((k, v) for k, v in vars(fn).items()
                             if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))))
        key = (type(fn), attrs)
    elif isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        key = fn
    else:
        return None  # a class, a bound method, an object: calling it could do anything
    try:
        return _IDENTIFIED[key]
    except KeyError:
        pass
    except TypeError:  # unhashable: decide without caching
        key = None
    name = activations.identify(copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn)
    if key is not None:
        _IDENTIFIED[key] = name
    return name


_IDENTIFIED: dict = {}


def _activation_of(module: nn.Module, argument: str = "activation") -> str:
    """The activation a source module applies: its activation attribute, else its config's hidden_act."""
    for attr in _ACTIVATION_ATTRS:
        fn = getattr(module, attr, None)
        if fn is None:
            continue
        if isinstance(fn, str):
            return activations.get(fn, argument=f"{argument} ({attr})").name
        name = activation_name(fn)
        if name is None:
            raise InputError(
                f"{argument}: cannot tell which activation {type(module).__name__}.{attr} "
                f"({type(fn).__name__}) computes; pass activation= explicitly"
            )
        return name
    config = getattr(module, "config", None)
    for key in ("hidden_activation", "hidden_act"):
        name = getattr(config, key, None)
        if isinstance(name, str):
            return activations.get(name, argument=f"{argument} (config.{key})").name
    raise InputError(f"{argument}: {type(module).__name__} has no act_fn or config.hidden_act; pass activation=")


def _weight_of(module: nn.Module, name: str, shape: Optional[tuple] = None) -> tuple[nn.Parameter, Optional[nn.Parameter]]:
    """(weight, bias) Parameters of a Linear-like child, checked.

    Linear-like: an nn.Linear (or subclass), or a module whose in_features / out_features match its 2-D
    [out_features, in_features] weight. Other modules with a 2-D weight (nn.Embedding's [num, dim] table,
    transformers' Conv1D with its [in, out] weight) hold something else and are refused, not misread.
    """
    child = getattr(module, name, None) if name else module
    label = name or type(module).__name__
    expected = f"module: expected {name + ' to be ' if name else ''}an nn.Linear or a Linear-like module"
    if not isinstance(child, nn.Module):
        raise InputError(f"{expected}, got {type(child).__name__}")
    weight = getattr(child, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InputError(f"{expected} with a 2-D weight, got {type(child).__name__}")
    if not isinstance(child, nn.Linear):
        features = (getattr(child, "out_features", None), getattr(child, "in_features", None))
        if features != tuple(weight.shape):
            raise InputError(f"{expected} (in_features, out_features and an [out_features, in_features] weight), "
                             f"got {type(child).__name__}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise InputError(f"module: expected {label}.weight in a floating-point dtype, got {weight.dtype}")
    if 0 in weight.shape:
        raise InputError(f"module: expected {label}.weight without empty dimensions, got {list(weight.shape)}")
    if shape is not None and tuple(weight.shape) != tuple(shape):
        raise InputError(f"module: expected {label}.weight of shape {list(shape)}, got {list(weight.shape)}")
    bias = getattr(child, "bias", None)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        got = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise InputError(f"module: expected {label}.bias of shape [{weight.shape[0]}] or None, got {got}")
    return weight, bias


def _linear_using(weight: nn.Parameter, bias: Optional[nn.Parameter]) -> nn.Linear:
    """An nn.Linear whose parameters ARE the given ones (allocated on meta first, so nothing is copied)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=weight.requires_grad)
    if bias is not None:
        lin.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=bias.requires_grad)
    return lin


@torch.jit.unused
def _sharded(a: Tensor, b: Optional[Tensor] = None, c: Optional[Tensor] = None) -> bool:
    """True when tensor parallelism made the weights DTensors. Runs on every call: plain parameters are told apart
    by their type alone (a generator over the weights would cost more than a decode-sized call can spare)."""
    plain = _PLAIN
    if type(a) in plain and (b is None or type(b) in plain) and (c is None or type(c) in plain):
        return False
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from mlpfuse.ops import sharded

    return sharded.is_distributed(a, b, c)


@torch.jit.unused
def _weight_bias(linear: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of a Linear-like child: straight from its parameter dict when they live there, else (e.g.
    parametrized weights) through attribute access."""
    params = linear._parameters
    w = params.get("weight")
    if w is None:
        w = linear.weight
    b = params["bias"] if "bias" in params else getattr(linear, "bias", None)
    return w, b


@torch.jit.unused
def _plan_of(module: nn.Module, kind: type):
    """The module's call plan (made here for a module unpickled from before it had one)."""
    plan = module.__dict__.get("_plan")
    if plan is None:
        plan = module.__dict__["_plan"] = kind()
    return plan


def _same_kind(named: list[tuple[str, Optional[Tensor]]]) -> None:
    first_name, first = named[0]
    for name, t in named[1:]:
        if t is not None and (t.dtype != first.dtype or t.device != first.device):
            raise InputError(
                f"module: expected {name} in {first.dtype} on {first.device} like {first_name}, "
                f"got {t.dtype} on {t.device}"
            )


def _repr_backend(backend: str) -> str:
    return f", backend={backend}" if backend else ""


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): the Llama / Gemma / Mistral / Qwen MLP, gate and up in one kernel.

    backend: "auto" | "triton" | "torch" | "cuda", or None to read MLPFUSE_BACKEND at each call (else "auto").
    recompute: in training keep only the input for the backward, which recomputes the pre-activations with the
    forward's kernels (three [tokens, hidden] tensors less per block, two GEMMs more), eager and compiled.
    save: "high" (default: training keeps the pre-activations g and u in the weights' dtype) or "fp8" (training,
    eager and compiled, keeps them in the FP8 recipe, written by the gated GEMM's epilogue: half their bytes; the
    backward reads them dequantized — mlpfuse.ops.gated_mlp.gated_mlp_call); not with recompute or precision="fp8".
    precision: None (the weights' dtype), "fp8" (inference: the projections held in the FP8 recipe, `to_fp8`), or
    "fp8-train" (training in FP8: the weights stay in their dtype, the optimizer's masters, and every GEMM of the
    forward and the backward runs in e4m3 on them, quantized per step — mlpfuse.ops.fp8_train; g and u kept for the
    backward in FP8; what patch(precision="fp8") swaps in for a model in train mode).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: Optional[str] = "gelu_tanh",
        bias: bool = False,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
        recompute: bool = False,
        precision: Optional[str] = None,
        save: str = "high",
    ):
        super().__init__()
        dim, hidden = _check_init((("dim", dim), ("hidden", hidden)), bias, device, dtype)
        precision = _check_precision(precision)
        self.save: str = check_save(save, recompute, precision)
        self.dim, self.hidden = dim, hidden
        self.activation: str = activations.get(activation).name
        self.backend: str = dispatch.check_backend_name(backend)
        self.recompute: bool = _checks.flag("recompute", recompute)
        self.gate_proj = nn.Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self._plan = CallPlan()
        self.precision: str = "fp8-train" if precision == "fp8-train" else ""
        if precision == "fp8":
            self.to_fp8()

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_scripting():
            precision = self.__dict__.get("precision")
            if precision == "fp8":
                return self._fp8_forward(x)
            if precision == "fp8-train":
                return self._fp8_train_forward(x)
            # Plain dict reads instead of six nn.Module.__getattr__ calls: at decode sizes the host time per call
            # is the cost.
            mods = self._modules
            wg, bg = _weight_bias(mods["gate_proj"])
            wu, bu = _weight_bias(mods["up_proj"])
            wd, bd = _weight_bias(mods["down_proj"])
            if _sharded(wg, wu, wd):
                return self._sharded_forward(x)
            return gated_mlp_call(x, wg, wu, wd, bg, bu, bd, self.activation, self.backend, _plan_of(self, CallPlan),
                                  None, getattr(self, "recompute", False), None,
                                  self.__dict__.get("save") == "fp8")
        return registered_call(
            x,
            self.gate_proj.weight,
            self.up_proj.weight,
            self.down_proj.weight,
            self.gate_proj.bias,
            self.up_proj.bias,
            self.down_proj.bias,
            self.activation,
            self.backend,
            self.recompute,
        )

    @torch.jit.unused
    def _sharded_forward(self, x: Tensor) -> Tensor:
        from mlpfuse.ops import sharded

        children = [(n, getattr(self, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        return sharded.gated(x, children, False, self.activation, self.backend)

    @torch.jit.unused
    def _fp8_forward(self, x: Tensor) -> Tensor:
        mods = self._modules
        g, u, d = mods["gate_proj"], mods["up_proj"], mods["down_proj"]
        return fp8_mlp.fp8_gated_mlp(x, g.weight, g.weight_scale_inv, u.weight, u.weight_scale_inv, d.weight,
                                     d.weight_scale_inv, g.bias, u.bias, d.bias, self.activation, self.backend)

    @torch.jit.unused
    def _fp8_train_forward(self, x: Tensor) -> Tensor:
        from mlpfuse.ops import fp8_train

        mods = self._modules
        wg, bg = _weight_bias(mods["gate_proj"])
        wu, bu = _weight_bias(mods["up_proj"])
        wd, bd = _weight_bias(mods["down_proj"])
        if _sharded(wg, wu, wd):
            raise InputError("precision='fp8-train': sharded (DTensor) weights are not supported; train the block "
                             "unsharded or with precision=None")
        return fp8_train.fp8_gated_mlp_train(x, wg, wu, wd, bg, bu, bd, self.activation, self.backend)

    @torch.jit.unused
    def to_fp8(self) -> "GatedMLP":
        """Quantize the three projections into the FP8 recipe (mlpfuse.fp8: e4m3, one fp32 scale per 128×128
        block), in place, dropping the high-precision weights; returns the module. Inference only afterwards. The
        state_dict then holds `<proj>.weight` (e4m3) and `<proj>.weight_scale_inv` (fp32), transformers' FP8Linear
        keys; biases stay in their dtype."""
        if self.__dict__.get("precision") == "fp8":
            return self
        for name in ("gate_proj", "up_proj", "down_proj"):
            child = getattr(self, name)
            if isinstance(child, Fp8Linear):
                continue
            w, _ = _weight_of(self, name)
            if _sharded(w):
                raise InputError(f"{name}.weight: a sharded (DTensor) weight cannot be quantized in place; "
                                 "quantize before tensor parallelism")
            setattr(self, name, Fp8Linear.from_linear(child))
        self.precision = "fp8"
        return self

    @torch.jit.unused
    def dequantize(self) -> "GatedMLP":
        """Back to nn.Linear projections in the dtype the weights were quantized from (lossy: the FP8 values, not the
        originals), in place; returns the module."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            child = getattr(self, name)
            if isinstance(child, Fp8Linear):
                setattr(self, name, child.to_linear())
        self.precision = ""
        return self

    def extra_repr(self) -> str:
        bias = self.gate_proj.bias is not None
        precision = getattr(self, "precision", "")
        fp8_note = f", precision={precision}" if precision else ""
        return (
            f"dim={self.dim}, hidden={self.hidden}, activation={self.activation}, bias={bias}"
            f"{_repr_backend(self.backend)}{', recompute=True' if getattr(self, 'recompute', False) else ''}{fp8_note}"
        )

    @classmethod
    def from_linears(
        cls,
        gate_proj: nn.Module,
        up_proj: nn.Module,
        down_proj: nn.Module,
        activation: Optional[str] = "gelu_tanh",
        backend: Optional[str] = None,
    ) -> "GatedMLP":
        """A GatedMLP whose parameters are those of three Linear-like modules (shared, not copied)."""
        wg, bg = _weight_of(gate_proj, "")
        hidden, dim = wg.shape
        wu, bu = _weight_of(up_proj, "", (hidden, dim))
        wd, bd = _weight_of(down_proj, "", (dim, hidden))
        _same_kind([("gate_proj.weight", wg), ("up_proj.weight", wu), ("down_proj.weight", wd),
                    ("gate_proj.bias", bg), ("up_proj.bias", bu), ("down_proj.bias", bd)])
        m = cls(dim, hidden, activation, bias=False, device="meta", backend=backend)
        m.gate_proj, m.up_proj, m.down_proj = _linear_using(wg, bg), _linear_using(wu, bu), _linear_using(wd, bd)
        return m

    @classmethod
    def from_module(
        cls, module: nn.Module, activation: Optional[str] = None, backend: Optional[str] = None
    ) -> "GatedMLP":
        """Wrap a transformers-style gated MLP, sharing its parameters.

        Recognised layouts: gate_proj / up_proj / down_proj (Llama, Gemma, Mistral, Qwen), w1 / w3 / w2 (Mixtral
        experts), and a packed gate_up_proj [2·hidden, dim] with down_proj (Phi-3), which gives a PackedGatedMLP.
        activation None reads the module's act_fn (or its config's hidden_act).
        """
        if not isinstance(module, nn.Module):
            raise InputError(f"module: expected an nn.Module (a gated MLP), got {type(module).__name__}")
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            act = activation if activation is not None else _activation_of(module)
            return PackedGatedMLP.from_linears(module.gate_up_proj, module.down_proj, act, backend)
        for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
            if all(hasattr(module, n) for n in (gate, up, down)):
                act = activation if activation is not None else _activation_of(module)
                return cls.from_linears(getattr(module, gate), getattr(module, up), getattr(module, down), act, backend)
        raise InputError(
            f"module: expected gate_proj/up_proj/down_proj, w1/w3/w2 or gate_up_proj/down_proj children in "
            f"{type(module).__name__}"
        )

    @classmethod
    def from_packed(
        cls,
        gate_up_proj: nn.Module,
        down_proj: nn.Module,
        activation: Optional[str] = "gelu_tanh",
        backend: Optional[str] = None,
    ) -> "PackedGatedMLP":
        """A gated MLP over a packed [2·hidden, dim] gate_up projection (gate rows first), sharing parameters."""
        return PackedGatedMLP.from_linears(gate_up_proj, down_proj, activation, backend)


class PackedGatedMLP(GatedMLP):
    """GatedMLP with Phi-3's packed `gate_up_proj` ([2·hidden, dim], gate rows first) and `down_proj`.

    The kernels read gate and up as two views of the packed weight: no per-call split, concatenation or copy.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: Optional[str] = "gelu_tanh",
        bias: bool = False,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
        recompute: bool = False,
    ):
        nn.Module.__init__(self)  # not GatedMLP's: this layout has no separate gate_proj / up_proj
        dim, hidden = _check_init((("dim", dim), ("hidden", hidden)), bias, device, dtype)
        self.dim, self.hidden = dim, hidden
        self.activation: str = activations.get(activation).name
        self.backend: str = dispatch.check_backend_name(backend)
        self.recompute: bool = _checks.flag("recompute", recompute)
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        w = self.gate_up_proj.weight
        if not torch.jit.is_scripting():
            if _sharded(w, self.down_proj.weight):  # before any slicing: a DTensor slice would gather the shards
                return self._sharded_forward(x)
        b = self.gate_up_proj.bias
        gate_bias: Optional[Tensor] = None
        up_bias: Optional[Tensor] = None
        if b is not None:
            gate_bias, up_bias = b[: self.hidden], b[self.hidden :]
        if not torch.jit.is_scripting():
            return gated_mlp_call(x, w[: self.hidden], w[self.hidden :], self.down_proj.weight, gate_bias, up_bias,
                                  self.down_proj.bias, self.activation, self.backend, _plan_of(self, CallPlan), None,
                                  getattr(self, "recompute", False))
        return registered_call(
            x,
            w[: self.hidden],
            w[self.hidden :],
            self.down_proj.weight,
            gate_bias,
            up_bias,
            self.down_proj.bias,
            self.activation,
            self.backend,
            self.recompute,
        )

    @torch.jit.unused
    def _sharded_forward(self, x: Tensor) -> Tensor:
        from mlpfuse.ops import sharded

        children = [("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)]
        return sharded.gated(x, children, True, self.activation, self.backend)

    def extra_repr(self) -> str:
        bias = self.gate_up_proj.bias is not None
        return (
            f"dim={self.dim}, hidden={self.hidden}, activation={self.activation}, bias={bias}, packed=True"
            f"{_repr_backend(self.backend)}"
        )

    @torch.jit.unused
    def to_fp8(self) -> "GatedMLP":
        """A GatedMLP in the FP8 recipe holding this module's gate and up halves quantized apart (so its state_dict
        has gate_proj / up_proj keys, not gate_up_proj), and down_proj; this module is left as it is."""
        w, b = _weight_of(self.gate_up_proj, "gate_up_proj")
        h = self.hidden
        m = GatedMLP(self.dim, h, self.activation, bias=False, device="meta", backend=self.backend or None)
        m.gate_proj = Fp8Linear.from_weight(w[:h], None if b is None else b[:h])
        m.up_proj = Fp8Linear.from_weight(w[h:], None if b is None else b[h:])
        m.down_proj = Fp8Linear.from_linear(self.down_proj)
        m.precision = "fp8"
        return m

    @classmethod
    def from_linears(  # type: ignore[override]
        cls,
        gate_up_proj: nn.Module,
        down_proj: nn.Module,
        activation: Optional[str] = "gelu_tanh",
        backend: Optional[str] = None,
    ) -> "PackedGatedMLP":
        w, b = _weight_of(gate_up_proj, "")
        if w.shape[0] % 2:
            raise InputError(f"gate_up_proj: expected an even number of rows (gate and up), got {w.shape[0]}")
        hidden, dim = w.shape[0] // 2, w.shape[1]
        wd, bd = _weight_of(down_proj, "", (dim, hidden))
        _same_kind([("gate_up_proj.weight", w), ("down_proj.weight", wd), ("gate_up_proj.bias", b),
                    ("down_proj.bias", bd)])
        m = cls(dim, hidden, activation, bias=False, device="meta", backend=backend)
        m.gate_up_proj, m.down_proj = _linear_using(w, b), _linear_using(wd, bd)
        return m


class FusedLinear(nn.Linear):
    """act(x·weightᵀ + bias) with the bias and activation in the GEMM's epilogue; nn.Linear's parameters and init.

    An nn.Linear subclass, so that tools which shard or wrap linear layers by type (ColwiseParallel,
    RowwiseParallel) take it as one.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: Optional[str] = None,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
    ):
        nn.Module.__init__(self)  # not nn.Linear's: the sizes are checked first, and it would allocate before that
        in_features, out_features = _check_init(
            (("in_features", in_features), ("out_features", out_features)), bias, device, dtype
        )
        self.in_features, self.out_features = in_features, out_features
        self._plan = LinearActPlan()
        self.activation: str = activations.get(activation).name
        self.backend: str = dispatch.check_backend_name(backend)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def register_parameter(self, name: str, param) -> None:
        # (module.weight = ... comes here too.) The held weight.t() would keep the replaced weight's storage alive.
        self._drop_held_view()
        super().register_parameter(name, param)

    def _apply(self, fn, recurse=True):
        self._drop_held_view()  # .to() / .cuda() / .half() move the weight: the held view would pin the old copy
        return super()._apply(fn, recurse)

    @torch.jit.unused
    def _drop_held_view(self) -> None:
        plan = self.__dict__.get("_plan")  # (absent while nn.Module.__init__ registers, and in old pickles)
        if plan is not None:
            plan.weight_t.drop()

    def reset_parameters(self) -> None:
        # nn.Linear's own initialisation, so a FusedLinear starts exactly where an nn.Linear would.
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_scripting():  # (TorchScript compiles none of this block)
            params = self._parameters  # plain dict reads: the host time per call is the cost at small sizes
            w = params["weight"]
            if (self.activation == "identity" and type(x) is Tensor and type(w) in _PLAIN
                    and dispatch.resolve_backend(self.backend) == "auto"):
                # Nothing to fuse: `auto` runs nn.Linear's own call (one cuBLAS GEMM, the bias in its epilogue), and
                # so does this, with nothing checked first and the parameters read from their dict (nn.Linear reads
                # each through Module.__getattr__). Through the op layer the walkthrough's linear step took 246.9 µs
                # against eager's 217.7 under the profiler on an H100; with two helper frames in between, still ~7 µs
                # more than nn.Linear's before F.linear. For 2-D x, F.linear's own addmm / mm over the weight.t()
                # held from the last call (ops._plan.HeldTranspose: one dispatcher op instead of five). Input
                # F.linear refuses goes on to the op layer's checks.
                b = params["bias"]
                held = _plan_of(self, LinearActPlan).weight_t if x.dim() == 2 else None
                y = None if held is None else held.linear(x, w, b)
                if y is None:
                    y = plain_linear(x, w, b)
                    if y is None:
                        return self._call(x)
                    if held is not None:
                        held.make(w)
                return y
            return self._call(x)
        return linear_registered_call(x, self.weight, self.bias, self.activation, self.backend)

    @torch.jit.unused
    def _call(self, x: Tensor) -> Tensor:
        params = self._parameters
        w, b = params["weight"], params["bias"]
        if _sharded(w):
            return self._sharded_forward(x)
        return linear_act_call(x, w, b, self.activation, self.backend, _plan_of(self, LinearActPlan))

    @torch.jit.unused
    def _sharded_forward(self, x: Tensor) -> Tensor:
        from mlpfuse.ops import sharded

        return sharded.linear(self, x, self.activation, self.backend)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"activation={self.activation}{_repr_backend(self.backend)}"
        )

    @classmethod
    def from_module(
        cls, linear: nn.Module, activation: Optional[str] = None, backend: Optional[str] = None
    ) -> "FusedLinear":
        """A FusedLinear sharing an nn.Linear's weight and bias; activation None means none."""
        w, b = _weight_of(linear, "")
        _same_kind([("weight", w), ("bias", b)])
        m = cls(w.shape[1], w.shape[0], bias=False, activation=activation, device="meta", backend=backend)
        shared = _linear_using(w, b)
        m.weight = shared.weight
        m.bias = shared.bias
        return m


def check_save(save, recompute, precision: str = "") -> str:
    """`save` checked: "high" or "fp8" (what training keeps of g and u), and not contradicting the others (nor
    `recompute` contradicting `precision`)."""
    if not isinstance(save, str) or save.strip().lower() not in ("high", "fp8"):
        raise InputError(f"save: expected 'high' (g and u kept in the weights' dtype) or 'fp8', got {save!r}")
    save = save.strip().lower()
    if save == "fp8" and recompute is True:
        raise InputError("save: 'fp8' keeps g and u for the backward; recompute=True keeps neither — choose one")
    if save == "fp8" and precision == "fp8":
        raise InputError("save: precision='fp8' blocks are inference-only; save='fp8' is for training")
    if save == "fp8" and precision == "fp8-train":
        raise InputError("save: precision='fp8-train' keeps g and u in FP8 already; save='fp8' is for bf16 training")
    if precision == "fp8-train" and recompute is True:
        raise InputError("precision: 'fp8-train' keeps x, g and u in FP8 for the backward; recompute=True is for "
                         "precision=None")
    return save


def _check_precision(precision, allowed=("fp8", "fp8-train")) -> str:
    if precision is None or precision == "":
        return ""
    if not isinstance(precision, str) or precision.strip().lower() not in allowed:
        names = " or ".join(repr(a) for a in allowed)
        raise InputError(f"precision: expected None (the weights' own dtype) or {names}, got {precision!r}")
    return precision.strip().lower()


class Fp8Linear(nn.Module):
    """x·Wᵀ + b with W held in the FP8 recipe (mlpfuse.fp8): buffers `weight` (float8_e4m3fn [out, in]) and
    `weight_scale_inv` (fp32, one per 128×128 block), the keys of transformers' FP8Linear, and `bias` in `dtype`.
    Inference only. Decode-sized inputs (≤ 16 tokens) run weight-only; larger ones quantize x 1×128 and run an FP8
    GEMM (mlpfuse.ops.fp8_mlp). `dtype` is the dtype the weight was quantized from, which `to_linear` restores."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype: torch.dtype = torch.bfloat16, activation: Optional[str] = None, backend: Optional[str] = None):
        super().__init__()
        in_features, out_features = _check_init((("in_features", in_features), ("out_features", out_features)),
                                                bias, device, dtype)
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.activation: str = activations.get(activation).name
        self.backend: str = dispatch.check_backend_name(backend)
        self.register_buffer("weight", torch.zeros(out_features, in_features, device=device, dtype=fp8.DTYPE))
        self.register_buffer("weight_scale_inv", torch.ones(fp8.weight_scale_shape(out_features, in_features),
                                                            device=device, dtype=fp8.SCALE_DTYPE))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return fp8_mlp.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.activation, self.backend)

    def fp8_weight(self) -> fp8.Fp8Weight:
        return fp8.Fp8Weight(self.weight, self.weight_scale_inv, self.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Checked as a checkpoint is: a weight that is not e4m3, or scales that do not fit it, is one InputError
        # naming the tensor (nn.Module's own copy would cast a bf16 weight into e4m3 without its scales).
        if prefix + fp8.WEIGHT_KEY in state_dict or prefix + fp8.SCALE_KEY in state_dict:
            w = fp8.Fp8Weight.from_state_dict(state_dict, prefix, dtype=self.dtype)
            if tuple(w.shape) != (self.out_features, self.in_features):
                raise InputError(f"{prefix}weight: shape {list(w.shape)}, this module holds "
                                 f"[{self.out_features}, {self.in_features}]")
            state_dict = {**state_dict, prefix + fp8.SCALE_KEY: w.scale_inv}  # e8m0 scales widened to fp32
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation != "identity" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 128x128{act}{_repr_backend(self.backend)}")

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
                    backend: Optional[str] = None) -> "Fp8Linear":
        """Quantize a [out, in] weight (any floating dtype, which the module computes in); the bias is kept as is."""
        w = fp8.quantize_weight(weight.detach())
        m = cls(w.shape[1], w.shape[0], bias=False, device="meta", dtype=weight.dtype, activation=activation,
                backend=backend)
        m.weight, m.weight_scale_inv = w.values, w.scale_inv
        if bias is not None:
            m.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return m

    @classmethod
    def from_fp8(cls, weight: Tensor, scale_inv: Tensor, bias: Optional[Tensor] = None,
                 dtype: torch.dtype = torch.bfloat16, activation: Optional[str] = None, backend: Optional[str] = None,
                 prefix: str = "") -> "Fp8Linear":
        """Over values and scales already in the recipe (a FineGrainedFP8 checkpoint's FP8Linear): the same tensors,
        nothing quantized (e8m0 scales widened to fp32); checked as a checkpoint is (fp8.Fp8Weight.from_state_dict:
        one InputError naming `prefix` + the tensor). `dtype`: what the module computes and dequantizes in."""
        w = fp8.Fp8Weight.from_state_dict({prefix + fp8.WEIGHT_KEY: weight.detach(),
                                           prefix + fp8.SCALE_KEY: scale_inv.detach()}, prefix, dtype=dtype)
        m = cls(w.shape[1], w.shape[0], bias=False, device="meta", dtype=dtype, activation=activation,
                backend=backend)
        m.weight, m.weight_scale_inv = w.values, w.scale_inv
        if bias is not None:
            m.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Module, activation: Optional[str] = None,
                    backend: Optional[str] = None) -> "Fp8Linear":
        """An Fp8Linear from an nn.Linear-like module (its weight quantized, its bias kept)."""
        w, b = _weight_of(linear, "")
        return cls.from_weight(w, b, activation, backend)

    def to_linear(self) -> nn.Linear:
        """An nn.Linear in `dtype` holding the dequantized weight (lossy) and the bias."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                        dtype=self.dtype)
        lin.weight = nn.Parameter(self.fp8_weight().dequantize(self.dtype))
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().clone())
        return lin


class MLP(nn.Module):
    """fc2(act(fc1(x))): the GPT-style MLP, with fc1's bias and activation fused into its GEMM."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: Optional[str] = "gelu_tanh",
        bias: bool = True,
        device=None,
        dtype=None,
        backend: Optional[str] = None,
    ):
        super().__init__()
        dim, hidden = _check_init((("dim", dim), ("hidden", hidden)), bias, device, dtype)
        self.dim, self.hidden = dim, hidden
        self.fc1 = FusedLinear(dim, hidden, bias, activation, device=device, dtype=dtype, backend=backend)
        self.fc2 = nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}, activation={self.fc1.activation}"

    @classmethod
    def from_module(
        cls,
        fc1: nn.Module,
        fc2: Optional[nn.Module] = None,
        activation: Optional[str] = None,
        backend: Optional[str] = None,
    ) -> "MLP":
        """From a module with fc1 / fc2 children (activation read from it), or from two Linear modules
        (activation required). Parameters are shared, not copied."""
        if fc2 is None:
            module = fc1
            if not isinstance(module, nn.Module) or not (hasattr(module, "fc1") and hasattr(module, "fc2")):
                raise InputError(f"fc1: expected a module with fc1 and fc2 children, or pass fc2=; got {type(module).__name__}")
            activation = activation if activation is not None else _activation_of(module)
            fc1, fc2 = module.fc1, module.fc2
        elif activation is None:
            raise InputError("activation: required when MLP.from_module is given two Linear modules")
        w1, b1 = _weight_of(fc1, "")
        w2, b2 = _weight_of(fc2, "", (w1.shape[1], w1.shape[0]))
        _same_kind([("fc1.weight", w1), ("fc2.weight", w2), ("fc1.bias", b1), ("fc2.bias", b2)])
        m = cls(w1.shape[1], w1.shape[0], activation, bias=False, device="meta", backend=backend)
        m.fc1 = FusedLinear.from_module(fc1, activation, backend)
        m.fc2 = _linear_using(w2, b2)
        return m
