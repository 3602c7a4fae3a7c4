"""Small analyses over the event model, each returning a plain table (list of dicts) or dict.

Pipeline: `steps.find_steps` -> `link` (CPU op nesting, launch -> op attribution, GPU activity -> launch through
correlation ids) -> per-step counts, kernel table, op table, zero-kernel ops, `timeline` (GPU windows, busy, idle,
gaps, CPU-ahead) -> verdict. Steps without GPU work, when others have some, are left out of every average.
`Analysis` bundles the results; its `to_dict()` is the `analyze --json` schema (README documents every key).

No torch import here: analysis runs wherever the trace file is.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from mlpfuse.errors import InputError
from mlpfuse.profiling import kernel_names, timeline
from mlpfuse.profiling.schema import SCHEMA, validate
from mlpfuse.profiling.steps import AUTO, WHOLE_TRACE, Step, find_steps
from mlpfuse.profiling.trace import KERNEL, MEMSET, Event, Trace, clean_name


# Verdict threshold: share of the steps' GPU windows during which a kernel, memset or memcpy runs. At or above it
# the kernels decide the step time (compute-bound); below it the GPU mostly waits for the CPU (overhead-bound).
# Within overhead-bound, "launch-bound" is added when a GPU activity lasts less than the CPU call that launched it.
COMPUTE_BOUND_BUSY_SHARE = 0.5
# A launch that waits this many steps' time in the GPU queue is issued while the GPU is busy with earlier work:
# the CPU's launch cost is hidden behind it.
CPU_AHEAD_HIDES_LAUNCHES = 0.5


def is_launch(name: str) -> bool:
    """Runtime/driver calls that put work on the GPU queue (kernels and graphs)."""
    return "Launch" in name and "Occupancy" not in name


def is_occupancy_query(name: str) -> bool:
    return "Occupancy" in name


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


# ---------------------------------------------------------------- the analysis


def analyze_trace(trace: Trace, label: str | None = None, steps_from: str = AUTO) -> "Analysis":
    steps, source = find_steps(trace, label, steps_from)
    whole = source.kind == WHOLE_TRACE
    links = link(trace)
    n = len(steps)
    ops, runtime, gpu = trace.cpu_ops, trace.runtime, trace.gpu

    op_step = step_indices(steps, [e.ts for e in ops])
    rt_step = step_indices(steps, [e.ts for e in runtime])
    own_step = step_indices(steps, [e.ts for e in gpu])
    # GPU work belongs to the step that launched it (it may run after the step's CPU span has ended).
    gpu_step = [rt_step[r] if r >= 0 else own for r, own in zip(links.gpu_runtime, own_step)]

    act = timeline.Activity(
        start=np.fromiter((e.ts for e in gpu), np.float64, len(gpu)),
        end=np.fromiter((e.ts + e.dur for e in gpu), np.float64, len(gpu)),
        launch=np.fromiter((runtime[r].ts if r >= 0 else e.ts for r, e in zip(links.gpu_runtime, gpu)), np.float64,
                           len(gpu)),
        launched=np.fromiter((r >= 0 for r in links.gpu_runtime), bool, len(gpu)),
        step=np.asarray(gpu_step, dtype=np.int64),
        names=[e.name for e in gpu],
    )
    lines = timeline.per_step(steps, act, whole)
    ahead = timeline.cpu_ahead(steps, act)
    delay = timeline.launch_delay(steps, act)

    # A step that launched no GPU work while others did (the profiler's trailing step, a data-loading stall) is
    # reported but left out of every average: it would dilute each per-step figure.
    has_work = np.bincount(act.step[act.step >= 0], minlength=n) > 0
    any_gpu = bool(has_work.any())
    included = has_work.tolist() if any_gpu else [True] * n
    kept = [k if included[k] else -1 for k in range(n)]  # step -> itself, or -1 when left out

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

    op_kept = [kept[k] if k >= 0 else -1 for k in op_step]
    op_rows = _op_rows(ops, op_kept, links.op_self_us, launched_any, n)
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
    for k, (s, tl) in enumerate(zip(steps, lines)):
        step_rows.append({
            "name": s.name,
            "in_averages": included[k],
            "step_us": s.dur,
            "gpu_busy_us": tl.busy_us if any_gpu else 0.0,
            "gpu_window_us": tl.window_us if any_gpu else s.dur,
            "gpu_idle_us": max(tl.window_us - tl.busy_us, 0.0) if any_gpu else 0.0,
            "gpu_window_start_us": tl.window_start if any_gpu else s.ts,
            "gpu_window_end_us": tl.window_end if any_gpu else s.end,
            "cpu_ahead_us": None if whole else ahead[k],
            "launch_to_start_us": delay[k],
            "gpu_kernels": int(per[k]["gpu_kernels"]),
            "gpu_memsets": int(per[k]["gpu_memsets"]),
            "gpu_memcpys": int(per[k]["gpu_memcpys"]),
            "launch_calls": sum(launch_names[k].values()),
            "cpu_ops": int(per[k]["cpu_ops"]),
        })
        if included[k] and any_gpu:
            all_gaps.extend({"step": s.name, **gap} for gap in tl.gaps)

    keep = [k for k in range(n) if included[k]]
    avg = _per_step(step_rows, per, launch_names, runtime_names, fam_counts, keep)
    n_avg = len(keep)
    kernels = _kernel_table(kernel_rows, n_avg)
    op_table = _op_table(op_rows, n_avg)
    data = {
        "schema": SCHEMA,
        "trace": clean_name(str(trace.path)),
        "devices": trace.devices,
        "steps": n_avg,
        "steps_found": n,
        "steps_left_out": [{"name": steps[k].name, "reason": "no GPU work while other steps have some"}
                           for k in range(n) if not included[k]],
        "step_source": source.describe(),
        "step_source_kind": source.kind,
        "step_label": source.label,
        "step_source_reason": source.why,
        "step_names": [steps[k].name for k in keep],
        "per_step": avg,
        "step_table": step_rows,
        "kernels": kernels,
        "ops": op_table,
        "kernels_by_op": {op: dict(c.most_common()) for op, c in sorted(by_op.items())},
        "zero_kernel_ops": zero_kernel_ops(op_rows, n_avg) if any_gpu else [],
        "gpu_gaps": sorted(all_gaps, key=lambda g: -g["dur_us"])[:timeline.MAX_GAPS],
        "verdict": verdict(avg, any_gpu, whole, trace.unread),
        "skipped_events": dict(sorted(trace.skipped.items())),
        "repaired_events": dict(sorted(trace.repaired.items())),
        "unread_categories": dict(trace.unread),
    }
    return Analysis(data)


def _per_step(step_rows, per, launch_names, runtime_names, fam_counts, keep: list[int]) -> dict:
    """Means over the steps in `keep`."""
    n = len(keep)
    rows = [step_rows[k] for k in keep]

    def mean(key):
        return sum(r[key] for r in rows) / n

    def mean_of_known(key):  # None where a step has nothing to measure
        known = [r[key] for r in rows if r[key] is not None]
        return sum(known) / len(known) if known else None

    def mean_counter(counters: list[Counter]) -> dict:
        total: Counter = Counter()
        for k in keep:
            total.update(counters[k])
        return {name: v / n for name, v in total.most_common()}

    out = {key: mean(key) for key in ("gpu_kernels", "gpu_memsets", "gpu_memcpys", "launch_calls", "cpu_ops",
                                       "gpu_busy_us", "step_us", "gpu_idle_us", "gpu_window_us")}
    out["launch_calls_by_name"] = mean_counter(launch_names)
    out["runtime_calls"] = mean_counter(runtime_names)
    out["occupancy_queries"] = sum(per[k]["occupancy_queries"] for k in keep) / n
    out["launch_cpu_us"] = sum(per[k]["launch_us"] for k in keep) / n
    out["families"] = mean_counter(fam_counts)
    out["cpu_ahead_us"] = mean_of_known("cpu_ahead_us")
    out["launch_to_start_us"] = mean_of_known("launch_to_start_us")
    # The GPU queue in steps: how long a launch waits for the GPU, against the step time. Near 1 the CPU launches
    # a step while the GPU still runs the previous one. A single span is no loop to be ahead in.
    out["cpu_ahead_steps"] = (out["launch_to_start_us"] / out["step_us"] if out["launch_to_start_us"] is not None
                              and out["step_us"] > 0 and n > 1 else None)
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


# Categories of events that are no device activity: left out when a verdict names what it did not read.
_NOT_DEVICE = {"python_function", "gpu_user_annotation", "trace", "overhead", "cuda_sync", "ac2g", "fwdbwd"}


def _unread_note(unread: dict) -> str:
    cats = [(c, n) for c, n in unread.items() if c.lower() not in _NOT_DEVICE][:3]
    return f" (not read: events of categories {', '.join(f'{c} x{n}' for c, n in cats)})" if cats else ""


def verdict(per_step: dict, has_gpu: bool, whole_trace: bool = False, unread: dict | None = None) -> dict:
    """overhead-bound / compute-bound / gpu-not-traced / cpu-only, with the numbers that decided it and the
    threshold used."""
    launches = per_step["launch_calls"]
    if not has_gpu:
        if launches > 0:
            kind = "gpu-not-traced"
            reason = (f"{launches:g} launches per step, no GPU activity recorded: tracing of CUDA activities was off "
                      "(capture with ProfilerActivity.CUDA to see kernels)")
        else:
            kind = "cpu-only"
            reason = "no GPU kernels, memsets or memcpys in the steps: CPU activity only"
        return {"kind": kind, "reason": reason + _unread_note(unread or {}), "gpu_busy_share": None,
                "threshold": COMPUTE_BOUND_BUSY_SHARE}
    window = per_step["gpu_window_us"]
    share = per_step["gpu_busy_us"] / window if window > 0 else 0.0
    work = per_step["gpu_kernels"] + per_step["gpu_memsets"] + per_step["gpu_memcpys"]
    avg_gpu = per_step["gpu_busy_us"] / work if work else 0.0
    avg_launch = per_step["launch_cpu_us"] / launches if launches else 0.0
    kind = "compute-bound" if share >= COMPUTE_BOUND_BUSY_SHARE else "overhead-bound"
    reason = (
        f"GPU busy {per_step['gpu_busy_us']:.1f} of {window:.1f} us per step ({share:.0%} of its GPU window); "
        f"{'>=' if share >= COMPUTE_BOUND_BUSY_SHARE else '<'} {COMPUTE_BOUND_BUSY_SHARE:.0%} busy means "
        + ("the kernels decide the step time" if kind == "compute-bound" else "CPU-side overhead decides it")
    )
    ahead, queue, ahead_steps = (per_step.get(k) for k in ("cpu_ahead_us", "launch_to_start_us", "cpu_ahead_steps"))
    if not whole_trace and ahead is not None:
        reason += f"; a step's GPU work starts {ahead:.1f} us after its CPU start"
    if not whole_trace and queue is not None:
        reason += f"; a launch waits {queue:.1f} us for the GPU on average"
        if ahead_steps is not None:
            reason += (f": the CPU runs {ahead_steps:.2f} steps ahead"
                       + (", so launch overhead is hidden" if ahead_steps >= CPU_AHEAD_HIDES_LAUNCHES else ""))
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
        "cpu_ahead_steps": None if whole_trace else ahead_steps,
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


def analyze(source: Any, label: str | None = None, max_bytes: int | str | None = None,
            steps_from: str = AUTO) -> Analysis:
    """Analyse a trace path (.json / .json.gz), parsed trace JSON, a saved analysis JSON, or a Trace.

    Steps are `ProfilerStep#N` spans, else the whole trace as one window; `label` uses the spans of that name
    instead, and `steps_from` forces a source ("auto", "ProfilerStep", "label", "whole-trace").
    A file is read only if regular, and at most `max_bytes` (default $MLPFUSE_MAX_TRACE_BYTES, else 2 GiB) are
    read or inflated from it."""
    from mlpfuse.profiling.trace import no_gc

    with no_gc():
        return _analyze(source, label, max_bytes, steps_from)


def _analyze(source: Any, label: str | None, max_bytes: int | str | None, steps_from: str) -> Analysis:
    import os

    from mlpfuse.profiling import trace as trace_mod

    if isinstance(source, Analysis):
        return source
    if isinstance(source, Trace):
        return analyze_trace(source, label, steps_from)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        loaded = trace_mod.load_trace_or_json(path, max_bytes)
        if isinstance(loaded, dict):
            if label is not None or steps_from != AUTO:
                raise InputError(f"{path}: a saved analysis; its steps were chosen when it was made (--label and "
                                 "--steps-from apply to traces)")
            return Analysis.from_dict(loaded, path)
        return analyze_trace(loaded, label, steps_from)
    if isinstance(source, (dict, list)):
        if isinstance(source, dict) and "schema" in source and "traceEvents" not in source:
            trace_mod.refuse_execution_trace(source, "<trace>")
            return Analysis.from_dict(source)
        return analyze_trace(trace_mod.from_json(source), label, steps_from)
    raise InputError(f"TRACE: expected a path, trace JSON or Analysis, got {type(source).__name__}")
