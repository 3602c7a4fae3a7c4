"""Roofline arithmetic against hand counts, torch's own FLOP counter, and the floors DESIGN.md lists for the H200;
the peaks cache against real poisoned files."""

import json
import math
import os
import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cli_run import HANG_S

from mlpfuse.bench import roofline
from mlpfuse.bench.presets import Case
from mlpfuse.bench.variants import eager_module, make_problem


def test_gated_counts_by_hand():
    m, d, h = 8192, 768, 3072
    case = Case("geglu", "gelu_tanh", m, d, h, "bf16", "fwd")
    # three GEMMs (gate, up: M×D·D×H; down: M×H·H×D), 2 FLOPs per multiply-add
    assert roofline.flops(case) == 3 * (2 * m * d * h)
    # x read once, three D×H weights read once, y written once; 2 bytes each
    assert roofline.min_bytes(case) == 2 * (m * d + 3 * d * h + m * d)
    train = Case("geglu", "gelu_tanh", m, d, h, "bf16", "fwd+bwd")
    assert roofline.flops(train) == 3 * roofline.flops(case)
    # + dy read, dx and three dW written
    assert roofline.min_bytes(train) == 2 * (4 * m * d + 6 * d * h)


def test_mlp_and_linear_counts_by_hand():
    m, d, h = 64, 96, 160
    mlp = Case("mlp", "gelu", m, d, h, "fp32", "fwd")
    assert roofline.flops(mlp) == 2 * (2 * m * d * h)
    assert roofline.min_bytes(mlp) == 4 * (m * d + d * h + h + h * d + d + m * d)
    lin = Case("linear", "relu", m, d, h, "fp16", "fwd+bwd")
    assert roofline.flops(lin) == 3 * 2 * m * d * h
    fwd = m * d + h * d + h + m * h
    assert roofline.min_bytes(lin) == 2 * (fwd + m * h + m * d + h * d + h)
    assert roofline.intensity(lin) == roofline.flops(lin) / roofline.min_bytes(lin)


