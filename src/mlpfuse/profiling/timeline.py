"""GPU busy and idle time per step, on the GPU's own timeline.

Kernels run after the CPU launches them, often much later: in a training loop the CPU is usually a step ahead,
and while it runs step k the GPU is still busy with step k-1's queue. Measuring step k's GPU time from its CPU
start would count that queued work as idle. So each step gets a GPU window:

    start = the latest of: the step's CPU start; the end of all GPU work launched before it; the previous window's end
    end   = the latest of: the step's CPU end; the end of all GPU work launched up to then; the window's start

The window opens when both the CPU has begun the step and the GPU has drained what earlier steps queued, and closes
when both the CPU has finished the step and the GPU has finished its work. Windows never overlap: over contiguous
steps they tile the timeline, so per-step busy and idle add up to the trace's. GPU busy is the union of every GPU
activity (kernel, memset, memcpy; any stream, any step's work) inside the window; idle is window minus busy. When
the CPU is the bottleneck the window is the step's CPU span and the time the GPU waits for launches is idle; when
the GPU is, the window runs from the end of one step's GPU work to the end of the next.

With the whole trace as one step there are no step boundaries to wait on: its window is the GPU's own span, from
the first activity's start to the last one's end.

How far the CPU runs ahead: `cpu_ahead_us` is the time from a step's CPU start to the start of its own first GPU
activity (what it launched). When it approaches the step time, the CPU is a whole step ahead and launch overhead is
hidden behind GPU work; `launch_to_start_us` is the mean delay from a launch call to the start of its activity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlpfuse.profiling.steps import Step

MAX_GAPS = 5  # largest idle gaps listed, over all steps


@dataclass
class Activity:
    """GPU activities as parallel arrays (one entry per kernel, memset or memcpy)."""

    start: np.ndarray
    end: np.ndarray
    launch: np.ndarray  # start of the launching runtime call; the activity's own start when unknown
    launched: np.ndarray  # bool: the launch call is known
    step: np.ndarray  # index of the step that launched it, -1 for none
    names: list[str] | tuple[str, ...]


@dataclass
class _Merged:
    """The union of all activity intervals: disjoint busy periods, with the names at their edges."""

    start: np.ndarray
    end: np.ndarray
    first: list[str]  # activity starting the period
    last: list[str]  # activity ending it


def _merge(act: Activity) -> _Merged:
    if not len(act.start):
        return _Merged(np.zeros(0), np.zeros(0), [], [])
    order = np.lexsort((act.end, act.start))
    start, end = act.start[order], act.end[order]
    reach = np.maximum.accumulate(end)
    # A new busy period starts where an activity starts after everything before it has ended.
    new = np.empty(len(start), dtype=bool)
    new[0] = True
    new[1:] = start[1:] > reach[:-1]
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], len(start)) - 1
    group = np.cumsum(new) - 1
    # The activity ending a period: the last one, in (period, end) order.
    by_end = np.lexsort((end, group))
    last_idx = by_end[np.append(np.flatnonzero(np.diff(group[by_end])), len(start) - 1)]
    name = act.names.__getitem__
    return _Merged(start[heads], reach[tails], list(map(name, order[heads].tolist())),
                   list(map(name, order[last_idx].tolist())))


def windows(steps: list[Step], act: Activity, whole_trace: bool) -> list[tuple[float, float]]:
    """Each step's GPU window (see the module docstring)."""
    if whole_trace:
        if len(act.start):
            return [(float(act.start.min()), float(act.end.max()))]
        return [(steps[0].ts, steps[0].end)]
    order = np.argsort(act.launch, kind="stable")
    launch = act.launch[order]
    drained = np.maximum.accumulate(act.end[order]) if len(order) else np.zeros(0)

    def drained_by(t: float, side: str) -> float:
        i = int(np.searchsorted(launch, t, side=side))
        return float(drained[i - 1]) if i else 0.0

    out, prev_end = [], 0.0
    for s in steps:
        start = max(s.ts, drained_by(s.ts, "left"), prev_end)
        end = max(s.end, drained_by(s.end, "right"), start)
        out.append((start, end))
        prev_end = end
    return out


@dataclass
class StepTimeline:
    window_start: float
    window_end: float
    busy_us: float
    gaps: list[dict]  # the step's largest idle gaps: start_us (from the step's CPU start), dur_us, after, before

    @property
    def window_us(self) -> float:
        return self.window_end - self.window_start


def per_step(steps: list[Step], act: Activity, whole_trace: bool) -> list[StepTimeline]:
    merged = _merge(act)
    out = []
    for s, (lo, hi) in zip(steps, windows(steps, act, whole_trace)):
        # Busy periods overlapping [lo, hi]: from the first ending after lo to the last starting before hi.
        i = int(np.searchsorted(merged.end, lo, side="right"))
        j = int(np.searchsorted(merged.start, hi, side="left"))
        a = np.clip(merged.start[i:j], lo, hi)
        b = np.clip(merged.end[i:j], lo, hi)
        busy = float(np.sum(b - a)) if j > i else 0.0
        out.append(StepTimeline(lo, hi, min(busy, hi - lo), _gaps(s, merged, i, j, lo, hi, a, b)))
    return out


def _gaps(step: Step, m: _Merged, i: int, j: int, lo: float, hi: float, a: np.ndarray, b: np.ndarray) -> list[dict]:
    """The largest idle stretches inside [lo, hi], each named by the activities around it."""
    starts = np.concatenate(([lo], b))  # an idle stretch starts at the window start or where a busy period ends
    ends = np.concatenate((a, [hi]))
    dur = ends - starts
    top = [k for k in np.argsort(-dur, kind="stable")[:MAX_GAPS] if dur[k] > 0]
    gaps = []
    for k in top:
        before_idx, after_idx = i + k, i + k - 1  # busy periods after and before the stretch
        gaps.append({
            "start_us": float(starts[k] - step.ts) if starts[k] >= step.ts else 0.0,
            "dur_us": float(dur[k]),
            "after": m.last[after_idx] if after_idx >= 0 else "(trace start)",
            "before": m.first[before_idx] if before_idx < len(m.first) else "(trace end)",
        })
    return gaps


def cpu_ahead(steps: list[Step], act: Activity) -> list[float | None]:
    """Per step: from its CPU start to the start of the first GPU activity it launched (None without any)."""
    first = np.full(len(steps), np.inf)
    own = act.step >= 0
    np.minimum.at(first, act.step[own], act.start[own])
    return [max(float(f) - s.ts, 0.0) if np.isfinite(f) else None for s, f in zip(steps, first)]


def launch_delay(steps: list[Step], act: Activity) -> list[float | None]:
    """Per step: mean time from a launch call's start to its activity's start (None without known launches)."""
    keep = (act.step >= 0) & act.launched
    n = len(steps)
    count = np.bincount(act.step[keep], minlength=n)
    total = np.bincount(act.step[keep], weights=np.maximum(act.start[keep] - act.launch[keep], 0.0), minlength=n)
    return [float(t / c) if c else None for t, c in zip(total, count)]
