"""Where a trace's steps come from.

A step is a span of CPU time whose work is analysed as one unit and averaged with the others. The source is chosen
in this order unless the caller names one:
  1. `ProfilerStep#N` spans (torch.profiler's schedule with `prof.step()`): the loop's own iterations;
  2. the label mlpfuse's own capture wrote into the trace (`mlpfuse_label`), which it wraps around each step;
  3. the whole trace as one window.
Any other `record_function` label is used only when asked for (`label=`, CLI `--label`): picking the most common
label would silently analyse a warm-up region or a tiny repeated span instead of the loop.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from itertools import chain, compress
from typing import Sequence

from mlpfuse.errors import InputError
from mlpfuse.profiling.trace import Event, Trace, describe, event_field

PROFILER_STEP = "ProfilerStep"
LABEL = "label"
WHOLE_TRACE = "whole-trace"
AUTO = "auto"
SOURCES = (AUTO, PROFILER_STEP, LABEL, WHOLE_TRACE)
WHOLE_TRACE_NAME = "(whole trace)"

_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")
_NAME, _TS, _DUR = event_field("name"), event_field("ts"), event_field("dur")


@dataclass(frozen=True)
class Step:
    name: str
    ts: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.ts


@dataclass(frozen=True)
class StepSource:
    kind: str  # PROFILER_STEP | LABEL | WHOLE_TRACE
    label: str | None = None  # the span name, for LABEL
    why: str = ""  # how it was chosen, for the header

    def describe(self) -> str:
        """The `step_source` string of the JSON (its spelling predates `step_source_kind`)."""
        if self.kind == LABEL:
            return f"label {self.label!r}"
        return "whole trace" if self.kind == WHOLE_TRACE else PROFILER_STEP


def find_steps(trace: Trace, label: str | None = None, source: str = AUTO,
               names: Sequence[str] | None = None) -> tuple[list[Step], StepSource]:
    """Steps (sorted, disjoint) and their source. `label` names the spans to use (any name, `## ...` included);
    `source` forces one of SOURCES. `names`: the names of trace.annotations then trace.cpu_ops, when the caller
    has them at hand (it saves a pass over the events)."""
    if source not in SOURCES:
        raise InputError(f"steps-from: expected one of {', '.join(SOURCES)}, got {source!r}")
    if label is not None and (not isinstance(label, str) or not label):
        raise InputError(f"label: expected a non-empty span name, got {label!r}")
    if label is not None and source not in (AUTO, LABEL):
        raise InputError(f"label: a label chooses label spans as steps; it conflicts with steps-from {source}")
    if source == LABEL and label is None:
        raise InputError("steps-from label: name the spans with --label NAME (label=...)")
    if label is not None:
        return _label_steps(trace, label), StepSource(LABEL, label, "chosen")
    if source in (AUTO, PROFILER_STEP):
        # Each distinct name is tested once (a trace has few), then the events are picked by name in C.
        if names is None:
            names = tuple(map(_NAME, chain(trace.annotations, trace.cpu_ops)))
        step_names = {n for n in set(names) if n.startswith("ProfilerStep#") and _STEP_NAME.match(n)}
        spans = list(compress(chain(trace.annotations, trace.cpu_ops), map(step_names.__contains__, names)))
        if spans:
            return _outermost(spans), StepSource(PROFILER_STEP, why="ProfilerStep#N spans")
        if trace.skipped_steps:  # falling back to other spans would analyse something else without saying so
            raise InputError(f"TRACE {trace.path}: all {trace.skipped_steps} ProfilerStep# spans are malformed "
                             f"(skipped: {describe(trace.skipped)}); no steps to analyse (--steps-from whole-trace "
                             "analyses the trace as one window)")
        if source == PROFILER_STEP:
            raise InputError(f"TRACE {trace.path}: no ProfilerStep#N spans (capture with a torch.profiler "
                             "schedule and prof.step(), or use --steps-from whole-trace or --label NAME)")
        own = trace.metadata.get("mlpfuse_label")
        if isinstance(own, str) and own:
            steps = _spans(trace, own)
            if steps:
                return steps, StepSource(LABEL, own, "the label mlpfuse's capture recorded")
    return whole_trace(trace), StepSource(WHOLE_TRACE, why="no ProfilerStep#N spans" if source == AUTO else "chosen")


def _spans(trace: Trace, name: str) -> list[Step]:
    return _outermost([e for e in (*trace.annotations, *trace.cpu_ops) if e.name == name])


def _label_steps(trace: Trace, label: str) -> list[Step]:
    steps = _spans(trace, label)
    if not steps:
        raise InputError(f"TRACE {trace.path}: no spans named {label!r} to use as steps")
    return steps


def whole_trace(trace: Trace) -> list[Step]:
    """One step spanning every event the analysis reads."""
    first = last = None
    for events in (trace.cpu_ops, trace.annotations, trace.runtime, trace.gpu):
        if events:
            lo = min(map(_TS, events))
            hi = max(map(operator.add, map(_TS, events), map(_DUR, events)))
            first = lo if first is None else min(first, lo)
            last = hi if last is None else max(last, hi)
    return [Step(WHOLE_TRACE_NAME, first, last)]


def _outermost(spans: list[Event]) -> list[Step]:
    steps: list[Step] = []
    for e in sorted(spans, key=lambda e: (e.ts, -e.dur)):
        if steps and e.ts < steps[-1].end:  # nested or overlapping: the outer span is the step
            continue
        steps.append(Step(e.name, e.ts, e.end))
    return steps
