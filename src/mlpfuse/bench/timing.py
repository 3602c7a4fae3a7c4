"""Clocks: GPU time from CUDA events and host wall time per call, both taken in interleaved rounds.

GPU time: each repetition is bracketed by its own pair of CUDA events, after a write to a buffer twice the L2's
size, so every call starts with cold caches (as the next layer of a model would). With `queue_ahead` (the block
benchmarks) a GPU sleep longer than the call's host time follows the flush, so the host has queued the whole call
before its start event runs: the number is the GPU's own time, launch gaps and the host's noise kept out of it (on
a busy host, timing the call as its launches arrive gave ±50–200 % spreads at a few dozen tokens). Without it (the
model lab) the GPU waits for the host's launches inside the events, as an eager-mode step does. Wall time: N calls
back to back between two synchronizes, divided by N: what the host pays per call, dispatch included; this is the
number that matters when the GPU work is smaller than the Python and launch overhead.

Rounds: on the H200 two identical variants timed one after the other differed by 5 % (clock ramp, neighbours), and
agreed within 0.1 % when interleaved A B C A B C …; so each round times every variant once, and a variant's
result is the median over rounds, with the spread (max − min) / median reported beside it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Stat:
    median_us: float
    spread_pct: float  # (max − min) / median of the per-round medians, in %
    samples: int  # repetitions in all rounds
    rounds_us: tuple[float, ...] = ()  # the per-round values, in round order

    @staticmethod
    def of_rounds(rounds_us: list[float], samples: int) -> "Stat":
        med = statistics.median(rounds_us)
        spread = (max(rounds_us) - min(rounds_us)) / med * 100 if med > 0 else 0.0
        return Stat(med, spread, samples, tuple(rounds_us))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flusher:
    """Writes a buffer twice the size of the L2 cache: whatever the last call left there is evicted."""

    def __init__(self, device: torch.device):
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
        self.buf = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


class HostAhead:
    """A GPU sleep of a given length in µs, so the host can queue a whole call before the GPU reaches it."""

    def __init__(self, device: torch.device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # the clock up first
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_us = cycles / max(start.elapsed_time(end) * 1e3, 1.0)

    def __call__(self, us: float) -> None:
        torch.cuda._sleep(int(us * self.cycles_per_us))


def gpu_times_us(step, reps: int, flush: L2Flusher | None, ahead: HostAhead | None = None,
                 ahead_us: float = 0.0) -> list[float]:
    """Per-repetition GPU time of `step` in µs, each from its own event pair (after `ahead(ahead_us)` when given)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush()
        if ahead is not None:
            ahead(ahead_us)
        start.record()
        step()
        end.record()
    ends[-1].synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def wall_us_per_call(step, calls: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def first_call_ms(step, device: torch.device):
    """Latency of the very first call (compilation, autotuning, graph capture, module loading included)."""
    sync(device)
    t0 = time.perf_counter()
    out = step()
    sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def reps_for(estimate_us: float, target_ms: float, lo: int, hi: int) -> int:
    """How many repetitions fill about `target_ms` of one round, within [lo, hi]."""
    if estimate_us <= 0:
        return hi
    return int(min(hi, max(lo, target_ms * 1e3 / estimate_us)))


def interleaved(
    steps: dict[str, object],
    device: torch.device,
    *,
    rounds: int,
    target_ms: float,
    on_round=None,
    reps_bounds: tuple[int, int] | None = None,
    gpu_clock: bool = True,
    queue_ahead: bool = False,
) -> tuple[dict[str, Stat | None], dict[str, Stat], dict[str, str]]:
    """Time every step in rounds (A B C A B C …); returns GPU stats (None on CPU or without `gpu_clock`), wall
    stats, and errors.

    A step that raises while being timed is dropped from later rounds and reported in `errors`. `reps_bounds`: the
    fewest and most repetitions per round (default 5–200 on a GPU, 2–50 on a CPU). `gpu_clock=False` times wall
    only (steps that synchronize the host themselves, such as generate). `queue_ahead`: GPU time without the
    host's launch gaps (see the module's docstring); the sleep before each call is twice its first wall time.
    """
    cuda = device.type == "cuda"
    timed_on_gpu = cuda and gpu_clock
    flush = L2Flusher(device) if timed_on_gpu else None
    errors: dict[str, str] = {}
    # One timed call each as the size estimate for the repetition counts (after the caller's warm-up).
    estimate = {}
    for name, step in steps.items():
        try:
            estimate[name] = wall_us_per_call(step, 1, device)
        except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the others
            errors[name] = one_line(exc)
    ahead = HostAhead(device) if timed_on_gpu and queue_ahead else None
    lo, hi = reps_bounds or ((5, 200) if cuda else (2, 50))
    reps = {n: reps_for(e, target_ms, lo, hi) for n, e in estimate.items()}
    gpu_rounds: dict[str, list[float]] = {n: [] for n in estimate}
    wall_rounds: dict[str, list[float]] = {n: [] for n in estimate}
    for r in range(rounds):
        for name, step in steps.items():
            if name in errors:
                continue
            try:
                if timed_on_gpu:
                    times = gpu_times_us(step, reps[name], flush, ahead, min(2 * estimate[name], 100_000.0))
                    gpu_rounds[name].append(statistics.median(times))
                wall_rounds[name].append(wall_us_per_call(step, reps[name], device))
            except Exception as exc:  # noqa: BLE001
                errors[name] = one_line(exc)
        if on_round:
            on_round(r)
    gpu = {n: Stat.of_rounds(v, len(v) * reps[n]) if v else None for n, v in gpu_rounds.items() if n not in errors}
    wall = {n: Stat.of_rounds(v, len(v) * reps[n]) for n, v in wall_rounds.items() if n not in errors and v}
    return gpu, wall, errors


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, short enough for a table cell and a CSV field."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 200:
        msg = msg[:197] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
