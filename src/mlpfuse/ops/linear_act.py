"""linear_act: y = act(x·Wᵀ + b), bias and activation in the GEMM's epilogue, as torch.library custom ops.

    linear_act(x, W, b?, activation, backend) -> y           inference; its backward recomputes z = x·Wᵀ + b
    linear_act_train(..., save_preact) -> (y, z)              under autograd; z from the forward kernel's epilogue
    linear_act_backward(dy, x, W, b?, z, ...) -> (dx, dW, db) dz = dy·act'(z) (PyTorch pointwise), cuBLAS GEMMs
Without an activation there is nothing to save: dz = dy.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mlpfuse import activations, csrc, reference
from mlpfuse.ops import _checks, _plan, dispatch
from mlpfuse.errors import InputError
from mlpfuse.ops._util import (
    autocast_dtype, cast_all, leading, needs_grad, nothing, op_span, plain_eager, plain_linear, profiling, rows,
)


def _forward(x, weight, bias, activation: str, backend: str, save: bool, path: str = ""):
    """(y [..., out], z) with z the 2-D pre-activation when `save` and an activation needs it, else None.
    `path` given: the caller already validated the arguments and chose the path."""
    if not path:
        _checks.linear_act_args(x, weight, bias)
    act = activations.get(activation)
    save = save and act.id != activations.IDENTITY
    x2 = rows(x)
    path = path or dispatch.linear_act_path(backend, x2, weight.shape[0], act.id)
    if path == "torch" or x2.shape[0] == 0:
        out = reference.linear_act_forward(x2, weight, bias, act, save_preact=save)
    elif path == "cuda":
        ext = csrc.extension()  # the path's choice checked x2 for it
        y, z = dispatch.cuda_call(ext.linear_act_forward, x2, weight, bias, act.id, save)
        out = (y, z) if save else y
    else:
        gemm_act = dispatch.kernel("gemm_act").gemm_act
        out = gemm_act(x2, weight, bias, activation=act.id, save_preact=save, allow_tf32=dispatch.allow_tf32())
    y, z = out if save else (out, None)
    return (y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])), z


@torch.library.custom_op("mlpfuse::linear_act", mutates_args=())
def _linear_act_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    return _forward(x, weight, bias, activation, backend, False)[0]


@_linear_act_op.register_fake
def _(x, weight, bias, activation, backend):
    _checks.linear_act_args(x, weight, bias)
    activations.get(activation)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("mlpfuse::linear_act_train", mutates_args=())
def _linear_act_train_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str, save_preact: bool
) -> tuple[Tensor, Tensor]:
    y, z = _forward(x, weight, bias, activation, backend, save_preact)
    return y, (z if z is not None else nothing(x))


@_linear_act_train_op.register_fake
def _(x, weight, bias, activation, backend, save_preact):
    _checks.linear_act_args(x, weight, bias)
    act = activations.get(activation)
    y = x.new_empty(*x.shape[:-1], weight.shape[0])
    if save_preact and act.id != activations.IDENTITY:
        return y, x.new_empty(leading(x), weight.shape[0])
    return y, nothing(x)


def _backward_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    z: Tensor,
    activation: str,
    recompute: bool,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dW, db (empty placeholders where not needed); what the backward op and eager training run."""
    act = activations.get(activation)
    x2, dy2 = rows(x), rows(dy.to(x.dtype))
    if act.id == activations.IDENTITY:
        z = None
    elif recompute:
        # cuBLAS's addmm is the best way to get z back; the activation's epilogue has nothing to add here.
        z = F.linear(x2, weight, bias)
    dx, dw, db = reference.linear_act_backward(
        dy2, x2, weight, z, act, need_dx=need_dx, need_dw=need_dw, need_db=need_db
    )
    dx = dx.reshape(x.shape) if dx is not None else None
    return tuple(t if t is not None else nothing(x) for t in (dx, dw, db))


# The registered op is the implementation itself; eager training calls `_backward_impl` directly.
_linear_act_backward_op = torch.library.custom_op("mlpfuse::linear_act_backward", mutates_args=())(_backward_impl)


