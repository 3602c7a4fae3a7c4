"""Per-rank traces of one distributed run: each rank's analysis, the merged view, communication and rank skew.

A job on several GPUs writes one trace per rank (Kineto stamps each with `distributedInfo`: backend, rank,
world_size). `analyze_ranks(DIR)` reads every .json / .json.gz trace in the folder, checks that they are the ranks
of one run, runs the single-trace analysis on each and adds what only several ranks show:

- communication: time per step in communication kernels (NCCL's, by kernel family), as the union of their
  intervals on the GPU timeline, and the share of it overlapped by compute kernels (the intersection of the two
  unions). An NCCL kernel runs from its launch until every peer has joined, so its time includes waiting for
  slower ranks: a skewed run shows more communication on its fast ranks.
- skew: per step (matched by name across ranks), the slowest rank's step time against the fastest's.

mlpfuse's own results folders (walkthrough, profile, bench) hold saved analyses and summaries beside their traces:
those files are skipped by name and listed. The traces of such a folder are separate runs without ranks;
`analyze_folder` analyses each on its own there.

Bad input (one InputError line): no traces in the folder, a trace whose rank cannot be told, two traces of one rank
or disagreeing world sizes or traces whose time spans lie apart (traces of different runs), a rank missing from
0..world_size-1.

No torch import here, as for every analysis.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from typing import Any

from mlpfuse.errors import InputError, printable
from mlpfuse.profiling import kernel_names
from mlpfuse.profiling.analysis import Analysis, analyze, link, step_indices
from mlpfuse.profiling.steps import AUTO, find_steps
from mlpfuse.profiling.trace import KERNEL, Trace, load, no_gc

SCHEMA = "mlpfuse.ranks/1"
COMMUNICATION = "communication"
MAX_RANK_FILES = 4096  # a folder is untrusted too: refuse before reading thousands of files
# Traces of one run cover the same steps at the same wall-clock time; spans this far apart are different runs.
RUN_GAP_US = 60e6
_TRACE_SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d{1,9})(?!\d)", re.I)
_MAX_RANK = 1 << 31
# What mlpfuse writes beside its traces (saved analyses, summaries, bench results): never a trace.
_OWN_OUTPUTS = re.compile(r"\.analysis\.json$|^(summary|results|model-diff)\.json$", re.I)


# ---------------------------------------------------------------- which file is which rank


def trace_files(directory: str) -> tuple[list[str], list[str]]:
    """The regular .json / .json.gz files directly in `directory`, sorted by name, and apart from them the names
    of mlpfuse's own outputs there (skipped)."""
    try:
        names = sorted(os.listdir(directory))
    except NotADirectoryError:
        raise InputError(f"DIR {directory}: not a folder") from None
    except OSError as exc:
        raise InputError(f"DIR {directory}: cannot be listed ({exc.strerror or exc})") from None
    paths, own = [], []
    for name in names:
        if not name.lower().endswith(_TRACE_SUFFIXES):
            continue
        if _OWN_OUTPUTS.search(name):
            own.append(name)
            continue
        path = os.path.join(directory, name)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                continue
        except OSError:
            continue  # a dangling link among the files: not a trace of this run
        paths.append(path)
        if len(paths) > MAX_RANK_FILES:
            raise InputError(f"DIR {directory}: more than {MAX_RANK_FILES} trace files; one run's ranks expected")
    if not paths:
        beside = f" (only mlpfuse's saved results: {', '.join(own[:5])}{', ...' if len(own) > 5 else ''})" if own else ""
        raise InputError(f"DIR {directory}: no .json or .json.gz trace files in it{beside}")
    return paths, own


def _int_field(info: dict, key: str, path: str, low: int) -> int | None:
    value = info.get(key)
    if value is None:
        return None
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not low <= value < _MAX_RANK:
        raise InputError(f"TRACE {path}: distributedInfo.{key} is {value!r}, expected an integer >= {low}")
    return value


