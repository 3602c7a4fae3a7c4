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
from collections import Counter, defaultdict
from typing import NamedTuple

import numpy as np

from mlpfuse._peaks import cached_peaks
from mlpfuse.errors import InputError
from mlpfuse.profiling import costs
from mlpfuse.profiling import trace as trace_mod
from mlpfuse.profiling.analysis import Links, link

PREFIX = "mlpfuse.module: "  # annotation names: PREFIX + dotted module path ("" is the root)
MAP_FORMAT = "mlpfuse-graph-map"
MAP_VERSION = 2  # 2: each kernel's op call and the op's recorded inputs (optional fields)
MAP_VERSIONS = (1, 2)
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


class Entry(NamedTuple):
    """One kernel of a map: its name, module path, the op that launched it, which call of that op (kernels of one
    call share it), and the op's recorded inputs ((dims, dtypes) or None)."""
    name: str
    module: str
    op: str
    call: int
    inputs: tuple | None


def _entry(path: str, i: int, k) -> Entry:
    fields = (k.get("name"), k.get("module"), k.get("op")) if isinstance(k, dict) else None
    if fields is None or not all(isinstance(f, str) and len(f) <= MAX_FIELD_CHARS for f in fields):
        raise InputError(f"{path}: kernels[{i}]: expected name, module and op strings of at most "
                         f"{MAX_FIELD_CHARS} characters")
    call = k.get("call", i)
    if type(call) is not int or not 0 <= call <= MAX_MAP_KERNELS:
        raise InputError(f"{path}: kernels[{i}]: 'call' must be an integer from 0 to {MAX_MAP_KERNELS}")
    inputs = None
    if "dims" in k or "types" in k:
        inputs = trace_mod.op_inputs(k.get("dims"), k.get("types"))
        if inputs is None:
            raise InputError(f"{path}: kernels[{i}]: 'dims' and 'types' must be lists of equal length (at most "
                             f"{trace_mod.MAX_INPUTS}) of integer lists and strings")
    return Entry(*fields, call, inputs)


def read_map(path: str) -> list[Entry]:
    """The map file's kernels, checked; one InputError line on anything else."""
    try:
        data = trace_mod.load_json(path, MAX_MAP_BYTES)
    except InputError as exc:  # the reader speaks of a TRACE; this file is a map
        raise InputError(str(exc).replace("TRACE ", "MAP ", 1)) from None
    if not isinstance(data, dict) or data.get("format") != MAP_FORMAT:
        raise InputError(f"{path}: not an mlpfuse graph map (expected a JSON object with format {MAP_FORMAT!r})")
    if data.get("version") not in MAP_VERSIONS:
        raise InputError(f"{path}: graph map version {data.get('version')!r}, this mlpfuse reads "
                         f"{' and '.join(map(str, MAP_VERSIONS))}")
    kernels = data.get("kernels")
    if not isinstance(kernels, list) or len(kernels) > MAX_MAP_KERNELS:
        raise InputError(f"{path}: 'kernels' must be a list of at most {MAX_MAP_KERNELS} entries")
    return [_entry(path, i, k) for i, k in enumerate(kernels)]


def map_from_trace(trace: trace_mod.Trace, links: Links | None = None) -> list[Entry]:
    """The ordered kernels of an eager run as map entries."""
    links = links or link(trace)
    module_of = _innermost(trace)
    rows = []
    for g, ev in enumerate(trace.gpu):
        if ev.cat != trace_mod.KERNEL:
            continue
        r = links.gpu_runtime[g]
        op = links.gpu_op[g]
        rows.append((ev.ts, g, ev.name, (module_of[r] if r >= 0 else None) or "",
                     trace.cpu_ops[op].name if op >= 0 else "", op,
                     trace.inputs_of(trace.cpu_ops[op]) if op >= 0 else None))
    rows.sort(key=lambda row: row[:2])
    calls: dict = {}
    return [Entry(name, module, op_name, calls.setdefault(op if op >= 0 else ("kernel", g), len(calls)), inputs)
            for _, g, name, module, op_name, op, inputs in rows]


