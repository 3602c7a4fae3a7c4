"""Triton kernels. Import a kernel module only when `available()` is true.

Each file holds one kernel family with its launcher beside it; `configs.py` holds the tile table every launcher reads
(no autotuning at call time, so a new shape never pays for a search).
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available() -> bool:
    """True when the Triton kernels can run here: Triton imports and either CUDA is present or the interpreter is on."""
    if not triton_importable():
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    import torch

    return torch.cuda.is_available()
