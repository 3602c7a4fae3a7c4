"""Argument checks shared by the ops: one InputError line naming the argument and what was expected.

They run in the real implementations and in the fake (tracing) ones, so a bad call fails the same way eagerly, under
torch.compile and in torch.export.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mlpfuse.errors import InputError

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
STRIDED = torch.strided
PLAIN = (torch.nn.Parameter, Tensor)  # weight types a call plan keys on by address


def foreign(*weights: Tensor) -> bool:
    """Weights the kernels cannot read as given: wrapper subclasses holding other data (quantized weights, for one,
    which say so by flattening into inner tensors). Their calls run nn.Linear's own math, which dispatches on them.
    Fake and functional tensors, which stand in for plain ones while a graph is recorded, are not foreign."""
    return any(is_traceable_wrapper_subclass(w) for w in weights)


def flag(name: str, value) -> bool:
    """A True/False option (`recompute`, `fuse_norms`), or one InputError line naming it."""
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected True or False, got {value!r}")
    return value


def _shape(t: Tensor) -> list:
    return list(t.shape)


def _check_layout(name: str, t: Tensor) -> None:
    # Sparse, nested or mkldnn tensors have no strides the kernels or the reference's GEMMs can use as given.
    if t.is_nested:
        raise InputError(f"{name}: expected a dense (strided) tensor, got a nested tensor")
    if t.layout != STRIDED:
        raise InputError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")


def check_x(x: Tensor, in_features, source: str) -> None:
    if not isinstance(x, Tensor):
        raise InputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _check_layout("x", x)
    if x.dim() < 1:
        raise InputError(f"x: expected at least 1 dimension (..., {in_features}), got a 0-d tensor")
    if x.dtype not in DTYPES:
        raise InputError(f"x: expected dtype bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise InputError(f"x: expected last dimension {in_features} ({source}), got shape {_shape(x)}")


def module_input(x, weight: Tensor, first: str) -> None:
    """A module's input against its first projection's weight [out, dim], in the module's terms ("x is fp16, the
    module's weights are fp32") rather than the op's argument names. Runs once per layout (on a call plan's miss)."""
    if not isinstance(x, Tensor):
        raise InputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    dim = weight.shape[-1]
    if x.dim() < 1 or x.shape[-1] != dim:
        raise InputError(f"x: expected last dimension {dim} (the module's input features), got shape {_shape(x)}")
    if x.dtype != weight.dtype and weight.dtype in DTYPES:  # (a weight in another dtype: the op names it)
        raise InputError(f"x: dtype {x.dtype} does not match the module's weights ({first}: {weight.dtype}); cast "
                         f"x (x.to({weight.dtype})) or the module (module.to({x.dtype}))")
    if x.device != weight.device:
        raise InputError(f"x: x is on {x.device} but the module's weights ({first}) are on {weight.device}; move "
                         f"one of them (x.to('{weight.device}') or module.to('{x.device}'))")


def check_2d(name: str, w: Tensor, shape: Sequence, source: str) -> None:
    if not isinstance(w, Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    _check_layout(name, w)
    if w.dim() != len(shape) or any(a != b for a, b in zip(w.shape, shape)):
        raise InputError(f"{name}: expected shape {list(shape)} ({source}), got {_shape(w)}")


def check_same(x: Tensor, named: Sequence[tuple[str, Optional[Tensor]]]) -> None:
    """Every tensor has x's dtype and device."""
    for name, t in named:
        if t is None:
            continue
        if t.device != x.device:
            raise InputError(f"{name}: expected a tensor on {x.device} like x, got one on {t.device}")
        if t.dtype != x.dtype:
            raise InputError(f"{name}: expected dtype {x.dtype} like x, got {t.dtype}")


def tensors(required: Sequence[tuple[str, object]], optional: Sequence[tuple[str, object]] = ()) -> None:
    """Type check of the public functions' tensor arguments (the ops check the rest); optional ones may be None."""
    for name, t in required:
        if not isinstance(t, Tensor):
            raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in optional:
        if t is not None and not isinstance(t, Tensor):
            raise InputError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")


def _well_formed(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> bool:
    """The common case, checked quickly (this runs on every call, also for decode-sized ones). dtypes are singletons
    (compared with `is`) and a torch.Size equals a tuple: each attribute read here costs ~0.1 µs."""
    try:
        hidden, dim = gate_weight.shape
        dtype, device = x.dtype, x.device
        # A 0-d x raises IndexError here; a nested one RuntimeError.
        if x.shape[-1] != dim or dtype not in DTYPES or x.layout is not STRIDED:
            return False
        if up_weight.shape != gate_weight.shape or down_weight.shape != (dim, hidden):
            return False
        for t in (gate_weight, up_weight, down_weight):
            if t.dtype is not dtype or t.device != device or t.layout is not STRIDED:
                return False
        for b, n in ((gate_bias, hidden), (up_bias, hidden), (down_bias, dim)):
            if b is not None and (b.shape != (n,) or b.dtype is not dtype or b.device != device
                                  or b.layout is not STRIDED):
                return False
        return True
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return False


def _linear_well_formed(x, weight, bias) -> bool:
    """linear_act's common case, checked quickly (as _well_formed)."""
    try:
        out_features, in_features = weight.shape
        dtype, device = x.dtype, x.device
        if x.shape[-1] != in_features or dtype not in DTYPES or x.layout is not STRIDED:
            return False
        if weight.dtype is not dtype or weight.device != device or weight.layout is not STRIDED:
            return False
        if bias is not None and (bias.shape != (out_features,) or bias.dtype is not dtype or bias.device != device
                                 or bias.layout is not STRIDED):
            return False
        return True
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return False


def gated_mlp_args(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias) -> None:
    if _well_formed(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias):
        return
    if not isinstance(gate_weight, Tensor) or gate_weight.dim() != 2:
        got = _shape(gate_weight) if isinstance(gate_weight, Tensor) else type(gate_weight).__name__
        raise InputError(f"gate_weight: expected a 2-D [hidden, dim] tensor, got {got}")
    _check_layout("gate_weight", gate_weight)
    hidden, dim = gate_weight.shape
    check_x(x, dim, "gate_weight is [hidden, dim]")
    check_2d("up_weight", up_weight, [hidden, dim], "like gate_weight")
    check_2d("down_weight", down_weight, [dim, hidden], "[dim, hidden] for gate_weight's [hidden, dim]")
    for name, b, size in (("gate_bias", gate_bias, hidden), ("up_bias", up_bias, hidden), ("down_bias", down_bias, dim)):
        if b is not None:
            check_2d(name, b, [size], "one per output feature")
    check_same(
        x,
        [
            ("gate_weight", gate_weight),
            ("up_weight", up_weight),
            ("down_weight", down_weight),
            ("gate_bias", gate_bias),
            ("up_bias", up_bias),
            ("down_bias", down_bias),
        ],
    )


def linear_act_args(x, weight, bias) -> None:
    if _linear_well_formed(x, weight, bias):
        return
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        got = _shape(weight) if isinstance(weight, Tensor) else type(weight).__name__
        raise InputError(f"weight: expected a 2-D [out_features, in_features] tensor, got {got}")
    _check_layout("weight", weight)
    out_features, in_features = weight.shape
    check_x(x, in_features, "weight is [out_features, in_features]")
    if bias is not None:
        check_2d("bias", bias, [out_features], "out_features")
    check_same(x, [("weight", weight), ("bias", bias)])
