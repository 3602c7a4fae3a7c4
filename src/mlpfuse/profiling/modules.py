"""Which module each GPU kernel belongs to, in eager steps and inside CUDA-graph replays; time per module path.

Eager steps: `mlpfuse.profile(..., modules=model)` wraps every submodule's forward in a profiler annotation
`mlpfuse.module: <path>` (capture.module_annotations). A kernel belongs to the innermost annotation open on the
thread of the runtime call that launched it, at the time of that call.

Graph replays: a replay is one `cudaGraphLaunch`; its kernels carry that call's correlation id, but no annotation
encloses them (no Python runs during a replay). They are attributed through a *map*: the ordered kernels of one
eager run of the same callable with the annotations on (`write_map`). Why an eager run and not the capture: during
capture the kernels are recorded but not executed, so the profiler sees launches without kernel names to match, and
capture-time allocations and warm-up paths (cuBLAS workspace, autotuning) are not the replayed ones; an eager run
of the same callable launches the same kernels in the same order, each with a name, a module and an op, which is
what the replay's kernels are matched against. Matching is by kernel name, in order (`attribute`: where replay and
map disagree, the walk resumes at the closest point where they agree again): a replay kernel matched to a map entry
takes its module and op; every other kernel is listed as unattributed with the reason, never guessed. A map of another model or graph matches little and says so.

A map file is untrusted input like a trace: bounded in size, every field checked, one error line.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from mlpfuse.errors import InputError
from mlpfuse.profiling import trace as trace_mod
from mlpfuse.profiling.analysis import Links, link

PREFIX = "mlpfuse.module: "  # annotation names: PREFIX + dotted module path ("" is the root)
MAP_FORMAT = "mlpfuse-graph-map"
MAP_VERSION = 1
MAX_MAP_BYTES = 256 << 20
MAX_MAP_KERNELS = 2_000_000
MAX_FIELD_CHARS = 4096
UNMATCHED = "the replay's kernel sequence differs from the map here (another graph, dynamic shapes or a conditional)"
NO_MAP = "a graph replay without a map (mlpfuse.profiling.record_graph_map)"
NO_ANNOTATION = "launched outside every module annotation"


def _innermost(trace: trace_mod.Trace) -> list[str | None]:
    """Per runtime call, the innermost module annotation open on its thread when it was made (None: none). One
    sweep per thread over annotations and calls in start order, with the stack of open annotations."""
    out: list[str | None] = [None] * len(trace.runtime)
    items: dict = defaultdict(list)
    for a in trace.annotations:
        if a.name.startswith(PREFIX):
            items[(a.pid, a.tid)].append((a.ts, 0, -a.end, a.end, a.name[len(PREFIX):]))
    if not items:
        return out
    for i, rt in enumerate(trace.runtime):
        key = (rt.pid, rt.tid)
        if key in items:
            items[key].append((rt.ts, 1, 0.0, rt.end, i))
    for events in items.values():
        events.sort(key=lambda e: e[:3])  # by start; an annotation before a call at the same instant, outer first
        stack: list[tuple[float, str]] = []
        for ts, kind, _, end, what in events:
            while stack and stack[-1][0] < ts:
                stack.pop()  # closed before this starts
            if kind == 0:
                stack.append((end, what))
                continue
            for span_end, path in reversed(stack):
                if end <= span_end:
                    out[what] = path
                    break
    return out


def _is_graph_launch(name: str) -> bool:
    return name.startswith("cudaGraphLaunch") or name.startswith("cuGraphLaunch")


def read_map(path: str) -> list[tuple[str, str, str]]:
    """The map file's kernels as (name, module path, op), checked; one InputError line on anything else."""
    try:
        data = trace_mod.load_json(path, MAX_MAP_BYTES)
    except InputError as exc:  # the reader speaks of a TRACE; this file is a map
        raise InputError(str(exc).replace("TRACE ", "MAP ", 1)) from None
    if not isinstance(data, dict) or data.get("format") != MAP_FORMAT:
        raise InputError(f"{path}: not an mlpfuse graph map (expected a JSON object with format {MAP_FORMAT!r})")
    if data.get("version") != MAP_VERSION:
        raise InputError(f"{path}: graph map version {data.get('version')!r}, this mlpfuse reads {MAP_VERSION}")
    kernels = data.get("kernels")
    if not isinstance(kernels, list) or len(kernels) > MAX_MAP_KERNELS:
        raise InputError(f"{path}: 'kernels' must be a list of at most {MAX_MAP_KERNELS} entries")
    out = []
    for i, k in enumerate(kernels):
        fields = (k.get("name"), k.get("module"), k.get("op")) if isinstance(k, dict) else None
        if fields is None or not all(isinstance(f, str) and len(f) <= MAX_FIELD_CHARS for f in fields):
            raise InputError(f"{path}: kernels[{i}]: expected name, module and op strings of at most "
                             f"{MAX_FIELD_CHARS} characters")
        out.append(fields)
    return out


