"""Small analyses over the event model, each returning a plain table (list of dicts) or dict.

Pipeline: `find_steps` -> `link` (CPU op nesting, launch -> op attribution, GPU activity -> launch through
correlation ids) -> per-step counts, kernel table, op table, zero-kernel ops, GPU idle and gaps -> verdict.
`Analysis` bundles the results; its `to_dict()` is the `analyze --json` schema (README documents every key).

No torch import here: analysis runs wherever the trace file is.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from mlpfuse.errors import InputError
from mlpfuse.profiling import kernel_names
from mlpfuse.profiling.schema import SCHEMA, validate
from mlpfuse.profiling.trace import KERNEL, MEMSET, Event, Trace, clean_name, describe


# Verdict threshold: share of the step's GPU window during which a kernel, memset or memcpy runs. At or above it
# the kernels decide the step time (compute-bound); below it the GPU mostly waits for the CPU (overhead-bound).
# Within overhead-bound, "launch-bound" is added when a GPU activity lasts less than the CPU call that launched it.
COMPUTE_BOUND_BUSY_SHARE = 0.5
MAX_GAPS = 5  # largest idle gaps listed, over all steps

_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")


def is_launch(name: str) -> bool:
    """Runtime/driver calls that put work on the GPU queue (kernels and graphs)."""
    return "Launch" in name and "Occupancy" not in name


def is_occupancy_query(name: str) -> bool:
    return "Occupancy" in name


@dataclass(frozen=True)
class Step:
    name: str
    ts: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.ts


# ---------------------------------------------------------------- steps


def find_steps(trace: Trace, label: str | None = None) -> tuple[list[Step], str]:
    """Steps and where they came from: `ProfilerStep#N` spans, else spans of the user label."""
    if label is None:
        spans = [e for e in (*trace.annotations, *trace.cpu_ops)
                 if e.name.startswith("ProfilerStep#") and _STEP_NAME.match(e.name)]
        if spans:
            return _outermost(spans), "ProfilerStep"
        if trace.skipped_steps:  # falling back to another span would analyse something else without saying so
            raise InputError(f"TRACE {trace.path}: all {trace.skipped_steps} ProfilerStep# spans are malformed "
                             f"(skipped: {describe(trace.skipped)}); no steps to analyse")
        label = trace.metadata.get("mlpfuse_label")
        if not isinstance(label, str) or not label:
            counts = Counter(e.name for e in trace.annotations if not e.name.startswith("## "))
            label = counts.most_common(1)[0][0] if counts else None
    if label:
        spans = [e for e in (*trace.annotations, *trace.cpu_ops) if e.name == label]
        if spans:
            return _outermost(spans), f"label {label!r}"
        raise InputError(f"TRACE {trace.path}: no spans named {label!r} to use as steps")
    raise InputError(
        f"TRACE {trace.path}: no steps (no ProfilerStep#N spans and no record_function label); "
        "capture with a torch.profiler schedule and prof.step(), or pass --label NAME"
    )


def _outermost(spans: list[Event]) -> list[Step]:
    steps: list[Step] = []
    for e in sorted(spans, key=lambda e: (e.ts, -e.dur)):
        if steps and e.ts < steps[-1].end:  # nested or overlapping: the outer span is the step
            continue
        steps.append(Step(e.name, e.ts, e.end))
    return steps


# ---------------------------------------------------------------- linking


@dataclass
class Links:
    op_parent: list[int]  # index of the enclosing CPU op on the same thread, -1 at top level
    op_self_us: list[float]
    launcher: list[int]  # runtime event -> innermost enclosing CPU op, -1 if none
    gpu_runtime: list[int]  # GPU event -> runtime call that issued it (correlation id), -1 if unknown
    gpu_op: list[int]  # GPU event -> CPU op that launched it, -1 if unknown


def link(trace: Trace) -> Links:
    ops, runtime, gpu = trace.cpu_ops, trace.runtime, trace.gpu
    n_ops = len(ops)
    op_parent = [-1] * n_ops
    op_self = [e.dur for e in ops]
    launcher = [-1] * len(runtime)

    # One sweep over ops and runtime calls ordered by (thread, start, longest first) keeps a stack of open ops
    # per thread. Index i < n_ops is an op, else a runtime call; on ties ops come first, since they may enclose.
    both = ops + runtime
    n = len(both)
    threads: dict[Any, int] = {}
    thread = np.fromiter((threads.setdefault((e.pid, e.tid), len(threads)) for e in both), np.int64, n)
    ts = np.fromiter((e.ts for e in both), np.float64, n)
    dur = np.fromiter((e.dur for e in both), np.float64, n)
    order = np.lexsort((np.arange(n), -dur, ts, thread)).tolist()
    ends = (ts + dur).tolist()
    thread_of = thread.tolist()
    dur_of = dur.tolist()
    current = -1
    stack: list[int] = []
    stack_end: list[float] = []
    for i in order:
        if thread_of[i] != current:
            current, stack, stack_end = thread_of[i], [], []
        end = ends[i]
        limit = end - 1e-6
        while stack_end and stack_end[-1] < limit:
            stack_end.pop()
            stack.pop()
        top = stack[-1] if stack else -1
        if i < n_ops:
            op_parent[i] = top
            if top >= 0:
                op_self[top] -= dur_of[i]
            stack.append(i)
            stack_end.append(end)
        else:
            launcher[i - n_ops] = top

    by_corr = {e.correlation: i for i, e in enumerate(runtime) if e.correlation is not None}
    by_ext: dict[int, int] = {}
    for i, e in enumerate(ops):
        if e.external_id is not None:
            by_ext.setdefault(e.external_id, i)
    gpu_runtime = [-1] * len(gpu)
    gpu_op = [-1] * len(gpu)
    for g, e in enumerate(gpu):
        r = by_corr.get(e.correlation, -1) if e.correlation is not None else -1
        gpu_runtime[g] = r
        if r >= 0 and launcher[r] >= 0:
            gpu_op[g] = launcher[r]
        elif e.external_id is not None:
            # Kineto also stamps GPU activity with the launching op's External id; use it when the launch is missing.
            gpu_op[g] = by_ext.get(e.external_id, -1)
    return Links(op_parent, np.maximum(np.asarray(op_self, dtype=np.float64), 0.0).tolist(), launcher, gpu_runtime,
                 gpu_op)


def step_indices(steps: list[Step], times: list[float]) -> list[int]:
    """Index of the step whose span holds each time, -1 outside every step (steps are sorted, disjoint)."""
    if not times:
        return []
    t = np.asarray(times, dtype=np.float64)
    starts = np.asarray([s.ts for s in steps])
    ends = np.asarray([s.end for s in steps])
    k = np.searchsorted(starts, t, side="right") - 1
    inside = (k >= 0) & (t <= ends[np.maximum(k, 0)])
    return np.where(inside, k, -1).tolist()


def _op_rows(ops: list[Event], op_step: list[int], self_us: list[float], launched_any, n: int) -> dict[str, dict]:
    """Per op name over the steps: count, total and self CPU time, whether any instance launched GPU work."""
    ids: dict[str, int] = {}
    name_id = np.fromiter((ids.setdefault(e.name, len(ids)) for e in ops), dtype=np.int64, count=len(ops))
    keep = np.asarray(op_step, dtype=np.int64) >= 0
    m = len(ids)
    idx = name_id[keep]
    count = np.bincount(idx, minlength=m)
    total = np.bincount(idx, weights=np.fromiter((e.dur for e in ops), np.float64, len(ops))[keep], minlength=m)
    own = np.bincount(idx, weights=np.asarray(self_us, dtype=np.float64)[keep], minlength=m)
    launched = np.bincount(idx, weights=np.frombuffer(bytes(launched_any), dtype=np.uint8)[keep].astype(np.float64),
                           minlength=m)
    rows = {}
    for name, i in ids.items():
        if count[i]:
            rows[name] = {"name": name, "count": int(count[i]), "cpu_total_us": float(total[i]),
                          "cpu_self_us": float(own[i]), "kernels": 0, "gpu_activities": 0, "kernel_names": Counter(),
                          "launched_any": int(launched[i])}
    return rows


# ---------------------------------------------------------------- GPU busy / idle


def gpu_timeline(step: Step, intervals: list[tuple[float, float, str]]) -> dict:
    """Busy = union of the step's GPU intervals; window = step start .. later of step end and last GPU end.

    An interval that starts before its step (skewed clocks, or a hand-made trace) counts from the step start, so
    busy never exceeds the window."""
    if not intervals:
        return {"busy_us": 0.0, "window_us": step.dur, "gaps": []}
    intervals = sorted(intervals)
    window_end = max(step.end, max(end for _, end, _ in intervals))
    busy = 0.0
    gaps = []
    cursor, before = step.ts, "(step start)"
    cur_start, cur_end, cur_last = None, None, ""
    for start, end, name in intervals:
        if start < step.ts:
            start, end = step.ts, max(end, step.ts)
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
                cursor, before = cur_end, cur_last
            if start > cursor:
                gaps.append({"start_us": cursor - step.ts, "dur_us": start - cursor, "after": before, "before": name})
            cur_start, cur_end, cur_last = start, end, name
        elif end > cur_end:
            cur_end, cur_last = end, name
    busy += cur_end - cur_start
    if window_end > cur_end:
        gaps.append({"start_us": cur_end - step.ts, "dur_us": window_end - cur_end, "after": cur_last,
                     "before": "(step end)"})
    window = window_end - step.ts
    return {"busy_us": min(busy, window), "window_us": window, "gaps": gaps}  # min(): float rounding only


# ---------------------------------------------------------------- the analysis


def analyze_trace(trace: Trace, label: str | None = None) -> "Analysis":
    steps, step_source = find_steps(trace, label)
    links = link(trace)
    n = len(steps)
    ops, runtime, gpu = trace.cpu_ops, trace.runtime, trace.gpu

    op_step = step_indices(steps, [e.ts for e in ops])
    rt_step = step_indices(steps, [e.ts for e in runtime])
    own_step = step_indices(steps, [e.ts for e in gpu])
    # GPU work belongs to the step that launched it (it may run after the step's CPU span has ended).
    gpu_step = [rt_step[r] if r >= 0 else own for r, own in zip(links.gpu_runtime, own_step)]

    # Ops whose subtree launched GPU work (an op "launches" if it or anything under it did).
    launched_any = bytearray(len(ops))
    for o in links.gpu_op:
        while o >= 0 and not launched_any[o]:
            launched_any[o] = 1
            o = links.op_parent[o]

    per = [defaultdict(float) for _ in range(n)]
    launch_names: list[Counter] = [Counter() for _ in range(n)]
    runtime_names: list[Counter] = [Counter() for _ in range(n)]
    fam_counts: list[Counter] = [Counter() for _ in range(n)]
    intervals: list[list[tuple[float, float, str]]] = [[] for _ in range(n)]

    for i, e in enumerate(runtime):
        k = rt_step[i]
        if k < 0:
            continue
        runtime_names[k][e.name] += 1
        if is_launch(e.name):
            launch_names[k][e.name] += 1
            per[k]["launch_us"] += e.dur
        elif is_occupancy_query(e.name):
            per[k]["occupancy_queries"] += 1

    op_rows = _op_rows(ops, op_step, links.op_self_us, launched_any, n)
    for k, c in enumerate(np.bincount(np.asarray(op_step, dtype=np.int64) + 1, minlength=n + 1)[1:]):
        per[k]["cpu_ops"] = float(c)

    kernel_rows: dict[tuple[str, str], dict] = {}
    by_op: dict[str, Counter] = defaultdict(Counter)
    for g, e in enumerate(gpu):
        k = gpu_step[g]
        if k < 0:
            continue
        family = kernel_names.family_of(e.name, e.cat)
        fam_counts[k][family] += 1
        per[k]["gpu_kernels" if e.cat == KERNEL else "gpu_memsets" if e.cat == MEMSET else "gpu_memcpys"] += 1
        intervals[k].append((e.ts, e.end, e.name))
        o = links.gpu_op[g]
        op_name = ops[o].name if o >= 0 else "(no CPU op)"
        by_op[op_name][e.name] += 1
        if o >= 0 and op_name in op_rows:
            op_rows[op_name]["gpu_activities"] += 1
            op_rows[op_name]["kernels"] += e.cat == KERNEL
            op_rows[op_name]["kernel_names"][e.name] += 1
        key = (e.name, e.cat)
        row = kernel_rows.get(key)
        if row is None:
            row = kernel_rows[key] = {"name": e.name, "category": e.cat, "family": family, "count": 0,
                                      "total_us": 0.0, "min_us": e.dur, "max_us": e.dur, "ops": Counter()}
        row["count"] += 1
        row["total_us"] += e.dur
        row["min_us"] = min(row["min_us"], e.dur)
        row["max_us"] = max(row["max_us"], e.dur)
        row["ops"][op_name] += 1

    step_rows, all_gaps = [], []
    for k, s in enumerate(steps):
        tl = gpu_timeline(s, intervals[k])
        row = {
            "name": s.name,
            "step_us": s.dur,
            "gpu_busy_us": tl["busy_us"],
            "gpu_window_us": tl["window_us"],
            "gpu_idle_us": max(tl["window_us"] - tl["busy_us"], 0.0) if intervals[k] else 0.0,
            "gpu_kernels": int(per[k]["gpu_kernels"]),
            "gpu_memsets": int(per[k]["gpu_memsets"]),
            "gpu_memcpys": int(per[k]["gpu_memcpys"]),
            "launch_calls": sum(launch_names[k].values()),
            "cpu_ops": int(per[k]["cpu_ops"]),
        }
        step_rows.append(row)
        all_gaps.extend({"step": s.name, **gap} for gap in tl["gaps"])

    has_gpu = any(intervals)
    per_step = _per_step(step_rows, per, launch_names, runtime_names, fam_counts, n)
    kernels = _kernel_table(kernel_rows, n)
    op_table = _op_table(op_rows, n)
    data = {
        "schema": SCHEMA,
        "trace": clean_name(str(trace.path)),
        "devices": trace.devices,
        "steps": n,
        "step_source": step_source,
        "step_names": [s.name for s in steps],
        "per_step": per_step,
        "step_table": step_rows,
        "kernels": kernels,
        "ops": op_table,
        "kernels_by_op": {op: dict(c.most_common()) for op, c in sorted(by_op.items())},
        "zero_kernel_ops": zero_kernel_ops(op_rows, n) if has_gpu else [],
        "gpu_gaps": sorted(all_gaps, key=lambda g: -g["dur_us"])[:MAX_GAPS],
        "verdict": verdict(per_step, has_gpu),
        "skipped_events": dict(sorted(trace.skipped.items())),
        "repaired_events": dict(sorted(trace.repaired.items())),
    }
    return Analysis(data)


def _per_step(step_rows, per, launch_names, runtime_names, fam_counts, n) -> dict:
    def mean(key):
        return sum(r[key] for r in step_rows) / n

    def mean_counter(counters: Iterable[Counter]) -> dict:
        total: Counter = Counter()
        for c in counters:
            total.update(c)
        return {name: v / n for name, v in total.most_common()}

    out = {key: mean(key) for key in ("gpu_kernels", "gpu_memsets", "gpu_memcpys", "launch_calls", "cpu_ops",
                                       "gpu_busy_us", "step_us", "gpu_idle_us", "gpu_window_us")}
    out["launch_calls_by_name"] = mean_counter(launch_names)
    out["runtime_calls"] = mean_counter(runtime_names)
    out["occupancy_queries"] = sum(p["occupancy_queries"] for p in per) / n
    out["launch_cpu_us"] = sum(p["launch_us"] for p in per) / n
    out["families"] = mean_counter(fam_counts)
    return out


def _kernel_table(rows: dict, n: int) -> list[dict]:
    table = []
    for row in sorted(rows.values(), key=lambda r: -r["total_us"]):
        table.append({
            "name": row["name"],
            "family": row["family"],
            "count": row["count"],
            "per_step": row["count"] / n,
            "total_us": row["total_us"],
            "avg_us": row["total_us"] / row["count"],
            "min_us": row["min_us"],
            "max_us": row["max_us"],
            "ops": dict(row["ops"].most_common()),
            "decoded": kernel_names.decode(row["name"]).to_dict() if row["category"] == KERNEL
            else {"family": row["family"]},
        })
    return table


def _op_table(rows: dict, n: int) -> list[dict]:
    table = []
    for row in sorted(rows.values(), key=lambda r: -r["cpu_total_us"]):
        table.append({
            "name": row["name"],
            "count": row["count"],
            "per_step": row["count"] / n,
            "cpu_total_us": row["cpu_total_us"],
            "cpu_self_us": row["cpu_self_us"],
            "kernels": row["kernels"] / n,
            "gpu_activities": row["gpu_activities"] / n,
            "kernel_names": dict(row["kernel_names"].most_common()),
            "launches_gpu_work": row["launched_any"] > 0,
        })
    return table


def zero_kernel_ops(op_rows: dict, n: int) -> list[dict]:
    """CPU ops that launched no GPU work (directly or through ops under them) in any step: metadata-only."""
    return [
        {"name": r["name"], "count": r["count"], "per_step": r["count"] / n}
        for r in sorted(op_rows.values(), key=lambda r: (-r["count"], r["name"]))
        if r["launched_any"] == 0
    ]


def verdict(per_step: dict, has_gpu: bool) -> dict:
    """overhead-bound / compute-bound / cpu-only, with the numbers that decided it and the threshold used."""
    if not has_gpu:
        return {
            "kind": "cpu-only",
            "reason": "no GPU kernels, memsets or memcpys in the steps: CPU activity only",
            "gpu_busy_share": None,
            "threshold": COMPUTE_BOUND_BUSY_SHARE,
        }
    window = per_step["gpu_window_us"]
    share = per_step["gpu_busy_us"] / window if window > 0 else 0.0
    launches = per_step["launch_calls"]
    work = per_step["gpu_kernels"] + per_step["gpu_memsets"] + per_step["gpu_memcpys"]
    avg_gpu = per_step["gpu_busy_us"] / work if work else 0.0
    avg_launch = per_step["launch_cpu_us"] / launches if launches else 0.0
    kind = "compute-bound" if share >= COMPUTE_BOUND_BUSY_SHARE else "overhead-bound"
    reason = (
        f"GPU busy {per_step['gpu_busy_us']:.1f} of {window:.1f} us per step ({share:.0%}); "
        f"{'>=' if share >= COMPUTE_BOUND_BUSY_SHARE else '<'} {COMPUTE_BOUND_BUSY_SHARE:.0%} busy means "
        + ("the kernels decide the step time" if kind == "compute-bound" else "CPU-side overhead decides it")
    )
    launch_bound = kind == "overhead-bound" and launches > 0 and avg_gpu < avg_launch
    if launch_bound:
        reason += f"; launch-bound: a GPU activity lasts {avg_gpu:.1f} us on average, a launch call {avg_launch:.1f} us"
    return {
        "kind": kind,
        "reason": reason,
        "gpu_busy_share": share,
        "threshold": COMPUTE_BOUND_BUSY_SHARE,
        "avg_gpu_activity_us": avg_gpu,
        "avg_launch_call_us": avg_launch,
        "launch_bound": launch_bound,
    }


class Analysis:
    """Result of analysing one trace. `to_dict()` is the JSON schema; `check()` tests expectations."""

    def __init__(self, data: dict):
        self.data = data
        self.expectations: list = []  # results of `profile(..., expect=[...])`

    @classmethod
    def from_dict(cls, data: dict, path: str = "<analysis>") -> "Analysis":
        """A saved analysis (e.g. `analyze --json` output read back), checked against the schema first."""
        validate(data, path)
        return cls(data)

    def to_dict(self) -> dict:
        return self.data

    # Convenience views used by renderers, diff and tests.
    @property
    def steps(self) -> int:
        return self.data["steps"]

    @property
    def per_step(self) -> dict:
        return self.data["per_step"]

    @property
    def kernels(self) -> list[dict]:
        return self.data["kernels"]

    @property
    def ops(self) -> list[dict]:
        return self.data["ops"]

    @property
    def verdict(self) -> dict:
        return self.data["verdict"]

    @property
    def trace_path(self) -> str:
        return self.data.get("trace", "")

    def op(self, name: str) -> dict | None:
        return next((o for o in self.ops if o["name"] == name), None)

    def kernel_names(self, family: str | None = None) -> list[str]:
        return [k["name"] for k in self.kernels if family is None or k["family"] == family]

    def check(self, expectations: Iterable[str]) -> list:
        from mlpfuse.profiling.expect import check

        return check(self, expectations)

    def __repr__(self) -> str:
        p = self.per_step
        return (f"<Analysis {self.steps} steps: {p['gpu_kernels']:g} kernels/step, "
                f"{self.verdict['kind']}, trace={self.trace_path!r}>")


def analyze(source: Any, label: str | None = None, max_bytes: int | str | None = None) -> Analysis:
    """Analyse a trace path (.json / .json.gz), parsed trace JSON, a saved analysis JSON, or a Trace.

    A file is read only if regular, and at most `max_bytes` (default $MLPFUSE_MAX_TRACE_BYTES, else 2 GiB) are
    read or inflated from it."""
    from mlpfuse.profiling.trace import no_gc

    with no_gc():
        return _analyze(source, label, max_bytes)


def _analyze(source: Any, label: str | None, max_bytes: int | str | None) -> Analysis:
    import os

    from mlpfuse.profiling import trace as trace_mod

    if isinstance(source, Analysis):
        return source
    if isinstance(source, Trace):
        return analyze_trace(source, label)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        loaded = trace_mod.load_trace_or_json(path, max_bytes)
        if isinstance(loaded, dict):
            return Analysis.from_dict(loaded, path)
        return analyze_trace(loaded, label)
    if isinstance(source, (dict, list)):
        if isinstance(source, dict) and "schema" in source and "traceEvents" not in source:
            return Analysis.from_dict(source)
        return analyze_trace(trace_mod.from_json(source), label)
    raise InputError(f"TRACE: expected a path, trace JSON or Analysis, got {type(source).__name__}")