def write_map(trace: trace_mod.Trace, path: str) -> int:
    """Write the map of an eager trace (see the module doc) to `path`; returns the number of kernels."""
    entries = map_from_trace(trace)
    kernels = []
    for e in entries:
        k = {"name": e.name, "module": e.module, "op": e.op, "call": e.call}
        if e.inputs is not None:
            k["dims"], k["types"] = [list(d) for d in e.inputs[0]], list(e.inputs[1])
        kernels.append(k)
    with open(path, "w") as f:
        json.dump({"format": MAP_FORMAT, "version": MAP_VERSION, "kernels": kernels}, f)
    return len(entries)


RESYNC_WINDOW = 64  # kernels looked ahead, in the replay and in the map, to find where they agree again
RESYNC_CONFIRM = 4  # consecutive equal names that confirm a resynchronisation (fewer only where both end)
# Where to look first when the walk resumes: (replay kernels skipped, map entries skipped), those that keep the
# replay's offset against the map (equal skips: a kernel replaced) before those that shift it (one missing or one
# extra), fewer skipped first.
_RESYNC_ORDER = sorted(((a, b) for a in range(RESYNC_WINDOW + 1) for b in range(RESYNC_WINDOW + 1) if a or b),
                       key=lambda ab: (abs(ab[0] - ab[1]), ab[0] + ab[1]))
MATCHED, BETWEEN = "matched", "between"


def _walk(replay: list[str], names: list[str]) -> list[tuple[int, int]]:
    """(replay index, map index) pairs of equal names, both increasing: the two sequences walked together; where
    they disagree, the walk resumes at the nearest point where they agree again for RESYNC_CONFIRM names in a row
    (or to both ends), the offset between them kept where possible (_RESYNC_ORDER). Nearest and offset-keeping
    matter: a model's layers repeat the same kernel names, so a longest common run (what difflib would take), or a
    short agreement far from where the walk was, can pair layer 1's kernels with layer 0's entries."""
    n, m = len(replay), len(names)
    pairs = []
    i = j = 0
    while i < n and j < m:
        if replay[i] == names[j]:
            pairs.append((i, j))
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
    return pairs


def _common_path(a: str, b: str) -> str:
    """The deepest module path holding both ('model.layers.3.mlp', 'model.layers.4.self_attn' -> 'model.layers')."""
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common) if a and b else ""


class Hit(NamedTuple):
    entry: int  # the map entry the kernel is (MATCHED) or follows (BETWEEN)
    how: str
    module: str  # the entry's module (MATCHED), the deepest module holding both neighbours (BETWEEN)


def attribute(replay: list[str], entries: list[Entry]) -> list[Hit | None]:
    """Per replayed kernel name (in order): a Hit, or None.

    MATCHED: the walk (_walk) over the kernels whose names both sides hold. A replay of the eager callable's own
    graph holds the map's kernels and nothing else; a compiled graph replaces the eager elementwise kernels with
    fused ones of its own but keeps the GEMMs, attention and mlpfuse's kernels, which then anchor the walk.
    BETWEEN: a kernel whose name the map does not hold at all (a compiled graph's fused kernel), lying between two
    matched kernels that are consecutive anchors on both sides (nothing skipped there), belongs to the deepest
    module holding both: the program runs in order between them. Every other kernel is None — never guessed."""
    names = [e.name for e in entries]
    held = set(names)
    common = held.intersection(replay)
    ri = [i for i, name in enumerate(replay) if name in common]
    mj = [j for j, name in enumerate(names) if name in common]
    pairs = _walk([replay[i] for i in ri], [names[j] for j in mj])
    out: list[Hit | None] = [None] * len(replay)
    for a, b in pairs:
        out[ri[a]] = Hit(mj[b], MATCHED, entries[mj[b]].module)
    for (a0, b0), (a1, b1) in zip(pairs, pairs[1:]):
        if a1 != a0 + 1 or b1 != b0 + 1:
            continue  # anchors skipped between these two: what lies between is not known
        holder = _common_path(entries[mj[b0]].module, entries[mj[b1]].module)
        if not holder:
            continue
        for i in range(ri[a0] + 1, ri[a1]):
            if replay[i] not in held:
                out[i] = Hit(mj[b0], BETWEEN, holder)
    return out