def map_from_trace(trace: trace_mod.Trace, links: Links | None = None) -> list[tuple[str, str, str]]:
    """The ordered kernels of an eager run as map entries: (name, module path, the op that launched it)."""
    links = links or link(trace)
    module_of = _innermost(trace)
    rows = []
    for g, ev in enumerate(trace.gpu):
        if ev.cat != trace_mod.KERNEL:
            continue
        r = links.gpu_runtime[g]
        op = links.gpu_op[g]
        rows.append((ev.ts, ev.name, (module_of[r] if r >= 0 else None) or "",
                     trace.cpu_ops[op].name if op >= 0 else ""))
    rows.sort(key=lambda row: row[0])
    return [row[1:] for row in rows]


def write_map(trace: trace_mod.Trace, path: str) -> int:
    """Write the map of an eager trace (see the module doc) to `path`; returns the number of kernels."""
    entries = map_from_trace(trace)
    with open(path, "w") as f:
        json.dump({"format": MAP_FORMAT, "version": MAP_VERSION,
                   "kernels": [{"name": n, "module": m, "op": o} for n, m, o in entries]}, f)
    return len(entries)


RESYNC_WINDOW = 64  # kernels looked ahead, in the replay and in the map, to find where they agree again
RESYNC_CONFIRM = 4  # consecutive equal names that confirm a resynchronisation (fewer only where both end)
# Where to look first when the walk resumes: (replay kernels skipped, map entries skipped), those that keep the
# replay's offset against the map (equal skips: a kernel replaced) before those that shift it (one missing or one
# extra), fewer skipped first.
_RESYNC_ORDER = sorted(((a, b) for a in range(RESYNC_WINDOW + 1) for b in range(RESYNC_WINDOW + 1) if a or b),
                       key=lambda ab: (abs(ab[0] - ab[1]), ab[0] + ab[1]))


def attribute(replay: list[str], entries: list[tuple[str, str, str]]) -> list[tuple[str, str] | None]:
    """Per replayed kernel name (in order), the (module, op) of the map entry it matches, or None.

    Both sequences are walked together; where they disagree, the walk resumes at the nearest point where they agree
    again for RESYNC_CONFIRM names in a row (or to both ends), the offset between them kept where possible
    (_RESYNC_ORDER), and the kernels skipped stay unattributed. Nearest and offset-keeping matter: a model's layers
    repeat the same kernel names, so a longest common run (what difflib would take), or a short agreement far from
    where the walk was, can pair layer 1's kernels with layer 0's entries."""
    names = [e[0] for e in entries]
    n, m = len(replay), len(names)
    out: list[tuple[str, str] | None] = [None] * n
    i = j = 0
    while i < n and j < m:
        if replay[i] == names[j]:
            out[i] = entries[j][1:]
            i, j = i + 1, j + 1
            continue
        found = None
        for skip_replay, skip_map in _RESYNC_ORDER:
            ii, jj = i + skip_replay, j + skip_map
            if ii >= n or jj >= m or replay[ii] != names[jj]:
                continue
            run = min(RESYNC_CONFIRM, n - ii, m - jj)
            if run < RESYNC_CONFIRM and not (ii + run == n and jj + run == m):
                continue  # a short agreement that is not the common end of both: too weak to resume on
            if all(replay[ii + t] == names[jj + t] for t in range(run)):
                found = ii, jj
                break
        if found is None:
            break  # no agreement within the window: the rest stays unattributed
        i, j = found
    return out


