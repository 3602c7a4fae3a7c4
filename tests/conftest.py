"""Test setup shared by every test module.

Without a CUDA device the Triton kernels run through Triton's interpreter; the switch must be set before any
kernel module is imported, because `triton.jit` reads it when a kernel is defined.
"""

import os

import torch

# The CLI's setting (mlpfuse.cli): no `USDT: ... profiler_start` lines from torch's profiler in the tests' output.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
