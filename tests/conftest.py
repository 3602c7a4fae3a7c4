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


def pytest_terminal_summary(terminalreporter):
    """The family sweep's table (tests/family_sweep.py), shown whatever the output capture: CI's log lists which
    transformers families mlpfuse.patch swaps, by layout, and what it leaves, with why."""
    import sys

    sweep = sys.modules.get("family_sweep")
    if sweep is not None and sweep.TABLE:
        terminalreporter.write_sep("=", "mlpfuse.patch over the installed transformers families")
        for line in sweep.TABLE:
            terminalreporter.write_line(line)


# `pytest -m quick`: every area once, fast (under two minutes on two cores): these modules whole, less the tests
# marked slow. The kernels run through the modules' call plans (test_call_plan), the CLI through the console script.
QUICK_MODULES = {
    "test_activations", "test_api_inputs", "test_modules", "test_reference", "test_call_plan",
    "test_profiling_cpu", "test_profiling_gpu_traces", "test_profiling_kernel_names", "test_profiling_bad_input",
    "test_profiling_ranks", "test_profiling_timeline", "test_profile_cleanup", "test_trace_hostile", "test_trace_json",
    "test_patching", "test_bench_presets", "test_bench_timing", "test_bench_outputs",
    "test_cli_help", "test_cli_profile", "test_cli_piped", "test_cli_first_run", "test_cli_examples",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.stem in QUICK_MODULES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)
