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