@_linear_act_backward_op.register_fake
def _(dy, x, weight, bias, z, activation, recompute, need_dx, need_dw, need_db):
    return (
        torch.empty_like(x) if need_dx else nothing(x),
        torch.empty_like(weight) if need_dw else nothing(x),
        x.new_empty(weight.shape[0]) if need_db else nothing(x),
    )


def _setup(ctx, inputs, output):
    x, weight, bias, activation = inputs[:4]
    ctx.activation = activation
    ctx.extra_inputs = len(inputs) - 5  # the train op's save_preact
    saved = ctx.extra_inputs and inputs[5] and activations.get(activation).id != activations.IDENTITY
    ctx.recompute = not saved
    ctx.save_for_backward(x, weight, bias, *((output[1],) if saved else ()))


def _backward(ctx, dy, *_, impl=None):
    """Gradients for autograd; `impl` None runs the registered backward op (what compile and export record)."""
    x, weight, bias = ctx.saved_tensors[:3]
    z = ctx.saved_tensors[3] if not ctx.recompute else nothing(dy)
    need = ctx.needs_input_grad
    grads = (impl or torch.ops.mlpfuse.linear_act_backward)(
        dy, x, weight, bias, z, ctx.activation, ctx.recompute, need[0], need[1], bias is not None and need[2]
    )
    return (*(t if need[i] else None for i, t in enumerate(grads)), None, None) + (None,) * ctx.extra_inputs


_linear_act_op.register_autograd(_backward, setup_context=_setup)
_linear_act_train_op.register_autograd(_backward, setup_context=_setup)


class _EagerTraining(torch.autograd.Function):
    """Plain eager training without the custom-op machinery's host cost (see ops/gated_mlp.py); same math."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation: str, backend: str, path: str):
        y, z = _forward(x, weight, bias, activation, backend, dispatch.SAVE_PREACT, path=path)
        ctx.activation, ctx.recompute, ctx.extra_inputs = activation, z is None, 1  # extra: path
        ctx.save_for_backward(x, weight, bias, *(() if z is None else (z,)))
        return y

    @staticmethod
    def backward(ctx, dy):
        if profiling():
            with op_span("mlpfuse::linear_act_backward"):
                return _backward(ctx, dy, impl=_backward_impl)
        return _backward(ctx, dy, impl=_backward_impl)


class LinearActPlan(_plan.Memo):
    """A module's memo of its plain eager linear+activation calls, as ops.gated_mlp.CallPlan is for the gated MLP:
    the arguments checked and the path chosen once per layout (the key: x's layout, the weight's and bias's address,
    shape, dtype and the weight's strides, the resolved backend, the activation, whether a gradient is needed, TF32
    for fp32). `weight_t`: the module's weight.t(), held for FusedLinear's calls that are F.linear alone."""

    __slots__ = ("weight_t",)

    def __init__(self):
        super().__init__()
        self.weight_t = _plan.HeldTranspose()

    def run(self, x, weight, bias, activation: str, backend: str, grad: bool) -> Tensor:
        key = (dispatch.resolve_backend(backend), _plan.x_key(x), _plan.weight_key(weight), _plan.bias_key(bias),
               activation, grad, x.dtype is torch.float32 and dispatch.allow_tf32())
        entry = self.entries.get(key)
        if entry is None:
            _checks.module_input(x, weight, "weight")
            entry = self.remember(key, _LinearActEntry.choose(x, weight, bias, activation, backend, grad))
        return entry(x, weight, bias)


class _LinearActEntry:
    """One layout's call with its path chosen: eager's own ops on the torch path (under autograd when a gradient
    is needed), else `_forward` on that path or `_EagerTraining` for a gradient."""

    __slots__ = ("path", "act", "backend", "grad")

    def __init__(self, path: str, act: activations.Activation, backend: str, grad: bool):
        self.path, self.act, self.backend, self.grad = path, act, backend, grad

    @classmethod
    def choose(cls, x, weight, bias, activation: str, backend: str, grad: bool) -> "_LinearActEntry":
        """The entry for this call's layout: the arguments checked, the path chosen (dispatch.linear_act_path).
        Weights the kernels cannot read (a tensor subclass, a non-float dtype) take nn.Linear's own math."""
        act = activations.get(activation)
        if _checks.foreign(weight):
            return cls("torch", act, backend, grad)
        _checks.linear_act_args(x, weight, bias)
        return cls(dispatch.linear_act_path(backend, rows(x), weight.shape[0], act.id), act, backend, grad)

    def __call__(self, x, weight, bias) -> Tensor:
        if self.path == "torch":
            return self.act.forward(F.linear(x, weight, bias))  # reference.linear_act_forward, its lookups done
        if self.grad:
            return _EagerTraining.apply(x, weight, bias, self.act.name, self.backend, self.path)
        return _forward(x, weight, bias, self.act.name, self.backend, False, path=self.path)[0]


