"""Where mlpfuse keeps what it measures or builds once per machine (device peaks, the CUDA backend's build)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MLPFUSE_CACHE_DIR"


def cache_dir() -> Path:
    """$MLPFUSE_CACHE_DIR, else $XDG_CACHE_HOME/mlpfuse, else ~/.cache/mlpfuse."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return Path(own)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlpfuse"