def module_view(trace: trace_mod.Trace, entries: list[tuple[str, str, str]] | None = None,
                links: Links | None = None, depth: int = 6) -> dict:
    """Time per module path over the trace's kernels: eager kernels by their annotation, replayed ones through
    `entries` (a map). `rows`: every path prefix up to `depth` parts (`model`, `model.layers`, `model.layers.7`,
    `model.layers.7.mlp`, ...) with GPU µs, kernel counts and share of all kernel time; `kinds`: the same with layer
    numbers folded (`model.layers.*.mlp`: every layer's MLP together). Every kernel not attributed is counted by
    reason. Replays also report the idle time between their kernels (bubbles a graph still has)."""
    links = links or link(trace)
    module_of = _innermost(trace)
    gpu = trace.gpu
    replays: dict[int, list[int]] = defaultdict(list)
    owner: list[str | None] = [None] * len(gpu)
    reasons: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for g, ev in enumerate(gpu):
        if ev.cat != trace_mod.KERNEL:
            continue
        r = links.gpu_runtime[g]
        if r >= 0 and _is_graph_launch(trace.runtime[r].name):
            replays[r].append(g)
        elif r >= 0 and module_of[r] is not None:
            owner[g] = module_of[r]
        else:
            reason = reasons[NO_ANNOTATION]
            reason[0] += 1
            reason[1] += ev.dur
    idle = 0.0
    for r, members in replays.items():
        members.sort(key=lambda g: (gpu[g].ts, g))
        starts = np.array([gpu[g].ts for g in members])
        ends = np.maximum.accumulate(np.array([gpu[g].end for g in members]))
        idle += float(np.clip(starts[1:] - ends[:-1], 0, None).sum()) if len(members) > 1 else 0.0
        if not entries:
            matched = [None] * len(members)
            why = NO_MAP
        else:
            matched = attribute([gpu[g].name for g in members], entries)
            why = UNMATCHED
        for g, m in zip(members, matched):
            if m is not None and m[0]:
                owner[g] = m[0]
            else:
                reason = reasons[why if m is None else NO_ANNOTATION]
                reason[0] += 1
                reason[1] += gpu[g].dur
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    kernel_us = 0.0
    for g, ev in enumerate(gpu):
        if ev.cat != trace_mod.KERNEL:
            continue
        kernel_us += ev.dur
        path = owner[g]
        if path is None:
            continue
        parts = path.split(".") if path else []
        for d in range(0, min(len(parts), depth) + 1):
            key = ".".join(parts[:d])
            totals[key][0] += 1
            totals[key][1] += ev.dur
    attributed = totals[""][1] if "" in totals else 0.0
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for key, (n, us) in totals.items():  # layers folded: model.layers.*.mlp sums every layer's mlp
        folded = ".".join("*" if part.isdigit() else part for part in key.split(".")) if key else ""
        kinds[folded][0] += n
        kinds[folded][1] += us

    def table(source):
        return [{"module": key or "(all modules)", "depth": key.count(".") + 1 if key else 0, "kernels": int(n),
                 "gpu_us": us, "share": us / kernel_us if kernel_us else 0.0}
                for key, (n, us) in sorted(source.items(), key=lambda kv: kv[0].split("."))]

    return {"rows": table(totals), "kinds": table(kinds), "kernel_us": kernel_us, "attributed_us": attributed,
            "attributed_share": attributed / kernel_us if kernel_us else 0.0,
            "unattributed": [{"reason": why, "kernels": int(n), "gpu_us": us} for why, (n, us) in reasons.items()],
            "replays": len(replays), "replay_idle_us": idle}


def map_path(trace_path: str) -> str:
    """Where the map of a trace's graph is looked for: beside it, `<trace>.map.json` (`step.pt.trace.json.gz` ->
    `step.pt.trace.map.json`)."""
    for suffix in (".json.gz", ".json"):
        if trace_path.endswith(suffix):
            return trace_path[: -len(suffix)] + ".map.json"
    return trace_path + ".map.json"


def view_if_any(trace: trace_mod.Trace, links: Links, graph_map: str | None, steps: int) -> dict | None:
    """The module view for an analysis: when the trace has module annotations or graph replays, or a map was given
    (None otherwise: a trace of neither keeps its analysis as it was)."""
    annotated = any(a.name.startswith(PREFIX) for a in trace.annotations)
    replayed = any(_is_graph_launch(r.name) for r in trace.runtime)
    if not (annotated or replayed or graph_map):
        return None
    entries = read_map(graph_map) if graph_map else None
    view = module_view(trace, entries, links)
    view["steps"] = max(int(steps), 1)
    view["map"] = graph_map
    return view


def render(view: dict, limit: int = 40) -> list[str]:
    """Terminal lines: the module tree with layers folded (indented by depth), then what was not attributed, and
    why."""
    n = view.get("steps", 1)
    lines = [f"GPU time by module (per step, {n} steps): {view['attributed_share']:.1%} of "
             f"{view['kernel_us'] / n:.1f} us of kernels attributed"
             + (f"; {view['replays']} graph replays, {view['replay_idle_us'] / n:.1f} us idle between their "
                f"kernels" if view["replays"] else "")]
    for row in view["kinds"][:limit]:
        lines.append(f"  {'  ' * row['depth']}{row['module']:<{max(8, 48 - 2 * row['depth'])}} "
                     f"{row['gpu_us'] / n:10.1f} us {row['share']:6.1%} {row['kernels'] / n:8.1f} kernels")
    if len(view["kinds"]) > limit:
        lines.append(f"  ... {len(view['kinds']) - limit} more rows (JSON has them all, and every layer apart)")
    for u in view["unattributed"]:
        lines.append(f"  not attributed: {u['kernels'] / n:.1f} kernels, {u['gpu_us'] / n:.1f} us per step: "
                     f"{u['reason']}")
    return lines
