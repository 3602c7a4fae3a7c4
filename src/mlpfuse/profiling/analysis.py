"""Small analyses over the event model, each returning a plain table (list of dicts) or dict.

Pipeline: `steps.find_steps` -> `link` (CPU op nesting, launch -> op attribution, GPU activity -> launch through
correlation ids) -> per-step counts, kernel table, op table, zero-kernel ops, `timeline` (GPU windows, busy, idle,
gaps, CPU-ahead) -> verdict. Steps without GPU work, when others have some, are left out of every average.
`Analysis` bundles the results; its `to_dict()` is the `analyze --json` schema (README documents every key).

No torch import here: analysis runs wherever the trace file is.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

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


class Columns(NamedTuple):
    """One list of events field by field, each a tuple in event order. Gathered in one pass (zip), since on a large
    trace each pass over the events costs about as much as the work done with the field it reads."""

    name: tuple
    cat: tuple
    tid: tuple
    ts: tuple
    dur: tuple
    correlation: tuple
    external_id: tuple
    pid: tuple


def columns(events: list[Event]) -> Columns:
    return Columns(*zip(*events)) if events else Columns(*((),) * len(Columns._fields))


def _floats(values: tuple) -> np.ndarray:
    return np.fromiter(values, np.float64, len(values))


def _threads(pids: tuple, tids: tuple) -> list[np.ndarray]:
    """Sort keys that group events by thread, major last: equal (pid, tid) pairs, as a dict compares them, alike.
    Integer pids and tids (what Kineto writes) are used as they are; anything else is numbered through a dict."""
    if set(map(type, pids)) <= {int} and set(map(type, tids)) <= {int}:
        try:
            return [np.array(tids, dtype=np.int64), np.array(pids, dtype=np.int64)]
        except OverflowError:
            pass
    keys = list(zip(pids, tids))
    ids = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    return [np.fromiter(map(ids.__getitem__, keys), np.int64, len(keys))]


def _sweep_order(ts: np.ndarray, dur: np.ndarray, threads: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Indices by (thread, start, longest first, index), as np.lexsort((-dur, ts, *threads)) orders them, in a
    fraction of its time: starts come nearly sorted, so a stable sort of them is cheap, and only runs of equal starts
    need the duration key. Also a thread number per position, in that order."""
    order = np.argsort(ts, kind="stable")
    s = ts[order]
    tie = np.flatnonzero(s[1:] == s[:-1])
    if len(tie):
        at = np.union1d(tie, tie + 1)  # positions inside runs of equal starts; each run is contiguous
        run = np.cumsum(np.concatenate(([True], s[1:] != s[:-1])))[at]
        sub = order[at]
        order[at] = sub[np.lexsort((-dur[sub], run))]
    for key in threads:
        order = order[np.argsort(key[order], kind="stable")]
    new = np.zeros(len(order), dtype=bool)
    for key in threads:
        k = key[order]
        new[1:] |= k[1:] != k[:-1]
    return order, np.cumsum(new)


def _sweep(order: list[int], thread: list[int], end: list[float], limit: list[float], n_ops: int) -> list[int]:
    """Per item in sweep order, the innermost CPU op still open on its thread (-1 for none). An op stays open while
    it ends no earlier than the item does; ops (index < n_ops) are pushed, runtime calls only looked up."""
    tops: list[int] = []
    found = tops.append
    current = -1
    stack: list[int] = []
    stack_end: list[float] = []
    for i, th, e, lim in zip(order, thread, end, limit):
        if th != current:
            current, stack, stack_end = th, [-1], [math.inf]  # the sentinel is never popped
        while stack_end[-1] < lim:
            stack_end.pop()
            stack.pop()
        found(stack[-1])
        if i < n_ops:
            stack.append(i)
            stack_end.append(e)
    return tops


