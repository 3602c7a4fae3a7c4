"""g and u (and dg and du) as the two halves of one allocation, so the backward's two weight gradients
dWg = dgᵀ·x and dWu = duᵀ·x run as one batched GEMM over both (ops/gated_mlp.py). Torch only: the ops import it
without Triton."""

from __future__ import annotations

from typing import Optional

import torch

_STEP = 64  # elements: u starts on a 128-byte boundary in 16-bit (256 in fp32), as a fresh tensor would


def preact_pair(m: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contiguous [m, n] tensors of like's dtype and device in one allocation, the second at a fixed distance
    after the first (`stacked` finds that distance again)."""
    step = -(-m * n // _STEP) * _STEP
    block = torch.empty(2 * step, device=like.device, dtype=like.dtype)
    return block[: m * n].view(m, n), block[step : step + m * n].view(m, n)


def stacked(a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
    """A [2, *shape] view over a and b when b lies at a fixed distance after a in one allocation (`preact_pair`'s
    layout), both contiguous and alike; else None."""
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_contiguous() and b.is_contiguous()):
        return None
    step = b.storage_offset() - a.storage_offset()
    if step < a.numel() or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    return a.as_strided((2, *a.shape), (step, *a.stride()))
