"""Results are never lost: walkthrough, profile and bench refuse a folder holding an earlier run's results (unless
--force), give each default run a folder of its own, print their paths literally, refuse a path the filesystem
cannot hold before any work, and, stopped by SIGTERM like by Ctrl-C, remove their temporary traces and leave a note
in what they had written."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_run import assert_one_error_line, cli_env, run_cli
from mlpfuse import _outputs
from mlpfuse.cli import main
from mlpfuse.errors import printable
from mlpfuse.profiling.capture import TEMP_PREFIX

PROFILE = ["profile", "linear", "--device", "cpu", "--batch", "4", "--in-dim", "8", "--out-dim", "16", "--steps", "3",
           "--active", "1"]
BENCH = ["bench", "--tokens", "8", "--dim", "16", "--hidden", "32", "--workload", "geglu", "--variants", "eager",
         "--dtype", "fp32", "--device", "cpu", "--rounds", "1", "--target-ms", "1", "--no-plots"]
WALKTHROUGH = ["walkthrough", "--device", "cpu", "--rounds", "1", "--steps", "3"]
COMMANDS = {"profile": PROFILE, "bench": BENCH, "walkthrough": WALKTHROUGH}
# The file each command's finished run is known by, and the line that names its folder.
FINISHED = {"profile": "report.html", "bench": "results.json", "walkthrough": "summary.md"}
SAYS = {"profile": "report: {}/report.html", "bench": "wrote {}/results.json", "walkthrough": "results: {}/ ("}


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path, monkeypatch):
    """The peaks cache and the working folder (the default --out is relative) private to each test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MLPFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE"):  # what `mlpfuse ... | cat` sees, as in cli_env
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def small_walkthrough(monkeypatch):
    """The walkthrough with one case and no model layer: what is tested here is where it writes."""
    monkeypatch.setattr("mlpfuse.commands.walkthrough.CASES", [("linear-eager", "linear", "eager")])
    monkeypatch.setattr("mlpfuse.commands.walkthrough._model_layer", lambda *args, **kwargs: None)


def _run(command: str, *flags) -> int:
    return main([*COMMANDS[command], *map(str, flags)])


def _snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_earlier_runs_folder_is_refused_and_force_writes_over_it(command, tmp_path, capsys, small_walkthrough):
    out = tmp_path / "results"
    assert _run(command, "--out", out) == 0
    assert (out / FINISHED[command]).is_file() and not (out / _outputs.NOTE).exists()
    before = _snapshot(out)
    capsys.readouterr()

    assert _run(command, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mlpfuse: error: --out {out}: holds the results of an earlier run; give another folder, or "
                   "--force to write over them"]
    assert _snapshot(out) == before  # not a byte touched

    assert _run(command, "--out", out, "--force") == 0
    assert (out / FINISHED[command]).is_file() and not (out / _outputs.NOTE).exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_an_empty_or_unrelated_folder_is_used_as_is(command, tmp_path, small_walkthrough):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    assert _run(command, "--out", out) == 0
    assert (out / FINISHED[command]).is_file() and (out / "notes.txt").read_text() == "the user's own file"


@pytest.mark.parametrize("command", COMMANDS)
def test_two_default_runs_in_the_same_second_get_folders_of_their_own(command, tmp_path, monkeypatch,
                                                                     small_walkthrough):
    monkeypatch.setattr(_outputs, "_stamp", lambda: "20261128-120000")  # one second, frozen
    assert _run(command) == 0
    assert _run(command) == 0
    [kind] = (tmp_path / "mlpfuse-results").iterdir()
    assert sorted(p.name for p in kind.iterdir()) == ["20261128-120000", "20261128-120000-2"]
    for run in kind.iterdir():
        assert (run / FINISHED[command]).is_file() and not (run / _outputs.NOTE).exists()