def link(trace: Trace, cols: tuple[Columns, Columns, Columns] | None = None,
         times: tuple[np.ndarray, ...] | None = None) -> Links:
    """`cols`: the columns of trace.cpu_ops, trace.runtime and trace.gpu, and `times` the starts and durations of
    the ops and runtime calls as arrays (op ts, op dur, runtime ts, runtime dur), when the caller has them."""
    ops, runtime, gpu = cols or (columns(trace.cpu_ops), columns(trace.runtime), columns(trace.gpu))
    n_ops, n_rt, n_gpu = len(ops.ts), len(runtime.ts), len(gpu.ts)
    op_ts, op_dur, rt_ts, rt_dur = times or (_floats(ops.ts), _floats(ops.dur), _floats(runtime.ts),
                                             _floats(runtime.dur))

    # One sweep over ops and runtime calls ordered by (thread, start, longest first) keeps a stack of open ops
    # per thread. Index i < n_ops is an op, else a runtime call; on ties ops come first, since they may enclose.
    ts, dur = np.concatenate((op_ts, rt_ts)), np.concatenate((op_dur, rt_dur))
    order, thread = _sweep_order(ts, dur, _threads(ops.pid + runtime.pid, ops.tid + runtime.tid))
    end = (ts + dur)[order]
    tops = np.asarray(_sweep(order.tolist(), thread.tolist(), end.tolist(), (end - 1e-6).tolist(), n_ops),
                      dtype=np.int64)
    top = np.empty(n_ops + n_rt, dtype=np.int64)
    top[order] = tops
    # Self time: an op's duration less its children's, subtracted one child at a time in sweep order (ufunc.at
    # is unbuffered and goes in index order, so the rounding is that of a running subtraction).
    op_self = dur[:n_ops].copy()
    child = (order < n_ops) & (tops >= 0)
    np.subtract.at(op_self, tops[child], dur[order[child]])
    launcher = top[n_ops:]

    by_corr = dict(zip(runtime.correlation, range(n_rt)))  # the last call of an id
    by_corr.pop(None, None)
    gpu_runtime = np.fromiter(map(by_corr.get, gpu.correlation, itertools.repeat(-1)), np.int64, n_gpu)
    gpu_op = np.append(launcher, -1)[gpu_runtime]  # -1 when the call is unknown or outside every op
    # Kineto also stamps GPU activity with the launching op's External id; used when the launch is missing.
    missing = np.flatnonzero(gpu_op < 0).tolist()
    if missing and n_ops:
        by_ext = dict(zip(reversed(ops.external_id), range(n_ops - 1, -1, -1)))  # the first op of an id
        by_ext.pop(None, None)
        ext = gpu.external_id
        gpu_op[missing] = [by_ext.get(ext[g], -1) for g in missing]
    return Links(top[:n_ops].tolist(), np.maximum(op_self, 0.0).tolist(), launcher.tolist(), gpu_runtime.tolist(),
                 gpu_op.tolist())


def _step_of(steps: list[Step], t: np.ndarray) -> np.ndarray:
    """Index of the step whose span holds each time, -1 outside every step (steps are sorted, disjoint)."""
    starts = np.asarray([s.ts for s in steps])
    ends = np.asarray([s.end for s in steps])
    k = np.searchsorted(starts, t, side="right") - 1
    inside = (k >= 0) & (t <= ends[np.maximum(k, 0)])
    return np.where(inside, k, -1)


def step_indices(steps: list[Step], times: list[float]) -> list[int]:
    """Index of the step whose span holds each time, -1 outside every step (steps are sorted, disjoint)."""
    if not len(times):
        return []
    return _step_of(steps, np.asarray(times, dtype=np.float64)).tolist()


def _op_rows(ops: Columns, dur: np.ndarray, op_step: np.ndarray, self_us: list[float], launched_any,
             n: int) -> dict[str, dict]:
    """Per op name over the steps: count, total and self CPU time, whether any instance launched GPU work."""
    ids = {name: i for i, name in enumerate(dict.fromkeys(ops.name))}
    name_id = np.fromiter(map(ids.__getitem__, ops.name), dtype=np.int64, count=len(ops.name))
    keep = op_step >= 0
    m = len(ids)
    idx = name_id[keep]
    count = np.bincount(idx, minlength=m)
    total = np.bincount(idx, weights=dur[keep], minlength=m)
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


