"""The device peaks file (bench/roofline.py measures it and caches it per device; the profiler's roofline reads it),
read as untrusted input without torch."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

from mlpfuse._cache import cache_dir

# Far above any device of today (an H200: ~1,000 dense bf16 TFLOP/s, 4,800 GB/s): a larger cached value is corrupt.
MAX_TFLOPS = 1e5
MAX_GBPS = 1e6
_MAX_CACHE_BYTES = 1 << 16  # our file is ~1 KB; a bigger one is not ours


class BadCache(Exception):
    """Why a peaks cache file cannot be used (one line)."""


def _rate(value, what: str, most: float) -> float:
    # bool is an int to Python, and JSON's true is not a rate.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadCache(f"{what} is {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value) or value <= 0 or value > most:
        raise BadCache(f"{what} = {value!r} is not a plausible positive rate")
    return value


def read_peaks(path: Path, name: str) -> dict:
    """The peaks file at `path`, measured on the device called `name`, checked field by field: {'device', 'gemm_tflops',
    'copy_gbps', 'how'}; BadCache says what is wrong."""
    try:
        # Opened without blocking and checked before reading: a FIFO in its place would block a plain open, a
        # device such as /dev/zero would never end.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise BadCache("not a regular file")
            raw = fh.read(_MAX_CACHE_BYTES + 1)
        if len(raw) > _MAX_CACHE_BYTES:
            raise BadCache(f"more than {_MAX_CACHE_BYTES} bytes, larger than a peaks file")
        data = json.loads(raw.decode("utf-8"))
    except BadCache:
        raise
    except OSError as exc:
        raise BadCache(f"unreadable ({exc.strerror or type(exc).__name__})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadCache(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise BadCache(f"a JSON {type(data).__name__}, not an object")
    measured_on, gemm, how = data.get("device"), data.get("gemm_tflops"), data.get("how", {})
    if measured_on != name:
        raise BadCache(f"measured on {measured_on!r}, not on {name!r}")
    if not isinstance(gemm, dict) or not all(isinstance(k, str) for k in gemm):
        raise BadCache("gemm_tflops is not an object of dtype -> TFLOP/s")
    tflops = {dt: _rate(v, f"gemm_tflops[{dt!r}]", MAX_TFLOPS) for dt, v in gemm.items()}
    copy = _rate(data.get("copy_gbps"), "copy_gbps", MAX_GBPS)
    if not isinstance(how, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in how.items()):
        raise BadCache("how is not an object of strings")
    return {"device": name, "gemm_tflops": tflops, "copy_gbps": copy, "how": dict(how)}


def peaks_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the device's part of the cache file's name."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def cached_peaks(name: str) -> dict | None:
    """The cached peaks of the device called `name` (as torch names it), or None where there are none or they do
    not pass read_peaks' checks."""
    path = cache_dir() / f"peaks-{peaks_slug(name)}.json"
    if not path.exists():
        return None
    try:
        return read_peaks(path, name)
    except BadCache:
        return None
