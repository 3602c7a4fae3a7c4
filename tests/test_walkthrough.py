"""`mlpfuse walkthrough` end to end on CPU: every case profiled (or recorded as not run, with a reason), the
results folder complete, and the walkthrough's CPU-side facts visible in its own output files."""

import json
import os
import statistics
import subprocess
import sys
from html import escape

import pytest

from cli_run import HANG_S, assert_one_error_line, close, run_cli, table
from mlpfuse import workloads
from mlpfuse.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The walkthrough as a user runs it: the console script, its output a pipe."""
    out = tmp_path_factory.mktemp("walkthrough")
    proc = run_cli("walkthrough", "--device", "cpu", "--out", out, "--steps", "3", "--threads", "1")  # 3 rounds
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "summary.json") as fh:
        return out, json.load(fh), proc


@pytest.fixture(scope="module")
def results(run):
    return run[:2]


def test_piped_output_carries_each_case_whole(run):
    out, summary, proc = run
    # Each case's section starts with its rule line; its CPU op table holds what its saved analysis holds.
    sections = {line.split(":")[0].removeprefix("── "): i for i, line in enumerate(proc.stdout.splitlines())
                if line.startswith("── ")}
    lines = proc.stdout.splitlines()
    for case in summary["cases"]:
        start = sections[case]
        end = min([i for i in sections.values() if i > start] + [len(lines)])
        data = json.loads((out / f"{case}.analysis.json").read_text())
        ops = table("\n".join(lines[start:end]), "CPU ops (per step)").dicts()
        assert len(ops) == len(data["ops"])
        for row, o in zip(ops, data["ops"]):
            assert row["op"] == o["name"] and close(row["total us"], o["cpu_total_us"] / data["steps"], 1)
    assert "Traceback" not in proc.stderr


def test_analyze_reads_the_walkthroughs_own_folder(run):
    out, summary, _ = run
    proc = run_cli("analyze", out)
    assert proc.returncode == 0, proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 1
    for case in summary["cases"]:
        assert f"{case}.analysis.json" in skipped[0]
        assert f"{out / case}.pt.trace.json.gz  (no GPU recorded)" in proc.stdout
    assert "summary.json" in skipped[0]
    data = json.loads(run_cli("analyze", out, "--json").stdout)
    assert data["schema"] == "mlpfuse.folder/1" and "summary.json" in data["skipped"]
    by_trace = {os.path.basename(t["trace"]): t for t in data["traces"]}
    assert set(by_trace) == {f"{case}.pt.trace.json.gz" for case in summary["cases"]}
    for case, saved in summary["cases"].items():  # the same analysis the walkthrough saved
        again = by_trace[f"{case}.pt.trace.json.gz"]
        assert [o["name"] for o in again["ops"]] == [o["name"] for o in saved["ops"]]
        assert again["per_step"]["step_us"] == pytest.approx(saved["per_step"]["step_us"])
    assert "separate runs" in assert_one_error_line(run_cli("diff", out))


def test_results_folder_has_traces_analyses_and_summary(results):
    out, summary = results
    files = set(os.listdir(out))
    assert {"summary.md", "summary.json"} <= files
    for case in summary["cases"]:
        assert f"{case}.pt.trace.json.gz" in files and f"{case}.analysis.json" in files
    run = set(summary["cases"]) | set(summary["failed"])
    # a CPU has no FP8 tensor cores: the FP8 cases are not part of its walkthrough (its summary says where they run)
    assert run == {"linear-eager", "linear-compile", "geglu-mlp-eager", "geglu-mlp-compile", "linear-mlpfuse",
                   "geglu-mlp-mlpfuse"}
    for reason in summary["failed"].values():
        assert reason and "\n" not in reason
    assert "also profiles the MLP in FP8" in (out / "summary.md").read_text()


def test_cpu_walkthrough_facts(results):
    _, summary = results
    cases = summary["cases"]
    eager = {o["name"] for o in cases["linear-eager"]["ops"]}
    assert {"aten::linear", "aten::t", "aten::addmm"} <= eager
    assert all(c["verdict"]["kind"] == "cpu-only" and c["steps"] == 1 for c in cases.values())
    if "linear-compile" in cases:  # torch.compile needs a C++ compiler on CPU
        d = summary["diffs"]["linear-eager -> linear-compile"]
        assert "aten::t" in {o["name"] for o in d["ops_removed"]}
    mlp = {o["name"]: o["per_step"] for o in cases["geglu-mlp-eager"]["ops"]}
    assert mlp["aten::linear"] == 3 and mlp["aten::gelu"] == 1 and mlp["aten::mul"] == 1


def test_report_html_has_every_case(results):
    out, summary = results
    html = (out / "report.html").read_text()
    assert "could not be drawn" not in html and "No GPU in this run" in html
    for case in summary["cases"]:
        assert f"{case}.pt.trace.json.gz" in html and 'data-step="ProfilerStep#' in html
    for reason in summary["failed"].values():
        assert f"Not run: {escape(reason)}" in html
    assert html.count('class="timeline"') == len(summary["cases"])
    for title in summary["diffs"]:
        assert title.replace(">", "&gt;") in html


def test_summary_md_names_every_case(results):
    out, summary = results
    text = (out / "summary.md").read_text()
    for case in (*summary["cases"], *summary["failed"]):
        assert f"| {case} |" in text


def test_summary_md_says_what_a_cpu_run_shows_and_lists_diffs_both_ways(results):
    out, summary = results
    text = (out / "summary.md").read_text()
    assert "cannot show the kernel story" in text and "needs CUDA" in text and "pinned to 1" in text
    assert summary["threads"] == 1
    sections = text.split("\n## ")[1:]
    for section in sections:  # no heading without content
        heading, _, body = section.partition("\n")
        assert body.strip(), heading
    for title, d in summary["diffs"].items():
        body = next(s for s in sections if s.startswith(f"diff {title}\n"))
        for o in d["ops_removed"]:
            assert f"`{o['name']}`" in body.split("CPU ops gone:")[1].split("\n")[0]
        for o in d["ops_added"]:
            assert f"`{o['name']}`" in body.split("CPU ops new:")[1].split("\n")[0]
    if "linear-eager -> linear-compile" in summary["diffs"]:  # torch.compile needs a C++ compiler on CPU
        assert summary["diffs"]["linear-eager -> linear-compile"]["ops_added"]  # Dynamo's own ops are new in B


def test_threads_must_be_positive(tmp_path, capsys):
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_unavailable_variant_is_recorded_not_fatal(tmp_path, monkeypatch):
    # A real registry entry whose availability check fails the way a missing fused module would.
    broken = workloads.Variant("mlpfuse", "fused", workloads.VARIANTS["mlpfuse"].wrap,
                               lambda: (False, "mlpfuse.modules cannot be imported (ImportError: test)"))
    monkeypatch.setitem(workloads.VARIANTS, "mlpfuse", broken)
    monkeypatch.setattr("mlpfuse.commands.walkthrough.CASES", [("linear-eager", "linear", "eager"),
                                                     ("linear-mlpfuse", "linear", "mlpfuse")])
    import torch

    before = torch.get_num_threads()
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--steps", "3"]) == 0
    assert torch.get_num_threads() == before  # the pinned thread count is the run's only
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["cases"]) == ["linear-eager"]
    assert "cannot be imported" in summary["failed"]["linear-mlpfuse"]


def test_walkthrough_ends_with_a_patched_model_layer(results):
    pytest.importorskip("transformers")
    out, summary = results
    keys = [k for k in summary["diffs"] if k.endswith(": eager -> mlpfuse.patch")]
    assert keys == ["llama3-8b (tiny), 1 layer 1x64 float32: eager -> mlpfuse.patch"]
    d = summary["diffs"][keys[0]]
    assert "mlpfuse::gated_mlp" in {o["name"] for o in d["ops_added"]}  # the layer's MLP, now one op
    assert f"## diff {keys[0]}" in (out / "summary.md").read_text()
    assert {"model-eager.pt.trace.json.gz", "model-mlpfuse.pt.trace.json.gz"} <= set(os.listdir(out / "model"))


RUN_ORDER = ["linear-eager", "linear-compile", "linear-mlpfuse", "geglu-mlp-eager", "geglu-mlp-compile",
             "geglu-mlp-mlpfuse"]


def test_rounds_are_interleaved_and_every_case_ran_in_each(results):
    _, summary = results
    rounds = summary["rounds"]
    assert rounds["rounds"] == 3  # the default
    ran = [c for c in RUN_ORDER if c in summary["cases"]]
    assert sorted(tuple(x) for x in rounds["order"]) == sorted((r, c) for r in range(3) for c in ran)
    by_round = [[c for r2, c in rounds["order"] if r2 == r] for r in range(3)]
    for workload in ("linear", "geglu-mlp"):
        mine = [c for c in ran if c.startswith(workload + "-")]
        orders = []
        for order in by_round:  # each workload's variants together
            where = [i for i, c in enumerate(order) if c in mine]
            assert where == list(range(where[0], where[0] + len(mine)))
            orders.append([order[i] for i in where])
        if len(mine) == 3:
            assert sorted(o[0] for o in orders) == sorted(mine)  # each variant first once
            for variant in ("eager", "mlpfuse"):  # the compared two: a different predecessor each time
                case = f"{workload}-{variant}"
                before = [o[o.index(case) - 1] for o in orders if o.index(case) > 0]
                assert len(before) == 2 and len(set(before)) == 2, (case, orders)


@pytest.mark.parametrize("names", [["eager", "compile", "mlpfuse"], ["eager", "mlpfuse"], ["compile", "eager"]])
def test_round_order_is_carry_over_balanced(names):
    """Over 2·n rounds every variant of a workload runs right after every other one equally often, and first
    equally often."""
    from collections import Counter

    from mlpfuse.commands.walkthrough import round_order

    cases = [f"linear-{n}" for n in names]
    n = len(cases)
    follows, first = Counter(), Counter()
    for r in range(2 * n):
        order = round_order(cases, r)
        assert sorted(order) == sorted(cases)
        first[order[0]] += 1
        follows.update(zip(order, order[1:]))
    assert set(first.values()) == {2}
    assert len(follows) == n * (n - 1) and set(follows.values()) == {2}


def test_medians_and_spreads_come_from_the_recorded_samples(results):
    out, summary = results
    text = (out / "summary.md").read_text()
    table = (out / "readme-table.md").read_text()
    for case, entry in summary["rounds"]["cases"].items():
        step = entry["figures"]["step_us"]
        samples = step["samples"]
        assert len(samples) == 3 and all(v > 0 for v in samples)
        assert step["median"] == statistics.median(samples)
        assert (step["min"], step["max"]) == (min(samples), max(samples))
        # the case's tables, trace and analysis are its median round's
        assert summary["cases"][case]["per_step"]["step_us"] == samples[entry["median_round"]] == step["median"]
        saved = json.loads((out / f"{case}.analysis.json").read_text())
        assert saved["per_step"]["step_us"] == step["median"]
        cell = f"{statistics.median(samples):.1f}"
        if min(samples) != max(samples):
            cell += f" ({min(samples):.1f}–{max(samples):.1f})"
        assert f"| {case} | " in text and cell in text.split(f"| {case} | ")[1].split("\n")[0]
        row = table.split(f"| {case} | ")[1].split("\n")[0]
        assert row.startswith(cell) and row.count("n/a") == 4  # GPU busy, GPU start, kernels, launches
        # a CPU run measures no GPU figure: none recorded
        assert all(entry["figures"][k] is None for k in ("gpu_busy_us", "cpu_ahead_us", "gpu_kernels",
                                                          "launch_calls"))
    assert not (out / "rounds").exists()  # the other rounds' traces are gone; the median round's kept
    assert "Median of 3 interleaved rounds" in table and "CPU (cpu)" in table
    assert "`python3 -m mlpfuse walkthrough --device cpu --out " in table and "--steps 3`" in table


def test_verdict_sentences_follow_the_medians(results):
    out, summary = results
    steps = {c: e["figures"]["step_us"]["median"] for c, e in summary["rounds"]["cases"].items()}
    assert summary["verdicts"]  # eager and mlpfuse ran for both workloads
    for workload in ("linear", "geglu-mlp"):
        sentence = next(v for v in summary["verdicts"] if v.startswith(workload + ":"))
        mine = steps[f"{workload}-mlpfuse"]
        others = {v: steps[f"{workload}-{v}"] for v in ("eager", "compile") if f"{workload}-{v}" in steps}
        assert f"mlpfuse's step, {mine:.1f} µs (median of 3 rounds)" in sentence
        if mine < min(others.values()):
            assert "is the shortest" in sentence
        else:
            best = min(others, key=others.get)
            assert f"is not the shortest: {best}'s is {others[best]:.1f} µs" in sentence
            assert "Why: on a CPU the step is its ops' own time" in sentence
        assert sentence in (out / "summary.md").read_text()
        assert escape(sentence) in (out / "report.html").read_text()


def test_cpu_tables_show_na_and_the_timeline_no_gpu_legend(results):
    out, summary = results
    html = (out / "report.html").read_text()
    verdicts = html.split('<table class="verdicts">')[1].split("</table>")[0]
    for case in summary["cases"]:
        row = verdicts.split(f'>{case}</a>')[1].split("</tr>")[0]
        assert row.count(">n/a<") == 6, row  # kernels, launches, GPU busy, idle, busy share, in launch calls
    assert "kernel: GEMM" not in html and "another step&#x27;s GPU work" not in html  # no GPU lanes to explain
    assert "GPU busy / idle / window</td><td>n/a" in html


def _capture_with_fixture_steps(name):
    """A real GPU capture's steps as rounds: each ProfilerStep of a committed H200 trace becomes one round's
    analysis (its per-step figures are that step's own)."""
    from mlpfuse.profiling import analyze
    from mlpfuse.profiling.analysis import Analysis

    a = analyze(os.path.join(os.path.dirname(__file__), "fixtures", "traces", f"{name}.json.gz"))
    return [Analysis({**a.data, "per_step": {**a.per_step, **row}}) for row in a.data["step_table"]]


def test_a_gpu_verdict_says_which_part_of_the_step_grew():
    from mlpfuse.commands.walkthrough_rounds import Rounds, verdicts

    fast, slow = _capture_with_fixture_steps("geglu_eager"), _capture_with_fixture_steps("geglu_compile")
    rounds = Rounds({"w-eager": ("w", "eager"), "w-mlpfuse": ("w", "mlpfuse")})
    for r, (a, b) in enumerate(zip(fast, slow)):
        rounds.add(r, "w-eager", a)
        rounds.add(r, "w-mlpfuse", b)
    [sentence] = verdicts(rounds)

    def med(runs, key):
        return statistics.median(x.per_step[key] for x in runs)

    step_f, step_s = med(fast, "step_us"), med(slow, "step_us")
    assert step_s > step_f
    assert f"is not the shortest: eager's is {step_f:.1f} µs ({step_s / step_f:.2f}× its time)" in sentence
    pieces = {"GPU busy time": med(slow, "gpu_busy_us") - med(fast, "gpu_busy_us"),
              "the wait before the GPU starts": med(slow, "cpu_ahead_us") - med(fast, "cpu_ahead_us")}
    pieces["GPU idle after it starts"] = step_s - step_f - sum(pieces.values())
    main_part = max(pieces, key=pieces.get)
    assert f"of the {step_s - step_f:.1f} µs more, most is {main_part} (+{pieces[main_part]:.1f} µs)" in sentence
    assert (f"its GPU work started {med(slow, 'cpu_ahead_us'):.1f} µs after the step's CPU start, eager's "
            f"{med(fast, 'cpu_ahead_us'):.1f}") in sentence
    assert f"GPU busy {med(slow, 'gpu_busy_us'):.1f} µs against {med(fast, 'gpu_busy_us'):.1f}" in sentence

    swapped = Rounds({"w-eager": ("w", "eager"), "w-mlpfuse": ("w", "mlpfuse")})
    for r, (a, b) in enumerate(zip(fast, slow)):
        swapped.add(r, "w-eager", b)
        swapped.add(r, "w-mlpfuse", a)
    [sentence] = verdicts(swapped)
    assert f"mlpfuse's step, {step_f:.1f} µs (median of 3 rounds), is the shortest, against eager's {step_s:.1f}" \
        in sentence


def test_rounds_must_be_positive(tmp_path, capsys):
    assert main(["walkthrough", "--device", "cpu", "--out", str(tmp_path), "--rounds", "0"]) == 2
    assert "--rounds: expected an integer >= 1, got 0" in capsys.readouterr().err


SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def test_without_transformers_every_output_says_what_was_skipped_and_how_to_get_it(tmp_path):
    # transformers made unimportable in the walkthrough's own process, as where it is not installed; output piped
    code = ("import sys; sys.modules['transformers'] = None; from mlpfuse.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "w"
    proc = subprocess.run([sys.executable, "-c", code, "walkthrough", "--device", "cpu", "--out", str(out),
                           "--rounds", "1", "--steps", "3"], capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, "PYTHONPATH": SRC, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    how = "pip install 'mlpfuse[models]'"
    case = "llama3-8b layer: eager -> mlpfuse.patch"
    last = proc.stdout.strip().splitlines()
    assert any(line.startswith(f"not run: {case}") and how in line for line in last[-6:]), last[-6:]
    row = (out / "summary.md").read_text().split("| linear-eager | ")[1].split("\n")[0]
    assert row.count("| n/a ") == 4  # GPU busy, GPU start, kernels, launches
    assert f"- {case}: unavailable: transformers is not installed ({how})" in (out / "summary.md").read_text()
    html = (out / "report.html").read_text()
    assert f"Not run: {escape(case)} — unavailable: transformers is not installed ({escape(how)})" in html
    assert html.count(f"Not run: unavailable: transformers is not installed ({escape(how)})") == 1  # its section
    assert "GPU window" in proc.stdout and "n/a" in proc.stdout.split("GPU window")[1].split("\n")[0]
