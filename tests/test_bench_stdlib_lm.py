"""benchmarks/stdlib_lm.py: the trained-model accuracy benchmark. Its corpus split is deterministic and disjoint, its
training windows are the next bytes of their inputs, a tiny run end to end on the CPU trains (the loss falls) and
evaluates bf16, mlpfuse bf16 and mlpfuse FP8 (the reference path) with every MLP really in FP8."""

import json
import math

import pytest
import torch

from cli_run import benchmark_script


@pytest.fixture(scope="module")
def script():
    return benchmark_script("stdlib_lm")


def test_the_split_holds_out_every_tenth_file_and_nothing_twice(script):
    files = script.corpus_files()
    assert files == sorted(files) and len(files) > 20
    assert not any("site-packages" in f for f in files)
    train, held = script.split(files)
    assert not set(train) & set(held) and sorted(train + held) == files
    assert held == files[::10]


def test_windows_hold_each_input_and_its_next_bytes(script):
    data = script.read_bytes(script.corpus_files()[:3])
    w = script.windows(data, 4, 16, torch.Generator().manual_seed(0))
    assert w.shape == (4, 17)
    starts = [next(i for i in range(data.numel() - 16) if torch.equal(data[i:i + 17].long(), row)) for row in w]
    assert all(torch.equal(data[s:s + 17].long(), row) for s, row in zip(starts, w))


def test_a_tiny_run_trains_and_evaluates_fp8_on_the_cpu(script, tmp_path):
    res = script.main([str(tmp_path), "--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "2",
                       "--seq", "32", "--batch", "8", "--steps", "40", "--lr", "3e-3", "--eval-windows", "16",
                       "--limit-bytes", "200000", "--device", "cpu"])
    losses = res["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # from ~ln 256 = 5.5 down: it learns
    rows = res["held_out_loss"]
    assert set(rows) == {"bf16", "mlpfuse bf16", "mlpfuse fp8"} and all(math.isfinite(v) for v in rows.values())
    assert "1 in fp8" in res["notes"]["mlpfuse fp8"]
    saved = json.loads((tmp_path / "stdlib_lm.json").read_text())
    assert saved["held_out_loss"] == rows


def test_widths_off_the_fp8_groups_are_refused_in_one_line(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["/tmp/unused", "--hidden", "100"])
    assert e.value.code == 2
    assert "--hidden must be a multiple of 128" in capsys.readouterr().err
