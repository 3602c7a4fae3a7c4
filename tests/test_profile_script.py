"""`mlpfuse profile -- python SCRIPT.py ARGS` through the real CLI on a tiny training script, the thread pinning of
`mlpfuse.profile()`, and the busy-machine warning (fed fake load figures)."""

import gzip
import json
import os
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import mlpfuse
from cli_run import assert_one_error_line, run_cli
from mlpfuse import _host
from mlpfuse.profiling import script

STEPS = 8  # optimizer steps the script makes per epoch

TRAIN = textwrap.dedent(f"""\
    import argparse
    import torch
    from torch import nn

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.step()  # two optimizer steps per call: --step-fn counts calls, the default counts optimizer steps

    for epoch in range(args.epochs):
        for i in range({STEPS // 2}):
            train_step(torch.randn(8, 16), torch.randn(8, 4))
    print("threads", torch.get_num_threads(), "trained", __name__)
""")


@pytest.fixture
def train(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


def _profile(tmp_path, *argv):
    out = tmp_path / "out"
    proc = run_cli("profile", "--out", out, *argv, cwd=tmp_path)
    return proc, out


def _recorded(wait, warmup, active, steps):
    """Complete steps inside the profiler's window: those after wait + warmup, at most `active`."""
    return max(0, min(active, steps - wait - warmup))


def test_script_profile_writes_tables_json_trace_and_report(tmp_path, train):
    wait, warmup, active = 1, 2, 4
    proc, out = _profile(tmp_path, "--wait", wait, "--warmup", warmup, "--active", active, "--json",
                         "--", "python", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # the script's own print went to stderr: stdout is the JSON alone
    assert "trained __main__" in proc.stderr
    assert data["steps"] == _recorded(wait, warmup, active, STEPS) == 4
    assert data["step_source_kind"] == "ProfilerStep" and data["steps_found"] == 4
    assert data["script"]["steps_run"] == STEPS and data["script"]["note"] is None
    assert data["workload"] == "python train.py --epochs 1"
    ops = {o["name"] for o in data["ops"]}
    assert {"aten::addmm", "aten::mse_loss"} <= ops
    assert sorted(os.listdir(out)) == ["report.html", "train.analysis.json", "train.pt.trace.json.gz"]
    with gzip.open(out / "train.pt.trace.json.gz", "rt") as fh:
        assert "traceEvents" in json.load(fh)
    with open(out / "train.analysis.json") as fh:
        assert json.load(fh)["steps"] == 4
    assert "<html" in (out / "report.html").read_text()[:500].lower()


def test_script_without_python_word_prints_tables(tmp_path, train):
    proc, out = _profile(tmp_path, "--", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Per step (average over 3 steps" in proc.stdout and "report:" in proc.stdout
    assert "threads 1 trained" in proc.stderr  # pinned to one thread by default
    assert (out / "report.html").is_file()


def test_step_fn_counts_calls_of_the_function(tmp_path, train):
    # 4 calls of train_step, each with 2 optimizer steps: 1 waited, 1 warm-up, 2 of the 3 active steps recorded.
    proc, _ = _profile(tmp_path, "--json", "--step-fn", "train_step", "--threads", "2",
                       "--", "python", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["script"]["steps_run"] == STEPS // 2 and data["script"]["step_ends_at"] == "train_step() returned"
    assert data["steps"] == _recorded(1, 1, 3, STEPS // 2) == 2
    ops = {o["name"]: o["per_step"] for o in data["ops"]}
    assert ops["aten::mse_loss"] == 1  # one call of the function per step (by optimizer steps: one loss per two)
    assert "threads 2 trained" in proc.stderr


def test_fewer_steps_than_the_window_analyses_what_was_recorded(tmp_path, train):
    wait, warmup, active = 1, 1, 20
    proc, out = _profile(tmp_path, "--json", "--active", active, "--", "python", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["steps"] == _recorded(wait, warmup, active, STEPS) == 6
    note = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert len(note) == 1 and "6 of the 20 active steps" in note[0]
    assert data["script"]["note"] in note[0]
    with gzip.open(out / "train.pt.trace.json.gz", "rt") as fh:
        names = {e.get("name") for e in json.load(fh)["traceEvents"]}
    assert script.TAIL in names and f"ProfilerStep#{STEPS}" not in names  # the script's tail is no step


def test_a_script_that_raises_is_one_error_line(tmp_path):
    (tmp_path / "bad.py").write_text("import torch\n\n\ndef go():\n    raise RuntimeError('boom\\nmore')\n\n\ngo()\n")
    proc, _ = _profile(tmp_path, "--", "python", "bad.py")
    line = assert_one_error_line(proc)
    assert line == "mlpfuse: error: your script raised RuntimeError: boom (bad.py, line 5)"


@pytest.mark.parametrize("source,argv,words", [
    ("import sys\nsys.exit(0)\n", [], "made 0 optimizer steps"),  # SystemExit(0) is fine; no step is the error
    ("import sys\nsys.exit(3)\n", [], "exited with status 3"),
    ("x = 1\n", ["--step-fn", "train_step"], "no top-level `def train_step"),
    ("def f(:\n", [], "does not compile"),
    ("x = 1\n", ["--steps", "9"], "--steps: does not apply to a script"),
])
def test_script_mistakes_are_one_error_line(tmp_path, source, argv, words):
    (tmp_path / "s.py").write_text(source)
    proc, _ = _profile(tmp_path, *argv, "--", "python", "s.py")
    assert words in assert_one_error_line(proc)


def test_missing_script_fails_before_any_folder_is_made(tmp_path):
    proc, out = _profile(tmp_path, "--", "python", "nowhere.py")
    assert "SCRIPT nowhere.py: no such file" in assert_one_error_line(proc)
    assert not out.exists()


def test_python_dash_m_runs_a_module(tmp_path, train):
    proc, _ = _profile(tmp_path, "--json", "--", "python", "-m", "train", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["steps"] == 3 and "trained __main__" in proc.stderr


def test_in_process_run_restores_argv_path_main_and_threads(tmp_path, train, monkeypatch, capsys):
    from mlpfuse.cli import main

    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)
    before = (list(sys.argv), list(sys.path), sys.modules["__main__"])
    try:
        assert main(["profile", "--out", str(tmp_path / "o"), "--json", "--", "train.py", "--epochs", "1"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert (list(sys.argv), list(sys.path), sys.modules["__main__"]) == before
    assert "threads 1 trained" in capsys.readouterr().err
    from torch.optim.optimizer import _global_optimizer_post_hooks

    assert not _global_optimizer_post_hooks  # the step hook is gone


def _step_recording_threads(seen):
    layer, x = nn.Linear(8, 4), torch.randn(2, 8)

    def step():
        seen.append(torch.get_num_threads())
        layer(x)

    return step


@pytest.mark.parametrize("threads,inside", [(1, 1), (2, 2), (None, 3)])
def test_profile_api_pins_threads_and_restores_them(threads, inside):
    seen = []
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", _host.HostLoadWarning)  # this test machine may well be busy
            mlpfuse.profile(_step_recording_threads(seen), steps=3, wait=0, warmup=1, active=2, threads=threads)
        assert set(seen) == {inside} and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(previous)


def test_profile_api_refuses_a_bad_thread_count():
    with pytest.raises(mlpfuse.InputError, match="threads: expected an integer >= 1"):
        mlpfuse.profile(lambda: None, threads=0)


def test_busy_warning_from_given_load_figures():
    assert _host.busy(load=0.5, cores=2) is None and _host.busy(load=2.0, cores=2) is None
    message = _host.busy(load=7.25, cores=2)
    assert message.startswith("this machine is busy (load average 7.2 on 2 cores)")
    with pytest.warns(_host.HostLoadWarning, match="mlpfuse: this machine is busy"):
        _host.warn_if_busy(load=5.0, cores=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _host.warn_if_busy(load=1.0, cores=4) is None


def test_profile_api_warns_on_a_busy_machine(monkeypatch):
    monkeypatch.setattr(_host, "busy", lambda load=None, cores=None: "this machine is busy (test)")
    with pytest.warns(_host.HostLoadWarning, match="busy"):
        mlpfuse.profile(_step_recording_threads([]), steps=2, wait=0, warmup=0, active=2)


def test_a_script_s_graph_map_goes_to_the_analysis_and_a_bad_one_is_one_line(tmp_path, train):
    from mlpfuse.profiling import modules

    good = tmp_path / "step.map.json"
    good.write_text(json.dumps({"format": modules.MAP_FORMAT, "version": 2,
                                "kernels": [{"name": "k", "module": "0", "op": "aten::mm", "call": 0}]}))
    proc, _ = _profile(tmp_path, "--json", "--map", good, "--", "python", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["modules"]["map"] == str(good)
    bad = tmp_path / "bad.map.json"
    bad.write_text("{}")
    line = assert_one_error_line(run_cli("profile", "--out", tmp_path / "o2", "--map", bad, "--", "python",
                                         "train.py", "--epochs", "1", cwd=tmp_path))
    assert "not an mlpfuse graph map" in line
    line = assert_one_error_line(run_cli("profile", "linear", "--map", good, "--out", tmp_path / "w"))
    assert line == "mlpfuse: error: --map: applies to a script (mlpfuse profile -- python SCRIPT.py ARGS)"