def analyze_trace(trace: Trace, label: str | None = None, steps_from: str = AUTO,
                  graph_map: str | None = None) -> "Analysis":
    cols = ops, runtime, gpu = columns(trace.cpu_ops), columns(trace.runtime), columns(trace.gpu)
    steps, source = find_steps(trace, label, steps_from, names=tuple(e.name for e in trace.annotations) + ops.name)
    whole = source.kind == WHOLE_TRACE
    op_ts, op_dur, rt_ts, rt_dur = _floats(ops.ts), _floats(ops.dur), _floats(runtime.ts), _floats(runtime.dur)
    links = link(trace, cols, (op_ts, op_dur, rt_ts, rt_dur))
    n = len(steps)

    op_step = _step_of(steps, op_ts)
    rt_step = _step_of(steps, rt_ts)
    gpu_ts = _floats(gpu.ts)
    gpu_dur = _floats(gpu.dur)
    gpu_rt = np.asarray(links.gpu_runtime, dtype=np.int64)
    launched = gpu_rt >= 0
    # GPU work belongs to the step that launched it (it may run after the step's CPU span has ended).
    gpu_step = np.where(launched, np.append(rt_step, -1)[gpu_rt], _step_of(steps, gpu_ts))

    act = timeline.Activity(
        start=gpu_ts,
        end=gpu_ts + gpu_dur,
        launch=np.where(launched, np.append(rt_ts, 0.0)[gpu_rt], gpu_ts),
        launched=launched,
        step=gpu_step,
        names=gpu.name,
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
    launched_any = bytearray(len(ops.name))
    for o in links.gpu_op:
        while o >= 0 and not launched_any[o]:
            launched_any[o] = 1
            o = links.op_parent[o]

    per = [defaultdict(float) for _ in range(n)]
    launch_names: list[Counter] = [Counter() for _ in range(n)]
    runtime_names: list[Counter] = [Counter() for _ in range(n)]
    fam_counts: list[Counter] = [Counter() for _ in range(n)]

    # Counting distinct (step, name) pairs, in order of first appearance, keeps every counter's order (and so the
    # order of ties in the tables) that of the events.
    rt_names = runtime.name
    for (k, name), c in Counter(zip(rt_step.tolist(), rt_names)).items():
        if k < 0:
            continue
        runtime_names[k][name] += c
        if is_launch(name):
            launch_names[k][name] += c
        elif is_occupancy_query(name):
            per[k]["occupancy_queries"] += c
    launches = {name: is_launch(name) for name in set(rt_names)}
    counted = np.fromiter(map(launches.__getitem__, rt_names), bool, len(rt_names)) & (rt_step >= 0)
    # bincount adds its weights one by one in event order: the same sums as a running total per step.
    for k, total in enumerate(np.bincount(rt_step[counted], weights=rt_dur[counted], minlength=n)):
        per[k]["launch_us"] = float(total)

    op_kept = np.append(np.asarray(kept, dtype=np.int64), -1)[op_step]  # -1 stays -1
    op_rows = _op_rows(ops, op_dur, op_kept, links.op_self_us, launched_any, n)
    for k, c in enumerate(np.bincount(op_step + 1, minlength=n + 1)[1:]):
        per[k]["cpu_ops"] = float(c)

    # GPU activities: sums per (name, category) in numpy, the rest per distinct (step, name, category, op).
    names, cats, op_names = gpu.name, gpu.cat, ops.name
    launcher_name = [op_names[o] if o >= 0 else None for o in links.gpu_op]
    keys = list(zip(names, cats))
    kernel_ids = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    kid = np.fromiter(map(kernel_ids.__getitem__, keys), np.int64, len(keys))
    mine = gpu_step >= 0
    m = len(kernel_ids)
    kid, dur = kid[mine], gpu_dur[mine]
    k_count = np.bincount(kid, minlength=m)
    k_total = np.bincount(kid, weights=dur, minlength=m)
    k_min, k_max = np.full(m, np.inf), np.full(m, -np.inf)
    np.minimum.at(k_min, kid, dur)
    np.maximum.at(k_max, kid, dur)

    kernel_rows: dict[tuple[str, str], dict] = {}
    by_op: dict[str, Counter] = defaultdict(Counter)
    for (k, name, cat, launcher), c in Counter(zip(gpu_step.tolist(), names, cats, launcher_name)).items():
        if k < 0:
            continue
        key = (name, cat)
        row = kernel_rows.get(key)
        if row is None:
            i = kernel_ids[key]
            row = kernel_rows[key] = {"name": name, "category": cat, "family": kernel_names.family_of(name, cat),
                                      "count": int(k_count[i]), "total_us": float(k_total[i]),
                                      "min_us": float(k_min[i]), "max_us": float(k_max[i]), "ops": Counter()}
        fam_counts[k][row["family"]] += c
        per[k]["gpu_kernels" if cat == KERNEL else "gpu_memsets" if cat == MEMSET else "gpu_memcpys"] += c
        op_name = launcher if launcher is not None else "(no CPU op)"
        by_op[op_name][name] += c
        if launcher is not None and op_name in op_rows:
            op_rows[op_name]["gpu_activities"] += c
            op_rows[op_name]["kernels"] += c if cat == KERNEL else 0
            op_rows[op_name]["kernel_names"][name] += c
        row["ops"][op_name] += c

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
    from mlpfuse.profiling import modules  # (it reads `link` from here)

    view = modules.view_if_any(trace, links, graph_map, n_avg)
    if view is not None:
        data["modules"] = view
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


NA = "n/a"  # what renderers show for a figure the run could not measure (not a zero it measured)


def gpu_measured(data: dict) -> tuple[bool, bool]:
    """(GPU activity recorded, CUDA launches recorded) in an analysis dict: a CPU-only run has neither, a trace
    captured without CUDA activity tracing has launches only. The per-step figures keep their numbers (a CPU run's
    GPU window is its step); renderers show NA where the run cannot have measured them."""
    verdict = data.get("verdict") if isinstance(data, dict) else None
    kind = verdict.get("kind") if isinstance(verdict, dict) else None
    return kind not in ("cpu-only", "gpu-not-traced"), kind != "cpu-only"


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
            steps_from: str = AUTO, graph_map: str | None = None) -> Analysis:
    """Analyse a trace path (.json / .json.gz), parsed trace JSON, a saved analysis JSON, or a Trace.

    Steps are `ProfilerStep#N` spans, else the whole trace as one window; `label` uses the spans of that name
    instead, and `steps_from` forces a source ("auto", "ProfilerStep", "label", "whole-trace").
    A file is read only if regular, and at most `max_bytes` (default $MLPFUSE_MAX_TRACE_BYTES, else 2 GiB) are
    read or inflated from it. `graph_map`: the map file of the CUDA graph the trace replays
    (profiling.modules.write_map); without it, one beside a trace path (profiling.modules.map_path) is used."""
    from mlpfuse.profiling.trace import no_gc

    with no_gc():
        return _analyze(source, label, max_bytes, steps_from, graph_map)


