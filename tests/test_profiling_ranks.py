"""`mlpfuse analyze DIR` / `mlpfuse diff DIR` on folders of per-rank traces.

Synthetic Kineto traces are built here from the raw event structure (step spans, launches with correlation ids,
NCCL and compute kernels on the GPU timeline, distributedInfo), with integer microsecond times; the communication
and overlap figures are checked against a count of covered microseconds, an independent computation. The public
pair of ranks from Holistic Trace Analysis (tests/fixtures/traces/hta_sampled_ranks) is checked against a sweep
over its raw events.
"""

import gzip
import json
import os
import shutil

import pytest

from mlpfuse.cli import main
from mlpfuse.profiling import analyze
from mlpfuse.profiling.ranks import analyze_ranks

HTA = os.path.join(os.path.dirname(__file__), "fixtures", "traces", "hta_sampled_ranks")
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
GELU = "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>(int, T, T)"


def rank_trace(rank, world, steps, base_ns=1_700_000_000_000_000_000, info=True):
    """A Kineto-shaped trace. steps: [(start, dur, [(kernel name, start, dur), ...]), ...]; each kernel is launched
    by a cudaLaunchKernel inside its step's span, under an aten op, and linked to it by a correlation id."""
    events, corr = [], 100
    for k, (start, dur, kernels) in enumerate(steps):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k + 5}", "pid": 10, "tid": 10,
                       "ts": start, "dur": dur})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 10, "tid": 10, "ts": start + 1,
                       "dur": len(kernels) + 1, "args": {"External id": corr}})
        for i, (name, ks, kd) in enumerate(kernels):
            corr += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": 10,
                           "ts": start + 1 + i, "dur": 1, "args": {"correlation": corr}})
            events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ks, "dur": kd,
                           "args": {"correlation": corr, "device": 0, "stream": 7}})
    doc = {"schemaVersion": 1, "traceEvents": events, "baseTimeNanoseconds": base_ns}
    if info:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": world}
    return doc


def write(folder, name, doc):
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_bytes(gzip.compress(json.dumps(doc).encode()) if name.endswith(".gz") else json.dumps(doc).encode())
    return str(path)


def run_of(world=2, slow=1):
    """Per rank, two steps: a GEMM, then an all-reduce that overlaps the tail of the GEMM and a GELU, then a lone
    NCCL kernel that runs past the step's CPU span (it still belongs to the step that launched it); then a step
    without GPU work. Rank `slow` takes longer steps, and its peers' all-reduce waits for it."""
    runs = {}
    for r in range(world):
        extra = 300 if r == slow else 0
        steps = []
        for k in range(2):
            t = 1000 + k * 5000
            steps.append((t, 2000 + extra, [
                (GEMM, t + 10, 500 + extra),                  # compute
                (NCCL, t + 400 + extra, 200 + (0 if r == slow else 150)),  # overlaps the GEMM's last 110 us
                (GELU, t + 550 + extra, 100),                 # inside the all-reduce
                (NCCL, t + 1990 + extra, 40 + 10 * k),        # ends after the step's span
            ]))
        steps.append((11000, 500 + extra, []))  # the profiler's last step, no GPU work: left out of the averages
        runs[r] = steps
    return runs


def covered(steps):
    """Oracle: per-step averages of the microseconds covered by communication kernels, by compute kernels, and by
    both — counted microsecond by microsecond (all times are integers)."""
    comm = compute = both = 0
    steps = [s for s in steps if s[2]]  # steps without GPU work are not averaged
    for _, _, kernels in steps:
        c, w = set(), set()
        for name, ks, kd in kernels:
            (c if name.startswith("nccl") else w).update(range(ks, ks + kd))
        comm, compute, both = comm + len(c), compute + len(w), both + len(c & w)
    n = len(steps)
    return comm / n, compute / n, both / n


