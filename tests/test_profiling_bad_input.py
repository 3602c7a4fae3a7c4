"""Every way a trace argument can be wrong ends in one line on stderr and exit code 2, through the real CLI."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from mlpfuse.cli import main

GOOD = os.path.join(os.path.dirname(__file__), "fixtures", "traces", "linear_eager.json.gz")


def write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


def cpu_only_trace():
    """A minimal Kineto-shaped CPU trace: two ProfilerStep spans, each with aten::linear -> aten::t."""
    events = []
    for s in range(2):
        t0 = 1000.0 * (s + 1)
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t0, "dur": 500},
            {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": t0 + 10, "dur": 100},
            {"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": 1, "tid": 1, "ts": t0 + 20, "dur": 10},
        ]
    return {"traceEvents": events}


def empty_folder(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir(exist_ok=True)
    return folder


def bad_cases(tmp_path):
    full = gzip.decompress(open(GOOD, "rb").read())
    return {
        "missing": (str(tmp_path / "nope.json"), "no such file"),
        "directory": (str(empty_folder(tmp_path)), "is a directory"),
        "empty": (write(tmp_path / "empty.json", b""), "empty"),
        "whitespace": (write(tmp_path / "ws.json", b"  \n"), "empty"),
        "truncated gzip": (write(tmp_path / "t.json.gz", gzip.compress(full)[:-200]), "gzip"),
        "empty gzip": (write(tmp_path / "e.json.gz", gzip.compress(b"")), "empty"),
        "truncated json": (write(tmp_path / "t.json", full[: len(full) // 2]), "truncated JSON"),
        "not json": (write(tmp_path / "n.json", b"hello, trace"), "not valid JSON"),
        "binary": (write(tmp_path / "b.json", bytes(range(256))), "JSON"),
        "json not a trace": (write(tmp_path / "o.json", b'{"a": 1}'), "traceEvents"),
        "json scalar": (write(tmp_path / "s.json", b"42"), "expected a Chrome trace"),
        "no complete events": (write(tmp_path / "m.json", json.dumps({"traceEvents": [{"ph": "M"}]}).encode()),
                               "no complete"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "whitespace", "truncated gzip", "empty gzip",
                                  "truncated json", "not json", "binary", "json not a trace", "json scalar",
                                  "no complete events"])
@pytest.mark.parametrize("command", ["analyze", "diff"])
def test_bad_trace_is_one_line_and_exit_2(tmp_path, capsys, case, command):
    path, words = bad_cases(tmp_path)[case]
    if case == "directory" and command == "analyze":
        words = "no .json or .json.gz trace files"  # a folder is read as per-rank traces of one run
    argv = ["analyze", path] if command == "analyze" else ["diff", GOOD, path]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlpfuse: error:")
    assert words in err and path in err


def test_unreadable_file(tmp_path, capsys):
    # /proc/self/mem exists and opens, but reading it from offset 0 fails: a real unreadable file, even as root.
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("needs Linux /proc")
    assert main(["analyze", "/proc/self/mem"]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_cpu_only_trace_is_analyzable_with_a_cpu_only_verdict(tmp_path, capsys):
    path = write(tmp_path / "cpu.json", json.dumps(cpu_only_trace()).encode())
    assert main(["analyze", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"]["kind"] == "cpu-only"
    assert data["steps"] == 2 and data["per_step"]["gpu_kernels"] == 0
    assert data["zero_kernel_ops"] == []  # "launched nothing" says nothing without GPU activity
    linear = next(o for o in data["ops"] if o["name"] == "aten::linear")
    assert linear["cpu_self_us"] == pytest.approx(2 * (100 - 10))


def test_bad_label_and_unknown_expectation(tmp_path, capsys):
    assert main(["analyze", GOOD, "--label", "no-such-label"]) == 2
    assert "no-such-label" in capsys.readouterr().err


def test_saved_analysis_json_round_trips_through_diff(tmp_path, capsys):
    assert main(["analyze", GOOD, "--json"]) == 0
    saved = tmp_path / "a.json"
    saved.write_text(capsys.readouterr().out)
    assert main(["diff", str(saved), GOOD, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kernels_removed"] == [] and d["kernels_added"] == [] and len(d["kernels_unchanged"]) == 2
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"schema": "mlpfuse.analysis/1", "steps": 1}))
    assert main(["diff", str(bogus), GOOD]) == 2
    assert "not an mlpfuse analysis" in capsys.readouterr().err


def test_subprocess_cli_bad_input_and_no_torch_import(tmp_path):
    bad = write(tmp_path / "bad.json.gz", b"\x1f\x8b\x08\x00garbage")
    proc = subprocess.run([sys.executable, "-m", "mlpfuse", "analyze", bad], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "gzip" in proc.stderr
    # analyze must not import torch: it runs where the trace is, fast
    code = ("import sys; from mlpfuse.cli import main; rc = main(['analyze', %r, '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)") % GOOD
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["per_step"]["gpu_kernels"] == 1