def test_default_folders_are_made_exclusively(tmp_path, monkeypatch):
    monkeypatch.setattr(_outputs, "_stamp", lambda: "20261128-120000")
    made = [_outputs.prepare(None, default="runs") for _ in range(5)]
    assert made == [os.path.join("runs", "20261128-120000" + suffix) for suffix in ("", "-2", "-3", "-4", "-5")]
    assert all(os.listdir(folder) == [] for folder in made)  # outside the CLI: no note either


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("path", ["x[/]", "[bold]red\x1b[31m:smile:"], ids=["x[/]", "bold-esc"])
def test_paths_print_literally(command, path, tmp_path, capsys, small_walkthrough):
    assert _run(command, "--out", path) == 0
    assert (tmp_path / path / FINISHED[command]).is_file()
    printed = capsys.readouterr()
    shown = printable(path)
    assert SAYS[command].format(shown) in printed.out + printed.err
    assert "\x1b" not in printed.out + printed.err  # the escape character shows as \x1b, never reaches a terminal


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_too_long_fails_before_any_work_with_one_line(command, tmp_path):
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    long = "/".join(["d" * 200] * (path_max // 201 + 1))  # relative, every name legal, the whole too long
    proc = run_cli(*COMMANDS[command], "--out", long, cwd=tmp_path, timeout=300)
    line = assert_one_error_line(proc)
    assert line.startswith("mlpfuse: error: --out ddd") and "bytes long" in line and len(line) < 400
    assert "profiling" not in proc.stderr and "round 1" not in proc.stdout
    assert not (tmp_path / ("d" * 200)).exists() and not (tmp_path / "cache").exists()  # nothing made, nothing measured

    too_long_name = "n" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1)
    line = assert_one_error_line(run_cli(*COMMANDS[command], "--out", too_long_name, cwd=tmp_path, timeout=300))
    assert "a name in it is" in line and "bytes long" in line


# The child blocks inside its first profiled step, with everything it keeps open at that point (a temporary trace
# folder for bench, a partial --out) in place, and says so with a file: the test signals it only then.
_BLOCKED_CHILD = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell may start the tests with Ctrl-C ignored
import mlpfuse.profiling.capture as capture
real = capture.capture

def blocked(fn, *args, **kwargs):
    def step(*a, **k):
        with open(os.environ["STARTED"], "w") as fh:
            fh.write("in a profiled step")
        while True:
            time.sleep(0.05)  # until the test's signal arrives
    return real(step, *args, **kwargs)

capture.capture = blocked
from mlpfuse.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command, sig, code", [
    ("bench", signal.SIGTERM, 143), ("bench", signal.SIGINT, 130), ("profile", signal.SIGTERM, 143),
    ("walkthrough", signal.SIGTERM, 143),
])
def test_a_stopped_run_leaves_no_temporary_traces_and_says_its_output_is_partial(command, sig, code, tmp_path):
    temp, out, started = tmp_path / "tmp", tmp_path / "out", tmp_path / "started"
    temp.mkdir()
    args = COMMANDS[command] + (["--threads", "1"] if command == "walkthrough" else [])
    env = cli_env(TMPDIR=temp, STARTED=started, XDG_CACHE_HOME=tmp_path / "cache")
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_CHILD, *args, "--out", str(out)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), proc.communicate(timeout=60)
        if command == "bench":  # the kernel count profiles into a temporary folder: it is there now
            assert [p for p in temp.iterdir() if p.name.startswith(TEMP_PREFIX)]
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == ("mlpfuse: terminated" if code == 143 else "mlpfuse: interrupted")
    assert [p.name for p in temp.iterdir() if p.name.startswith(TEMP_PREFIX)] == []
    note = (out / _outputs.NOTE).read_text()
    why = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert note.startswith(f"`mlpfuse {command}` was {why} before it finished"), note
    assert not (out / FINISHED[command]).exists()


def test_the_note_goes_once_the_folder_is_written_again(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / _outputs.NOTE).write_text("`mlpfuse profile` was stopped by SIGTERM before it finished")
    assert main([*PROFILE, "--out", str(out), "--json"]) == 0  # a note alone is no earlier run's results
    assert not (out / _outputs.NOTE).exists()
    assert json.loads(capsys.readouterr().out)["steps"] == 1