def linear_act_call(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str,
                    plan: Optional[LinearActPlan] = None) -> Tensor:
    """Every linear+activation call's one way in, as `ops.gated_mlp.gated_mlp_call` is for the gated MLP: whether a
    gradient is needed is decided here, once; plain eager calls run their path (through the module's `plan` when
    given), the rest the registered ops. Under torch.profiler an eager call shows as a `mlpfuse::linear_act` CPU op
    around the kernels it launches.

    A plain eager module call (`plan` given: its weights are a Linear's) where every call takes eager's own ops
    whatever x is (backend "torch", or `auto` with an activation it never fuses) is those ops and nothing else, with
    no plan to look up. Input they refuse goes on to the checks, which name the argument."""
    if not plain_eager(x):
        if plan is not None:
            _checks.module_input(x, weight, "weight")
        return registered_call(x, weight, bias, activation, backend)
    if plan is not None:
        act = activations.get(activation)
        if dispatch.eager_math(backend, act.id):
            if profiling():
                with op_span("mlpfuse::linear_act"):
                    y = plain_linear(x, weight, bias, act.forward)
            else:
                y = plain_linear(x, weight, bias, act.forward)
            if y is not None:
                return y
    if profiling():
        with op_span("mlpfuse::linear_act"):
            return _eager(x, weight, bias, activation, backend, plan)
    return _eager(x, weight, bias, activation, backend, plan)


def _eager(x, weight, bias, activation: str, backend: str, plan: Optional[LinearActPlan]) -> Tensor:
    low = autocast_dtype(x)
    if low is not None:  # as autocast casts nn.Linear's inputs
        x, weight, bias = cast_all([x, weight, bias], low)
        plan = None  # fresh copies every call: no layout worth remembering
    grad = needs_grad([x, weight, bias])
    if plan is not None and type(weight) in _checks.PLAIN:
        return plan.run(x, weight, bias, activation, backend, grad)
    return _LinearActEntry.choose(x, weight, bias, activation, backend, grad)(x, weight, bias)


def registered_call(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    """The call as a graph records it: `mlpfuse::linear_act_train` when a gradient is needed, else
    `mlpfuse::linear_act`. TorchScript-compatible (a scripted module calls it directly)."""
    if not torch.jit.is_scripting():
        if not isinstance(x, Tensor):
            raise InputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if _checks.foreign(weight):
            return reference.linear_act_forward(x, weight, bias, activations.get(activation))
        low = autocast_dtype(x)
        if low is not None:
            x, weight, bias = cast_all([x, weight, bias], low)
    if needs_grad([x, weight, bias]):
        return torch.ops.mlpfuse.linear_act_train(x, weight, bias, activation, backend, dispatch.SAVE_PREACT)[0]
    return torch.ops.mlpfuse.linear_act(x, weight, bias, activation, backend)


def linear_act(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    """act(x·weightᵀ + bias) with an nn.Linear-layout weight [out_features, in_features], any leading dimensions.

    activation: a name or alias from mlpfuse.activations, None for none. backend: "auto" | "triton" | "torch" | "cuda";
    None reads MLPFUSE_BACKEND, else "auto". Differentiable in x, weight and bias.
    """
    name = activations.get(activation).name
    _checks.tensors([("x", x), ("weight", weight)], [("bias", bias)])
    return linear_act_call(x, weight, bias, name, dispatch.check_backend_name(backend))
