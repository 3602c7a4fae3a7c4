"""The CUDA backend's C++/CUDA sources and their loader.

`extension()` builds them with torch.utils.cpp_extension on first use (a minute or two) into
`<cache_dir>/cuda-ext/<name>/`, where <name> hashes the sources, torch's version and its CUDA version, so a later
process loads the built module in a fraction of a second and a changed source or torch gets its own build. What
cannot work here (no CUDA device, no nvcc, a failed build) is found once per process and reported the same way on
every call, as one line naming the build log where there is one; a failed build is not retried in that process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

from mlpfuse._cache import cache_dir

HERE = Path(__file__).resolve().parent
SOURCES = ("mlpfuse_cuda.cpp", "glu.cu", "decode.cu")
HEADERS = ("kernels.h", "common.cuh", "glu.cuh")
# Flags added to torch.utils.cpp_extension's own (the compile test on CPU uses the same).
EXTRA_CFLAGS = ("-O3",)
EXTRA_CUDA_CFLAGS = ("-O3",)

_lock = threading.Lock()
_state: dict = {}  # "module" or "error", set once


def build_name() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    digest.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return f"mlpfuse_cuda_{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    return cache_dir() / "cuda-ext" / build_name()


def find_nvcc() -> Optional[str]:
    """The nvcc torch.utils.cpp_extension would use: $CUDA_HOME/bin/nvcc (torch's guess of CUDA_HOME), else PATH."""
    from torch.utils import cpp_extension

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def environment_problem() -> Optional[str]:
    """Why the extension cannot be built or run in this process, before trying (None when it may)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if find_nvcc() is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH) to build the CUDA extension"
    return None


def extension():
    """The built module, or an InputError saying why there is none (the same one on every call)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state and "error" not in _state:
            try:
                _state["module"] = _build()
            except _Unavailable as e:
                _state["error"] = str(e)
    if "error" in _state:
        from mlpfuse.errors import InputError

        raise InputError(f"backend: 'cuda' is not available: {_state['error']}")
    return _state["module"]


class _Unavailable(Exception):
    pass


def _build():
    problem = environment_problem()
    if problem is not None:
        raise _Unavailable(problem)
    from torch.utils import cpp_extension

    folder = build_dir()
    log = folder / "build.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _Unavailable(f"cannot create the build folder {folder}: {e.strerror or e}") from None
    try:
        # verbose=False: ninja's output is captured and, on failure, is part of the exception's text.
        module = cpp_extension.load(
            name=folder.name, sources=[str(HERE / s) for s in SOURCES], build_directory=str(folder),
            extra_cflags=list(EXTRA_CFLAGS), extra_cuda_cflags=list(EXTRA_CUDA_CFLAGS), verbose=False,
        )
    except Exception as e:  # a compiler error, a missing toolchain piece, a failed import of the result
        log.write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8", errors="replace")
        raise _Unavailable(f"building the CUDA extension failed; build log: {log}") from None
    log.write_text(f"built {folder.name} for torch {torch.__version__} (CUDA {torch.version.cuda})\n",
                   encoding="utf-8")
    return module
