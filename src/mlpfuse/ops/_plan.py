"""What the modules' per-layout call plans share (ops.gated_mlp.CallPlan, ops.linear_act.LinearActPlan).

A plan remembers, per key, the path an eager call took once the op layer had checked its arguments; the key holds
every property the checks and the path's choice read, so an entry only ever serves the layout it was made for (a
weight replaced, moved or re-allocated changes its address; a freed and reused address with another shape, dtype
or strides changes the key).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.nn import Parameter


def x_key(x: Tensor) -> tuple:
    return (x.shape, x.stride(), x.data_ptr() & 15, x.dtype, x.get_device())


def weight_key(w: Tensor) -> tuple:
    return (w.data_ptr(), w.shape, w.stride(), w.dtype)


def bias_key(b: Optional[Tensor]):
    return None if b is None else (b.data_ptr(), b.shape, b.dtype)


class Memo:
    """The entries of one plan: at most MAX_ENTRIES layouts, cleared when full. Pickled or deep-copied it starts
    empty (entries hold launch plans and extension handles valid in this process only)."""

    __slots__ = ("entries",)
    MAX_ENTRIES = 16

    def __init__(self):
        self.entries: dict = {}

    def __reduce__(self):
        return (type(self), ())

    def remember(self, key, entry):
        if len(self.entries) >= self.MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = entry
        return entry

    def release(self) -> None:
        """Drop the weight views the plan holds (a plan with held views overrides this)."""


class Transposed:
    """One weight's transposed view, kept from one no-grad call to the next: the B operand of `torch.mm` /
    `torch.addmm`, as F.linear computes it, without `weight.t()` per call (three dispatcher ops, aten::t,
    aten::transpose and aten::as_strided, each a TensorImpl made and, while torch.profiler records, an event).

    Held for Parameters (a module's own weights); any other tensor gets `w.t()`. A hit needs the same Parameter with
    the same address, shape, strides and dtype, so memory swapped in through `.data` is seen. The view is of the
    detached weight: it keeps the memory alive but not the Parameter, and when the Parameter is freed (replaced on
    its module) the view goes with it. The modules that hold one drop it in `_apply`, before `.to()`, `.cuda()`,
    `.half()`, ... move the memory under the same Parameter; memory swapped through `.data` by other code stays
    alive until the next call. Only for calls that need no gradient (the view is outside autograd). Pickled or
    deep-copied it starts empty."""

    __slots__ = ("held", "__weakref__")

    def __init__(self):
        self.held = None  # (weakref to the weight, its weight_key, the view), replaced whole so a reader sees one

    def __reduce__(self):
        return (type(self), ())

    def of(self, w: Tensor) -> Tensor:
        held = self.held
        if held is not None and held[0]() is w and weight_key(w) == held[1]:
            return held[2]
        if type(w) is not Parameter:  # a view made per call (GPT-2's Conv1D weight.t(), packed halves): no one to hold
            return w.t()
        view = w.detach().t()
        self.held = (weakref.ref(w, self._freed), weight_key(w), view)
        return view

    def _freed(self, ref) -> None:
        held = self.held
        if held is not None and held[0] is ref:
            self.held = None

    def release(self) -> None:
        self.held = None


def release(module) -> None:
    """Drop every view the module's plans and holders keep (from its `_apply`, before the memory moves)."""
    for value in module.__dict__.values():
        if isinstance(value, (Memo, Transposed)):
            value.release()
