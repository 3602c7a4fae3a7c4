"""The hardware floor of each case: FLOPs, the fewest bytes, and this device's measured peaks.

Counting (M tokens, D dim, H hidden, s bytes per element):
    gated fwd   FLOPs 2·M·D·H·3 (gate, up, down GEMMs)         bytes s·(M·D + 3·H·D + M·D)      (x, weights, y)
    mlp fwd     FLOPs 2·M·D·H·2                                 bytes s·(M·D + 2·H·D + H + D + M·D)
    linear fwd  FLOPs 2·M·D·H                                   bytes s·(M·D + H·D + H + M·H)
    fwd+bwd     FLOPs 3× forward (each GEMM also computes dX and dW)
                bytes forward's + dy read + dx, dW, db written  (intermediates may be recomputed: not counted)
Activations, bias adds and the GLU product are O(M·H) flops, under 0.1 % of the GEMMs: left out.
floor = max(FLOPs / peak FLOP/s, bytes / copy bandwidth); % of floor = floor / measured time.

Peaks are measured, not looked up: a large GEMM (8192³ on a GPU) per dtype and a large device-to-device copy
(bytes read + written). They are cached per device in peaks-<device>.json under cache_dir() because measuring costs
seconds; `--remeasure-peaks` refreshes them. The cache is untrusted input: a file that is not a small regular file
of finite, positive, plausible peaks for this device is ignored with a note, measured again and replaced.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mlpfuse._cache import CACHE_ENV, cache_dir  # noqa: F401 (CACHE_ENV: part of this module's interface)
from mlpfuse._peaks import BadCache, peaks_slug, read_peaks

from mlpfuse._io import atomic_write_text
from mlpfuse.bench.presets import DTYPES, Case

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def flops(case: Case) -> int:
    m, d, h = case.tokens, case.dim, case.hidden
    gemms = {"gated": 3, "mlp": 2, "linear": 1}[case.kind]
    fwd = 2 * m * d * h * gemms
    return fwd * 3 if case.mode == "fwd+bwd" else fwd


def min_bytes(case: Case) -> int:
    m, d, h = case.tokens, case.dim, case.hidden
    s = ELEMENT_BYTES[case.dtype]
    if case.kind == "gated":
        x, weights, bias, y = m * d, 3 * h * d, 0, m * d
    elif case.kind == "mlp":
        x, weights, bias, y = m * d, 2 * h * d, h + d, m * d
    else:
        x, weights, bias, y = m * d, h * d, h, m * h
    fwd = x + weights + bias + y
    if case.mode == "fwd":
        return s * fwd
    dy, dx, dweights, dbias = y, x, weights, bias
    return s * (fwd + dy + dx + dweights + dbias)


def intensity(case: Case) -> float:
    """Arithmetic intensity in FLOP per byte of the minimal traffic."""
    return flops(case) / min_bytes(case)


@dataclass
class Peaks:
    device: str
    gemm_tflops: dict[str, float] = field(default_factory=dict)  # dtype -> TFLOP/s
    copy_gbps: float = 0.0  # GB/s (1e9 bytes), read + written
    how: dict[str, str] = field(default_factory=dict)

    def floor_us(self, case: Case) -> float:
        return max(self.compute_us(case), self.memory_us(case))

    def compute_us(self, case: Case) -> float:
        return flops(case) / (self.gemm_tflops[case.dtype] * 1e12) * 1e6

    def memory_us(self, case: Case) -> float:
        return min_bytes(case) / (self.copy_gbps * 1e9) * 1e6

    def to_dict(self) -> dict:
        return {"device": self.device, "gemm_tflops": self.gemm_tflops, "copy_gbps": self.copy_gbps, "how": self.how}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{os.cpu_count()}c"


def device_slug(device: torch.device) -> str:
    return peaks_slug(device_name(device))


def cache_path(device: torch.device) -> Path:
    return cache_dir() / f"peaks-{device_slug(device)}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm_tflops(device: torch.device, dtype: str, n: int | None = None, reps: int = 20) -> tuple[float, str]:
    # CPUs: small sizes, and smaller for 16-bit types, which most CPUs emulate slowly.
    n = n or (8192 if device.type == "cuda" else (1024 if dtype == "fp32" else 384))
    if device.type != "cuda":
        reps = min(reps, 5)
    g = torch.Generator(device=device).manual_seed(0)
    # Random data, not zeros: GEMMs on zeros run measurably faster on Hopper.
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype], generator=g)
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype], generator=g)
    out = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    sec = _median_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    return 2 * n**3 / sec / 1e12, f"{dtype} torch.mm {n}x{n}x{n}, median of {reps}"


def measure_copy_gbps(device: torch.device, nbytes: int | None = None, reps: int = 20) -> tuple[float, str]:
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    if device.type != "cuda":
        reps = min(reps, 5)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sec = _median_seconds(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / sec / 1e9, f"copy_ of {nbytes >> 20} MiB (read + write), median of {reps}"


def spin_up(device: torch.device, seconds: float = 0.3) -> None:
    """Run large GEMMs for a while: clocks ramp, and a cold GPU times 5 % slow (DESIGN.md, Measuring)."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize(device)


def _read_cache(path: Path, device: torch.device) -> Peaks:
    """The cached peaks at `path`, checked field by field; BadCache says what is wrong."""
    data = read_peaks(path, device_name(device))
    return Peaks(data["device"], data["gemm_tflops"], data["copy_gbps"], data["how"])


def _note(log, message: str) -> None:
    if log:
        log(message)
    else:
        print(f"mlpfuse: {message}", file=sys.stderr)


def load_peaks(device: torch.device, dtypes, *, remeasure: bool = False, log=None) -> Peaks:
    """Peaks for `dtypes` on `device`, from the cache where valid, measuring (and caching) what is missing.

    `log(message)` receives one-line notes (an ignored cache, a measurement, a cache that cannot be written);
    without it they go to stderr.
    """
    path = cache_path(device)
    peaks = Peaks(device_name(device))
    if not remeasure and (path.exists() or path.is_symlink()):
        try:
            peaks = _read_cache(path, device)
        except BadCache as why:
            _note(log, f"ignoring the peaks cache {path}: {why}; measuring again")
    missing = [d for d in dtypes if d not in peaks.gemm_tflops]
    if missing or not peaks.copy_gbps:
        if log:
            log(f"measuring this device's peaks ({', '.join(missing) or 'copy'}); cached in {path}")
        spin_up(device)
        for dt in missing:
            peaks.gemm_tflops[dt], peaks.how[f"gemm_{dt}"] = measure_gemm_tflops(device, dt)
        if not peaks.copy_gbps:
            peaks.copy_gbps, peaks.how["copy"] = measure_copy_gbps(device)
        peaks.how["measured_with"] = f"torch {torch.__version__}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(peaks.to_dict(), indent=2) + "\n")
        except OSError as exc:
            # A read-only home (or a folder where the file belongs) still benches; it measures again next time.
            _note(log, f"cannot cache the peaks in {path} ({exc.strerror or type(exc).__name__})")
    return peaks