@pytest.mark.parametrize("workload", ["geglu", "mlp", "linear"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_flops_match_torch_flop_counter(workload, mode):
    """torch's FlopCounterMode counts the GEMMs the eager module really runs (including dX/dW in backward)."""
    case = Case(workload, "gelu_tanh", 24, 40, 56, "fp32", mode)
    problem = make_problem(case, torch.device("cpu"))
    module = eager_module(problem)
    with FlopCounterMode(display=False) as counter:
        y = module(problem.x)
        if mode == "fwd+bwd":
            y.backward(problem.dy)  # dX and dW of every GEMM, as autograd.grad in the bench computes them
    assert roofline.flops(case) == counter.get_total_flops()


def test_floors_of_design_table():
    """DESIGN.md's H200 table: floors of 171, 83, 3.4 and 512 µs at 680 TFLOP/s and 4.25 TB/s."""
    peaks = roofline.Peaks("H200", {"bf16": 680.0}, 4250.0)
    blog = Case("geglu", "gelu_tanh", 8192, 768, 3072, "bf16", "fwd")
    assert peaks.floor_us(blog) == pytest.approx(171, abs=0.5)
    assert peaks.compute_us(blog) > peaks.memory_us(blog)  # compute-bound
    decode = Case("geglu", "gelu_tanh", 16, 4096, 14336, "bf16", "fwd")
    assert peaks.floor_us(decode) == pytest.approx(83, abs=0.5)
    assert peaks.memory_us(decode) > peaks.compute_us(decode)  # weight-bandwidth-bound
    small = Case("geglu", "gelu_tanh", 64, 768, 3072, "bf16", "fwd")
    assert peaks.floor_us(small) == pytest.approx(3.4, abs=0.05)
    train = Case("geglu", "gelu_tanh", 8192, 768, 3072, "bf16", "fwd+bwd")
    assert peaks.floor_us(train) == pytest.approx(512, abs=1)


def test_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.delenv(roofline.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = torch.device("cpu")
    peaks = roofline.load_peaks(cpu, ["fp32"])
    path = roofline.cache_path(cpu)
    assert path.parent == tmp_path / "mlpfuse" and path.exists()
    assert peaks.gemm_tflops["fp32"] > 0 and peaks.copy_gbps > 0
    # A planted value proves the second call reads the cache instead of measuring again...
    data = json.loads(path.read_text())
    data["copy_gbps"] = 12345.0
    path.write_text(json.dumps(data))
    assert roofline.load_peaks(cpu, ["fp32"]).copy_gbps == 12345.0
    # ...a dtype not in the cache is measured and added, the others kept...
    data["gemm_tflops"] = {"bf16": 777.0}
    path.write_text(json.dumps(data))
    more = roofline.load_peaks(cpu, ["fp32"])
    assert more.copy_gbps == 12345.0 and more.gemm_tflops["bf16"] == 777.0 and more.gemm_tflops["fp32"] > 0
    assert set(json.loads(path.read_text())["gemm_tflops"]) == {"bf16", "fp32"}
    # ...and remeasure replaces everything.
    assert roofline.load_peaks(cpu, ["fp32"], remeasure=True).copy_gbps != 12345.0


# ---- the peaks cache is untrusted: every poisoned file is ignored with one note, measured again, and replaced ----

CPU = torch.device("cpu")


def _valid() -> dict:
    return {"device": roofline.device_name(CPU), "gemm_tflops": {"fp32": 1.5}, "copy_gbps": 20.0,
            "how": {"copy": "by hand"}}


def _with(**changes) -> str:
    data = _valid()
    data.update(changes)
    return json.dumps(data)  # allow_nan: NaN and Infinity are written as the bare tokens Python's json reads back


def _gemm(value) -> str:
    return _with(gemm_tflops={"fp32": value})


POISONED = {
    "zero gemm": _gemm(0),
    "zero copy": _with(copy_gbps=0),
    "negative gemm": _gemm(-3.0),
    "negative copy": _with(copy_gbps=-20.0),
    "NaN gemm": _gemm(float("nan")),
    "NaN copy": _with(copy_gbps=float("nan")),
    "Infinity copy": _with(copy_gbps=float("inf")),
    "overflowing number": _with(copy_gbps=1).replace('"copy_gbps": 1', '"copy_gbps": 1e400'),
    "implausible gemm": _gemm(5e9),
    "string gemm": _gemm("1.5"),
    "string copy": _with(copy_gbps="fast"),
    "null copy": _with(copy_gbps=None),
    "true copy": _with(copy_gbps=True),
    "gemm a list": _with(gemm_tflops=[1.5]),
    "gemm null": _with(gemm_tflops=None),
    "how not strings": _with(how={"copy": 3}),
    "missing copy": json.dumps({k: v for k, v in _valid().items() if k != "copy_gbps"}),
    "another device": _with(device="NVIDIA H200"),
    "top-level list": "[1, 2, 3]",
    "top-level null": "null",
    "truncated": json.dumps(_valid())[:40],
    "empty": "",
    "not UTF-8": b"\xff\xfe{\x00",
    "nested 100000 deep": "[" * 100000 + "]" * 100000,
    "larger than a peaks file": _with(how={"copy": "x" * 100_000}),
}


def _load(log: list) -> roofline.Peaks:
    return roofline.load_peaks(CPU, ["fp32"], log=log.append)


def _assert_sane(peaks: roofline.Peaks) -> None:
    rates = [*peaks.gemm_tflops.values(), peaks.copy_gbps]
    assert all(isinstance(v, float) and math.isfinite(v) and 0 < v < 1e5 for v in rates), rates
    assert "fp32" in peaks.gemm_tflops


def _ignored(log: list, path) -> list[str]:
    return [m for m in log if m.startswith(f"ignoring the peaks cache {path}: ")]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "c"))
    path = roofline.cache_path(CPU)
    path.parent.mkdir()
    return path


def test_cache_dir_env_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(roofline.CACHE_ENV, str(tmp_path / "own"))
    assert roofline.cache_path(CPU).parent == tmp_path / "own"
    monkeypatch.delenv(roofline.CACHE_ENV)
    assert roofline.cache_path(CPU).parent == tmp_path / "xdg" / "mlpfuse"


def test_a_valid_cache_is_used_as_is(cache):
    cache.write_text(json.dumps(_valid()))
    log = []
    peaks = _load(log)
    assert log == [] and peaks.gemm_tflops == {"fp32": 1.5} and peaks.copy_gbps == 20.0


@pytest.mark.parametrize("name", list(POISONED))
def test_a_poisoned_cache_is_remeasured_and_replaced(cache, name):
    content = POISONED[name]
    cache.write_bytes(content if isinstance(content, bytes) else content.encode())
    log = []
    peaks = _load(log)
    _assert_sane(peaks)
    notes = _ignored(log, cache)
    assert len(notes) == 1 and "\n" not in notes[0], log
    # Replaced by a valid file: the next run reads it without a note and without measuring.
    again = []
    assert _load(again).to_dict() == peaks.to_dict() and again == []
    assert json.loads(cache.read_text())["copy_gbps"] == peaks.copy_gbps


def test_a_folder_in_place_of_the_cache(cache):
    cache.mkdir()
    (cache / "keep.txt").write_text("someone's")
    log = []
    _assert_sane(_load(log))
    assert len(_ignored(log, cache)) == 1
    assert any(m.startswith(f"cannot cache the peaks in {cache}") for m in log)
    assert (cache / "keep.txt").read_text() == "someone's"  # nothing of the user's is deleted
    assert not [p for p in cache.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_cache_does_not_block(cache):
    os.mkfifo(cache)
    log, done = [], []
    worker = threading.Thread(target=lambda: done.append(_load(log)), daemon=True)
    worker.start()
    worker.join(timeout=HANG_S)
    assert done, "load_peaks blocked on a FIFO"
    _assert_sane(done[0])
    assert len(_ignored(log, cache)) == 1 and cache.is_file()


def test_symlinks_gone_wrong(cache):
    cache.symlink_to(cache.parent / "nowhere.json")  # dangling
    log = []
    _assert_sane(_load(log))
    assert len(_ignored(log, cache)) == 1
    loop = cache.parent / "loop.json"
    os.unlink(cache)
    cache.symlink_to(loop)
    loop.symlink_to(cache)
    log = []
    _assert_sane(_load(log))
    assert len(_ignored(log, cache)) == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_cache(cache):
    cache.write_text(json.dumps(_valid()))
    cache.chmod(0)
    log = []
    _assert_sane(_load(log))
    assert len(_ignored(log, cache)) == 1


def test_without_a_log_the_note_is_one_stderr_line(cache, capsys):
    cache.write_text(_with(copy_gbps=-1))
    _assert_sane(roofline.load_peaks(CPU, ["fp32"]))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"mlpfuse: ignoring the peaks cache {cache}: copy_gbps = -1.0")


def test_bench_after_a_poisoned_cache_runs_and_repairs_it(cache, tmp_path, capsys):
    from mlpfuse.cli import main

    cache.write_text(_gemm(0))  # a zero TFLOP/s peak used to divide by zero in every later run
    flags = ["bench", "--tokens", "8", "--dim", "16", "--hidden", "32", "--rounds", "1", "--target-ms", "1",
             "--variants", "eager", "--no-plots", "--no-profile", "--device", "cpu", "--out", str(tmp_path / "o")]
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert f"ignoring the peaks cache {cache}: gemm_tflops['fp32'] = 0.0" in err
    assert json.loads(cache.read_text())["gemm_tflops"]["fp32"] > 0
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["rows"]
    assert rows[0]["status"] == "ok" and rows[0]["floor_us"] > 0
