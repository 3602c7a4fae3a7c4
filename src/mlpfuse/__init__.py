"""mlpfuse: see where an nn.Linear / MLP block spends its time, kernel by kernel, and make it faster.

Public API only. Names resolve lazily so that `mlpfuse analyze` (pure trace reading) never pays for the
kernel stack's imports.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "GatedMLP": "mlpfuse.modules",
    "FusedLinear": "mlpfuse.modules",
    "MLP": "mlpfuse.modules",
    "Fp8Linear": "mlpfuse.modules",
    "profile": "mlpfuse.profiling",
    "analyze": "mlpfuse.profiling",
    "diff": "mlpfuse.profiling",
    "patch": "mlpfuse.patching",
    "unpatch": "mlpfuse.patching",
    "PatchReport": "mlpfuse.patching",
    "InputError": "mlpfuse.errors",
}

_SUBMODULES = ("ops", "activations", "parallel", "fp8", "profiling")

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"mlpfuse.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mlpfuse' has no attribute {name!r}")


def __dir__():
    return __all__