class _Kernel(NamedTuple):
    g: int  # index into trace.gpu
    module: str | None  # None: not attributed
    op: str
    inputs: tuple | None
    call: tuple  # kernels of one op call share it
    how: str  # "annotation", MATCHED, BETWEEN, or the reason it is not attributed


def _kernels(trace: trace_mod.Trace, entries: list[Entry] | None, links: Links) -> tuple[list[_Kernel], dict]:
    """Every kernel with its module, op, op inputs and call, in start order; and the replays' kernels by launch."""
    module_of = _innermost(trace)
    gpu = trace.gpu
    out: list[_Kernel] = []
    replays: dict[int, list[int]] = defaultdict(list)
    for g, ev in enumerate(gpu):
        if ev.cat != trace_mod.KERNEL:
            continue
        r = links.gpu_runtime[g]
        if r >= 0 and _is_graph_launch(trace.runtime[r].name):
            replays[r].append(g)
            continue
        o = links.gpu_op[g]
        op = trace.cpu_ops[o] if o >= 0 else None
        module = module_of[r] if r >= 0 else None
        out.append(_Kernel(g, module, op.name if op else "", trace.inputs_of(op) if op else None,
                           ("op", o) if o >= 0 else ("kernel", g), "annotation" if module is not None else NO_ANNOTATION))
    for r, members in replays.items():
        members.sort(key=lambda g: (gpu[g].ts, g))
        found = attribute([gpu[g].name for g in members], entries) if entries else [None] * len(members)
        for g, hit in zip(members, found):
            if hit is None:
                out.append(_Kernel(g, None, "", None, ("kernel", g), UNMATCHED if entries else NO_MAP))
                continue
            e = entries[hit.entry]
            if hit.how == BETWEEN:
                out.append(_Kernel(g, hit.module, "", None, ("kernel", g), BETWEEN))
            elif e.module:
                out.append(_Kernel(g, e.module, e.op, e.inputs, ("replay", r, e.call), MATCHED))
            else:
                out.append(_Kernel(g, None, e.op, e.inputs, ("replay", r, e.call), NO_ANNOTATION))
    out.sort(key=lambda k: (gpu[k.g].ts, k.g))
    return out, replays


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _fold(path: str) -> str:
    """Layer numbers folded: 'model.layers.7.mlp' -> 'model.layers.*.mlp'."""
    return ".".join("*" if part.isdigit() else part for part in path.split(".")) if path else ""


def _roofline(trace: trace_mod.Trace, kernels: list[_Kernel], peaks: dict | None, steps: int) -> dict:
    """Per (module kind, op, inputs): the calls' bytes and FLOPs (costs.cost), their achieved rates and fractions of
    the card's peaks; and the step's costed bytes against the bandwidth floor."""
    calls: dict = {}
    for k in kernels:
        if k.module is None or not k.op:
            continue
        c = calls.setdefault(k.call, [k, 0.0, []])
        c[1] += trace.gpu[k.g].dur
        c[2].append(trace.gpu[k.g].name)
    groups: dict = {}
    costed_us = total_bytes = total_flops = 0.0
    for first, dur, names in calls.values():
        c = costs.cost(first.op, *(first.inputs or (None, None)))
        if c is None:
            continue
        key = (_fold(first.module), first.op, first.inputs, tuple(names))
        grp = groups.setdefault(key, [c, 0, 0.0])
        grp[1] += 1
        grp[2] += dur
        costed_us += dur
        total_bytes += c.bytes
        total_flops += c.flops
    rows = []
    for (module, op, inputs, names), (c, n, us) in groups.items():
        dtype = next((t for t in inputs[1] if t in costs.ELEMENT_BYTES), "")
        rate = costs.roofline(c, us / n / 1e6, peaks, costs.DTYPE_KEYS.get(dtype))
        rows.append({"module": module, "op": op, "kernel": max(names, key=len), "kernels_per_call": len(names),
                     "inputs": " ".join("x".join(map(str, d)) for d, t in zip(*inputs) if t in costs.ELEMENT_BYTES),
                     "dtype": dtype, "dtypes": [t for t in inputs[1] if t in costs.ELEMENT_BYTES], "kind": c.kind,
                     "calls": n / steps, "us_per_call": us / n, "flops": c.flops, "bytes": c.bytes, **rate})
    rows.sort(key=lambda r: -r["calls"] * r["us_per_call"])
    kernel_us = sum(trace.gpu[k.g].dur for k in kernels)
    bw = (peaks or {}).get("copy_gbps")
    return {"rows": rows, "costed_share": costed_us / kernel_us if kernel_us else 0.0,
            "bytes_per_step": total_bytes / steps, "flops_per_step": total_flops / steps,
            "costed_us_per_step": costed_us / steps,
            "floor_us_per_step": total_bytes / steps / bw / 1e3 if bw else None, "peaks": peaks}