def _map_beside(trace_path: str | None) -> str | None:
    """The graph map beside a trace file (profiling.modules.map_path), if there is one."""
    import os

    from mlpfuse.profiling.modules import map_path

    beside = map_path(trace_path) if trace_path else None
    return beside if beside and os.path.isfile(beside) else None


def _analyze(source: Any, label: str | None, max_bytes: int | str | None, steps_from: str,
             graph_map: str | None = None) -> Analysis:
    import os

    from mlpfuse.profiling import trace as trace_mod

    if isinstance(source, Analysis):
        return source
    if isinstance(source, Trace):
        return analyze_trace(source, label, steps_from, graph_map or _map_beside(source.path))
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        loaded = trace_mod.load_trace_or_json(path, max_bytes)
        if isinstance(loaded, dict):
            if label is not None or steps_from != AUTO:
                raise InputError(f"{path}: a saved analysis; its steps were chosen when it was made (--label and "
                                 "--steps-from apply to traces)")
            return Analysis.from_dict(loaded, path)
        return analyze_trace(loaded, label, steps_from, graph_map or _map_beside(path))
    if isinstance(source, (dict, list)):
        if isinstance(source, dict) and "schema" in source and "traceEvents" not in source:
            trace_mod.refuse_execution_trace(source, "<trace>")
            return Analysis.from_dict(source)
        return analyze_trace(trace_mod.from_json(source), label, steps_from, graph_map)
    raise InputError(f"TRACE: expected a path, trace JSON or Analysis, got {type(source).__name__}")
