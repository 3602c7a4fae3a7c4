"""What a new user meets first, through the console script with its output piped: `--version`, a bare `mlpfuse`,
the model lab's examples on a CPU machine (a small config by default, a size that cannot fit refused before anything
is allocated, with the estimate), and no warning from transformers about arguments mlpfuse passes."""

import json
import re

import pytest

from cli_run import assert_one_error_line, run_cli

GB = 1 << 30


def test_version_prints_and_exits_0():
    from mlpfuse import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"mlpfuse {__version__}" and not proc.stderr


def test_bare_mlpfuse_lists_the_commands():
    proc = run_cli()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for command in ("walkthrough", "analyze", "diff", "profile", "bench"):
        assert re.search(rf"^\s+{command}\s", proc.stderr, re.M), command
    assert "arguments are required" not in proc.stderr


@pytest.mark.slow
def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tmp_path):
    pytest.importorskip("transformers")
    # 6 GB of address space: building even one fp32 layer of the published widths beside the embeddings would fail
    # there with the allocator's traceback, so a clean refusal shows that nothing was allocated first.
    for args in (["bench", "--model", "llama3-8b", "--layers", "32", "--tokens", "1x8192"],
                 ["bench", "--model", "llama3-8b", "--layers", "4", "--mode", "decode,train", "--tokens", "2x2048"],
                 ["profile", "--model", "llama3-8b", "--no-tiny", "--layers", "32"]):
        proc = run_cli(*args, "--device", "cpu", "--out", tmp_path / "o", memory_cap=6 * GB)
        line = assert_one_error_line(proc)
        assert line.startswith("mlpfuse: error: --model llama3-8b: needs about "), line
        need, have = (float(x) for x in re.search(r"needs about ([\d.]+) GB.* but ([\d.]+) GB are free", line).groups())
        assert need > have and have < 6.5
    # Llama-3-8B's published size: 8.03 B parameters at 32 layers
    assert "(8.03 B parameters" in assert_one_error_line(
        run_cli("bench", "--model", "llama3-8b", "--layers", "32", "--device", "cpu", "--out", tmp_path / "o",
                memory_cap=6 * GB))
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.slow
def test_on_a_cpu_the_model_lab_defaults_to_a_small_config_and_says_so(tmp_path):
    pytest.importorskip("transformers")
    proc = run_cli("bench", "--model", "llama3-8b", "--device", "cpu", "--variants", "eager,mlpfuse", "--mode",
                   "prefill,decode", "--rounds", "1", "--target-ms", "1", "--new-tokens", "2", "--out", tmp_path,
                   "--json", memory_cap=8 * GB, PYTHONWARNINGS="error::FutureWarning")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert notes == ["note: on CPU the model lab runs llama3-8b at toy widths (as --tiny); give --layers N for its "
                     "published widths"]
    data = json.loads(proc.stdout)
    assert data["meta"]["lab"]["model"] == "llama3-8b (tiny)" and data["meta"]["notes"] == [notes[0][6:]]
    assert {(r["mode"], r["status"]) for r in data["rows"]} == {("prefill", "ok"), ("decode", "ok")}
    # generate got the static-cache keyword transformers wants: no FutureWarning (it would fail the run above)
    assert "FutureWarning" not in proc.stderr and "past_key_values" not in proc.stderr
    md = (tmp_path / "results.md").read_text()
    assert "Note: on CPU the model lab runs llama3-8b at toy widths" in md
    assert "Times are wall time (a CPU run)" in md and "CUDA events" not in md and "CUDA none" in md


@pytest.mark.slow
def test_published_widths_on_a_cpu_run_when_they_fit(tmp_path):
    pytest.importorskip("transformers")
    proc = run_cli("bench", "--model", "gpt2", "--layers", "1", "--tokens", "1x32", "--device", "cpu", "--variants",
                   "eager", "--rounds", "1", "--target-ms", "1", "--out", tmp_path, memory_cap=8 * GB)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "toy widths" not in proc.stderr
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["lab"]["model"] == "gpt2, 1 layer"