FUSE_MIN = 3  # consecutive memory-bound kernels of one module worth fusing
MLP_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "ffn_norm")  # the norms that feed an MLP
ATTENTION_NORMS = ("input_layernorm", "attention_norm")  # the norms that feed an attention's projections


def _hint(module: str) -> str:
    """What mlpfuse offers for a module, by its path ('' where nothing)."""
    last = module.rsplit(".", 1)[-1].lower()
    if last in MLP_NORMS:
        return "mlpfuse.patch hands this RMSNorm to the fused MLP block, which reads x once and normalises on chip"
    if last in ATTENTION_NORMS:
        return ("where the attention after it has separate q, k, v projections, mlpfuse.patch hands this RMSNorm to "
                "them: one decode launch that normalises x on chip")
    if any(word in module.lower() for word in ("mlp", "feed_forward", "ffn")):
        return "mlpfuse.patch swaps this MLP for the fused block (GLU in the GEMM's epilogue)"
    return ""


def _fusions(trace: trace_mod.Trace, kernels: list[_Kernel], steps: int) -> list[dict]:
    """Runs of FUSE_MIN or more consecutive kernels (on one stream) of one module whose ops are elementwise,
    reductions or norms: each pass reads and writes the tensor again; one fused kernel would move about the largest
    pass's bytes once. Grouped by module kind, per step."""
    by_stream: dict = defaultdict(list)
    for k in kernels:
        by_stream[(trace.gpu[k.g].pid, trace.gpu[k.g].tid)].append(k)
    found: dict = {}

    def close(run):  # run: (kernel, its cost) pairs, every cost memory-bound
        if len(run) < FUSE_MIN:
            return
        moved = [c.bytes for _, c in run]
        f = found.setdefault(_fold(run[0][0].module), [0, 0, 0.0, 0.0, 0.0, Counter()])
        f[0] += 1
        f[1] += len(run)
        f[2] += sum(trace.gpu[k.g].dur for k, _ in run)
        f[3] += sum(moved)
        f[4] += sum(moved) - max(moved)
        f[5].update(k.op for k, _ in run)

    for stream in by_stream.values():
        run: list = []
        for k in stream:
            c = costs.cost(k.op, *(k.inputs or (None, None))) if k.module is not None else None
            if c is None or c.kind not in costs.MEMORY_KINDS:
                close(run)
                run = []
            elif run and run[-1][0].module != k.module:
                close(run)
                run = [(k, c)]
            else:
                run.append((k, c))
        close(run)
    out = [{"module": module, "runs": n / steps, "kernels": kn / steps, "gpu_us": us / steps,
            "bytes": moved / steps, "bytes_saved": saved / steps,
            "ops": [op for op, _ in ops.most_common(8)], "mlpfuse": _hint(module)}
           for module, (n, kn, us, moved, saved, ops) in found.items()]
    out.sort(key=lambda f: -f["gpu_us"])
    return out


