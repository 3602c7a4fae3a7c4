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
from mlpfuse.ops._util import (
    autocast_dtype, cast_all, eager_tensor, leading, nothing, op_span, profiling, rows,
    wants_grad,
)


def _forward(x, weight, bias, activation: str, backend: str, save: bool, checked: bool = False, path: str = ""):
    """(y [..., out], z) with z the 2-D pre-activation when `save` and an activation needs it, else None.
    `checked`: the caller already validated the arguments; `path` given: and chose the path."""
    if not checked and not path:
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
    ctx.train = len(inputs) == 6
    saved = ctx.train and inputs[5] and activations.get(activation).id != activations.IDENTITY
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
    return (*(t if need[i] else None for i, t in enumerate(grads)), None, None) + ((None,) if ctx.train else ())


_linear_act_op.register_autograd(_backward, setup_context=_setup)
_linear_act_train_op.register_autograd(_backward, setup_context=_setup)


class _EagerTraining(torch.autograd.Function):
    """Plain eager training without the custom-op machinery's host cost (see ops/gated_mlp.py); same math."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation: str, backend: str):
        y, z = _forward(x, weight, bias, activation, backend, dispatch.SAVE_PREACT, checked=True)
        ctx.activation, ctx.recompute, ctx.train = activation, z is None, False
        ctx.save_for_backward(x, weight, bias, *(() if z is None else (z,)))
        return y

    @staticmethod
    def backward(ctx, dy):
        if profiling():
            with op_span("mlpfuse::linear_act_backward"):
                return _backward(ctx, dy, impl=_backward_impl)
        return _backward(ctx, dy, impl=_backward_impl)


class LinearActPlan(_plan.Memo):
    """A module's memo of its eager linear+activation calls, as ops.gated_mlp.CallPlan is for the gated MLP: the
    arguments checked and the path chosen once per layout (the key: x's layout, the weight's and bias's address,
    shape, dtype and the weight's strides, the resolved backend, the activation, grad mode, TF32 for fp32). Returns
    None for what it does not serve (see ops._plan.declines): the caller then takes `linear_act_call`."""

    __slots__ = ()

    def __call__(self, x, weight, bias, activation: str, backend: str) -> Optional[Tensor]:
        if _plan.declines(x):
            return None
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                            or (bias is not None and bias.requires_grad))
        key = (dispatch.resolve_backend(backend), _plan.x_key(x), _plan.weight_key(weight), _plan.bias_key(bias),
               activation, grad, x.dtype is torch.float32 and dispatch.allow_tf32())
        entry = self.entries.get(key)
        if entry is None:
            _checks.linear_act_args(x, weight, bias)
            act = activations.get(activation)
            path = dispatch.linear_act_path(backend, rows(x), weight.shape[0], act.id)
            entry = self.remember(key, _LinearActEntry(path, act, backend, grad))
        if profiling():
            with op_span("mlpfuse::linear_act"):
                return entry(x, weight, bias)
        return entry(x, weight, bias)


class _LinearActEntry:
    """One layout's call with its path chosen: eager's own ops on the torch path (under autograd when a gradient
    is needed), else `_forward` on that path or `_EagerTraining` for a gradient."""

    __slots__ = ("path", "act", "backend", "grad")

    def __init__(self, path: str, act: activations.Activation, backend: str, grad: bool):
        self.path, self.act, self.backend, self.grad = path, act, backend, grad

    def __call__(self, x, weight, bias) -> Tensor:
        if self.path == "torch":
            return reference.linear_act_forward(x, weight, bias, self.act)
        if self.grad:
            return _EagerTraining.apply(x, weight, bias, self.act.name, self.backend)
        return _forward(x, weight, bias, self.act.name, self.backend, False, path=self.path)[0]


def linear_act_call(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    """The op a module's forward calls: the training op when a gradient is needed. TorchScript-compatible.
    Under torch.profiler an eager call shows as a `mlpfuse::linear_act` CPU op around the kernels it launches."""
    if not torch.jit.is_scripting():
        if not torch.compiler.is_compiling() and profiling():
            with op_span("mlpfuse::linear_act"):
                return _call(x, weight, bias, activation, backend)
    return _call(x, weight, bias, activation, backend)


def _call(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, backend: str) -> Tensor:
    if not torch.jit.is_scripting():
        low = autocast_dtype(x)
        if low is not None:  # as autocast casts nn.Linear's inputs
            x, weight, bias = cast_all([x, weight, bias], low)
    grad = wants_grad([x, weight, bias])
    if not torch.jit.is_scripting():
        if not grad and eager_tensor(x):
            return _forward(x, weight, bias, activation, backend, False)[0]  # eager inference: no dispatcher trip
        if grad and eager_tensor(x):
            _checks.linear_act_args(x, weight, bias)
            act_id = activations.get(activation).id
            if dispatch.linear_act_path(backend, rows(x), weight.shape[0], act_id) == "torch":
                # eager autograd, as in gated_mlp
                return _forward(x, weight, bias, activation, backend, False, checked=True)[0]
            return _EagerTraining.apply(x, weight, bias, activation, backend)
    if grad:
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