def test_synthetic_run_matches_the_microsecond_count(tmp_path, capsys):
    runs = run_of(world=3, slow=1)
    folder = tmp_path / "run"
    for r, steps in runs.items():
        write(folder, f"trace_rank{r}.json.gz" if r % 2 else f"worker-{r}.pt.trace.json", rank_trace(r, 3, steps))
    (folder / "notes.txt").write_text("not a trace")  # other files are not read
    assert main(["analyze", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "mlpfuse.ranks/1" and data["world_size"] == 3 and data["ranks_found"] == [0, 1, 2]
    for row in data["per_rank"]:
        steps = runs[row["rank"]]
        comm, compute, both = covered(steps)
        assert row["comm_us"] == pytest.approx(comm) and row["compute_us"] == pytest.approx(compute)
        assert row["overlapped_us"] == pytest.approx(both)
        assert row["overlap_share"] == pytest.approx(both / comm)
        assert row["comm_kernels"] == 2 and row["rank_from"] == "distributedInfo"
        single = analyze(row["trace"]).to_dict()
        assert row["step_us"] == single["per_step"]["step_us"]
        assert row["comm_share"] == pytest.approx(comm / single["per_step"]["step_us"])
        assert [k["name"] for k in row["communication_kernels"]] == [NCCL]
    merged = data["merged"]
    total_comm = sum(covered(s)[0] for s in runs.values())
    assert merged["comm_us"] == pytest.approx(total_comm / 3)
    assert merged["overlap_share"] == pytest.approx(sum(covered(s)[2] for s in runs.values()) / total_comm)
    assert merged["communication_kernels"] == [{"name": NCCL, "count": 12, "ranks": 3,
                                                "total_us": pytest.approx(sum(sum(kd for n, _, kd in ks if n == NCCL)
                                                                              for s in runs.values()
                                                                              for _, _, ks in s))}]
    skew = data["skew"]
    assert skew["slowest_rank"] == 1 and skew["fastest_rank"] == 0 and skew["matched_by"] == "step name"
    tables = {row["rank"]: row["step_table"] for row in data["per_rank"]}
    for s in skew["steps"]:
        assert s["slowest_us"] == max(t[s["step"]] for t in tables.values())
        assert s["fastest_us"] == min(t[s["step"]] for t in tables.values())
    assert [s["step"] for s in skew["steps"]] == ["ProfilerStep#5", "ProfilerStep#6"]
    assert skew["ratio"] > 1

    assert main(["analyze", str(folder)]) == 0  # the text form
    out = capsys.readouterr().out
    assert "rank skew: slowest rank 1" in out and "world_size 3" in out


def test_ranks_from_file_names_without_distributed_info(tmp_path):
    runs = run_of(world=2)
    folder = tmp_path / "run"
    for r, steps in runs.items():
        write(folder, f"rank_{r}.json", rank_trace(r, 2, steps, info=False))
    result = analyze_ranks(folder).to_dict()
    assert result["world_size"] == 2 and result["ranks_found"] == [0, 1]
    assert [row["rank_from"] for row in result["per_rank"]] == ["file name"] * 2


def test_diff_between_ranks(tmp_path, capsys):
    runs = run_of(world=2, slow=1)
    folder = tmp_path / "run"
    paths = [write(folder, f"rank{r}.json", rank_trace(r, 2, s)) for r, s in runs.items()]
    assert main(["diff", str(folder), "--json"]) == 0  # default: fastest rank (A) against slowest (B)
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == {"a": 0, "b": 1}
    a, b = analyze(paths[0]).per_step, analyze(paths[1]).per_step
    assert data["per_step"]["delta"]["step_us"] == pytest.approx(b["step_us"] - a["step_us"]) == 300
    assert main(["diff", str(folder), "--ranks", "1,0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == {"a": 1, "b": 0}
    assert main(["diff", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("rank 0 (A) vs rank 1 (B)")


def _fails(argv, capsys, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlpfuse: error:"), err
    for w in words:
        assert w in err, err
    return err


def test_bad_folders(tmp_path, capsys):
    runs = run_of(world=4)
    steps = runs[0]

    def folder(name, files):
        d = tmp_path / name
        for fname, doc in files:
            write(d, fname, doc)
        return str(d)

    (tmp_path / "empty").mkdir()
    _fails(["analyze", str(tmp_path / "empty")], capsys, "no .json or .json.gz trace files")
    gap = folder("gap", [(f"r{r}.json", rank_trace(r, 4, runs[r])) for r in (0, 1, 3)])
    _fails(["analyze", gap], capsys, "missing rank(s) 2 of world_size 4", "found 0-1, 3")
    gap_names = folder("gapn", [(f"rank{r}.json", rank_trace(r, 4, runs[r], info=False)) for r in (0, 2)])
    _fails(["analyze", gap_names], capsys, "missing rank(s) 1 of ranks 0-2")
    dup = folder("dup", [("a.json", rank_trace(0, 2, steps)), ("b.json", rank_trace(0, 2, steps)),
                         ("c.json", rank_trace(1, 2, steps))])
    _fails(["analyze", dup], capsys, "two traces of rank 0 (a.json, b.json)", "different runs")
    worlds = folder("worlds", [("a.json", rank_trace(0, 2, steps)), ("b.json", rank_trace(1, 4, steps))])
    _fails(["analyze", worlds], capsys, "traces of different runs: a.json has world_size 2, b.json has 4")
    later = folder("later", [("a.json", rank_trace(0, 2, steps)),
                             ("b.json", rank_trace(1, 2, steps, base_ns=1_700_000_000_000_000_000 + 3600 * 10**9))])
    _fails(["analyze", later], capsys, "traces of different runs: rank 1's events start 3600 s after rank 0's end")
    nameless = folder("nameless", [("a.json", rank_trace(0, 2, steps, info=False))])
    _fails(["analyze", nameless], capsys, "cannot tell its rank")
    outside = folder("outside", [("a.json", rank_trace(2, 2, steps))])
    _fails(["analyze", outside], capsys, "rank 2 is outside world_size 2")
    bad_info = rank_trace(0, 2, steps)
    bad_info["distributedInfo"]["rank"] = "zero"
    _fails(["analyze", folder("badinfo", [("a.json", bad_info)])], capsys, "distributedInfo.rank is 'zero'")
    broken = folder("broken", [("a.json", rank_trace(0, 1, steps))])
    (tmp_path / "broken" / "b.json").write_text("{ truncated")
    _fails(["analyze", broken], capsys, "b.json", "JSON")
    ok = folder("ok", [(f"r{r}.json", rank_trace(r, 2, runs[r])) for r in (0, 1)])
    _fails(["diff", ok, "--ranks", "0,5"], capsys, "--ranks: rank 5 (B) has no trace")
    _fails(["diff", ok, "--ranks", "0"], capsys, "--ranks: expected two rank numbers")
    _fails(["diff", os.path.join(ok, "r0.json")], capsys, "B: expected a second trace")
    _fails(["diff", os.path.join(ok, "r0.json"), os.path.join(ok, "r1.json"), "--ranks", "0,1"], capsys,
           "--ranks: applies when A is a folder")


def test_missing_ranks_can_be_allowed(tmp_path):
    runs = run_of(world=4)
    d = tmp_path / "gap"
    for r in (0, 3):
        write(d, f"r{r}.json", rank_trace(r, 4, runs[r]))
    result = analyze_ranks(d, allow_missing=True).to_dict()
    assert result["world_size"] == 4 and result["ranks_found"] == [0, 3] and result["merged"]["ranks"] == 2


# ---------------------------------------------------------------- the public two-rank traces


def _sweep(steps_spans, runtime, kernels):
    """Oracle for one trace, from raw events: a kernel belongs to the step holding its launch (by correlation id),
    else the step holding its start; per step, a sweep over interval boundaries measures the time covered by
    NCCL kernels, by other kernels and by both. Returns per-step averages (comm, compute, both)."""
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in runtime if "correlation" in e.get("args", {})}

    def step_of(t):
        for i, (s, d) in enumerate(steps_spans):
            if s <= t <= s + d:
                return i
        return -1

    bounds = [[] for _ in steps_spans]
    for e in kernels:
        corr = e.get("args", {}).get("correlation")
        k = step_of(launch_ts[corr]) if corr in launch_ts else step_of(e["ts"])
        if k < 0:
            continue
        kind = 0 if "nccl" in e["name"].lower() else 1
        bounds[k] += [(e["ts"], 1, kind), (e["ts"] + e["dur"], -1, kind)]
    totals = [0.0, 0.0, 0.0]
    for b in bounds:
        active, last = [0, 0], None
        for t, delta, kind in sorted(b, key=lambda x: (x[0], x[1])):
            if last is not None:
                span = t - last
                totals[0] += span if active[0] else 0
                totals[1] += span if active[1] else 0
                totals[2] += span if active[0] and active[1] else 0
            active[kind] += delta
            last = t
    return [x / len(steps_spans) for x in totals]


def test_public_two_rank_traces(tmp_path, capsys):
    _fails(["analyze", HTA], capsys, "missing rank(s) 2-127 of world_size 128 (found 0-1)")
    assert main(["analyze", HTA, "--allow-missing-ranks", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 128 and data["ranks_found"] == [0, 1]
    for row in data["per_rank"]:
        raw = json.loads(gzip.decompress(open(row["trace"], "rb").read()))
        assert raw["distributedInfo"]["rank"] == row["rank"]
        ev = [e for e in raw["traceEvents"] if e.get("ph") == "X"]
        spans = [(e["ts"], e["dur"]) for e in ev if e["name"].startswith("ProfilerStep#")]
        comm, compute, both = _sweep(sorted(spans), [e for e in ev if e.get("cat") == "cuda_runtime"],
                                     [e for e in ev if e.get("cat") == "kernel"])
        assert row["steps"] == len(spans) == 2
        assert comm > 0 and row["comm_us"] == pytest.approx(comm)
        assert row["compute_us"] == pytest.approx(compute) and row["overlapped_us"] == pytest.approx(both)
    # diff between the two ranks works on them as on any two traces
    assert main(["diff", HTA, "--allow-missing-ranks", "--ranks", "0,1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["a"].endswith("sampled_rank-0.json.gz") and d["b"].endswith("sampled_rank-1.json.gz")
    # copies of one rank in the folder are refused
    folder = tmp_path / "copies"
    folder.mkdir()
    for i, name in enumerate(("a.json.gz", "b.json.gz")):
        shutil.copy(os.path.join(HTA, "sampled_rank-0.json.gz"), folder / name)
    _fails(["analyze", str(folder), "--allow-missing-ranks"], capsys, "two traces of rank 0")


def test_mlpfuse_outputs_beside_rank_traces_are_skipped_and_listed(tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(HTA, folder)
    assert main(["analyze", str(folder / "sampled_rank-0.json.gz"), "--json"]) == 0
    (folder / "sampled_rank-0.analysis.json").write_text(capsys.readouterr().out)  # as `profile` saves one
    (folder / "summary.json").write_text("{}")
    assert main(["analyze", str(folder), "--allow-missing-ranks", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["ranks_found"] == [0, 1] and data["skipped"] == ["sampled_rank-0.analysis.json", "summary.json"]
    assert captured.err.splitlines() == ["skipped 2 files mlpfuse wrote (saved analyses and summaries, not traces): "
                                         "sampled_rank-0.analysis.json, summary.json"]
    # a trace without a rank among ranked ones is still refused, as is a folder of saved results only
    write(folder, "extra.json", rank_trace(0, 2, run_of(world=2)[0], info=False))
    _fails(["analyze", str(folder), "--allow-missing-ranks"], capsys, "extra.json: cannot tell its rank")
    only = tmp_path / "only"
    only.mkdir()
    (only / "summary.json").write_text("{}")
    _fails(["analyze", str(only)], capsys, "no .json or .json.gz trace files in it (only mlpfuse's saved results: "
           "summary.json)")