def module_view(trace: trace_mod.Trace, entries: list[Entry] | None = None, links: Links | None = None,
                depth: int = 6, peaks: dict | None = None, steps: int = 1) -> dict:
    """Time per module path over the trace's kernels: eager kernels by their annotation, replayed ones through
    `entries` (a map). `rows`: every path prefix up to `depth` parts (`model`, `model.layers`, `model.layers.7`,
    `model.layers.7.mlp`, ...) with GPU µs, kernel counts and share of all kernel time; `kinds`: the same with layer
    numbers folded (`model.layers.*.mlp`: every layer's MLP together), each with the ops of the kernels launched in
    it directly. Every kernel not attributed is counted by reason; kernels attributed by position between two
    matched ones (attribute's BETWEEN) are counted apart too. Replays also report the idle time between their
    kernels (bubbles a graph still has). `roofline` and `fusions`: see _roofline and _fusions (`peaks`: the card's
    measured peaks, or None)."""
    links = links or link(trace)
    gpu = trace.gpu
    kernels, replays = _kernels(trace, entries, links)
    reasons: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    own_ops: dict[str, Counter] = defaultdict(Counter)
    between = [0, 0.0]
    for k in kernels:
        dur = gpu[k.g].dur
        if k.module is None:
            reasons[k.how][0] += 1
            reasons[k.how][1] += dur
            continue
        if k.how == BETWEEN:
            between[0] += 1
            between[1] += dur
        parts = k.module.split(".") if k.module else []
        for d in range(0, min(len(parts), depth) + 1):
            key = ".".join(parts[:d])
            totals[key][0] += 1
            totals[key][1] += dur
        own_ops[k.module][k.op or "(fused, compiled)"] += dur
    idle = 0.0
    for members in replays.values():
        starts = np.array([gpu[g].ts for g in members])
        ends = np.maximum.accumulate(np.array([gpu[g].end for g in members]))
        idle += float(np.clip(starts[1:] - ends[:-1], 0, None).sum()) if len(members) > 1 else 0.0
    kernel_us = sum(gpu[k.g].dur for k in kernels)
    attributed = totals[""][1] if "" in totals else 0.0
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    kind_ops: dict[str, Counter] = defaultdict(Counter)
    for key, (n, us) in totals.items():
        kinds[_fold(key)][0] += n
        kinds[_fold(key)][1] += us
    for key, ops in own_ops.items():
        kind_ops[_fold(key)].update(ops)

    def table(source, ops_of=None):
        rows = []
        for key, (n, us) in sorted(source.items(), key=lambda kv: kv[0].split(".")):
            row = {"module": key or "(all modules)", "depth": key.count(".") + 1 if key else 0, "kernels": int(n),
                   "gpu_us": us, "share": us / kernel_us if kernel_us else 0.0}
            if ops_of is not None:
                row["ops"] = [{"op": op, "gpu_us": t} for op, t in ops_of[key].most_common(6)]
            rows.append(row)
        return rows

    steps = max(int(steps), 1)
    return {"rows": table(totals), "kinds": table(kinds, kind_ops), "kernel_us": kernel_us,
            "busy_us": _busy([(gpu[k.g].ts, gpu[k.g].end) for k in kernels]), "attributed_us": attributed,
            "attributed_share": attributed / kernel_us if kernel_us else 0.0,
            "between": {"kernels": between[0], "gpu_us": between[1]},
            "unattributed": [{"reason": why, "kernels": int(n), "gpu_us": us} for why, (n, us) in reasons.items()],
            "replays": len(replays), "replay_idle_us": idle, "steps": steps,
            "roofline": _roofline(trace, kernels, peaks, steps), "fusions": _fusions(trace, kernels, steps)}


def kernel_modules(trace: trace_mod.Trace, graph_map: str | None = None) -> dict:
    """(ts, pid, tid, name) of each attributed kernel -> its module path: what the report's timeline colours by. A map
    that cannot be read any more attributes nothing (the analysis already reported it)."""
    try:
        entries = read_map(graph_map) if graph_map else None
    except InputError:
        entries = None
    kernels, _ = _kernels(trace, entries, link(trace))
    gpu = trace.gpu
    return {(gpu[k.g].ts, gpu[k.g].pid, gpu[k.g].tid, gpu[k.g].name): k.module for k in kernels
            if k.module is not None}


def map_path(trace_path: str) -> str:
    """Where the map of a trace's graph is looked for: beside it, `<trace>.map.json` (`step.pt.trace.json.gz` ->
    `step.pt.trace.map.json`)."""
    for suffix in (".json.gz", ".json"):
        if trace_path.endswith(suffix):
            return trace_path[: -len(suffix)] + ".map.json"
    return trace_path + ".map.json"


