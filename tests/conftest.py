"""Test setup shared by every test module.

Without a CUDA device the Triton kernels run through Triton's interpreter; the switch must be set before any
kernel module is imported, because `triton.jit` reads it when a kernel is defined.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def pytest_terminal_summary(terminalreporter):
    """The family sweep's table (tests/family_sweep.py), shown whatever the output capture: CI's log lists which
    transformers families mlpfuse.patch swaps, by layout, and what it leaves, with why."""
    import sys

    sweep = sys.modules.get("family_sweep")
    if sweep is not None and sweep.TABLE:
        terminalreporter.write_sep("=", "mlpfuse.patch over the installed transformers families")
        for line in sweep.TABLE:
            terminalreporter.write_line(line)
