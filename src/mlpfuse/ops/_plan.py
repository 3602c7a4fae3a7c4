"""What the modules' per-layout call plans share (ops.gated_mlp.CallPlan, ops.linear_act.LinearActPlan).

A plan remembers, per key, the path an eager call took once the op layer had checked its arguments; the key holds
every property the checks and the path's choice read, so an entry only ever serves the layout it was made for (a
weight replaced, moved or re-allocated changes its address; a freed and reused address with another shape, dtype
or strides changes the key).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


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


class HeldTranspose:
    """A module's weight.t(), kept between eager calls: F.linear makes it on every call with three dispatcher ops
    (t, transpose, as_strided) — host time on every call, and three more ops for torch.profiler to record.

    The view is made with autograd on (outside inference mode), so a call that needs a gradient flows it to the
    weight through the view's own TBackward node (it saves nothing, so any number of graphs may share it). It is
    handed out only while it is still weight.t() as the weight is now: the same Parameter object at the same
    address, with the same shape and dtype, contiguous, and requiring grad as it did when the view was made (`.data`
    assignments, `requires_grad_` and re-allocation all change one of these; a view's own requires_grad follows
    its base's without a grad_fn, so the weight's flag is kept; in-place updates such as an optimizer step keep
    the view valid, since it shares the storage), and never while torch.compile / torch.export / jit.trace record
    a graph or autocast is on (autocast caches its cast of the weight itself, a leaf, never of a view). The view
    keeps the weight's storage alive: modules drop it in `_apply` (`.to()`, `.cuda()`, `.half()`) and when a
    parameter is registered again (`module.weight = ...`)."""

    __slots__ = ("held",)

    def __init__(self):
        self.held = None

    def drop(self) -> None:
        self.held = None

    def transposed(self, w: Tensor) -> Optional[Tensor]:
        if torch.compiler.is_compiling() or torch._C._is_tracing() or torch._C._is_any_autocast_enabled():
            return None
        h = self.held
        if (h is not None and h[0] is w and h[1] == w.data_ptr() and h[2] == w.shape and h[3] is w.dtype
                and h[4] is w.requires_grad and w.is_contiguous()):
            return h[5]
        if type(w) is not torch.nn.Parameter or w.dim() != 2 or not w.is_contiguous() or w.is_inference():
            self.held = None
            return None
        with torch.inference_mode(False), torch.enable_grad():
            wt = w.t()
        self.held = (w, w.data_ptr(), w.shape, w.dtype, w.requires_grad, wt)
        return wt