def view_if_any(trace: trace_mod.Trace, links: Links, graph_map: str | None, steps: int,
                peaks: dict | None = None) -> dict | None:
    """The module view for an analysis: when the trace has module annotations or graph replays, or a map was given
    (None otherwise: a trace of neither keeps its analysis as it was). `peaks`: the card's measured peaks; by
    default the bench's cached ones for the trace's first device, where they exist (_peaks.cached_peaks)."""
    annotated = any(a.name.startswith(PREFIX) for a in trace.annotations)
    replayed = any(_is_graph_launch(r.name) for r in trace.runtime)
    if not (annotated or replayed or graph_map):
        return None
    entries = read_map(graph_map) if graph_map else None
    if peaks is None and trace.devices:
        peaks = cached_peaks(trace.devices[0])
    view = module_view(trace, entries, links, peaks=peaks, steps=steps)
    view["map"] = graph_map
    return view


def _rate(value, unit: str) -> str:
    return "-" if value is None else f"{value:,.0f} {unit}"


def _share(value) -> str:
    return "" if value is None else f" ({value:.0%})"


def render(view: dict, limit: int = 40, top: int = 8) -> list[str]:
    """Terminal lines: the module tree with layers folded (indented by depth, each module's own ops beside it), what
    was not attributed and why, then the costliest calls against the card's roofline and the fusions the step
    suggests."""
    n = view.get("steps", 1)
    lines = [f"GPU time by module (per step, {n} steps): {view['attributed_share']:.1%} of "
             f"{view['kernel_us'] / n:.1f} us of kernels attributed"
             + (f"; {view['replays']} graph replays, {view['replay_idle_us'] / n:.1f} us idle between their "
                f"kernels" if view["replays"] else "")]
    for row in view["kinds"][:limit]:
        ops = ", ".join(o["op"] for o in row.get("ops", [])[:3])
        lines.append(f"  {'  ' * row['depth']}{row['module']:<{max(8, 48 - 2 * row['depth'])}} "
                     f"{row['gpu_us'] / n:10.1f} us {row['share']:6.1%} {row['kernels'] / n:8.1f} kernels"
                     + (f"  [{ops}]" if ops else ""))
    if len(view["kinds"]) > limit:
        lines.append(f"  ... {len(view['kinds']) - limit} more rows (JSON has them all, and every layer apart)")
    between = view.get("between") or {}
    if between.get("kernels"):
        lines.append(f"  by position: {between['kernels'] / n:.1f} kernels, {between['gpu_us'] / n:.1f} us per step "
                     "have no counterpart in the map (a compiled graph's fused kernels) and are counted to the module "
                     "holding the matched kernels on both sides")
    for u in view["unattributed"]:
        lines.append(f"  not attributed: {u['kernels'] / n:.1f} kernels, {u['gpu_us'] / n:.1f} us per step: "
                     f"{u['reason']}")
    roof = view.get("roofline")
    if roof and roof["rows"]:
        floor = roof["floor_us_per_step"]
        lines.append(f"Roofline of the calls with known op and shapes ({roof['costed_share']:.1%} of kernel time): "
                     f"{roof['bytes_per_step'] / 1e6:,.1f} MB per step"
                     + (f", at the card's copy bandwidth a floor of {floor:,.1f} us" if floor else
                        " (no measured peaks for this card: run `mlpfuse bench` on it once)"))
        for r in roof["rows"][:top]:
            lines.append(f"  {r['module'][:40]:<40} {r['op'][:28]:<28} {r['inputs'][:34]:<34} "
                         f"{r['us_per_call']:8.1f} us x{r['calls']:g}  {_rate(r['gbps'], 'GB/s')}"
                         f"{_share(r['of_bandwidth'])}  {_rate(r['tflops'], 'TFLOP/s')}{_share(r['of_compute'])}")
    for f in (view.get("fusions") or [])[:top]:
        lines.append(f"Fusion: {f['module']}: {f['runs']:g} runs of {f['kernels'] / max(f['runs'], 1e-9):.1f} "
                     f"memory-bound kernels per step ({', '.join(f['ops'][:4])}), {f['gpu_us']:.1f} us; one kernel "
                     f"would save about {f['bytes_saved'] / 1e6:,.2f} MB of {f['bytes'] / 1e6:,.2f} MB"
                     + (f" — {f['mlpfuse']}" if f["mlpfuse"] else ""))
    return lines
