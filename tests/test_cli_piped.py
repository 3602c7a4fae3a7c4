"""Output through a pipe (`mlpfuse ... | cat`, COLUMNS unset or small): every table row on one line, every number
and kernel name whole. Each command runs through the console script; its tables are read back cell by cell and held
against the JSON of the same command (or the results files of the same run)."""

import json
import re

import pytest

from cli_run import close, close_as_shown, number, run_cli, table, tables

TRACES = "tests/fixtures/traces"
PUBLIC = f"{TRACES}/public"


def _json(*args):
    proc = run_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _piped(*args, **env):
    proc = run_cli(*args, **env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def check_kernel_rows(t, kernels):
    assert len(t.rows) == len(kernels)  # one line per kernel: nothing folded into a false row
    for row, k in zip(t.dicts(), kernels):
        assert row["kernel"] == k["name"]  # whole: the JSON's name, not a cut or compacted one
        assert row["family"] == k["family"]
        assert close(row["/step"], k["per_step"], 3) and close(row["avg us"], k["avg_us"], 1)
        assert row["launched by"] == ", ".join(k["ops"])
        for key in ("kernel", "op", "dtype", "tile", "layout"):
            if key in k["decoded"]:
                assert f"{key}={k['decoded'][key]}" in row["decoded"].split()


def check_op_rows(t, ops, steps):
    assert len(t.rows) == len(ops)
    for row, o in zip(t.dicts(), ops):
        assert row["op"] == o["name"]
        assert close(row["/step"], o["per_step"], 3) and close(row["total us"], o["cpu_total_us"] / steps, 1)
        assert close(row["self us"], o["cpu_self_us"] / steps, 1) and close(row["kernels"], o["kernels"], 3)


@pytest.mark.parametrize("env", [{}, {"COLUMNS": "40"}, {"COLUMNS": "60", "FORCE_COLOR": "1"}],
                         ids=["no-columns", "columns-40", "force-color"])
@pytest.mark.parametrize("trace", [f"{TRACES}/geglu_eager.json.gz", f"{PUBLIC}/tracelens_mi300_bert_small.json.gz"])
def test_analyze_prints_every_kernel_whole(trace, env):
    data = _json("analyze", trace)
    # FORCE_COLOR (CI sets it) makes rich colour a pipe as it would a terminal; the rows must stay whole all the same
    out = re.sub(r"\x1b\[[0-9;]*m", "", _piped("analyze", trace, **env))
    assert any(len(k["name"]) > 70 for k in data["kernels"])  # names a terminal table would shorten
    check_kernel_rows(table(out, "GPU kernels (per step)"), data["kernels"])
    check_op_rows(table(out, "CPU ops (per step)"), data["ops"], data["steps"])
    gaps = table(out, "Largest GPU idle gaps").dicts()
    assert [(g["after"], g["before"]) for g in gaps] == [(g["after"], g["before"]) for g in data["gpu_gaps"]]
    verdict = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict == f"verdict: {data['verdict']['kind']} — {data['verdict']['reason']}"  # one line, unwrapped


def test_diff_tells_every_kernel_apart():
    a, b = f"{TRACES}/geglu_eager.json.gz", f"{TRACES}/geglu_compile.json.gz"
    data = _json("diff", a, b)
    out = _piped("diff", a, b, COLUMNS="60")
    rows = table(out, "Kernels: A -> B").dicts()
    expected = ([("removed", k["name"], k["avg_us"]) for k in data["kernels_removed"]]
                + [("added", k["name"], k["avg_us"]) for k in data["kernels_added"]]
                + [("same", k["name"], k["avg_us"]["a"]) for k in data["kernels_unchanged"]])
    assert [(r["change"], r["kernel"]) for r in rows] == [(c, n) for c, n, _ in expected]
    removed = [r["kernel"] for r in rows if r["change"] == "removed"]
    assert len(removed) == len(set(removed)) == 2  # the two elementwise kernels: two different rows
    for r, (change, _, us) in zip(rows, expected):
        assert close(r["A us" if change != "added" else "B us"], us, 1)
    per = {r[0]: r[1:] for r in table(out, "Per step").rows}
    for key, value in data["per_step"]["a"].items():
        assert close(per[key][0], value, 1 if key.endswith("_us") else 3), key
    by_op = table(out, "Kernels by the CPU op that launched them").rows
    for side, op, kernels in by_op:
        names = data["kernels_by_op"][side.lower()][op]
        assert kernels == "; ".join(f"{k} x{c}" for k, c in names.items())


def test_rank_folder_tables_are_whole():
    folder = f"{TRACES}/hta_sampled_ranks"
    data = _json("analyze", folder, "--allow-missing-ranks")
    out = _piped("analyze", folder, "--allow-missing-ranks", COLUMNS="40")
    comm = table(out, "Communication kernels").dicts()
    assert [r["kernel"] for r in comm] == [k["name"] for k in data["merged"]["communication_kernels"]]
    skew = next(line for line in out.splitlines() if line.startswith("rank skew:"))
    assert f"({data['skew']['slowest_step_us']:.1f} us/step)" in skew and skew.endswith(" us")


def test_profile_cpu_ops_are_whole(tmp_path):
    out = _piped("profile", "linear", "--device", "cpu", "--out", tmp_path, COLUMNS="30")
    [saved] = tmp_path.glob("*.analysis.json")
    data = json.loads(saved.read_text())
    check_op_rows(table(out, "CPU ops (per step)"), data["ops"], data["steps"])
    assert f"trace: {tmp_path}/" in out and f"report: {tmp_path}/report.html" in out


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    proc = run_cli("bench", "--preset", "small", "--variants", "eager,mlpfuse-torch,mlpfuse-triton,liger",
                   "--rounds", "1", "--target-ms", "1", "--no-plots", "--out", folder, COLUMNS="50",
                   XDG_CACHE_HOME=folder / "cache", MLPFUSE_CACHE_DIR=folder / "cache")
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((folder / "results.json").read_text()), folder


@pytest.mark.slow
def test_bench_table_is_whole(bench_run):
    proc, data, folder = bench_run
    [t] = tables(proc.stdout)
    rows = data["rows"]
    assert len(t.rows) == len(rows)
    assert t.title == (f"{rows[0]['case']} — {rows[0]['flops'] / 1e9:.2f} GFLOP, "
                       f"{rows[0]['min_bytes'] / 1e6:.1f} MB min traffic, {rows[0]['intensity']:.0f} FLOP/B, "
                       f"floor {rows[0]['floor_us']:.1f} µs")
    for cells, r in zip(t.dicts(), rows):
        assert cells["variant"] == r["variant"] + ("" if r["peer"] else " *")
        if r["status"] != "ok":
            assert cells["status"] == r["error"] and cells["wall µs/call"] == "–"  # e.g. "skipped: needs CUDA"
            continue
        assert cells["status"] == "ok"
        assert close(cells["wall µs/call"], r["wall_us"], 1)
        assert cells["wall µs/call"].endswith(f" ±{r['wall_spread_pct']:.1f}%")
        # whole: a full mantissa and exponent (a cut cell would lose digits or the exponent), the JSON's value
        assert re.fullmatch(r"\d\.\d+e[+-]\d+", cells["rel. err"]), cells["rel. err"]
        assert close_as_shown(cells["rel. err"], r["max_rel_error"]), (cells["rel. err"], r["max_rel_error"])
    # stderr's list of files: each path whole on the one line
    wrote = next(line for line in proc.stderr.splitlines() if line.startswith("wrote "))
    for name in ("results.json", "results.csv", "results.md", "report.html"):
        assert f"{folder / name}" in wrote.split(", ") or f"wrote {folder / name}" in wrote


@pytest.mark.slow
def test_model_lab_tables_are_whole(tmp_path):
    pytest.importorskip("transformers")
    proc = run_cli("bench", "--model", "gpt2", "--tiny", "--device", "cpu", "--variants", "eager,liger,mlpfuse",
                   "--rounds", "1", "--target-ms", "1", "--out", tmp_path, COLUMNS="40")
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    [t] = tables(proc.stdout)
    assert len(t.rows) == len(data["rows"])
    for cells, r in zip(t.dicts(), data["rows"]):
        if r["status"] != "ok":
            assert cells["status"] == r["error"]  # "skipped: liger_kernel not installed (pip install ...)" whole
            continue
        assert close(cells["time"], r["time_ms"], 3) and cells["time"].endswith(f" ±{r['spread_pct']:.1f}%")
        eager_column = next(h for h in t.header if h.startswith("vs eager"))
        assert close(cells[eager_column], r["vs_eager"], 3)
        assert number(cells["logits rel. err vs fp32"]) == pytest.approx(r["rel_err"], rel=0.01, abs=1e-12)
