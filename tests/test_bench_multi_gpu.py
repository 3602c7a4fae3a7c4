"""benchmarks/multi_gpu.py: its argument checks (one line, exit 2) and a smoke run on 2 CPU processes with gloo.

The GPU run itself (NCCL, nvidia-h200-x2) is `PYTHONPATH=src python3 benchmarks/multi_gpu.py --gpus 2 --out DIR`;
here only what a CPU can check: that the script imports, refuses bad arguments, keeps NVLink multicast off in its
workers, and that its whole pipeline (baseline, plans, checks, interleaved timing, per-rank traces read back by
the profiler, table) runs.
"""

import json
import os
import statistics
import subprocess
import sys

import pytest

import _dist
from cli_run import HANG_S, benchmark_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "multi_gpu.py")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def script():
    return benchmark_script("multi_gpu")


def test_importing_it_turns_multicast_off(script):
    assert script.NO_MULTICAST == NO_MULTICAST
    assert all(os.environ[k] == v for k, v in NO_MULTICAST.items())


@pytest.mark.parametrize("argv,words", [
    (["--mode", "backward"], "--mode: expected some of fwd, fwd+bwd"),
    (["--tokens", "8192,x"], "--tokens: expected comma-separated integers"),
    (["--tokens", "0"], "--tokens: expected integers >= 1"),
    (["--variants", "liger"], "--variants: expected some of eager, mlpfuse"),
    (["--activation", "tanh"], "--activation: expected one of"),
    (["--gpus", "0"], "--gpus: expected an integer >= 1"),
    (["--rounds", "0"], "--rounds: expected an integer >= 1"),
    (["--cpu-gloo", "--hidden", "63"], "--hidden: 63 is not divisible by 2 GPUs"),
    (["--cpu-gloo", "--gpus", "3"], "--hidden: 64 is not divisible by 3 GPUs"),
    (["--cpu-gloo", "--sequence-parallel", "--tokens", "63"], "--tokens: with --sequence-parallel"),
    (["--cpu-gloo", "--dtype", "bf16"], "--dtype: --cpu-gloo runs in fp32"),
    (["--dim", "x"], "argument --dim: invalid int value"),
])
def test_bad_arguments_are_one_line(script, capsys, argv, words):
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("multi_gpu.py: error:") and words in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without GPUs")
def test_without_gpus_it_points_to_the_smoke_run(script, capsys):
    assert script.main([]) == 2
    assert "--cpu-gloo runs a smoke test" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not _dist.AVAILABLE, reason=_dist.WHY_NOT)
def test_cpu_gloo_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    for k in NO_MULTICAST:
        env.pop(k, None)  # the script must set them itself
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-gloo", "--rounds", "2", "--reps", "1", "--sequence-parallel",
                           "--variants", "eager,mlpfuse,mlpfuse-ce", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    data = json.loads((out / "results.json").read_text())
    assert data["info"]["environment"] == NO_MULTICAST  # as a worker saw its environment
    rows = data["rows"]
    assert {(r["mode"], r["variant"], r["gpus"]) for r in rows} == {
        (m, v, g) for m in ("fwd", "fwd+bwd") for v in ("eager", "mlpfuse", "mlpfuse-ce") for g in (1, 2)}
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["step_ms"] / 1e3))
        assert len(r["rounds_ms"]) == 2 and r["step_ms"] == pytest.approx(statistics.median(r["rounds_ms"]))
        # on a CPU every clock is the one perf_counter figure; no peak without CUDA's allocator
        assert r["wall_ms"] == pytest.approx(r["step_ms"]) and r["host_ms"] == pytest.approx(r["step_ms"])
        assert r["peak_mb"] is None
        assert (r["vs_eager_wall"] is None) == (r["variant"] == "eager")
        if r["gpus"] == 2:
            assert r["rel_error"] <= 5e-3
            assert r["efficiency"] == pytest.approx(r["speedup"] / 2)
            assert os.path.isdir(r["traces"]) and sorted(os.listdir(r["traces"])) == ["rank0.json.gz",
                                                                                     "rank1.json.gz"]
    # the table is the last thing printed: a header, a rule and one line per row
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| case | variant | GPUs |") and len(table) == 2 + len(rows)
    assert lines[-1] == table[-1]