def rank_of(trace: Trace) -> tuple[int, int | None, str]:
    """(rank, world_size or None, where the rank came from): Kineto's distributedInfo, else `rank<N>` in the file
    name (rank-3.json.gz, rank_3, trace.rank3.json)."""
    found = _rank_in(trace)
    if found is None:
        raise InputError(f"TRACE {trace.path}: cannot tell its rank (no distributedInfo.rank, no rank<N> in the file "
                         f"name)")
    return found


def _rank_in(trace: Trace) -> tuple[int, int | None, str] | None:
    path = trace.path
    info = trace.metadata.get("distributedInfo")
    if info is not None and not isinstance(info, dict):
        raise InputError(f"TRACE {path}: distributedInfo is {type(info).__name__}, expected an object")
    info = info or {}
    rank = _int_field(info, "rank", path, 0)
    world = _int_field(info, "world_size", path, 1)
    source = "distributedInfo"
    if rank is None:
        m = _RANK_IN_NAME.search(os.path.basename(path))
        if not m:
            return None
        rank, source = int(m.group(1)), "file name"
    if world is not None and rank >= world:
        raise InputError(f"TRACE {path}: rank {rank} is outside world_size {world}")
    return rank, world, source


def _span_us(trace: Trace) -> tuple[float, float]:
    """The trace's first and last event on an absolute clock (Kineto writes times relative to
    baseTimeNanoseconds when it gives one)."""
    base = trace.metadata.get("baseTimeNanoseconds")
    offset = base / 1000.0 if type(base) in (int, float) and 0 <= base < 1e22 else 0.0
    first, last = float("inf"), 0.0
    for events in (trace.cpu_ops, trace.annotations, trace.runtime, trace.gpu):
        if events:
            first = min(first, min(e.ts for e in events))
            last = max(last, max(e.end for e in events))
    return offset + first, offset + last


