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


# Bound once: each link of an attribute chain (torch.compiler.is_compiling, ...) costs ~30 ns on every call.
_compiling, _tracing, _autocast = torch.compiler.is_compiling, torch._C._is_tracing, torch._C._is_any_autocast_enabled


class HeldTranspose:
    """A module's weight.t(), kept between eager calls: F.linear makes it on every call with three dispatcher ops
    (t, transpose, as_strided), under one more (linear) — host time on every call, and four more ops for
    torch.profiler to record.

    The view is made with autograd on (outside inference mode), so a call that needs a gradient flows it to the
    weight through the view's own TBackward node (it saves nothing, so any number of graphs may share it). `linear`
    uses it only while it is still weight.t() as the weight is now: the same Parameter object at the same address,
    with the same shape and dtype, contiguous, and requiring grad as it did when the view was made (`.data`
    assignments, `requires_grad_` and re-allocation each change one of these; a view's own requires_grad follows
    its base's without a grad_fn, so the weight's flag is kept; in-place updates such as an optimizer step keep
    the view valid, as it shares the storage), and never while torch.compile / torch.export / jit.trace record a
    graph or autocast is on (autocast caches its cast of the weight itself, a leaf, never of a view). The checks
    cost about what the four ops do: on the H100 hosts measured a call took ~3 % more host time than nn.Linear's
    with the profiler off and ~12 % less with it on (four fewer ops recorded). The view keeps the weight's storage
    alive: modules drop it in `_apply` (`.to()`, `.cuda()`, `.half()`) and when a parameter is registered again
    (`module.weight = ...`)."""

    __slots__ = ("held",)

    def __init__(self):
        self.held = None  # (weight, its address, shape, dtype, requires_grad, weight.t())

    def drop(self) -> None:
        self.held = None

    def linear(self, x: Tensor, w: Tensor, b: Optional[Tensor]) -> Optional[Tensor]:
        """F.linear(x, w, b) for 2-D x: the one op F.linear runs there (addmm with the bias, mm without) over
        the held view; None where the view may not serve this call (then `make` it for the next) or the op refuses
        the input (F.linear then refuses it too, and the op layer's checks name the argument)."""
        h = self.held
        if h is None:
            return None
        w0, address, shape, dtype, grad, wt = h
        # is_compiling first: Dynamo cannot trace data_ptr() or _is_tracing().
        if (w0 is w and not _compiling() and address == w.data_ptr() and shape == w.shape
                and dtype is w.dtype and grad is w.requires_grad and w.is_contiguous() and not _tracing()
                and not _autocast()):
            try:
                return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)
            except (RuntimeError, TypeError, ValueError):  # refused input: F.linear refuses it too, then the checks
                return None
        return None

    def make(self, w: Tensor) -> None:
        """Hold w.t() for the next calls where it may serve them (a plain 2-D contiguous Parameter), else hold
        nothing; a call that could not use a view (compiling, tracing, autocast) leaves what is held as it is."""
        if _compiling() or _tracing() or _autocast():
            return
        if type(w) is not torch.nn.Parameter or w.dim() != 2 or not w.is_contiguous() or w.is_inference():
            self.held = None
            return
        with torch.inference_mode(False), torch.enable_grad():
            wt = w.t()
        self.held = (w, w.data_ptr(), w.shape, w.dtype, w.requires_grad, wt)
