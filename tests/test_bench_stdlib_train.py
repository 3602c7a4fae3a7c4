"""benchmarks/stdlib_train.py: the same small model trained from one seed in each variant. A tiny run on the CPU
trains every variant that runs there (torchao's needs CUDA and says so), with the FP8 one really in FP8: its MLP
gradients on the probe batch differ from bf16's by FP8's rounding (cosine ≥ 0.99, not 1), its loss falls with the
others'; the JSON and the loss-curve plot are written; a bad variant list is one argparse line."""

import json
import math

import pytest

from cli_run import benchmark_script


@pytest.fixture(scope="module")
def script():
    return benchmark_script("stdlib_train")


def test_a_tiny_run_trains_each_variant_from_the_same_start(script, tmp_path):
    res = script.main([str(tmp_path), "--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "2",
                       "--seq", "32", "--batch", "8", "--steps", "30", "--lr", "3e-3", "--eval-windows", "16",
                       "--limit-bytes", "200000", "--device", "cpu"])
    rows = res["variants"]
    assert set(rows) == set(script.VARIANTS)
    assert rows["torchao-fp8"]["note"].startswith("skipped")
    ran = {k: v for k, v in rows.items() if "losses" in v}
    assert set(ran) == {"bf16", "mlpfuse-bf16", "mlpfuse-save-fp8", "mlpfuse-fp8"}
    first = {v["losses"][0] for v in ran.values()}
    assert max(first) - min(first) < 0.05  # one initial model: the first losses agree
    for name, r in ran.items():
        assert sum(r["losses"][-5:]) / 5 < r["losses"][0] - 1.0, name  # from ~ln 256: it learns
        assert math.isfinite(r["held_out_loss"]) and r["tokens_per_s"] > 0
    cos = ran["mlpfuse-fp8"]["grad_cosine"]
    assert len(cos) == 3 and all(0.99 <= c < 0.99999 for c in cos.values()), cos  # gate, up, down: in FP8
    assert "fp8" in ran["mlpfuse-fp8"]["note"]
    assert abs(ran["mlpfuse-fp8"]["held_out_loss"] / ran["bf16"]["held_out_loss"] - 1) < 0.02
    for r in ran.values():  # each step's gradient norm before clipping, as clip_grad_norm_ returned it
        assert len(r["grad_norms"]) == 30 and all(math.isfinite(x) and x > 0 for x in r["grad_norms"])
    saved = json.loads((tmp_path / "stdlib_train.json").read_text())
    assert saved["variants"]["bf16"]["held_out_loss"] == rows["bf16"]["held_out_loss"]
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reference_variant_is_the_fp8_step_on_pytorch_ops(script, tmp_path):
    """mlpfuse-fp8-reference (named only) patches with backend="torch"; on a CPU mlpfuse-fp8 takes that path too, so
    the two train to the same losses bit for bit."""
    res = script.main([str(tmp_path), "--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "2",
                       "--seq", "32", "--batch", "4", "--steps", "6", "--eval-windows", "8", "--limit-bytes", "100000",
                       "--device", "cpu", "--variants", "bf16,mlpfuse-fp8,mlpfuse-fp8-reference"])
    rows = res["variants"]
    assert "mlpfuse-fp8-reference" not in script.VARIANTS and "fp8" in rows["mlpfuse-fp8-reference"]["note"]
    assert rows["mlpfuse-fp8-reference"]["losses"] == rows["mlpfuse-fp8"]["losses"]
    assert rows["mlpfuse-fp8-reference"]["losses"] != rows["bf16"]["losses"]


def test_a_bad_variant_list_is_one_line(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["/tmp/unused", "--variants", "bf16,fp4"])
    assert e.value.code == 2
    assert "--variants: expected names from" in capsys.readouterr().err
