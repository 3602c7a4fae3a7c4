"""Small helpers the ops share: 2-D views of activations, placeholders, and the "is a gradient needed" test."""

from typing import List, Optional

import torch
from torch import Tensor


def rows(t: Tensor) -> Tensor:
    """t as [tokens, features]: a view whenever the leading dimensions allow it (reshape copies otherwise)."""
    t2 = t.unsqueeze(0) if t.dim() == 1 else t.flatten(0, -2)
    if t2.stride(0) != 1 and t2.stride(1) != 1 and t2.numel() > 0:
        # Neither dimension is unit-stride (e.g. an expanded gradient): kernels need one of them to be.
        t2 = t2.contiguous()
    return t2


def nothing(like: Tensor) -> Tensor:
    """A placeholder output (custom ops return tensors, never None)."""
    return like.new_empty(0)


def leading(x: Tensor) -> int:
    n = 1
    for s in x.shape[:-1]:
        n = n * s
    return n


def wants_grad(tensors: List[Optional[Tensor]]) -> bool:
    """True when autograd will need this call's backward. TorchScript-compatible."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False