def _ranges(numbers: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def check_run(directory: str, found: list[dict], allow_missing: bool) -> int:
    """That the traces (dicts with rank, world, path, span) are the ranks of one run; returns its world size."""
    by_rank: dict[int, dict] = {}
    for f in found:
        if f["rank"] in by_rank:
            raise InputError(f"DIR {directory}: two traces of rank {f['rank']} "
                             f"({os.path.basename(by_rank[f['rank']]['path'])}, {os.path.basename(f['path'])}): "
                             f"traces of different runs mixed, or a copy")
        by_rank[f["rank"]] = f
    sized = sorted((f["world"], os.path.basename(f["path"])) for f in found if f["world"] is not None)
    if sized and sized[0][0] != sized[-1][0]:
        raise InputError(f"DIR {directory}: traces of different runs: {sized[0][1]} has world_size {sized[0][0]}, "
                         f"{sized[-1][1]} has {sized[-1][0]}")
    world = sized[0][0] if sized else max(by_rank) + 1
    earliest_end = min(found, key=lambda f: f["span"][1])
    latest_start = max(found, key=lambda f: f["span"][0])
    gap = latest_start["span"][0] - earliest_end["span"][1]
    if gap > RUN_GAP_US:
        raise InputError(f"DIR {directory}: traces of different runs: rank {latest_start['rank']}'s events start "
                         f"{gap / 1e6:.0f} s after rank {earliest_end['rank']}'s end")
    missing = [r for r in range(world) if r not in by_rank]
    if missing and not allow_missing:
        of = f"world_size {world}" if sized else f"ranks 0-{world - 1}"
        raise InputError(f"DIR {directory}: missing rank(s) {_ranges(missing)} of {of} (found "
                         f"{_ranges(sorted(by_rank))}); pass --allow-missing-ranks to analyse the ranks present")
    return world


# ---------------------------------------------------------------- communication on the GPU timeline


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication(trace: Trace, included: list[bool], label: str | None = None, steps_from: str = AUTO) -> dict:
    """Per step: communication kernels' time (union), compute kernels' time (union of every other kernel), and
    their overlap; averaged over the steps the single-trace analysis averages (`included`, one flag per step found).
    GPU work belongs to the step whose CPU span launched it, as in that analysis."""
    steps, _ = find_steps(trace, label, steps_from)
    if len(steps) != len(included):
        raise ValueError("included: one flag per step found")
    links = link(trace)
    rt_step = step_indices(steps, [e.ts for e in trace.runtime])
    own_step = step_indices(steps, [e.ts for e in trace.gpu])
    n = len(steps)
    comm: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    compute: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    comm_kernels = 0
    for g, e in enumerate(trace.gpu):
        if e.cat != KERNEL:
            continue
        r = links.gpu_runtime[g]
        k = rt_step[r] if r >= 0 else own_step[g]
        if k < 0 or not included[k]:
            continue
        if kernel_names.family_of(e.name, e.cat) == COMMUNICATION:
            comm[k].append((e.ts, e.end))
            comm_kernels += 1
        else:
            compute[k].append((e.ts, e.end))
    comm_us = compute_us = overlapped_us = 0.0
    for k in range(n):
        c, w = _union(comm[k]), _union(compute[k])
        comm_us += _length(c)
        compute_us += _length(w)
        overlapped_us += _intersection(c, w)
    m = max(sum(included), 1)
    return {"comm_kernels": comm_kernels / m, "comm_us": comm_us / m, "compute_us": compute_us / m,
            "overlapped_us": overlapped_us / m}


# ---------------------------------------------------------------- the analysis


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _rank_row(rank: int, an: Analysis, comm: dict) -> dict:
    per = an.per_step
    nccl = [{"name": k["name"], "count": k["count"], "per_step": k["per_step"], "total_us": k["total_us"]}
            for k in an.kernels if k["family"] == COMMUNICATION]
    return {
        "rank": rank,
        "trace": an.trace_path,
        "steps": an.steps,
        "step_us": per["step_us"],
        "gpu_busy_us": per["gpu_busy_us"],
        "gpu_kernels": per["gpu_kernels"],
        **comm,
        "comm_share": _share(comm["comm_us"], per["step_us"]),
        "overlap_share": _share(comm["overlapped_us"], comm["comm_us"]),
        "step_table": {row["name"]: row["step_us"] for row in an.data["step_table"] if row.get("in_averages", True)},
        "communication_kernels": nccl,
    }


def _merged(rows: list[dict]) -> dict:
    n = len(rows)

    def mean(key):
        return sum(r[key] for r in rows) / n

    kernels: dict[str, dict] = {}
    for r in rows:
        for k in r["communication_kernels"]:
            m = kernels.setdefault(k["name"], {"name": k["name"], "count": 0, "total_us": 0.0, "ranks": 0})
            m["count"] += k["count"]
            m["total_us"] += k["total_us"]
            m["ranks"] += 1
    comm = sum(r["comm_us"] for r in rows)
    return {
        "ranks": n,
        "step_us": mean("step_us"),
        "step_us_max": max(r["step_us"] for r in rows),
        "gpu_busy_us": mean("gpu_busy_us"),
        "gpu_kernels": mean("gpu_kernels"),
        "comm_kernels": mean("comm_kernels"),
        "comm_us": comm / n,
        "compute_us": mean("compute_us"),
        "overlapped_us": mean("overlapped_us"),
        "comm_share": _share(comm, sum(r["step_us"] for r in rows)),
        "overlap_share": _share(sum(r["overlapped_us"] for r in rows), comm),
        "communication_kernels": sorted(kernels.values(), key=lambda k: -k["total_us"]),
    }


def skew(rows: list[dict]) -> dict:
    """The slowest rank's step against the fastest's, step by step over the steps every rank has (by name), else
    over the ranks' mean step times."""
    common = set(rows[0]["step_table"])
    for r in rows[1:]:
        common &= set(r["step_table"])
    mean_rank = {r["rank"]: r["step_us"] for r in rows}
    slowest = max(mean_rank, key=lambda k: (mean_rank[k], -k))
    fastest = min(mean_rank, key=lambda k: (mean_rank[k], k))
    out: dict[str, Any] = {"slowest_rank": slowest, "fastest_rank": fastest,
                           "slowest_step_us": mean_rank[slowest], "fastest_step_us": mean_rank[fastest]}
    if common:
        per_step = []
        for name in sorted(common, key=lambda s: (len(s), s)):
            times = {r["rank"]: r["step_table"][name] for r in rows}
            hi = max(times, key=lambda k: (times[k], -k))
            lo = min(times, key=lambda k: (times[k], k))
            per_step.append({"step": name, "slowest_rank": hi, "fastest_rank": lo, "slowest_us": times[hi],
                             "fastest_us": times[lo], "skew_us": times[hi] - times[lo]})
        out["matched_by"] = "step name"
        out["steps"] = per_step
        out["skew_us"] = sum(s["skew_us"] for s in per_step) / len(per_step)
        out["worst_step"] = max(per_step, key=lambda s: s["skew_us"])
        slow = sum(s["slowest_us"] for s in per_step)
        fast = sum(s["fastest_us"] for s in per_step)
    else:
        out["matched_by"] = "mean step"
        out["steps"] = []
        out["skew_us"] = mean_rank[slowest] - mean_rank[fastest]
        out["worst_step"] = None
        slow, fast = mean_rank[slowest], mean_rank[fastest]
    out["ratio"] = slow / fast if fast > 0 else None
    return out


class RankAnalysis:
    """The analyses of one run's per-rank traces. `to_dict()` is `analyze DIR --json` (schema mlpfuse.ranks/1);
    `analyses` maps rank -> the single-trace Analysis."""

    def __init__(self, data: dict, analyses: dict[int, Analysis]):
        self.data = data
        self.analyses = analyses

    def to_dict(self) -> dict:
        return self.data

    def __repr__(self) -> str:
        m = self.data["merged"]
        return f"<RankAnalysis {m['ranks']} ranks of {self.data['world_size']}, {m['step_us']:.1f} us/step>"


class TraceSet:
    """The traces of one of mlpfuse's own results folders (the walkthrough's cases, `profile` runs): separate runs
    without ranks, each analysed on its own. `to_dict()` is `analyze DIR --json` for such a folder."""

    SCHEMA = "mlpfuse.folder/1"

    def __init__(self, directory: str, analyses: list[Analysis], skipped: list[str]):
        self.directory, self.analyses, self.skipped = directory, analyses, skipped

    def to_dict(self) -> dict:
        return {"schema": self.SCHEMA, "directory": self.directory, "skipped": self.skipped,
                "traces": [an.to_dict() for an in self.analyses]}


def analyze_folder(directory: str | os.PathLike, label: str | None = None, max_bytes: int | str | None = None,
                   allow_missing: bool = False, steps_from: str = AUTO) -> RankAnalysis | TraceSet:
    """`analyze DIR`: the per-rank traces of one run (a RankAnalysis), or, in one of mlpfuse's own results folders
    whose traces carry no rank, each trace on its own (a TraceSet). mlpfuse's saved analyses and summaries in the
    folder are skipped either way and listed (`skipped`)."""
    directory = os.fspath(directory)
    paths, skipped = trace_files(directory)
    found, rows, analyses, unranked = [], [], {}, []
    for path in paths:
        # One trace in memory at a time: each is reduced to its analysis and communication figures at once.
        with no_gc():
            trace = load(path, max_bytes)
            ranked = _rank_in(trace)
            if ranked is None and (rows or not skipped):  # no results folder of ours, or ranked traces beside
                rank_of(trace)
            an = analyze(trace, label, steps_from=steps_from)
            if ranked is None:
                unranked.append(an)
            else:
                rank, world, source = ranked
                found.append({"rank": rank, "world": world, "path": path, "span": _span_us(trace)})
                included = [row.get("in_averages", True) for row in an.data["step_table"]]
                comm = communication(trace, included, label, steps_from)
                rows.append({**_rank_row(rank, an, comm), "rank_from": source})
                analyses[rank] = an
        del trace
    if unranked:
        if rows:
            raise InputError(f"TRACE {unranked[0].trace_path}: cannot tell its rank (no distributedInfo.rank, no "
                             f"rank<N> in the file name)")
        return TraceSet(directory, unranked, skipped)
    world = check_run(directory, found, allow_missing)
    rows.sort(key=lambda r: r["rank"])
    data = {
        "schema": SCHEMA,
        "directory": directory,
        "world_size": world,
        "ranks_found": [r["rank"] for r in rows],
        "per_rank": rows,
        "merged": _merged(rows),
        "skew": skew(rows),
        "skipped": skipped,
    }
    return RankAnalysis(data, analyses)


def analyze_ranks(directory: str | os.PathLike, label: str | None = None, max_bytes: int | str | None = None,
                  allow_missing: bool = False, steps_from: str = AUTO) -> RankAnalysis:
    """Analyse the per-rank traces of one run in `directory` (see the module's docstring); `label`, `max_bytes`
    and `steps_from` mean what they mean for `analyze`, for every rank."""
    result = analyze_folder(directory, label, max_bytes, allow_missing, steps_from)
    if isinstance(result, TraceSet):
        raise InputError(f"DIR {os.fspath(directory)}: its traces are separate runs, not the ranks of one (no rank "
                         f"in them); give two of them to diff, or analyse the folder")
    return result


def diff_ranks(directory: str | os.PathLike, a: int | None = None, b: int | None = None,
               max_bytes: int | str | None = None, allow_missing: bool = False):
    """`diff` between two ranks of a run: rank a against rank b (default: the fastest rank against the slowest)."""
    from mlpfuse.profiling.diff import diff

    ranks = analyze_ranks(directory, max_bytes=max_bytes, allow_missing=allow_missing)
    sk = ranks.data["skew"]
    a = sk["fastest_rank"] if a is None else a
    b = sk["slowest_rank"] if b is None else b
    for name, r in (("A", a), ("B", b)):
        if r not in ranks.analyses:
            raise InputError(f"--ranks: rank {r} ({name}) has no trace in {directory}; found "
                             f"{_ranges(sorted(ranks.analyses))}")
    result = diff(ranks.analyses[a], ranks.analyses[b])
    result.data["ranks"] = {"a": a, "b": b}
    return result


# ---------------------------------------------------------------- the CLI's folder forms of analyze and diff


def _rank_pair(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and len(p.strip()) <= 9 for p in parts):
        raise InputError(f"--ranks: expected two rank numbers like 0,1, got {text!r}")
    return int(parts[0]), int(parts[1])


def run_analyze_dir(args, dump) -> int:
    from mlpfuse.profiling.render_ranks import print_folder, print_ranks

    if args.html:
        raise InputError("--html: a page is made from one trace; pass one rank's trace file")
    result = analyze_folder(args.trace, label=args.label, max_bytes=args.max_bytes,
                            allow_missing=args.allow_missing_ranks, steps_from=args.steps_from)
    data = result.to_dict()
    if data["skipped"]:
        names = data["skipped"]
        print(printable(f"skipped {len(names)} file{'s' if len(names) > 1 else ''} mlpfuse wrote (saved analyses "
                        f"and summaries, not traces): {', '.join(names)}"), file=sys.stderr)
    if args.json:
        dump(data)
    elif isinstance(result, TraceSet):
        print_folder(data)
    else:
        print_ranks(data)
    return 0


def run_diff_dir(args, dump) -> int:
    from mlpfuse.profiling import render

    if args.html:
        raise InputError("--html: pass the two ranks' trace files to diff them as a page")
    a, b = _rank_pair(args.ranks)
    result = diff_ranks(args.a, a, b, max_bytes=args.max_bytes, allow_missing=args.allow_missing_ranks)
    if args.json:
        dump(result.to_dict())
    else:
        r = result.data["ranks"]
        print(f"rank {r['a']} (A) vs rank {r['b']} (B)")
        render.print_diff(result.to_dict())
    return 0
