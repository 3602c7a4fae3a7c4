"""Which events of a trace the pictures draw: the step spans, the one step the timeline shows, its events.

The step spans are found from the analysis's own answer (its `step_names`), so the report draws the steps the
tables count; a trace whose steps have no span of their own (an analysis that took the whole trace as one
window) is drawn whole. GPU work belongs to the step whose CPU side launched it (correlation id -> runtime call
-> its start time), as in the analysis; GPU work of other steps that runs inside the window is drawn apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from mlpfuse.profiling.steps import Step as Span  # a step's name and [ts, end) span
from mlpfuse.profiling.trace import Event, Trace

# What one timeline draws at most, per kind; past these the first ones by start time are drawn, and the page
# says how many were left out (the tables still count every one).
MAX_GPU = 2000
MAX_RUNTIME = 2000
MAX_OPS = 4000
MAX_DEPTH = 12  # nesting rows of CPU ops per thread


def step_spans(trace: Trace, data: dict) -> list[Span]:
    """The analysis's steps as spans of this trace, in time order; the whole trace when none matches."""
    wanted = {n for n in data.get("step_names") or () if isinstance(n, str)}
    spans: list[Span] = []
    if wanted:
        # Outermost, non-overlapping spans of those names: a label can wrap nested spans of itself.
        found = sorted((e for e in chain(trace.annotations, trace.cpu_ops) if e.name in wanted),
                       key=lambda e: (e.ts, -e.dur))
        for e in found:
            if not spans or e.ts >= spans[-1].end:
                spans.append(Span(e.name, e.ts, e.end))
    if not spans:
        events = [e for e in chain(trace.cpu_ops, trace.annotations, trace.runtime, trace.gpu)]
        if events:
            spans = [Span("(whole trace)", min(e.ts for e in events), max(e.end for e in events))]
    return spans


def choose_step(spans: list[Span], data: dict) -> tuple[int, str]:
    """The step to draw and why: the one whose GPU activity count is nearest the per-step average (a typical
    step, not a warm-up outlier), the later one on ties; the last one when the analysis has no step table."""
    rows = data.get("step_table")
    if not isinstance(rows, list) or len(rows) != len(spans) or not spans:
        return max(len(spans) - 1, 0), "the last step"

    def work(row) -> float:
        if not isinstance(row, dict):
            return 0.0
        return sum(float(row.get(k) or 0) for k in ("gpu_kernels", "gpu_memsets", "gpu_memcpys")
                   if isinstance(row.get(k), (int, float)))

    counts = [work(r) for r in rows]
    with_gpu = [c for c in counts if c > 0]
    if not with_gpu:
        return len(spans) - 1, "the last step (no step has GPU activity)"
    mean = sum(with_gpu) / len(with_gpu)
    best = min((abs(c - mean), -i) for i, c in enumerate(counts) if c > 0)
    return -best[1], "the step whose GPU activity count is nearest the average"


@dataclass
class StepEvents:
    """One step's events as the timeline draws them; `totals` counts every one, the lists hold those drawn."""

    span: Span
    index: int
    why: str
    window_end: float
    ops: list[tuple[Event, int]] = field(default_factory=list)  # (op or annotation, nesting depth)
    runtime: list[Event] = field(default_factory=list)
    gpu: list[Event] = field(default_factory=list)  # launched by this step
    gpu_other: list[Event] = field(default_factory=list)  # other steps' work running inside the window
    totals: dict = field(default_factory=dict)


def _thread(e: Event):
    return (str(e.pid), str(e.tid))


def _nest(events: list[Event]) -> list[tuple[Event, int]]:
    """Depth of each event in its thread's nesting (an event inside an earlier, longer one is one row deeper)."""
    out = []
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault(_thread(e), []).append(e)
    for evs in by_thread.values():
        ends: list[float] = []
        for e in sorted(evs, key=lambda e: (e.ts, -e.dur)):
            while ends and ends[-1] <= e.ts:
                ends.pop()
            out.append((e, len(ends)))
            ends.append(e.end)
    return out


def step_events(trace: Trace, spans: list[Span], index: int, why: str) -> StepEvents:
    span = spans[index]
    lo, hi = span.ts, span.end
    runtime = [e for e in trace.runtime if lo <= e.ts <= hi]
    by_corr = {e.correlation for e in runtime if e.correlation is not None}
    # Correlation ids of runtime calls in other steps: their GPU work is not this step's even if it runs here.
    launched_elsewhere = {e.correlation for e in trace.runtime if e.correlation is not None
                          and not lo <= e.ts <= hi} if trace.runtime else set()
    mine, rest = [], []
    for e in trace.gpu:
        c = e.correlation
        if c is not None and c in by_corr:
            mine.append(e)
        elif (c is None or c not in launched_elsewhere) and lo <= e.ts <= hi:
            mine.append(e)  # no runtime call to say which step launched it: the one it starts in
        else:
            rest.append(e)
    window_end = max([hi] + [e.end for e in mine])
    others = [e for e in rest if e.ts < window_end and e.end > lo]
    ops = [e for e in chain(trace.annotations, trace.cpu_ops) if lo <= e.ts <= hi]
    nested = _nest(ops)
    deep = sum(1 for _, d in nested if d >= MAX_DEPTH)
    nested = [(e, d) for e, d in nested if d < MAX_DEPTH]
    totals = {"ops": len(ops), "ops_too_deep": deep, "runtime": len(runtime), "gpu": len(mine),
              "gpu_other": len(others)}
    nested.sort(key=lambda p: p[0].ts)
    return StepEvents(span=span, index=index, why=why, window_end=window_end, ops=nested[:MAX_OPS],
                      runtime=sorted(runtime, key=lambda e: e.ts)[:MAX_RUNTIME],
                      gpu=sorted(mine, key=lambda e: e.ts)[:MAX_GPU],
                      gpu_other=sorted(others, key=lambda e: e.ts)[:MAX_GPU], totals=totals)
