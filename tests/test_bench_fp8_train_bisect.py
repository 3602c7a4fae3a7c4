"""benchmarks/fp8_train_bisect.py: the FP8 training step split between the kernels and the reference path, and the
recipe with one part in full precision. On a CPU the kernels' backend is the reference path, so a tiny run checks the
harness itself: `abl-none` (the recipe written out in the script) trains bit for bit as the reference path does, each
ablation changes the step, `abl-all` (nothing quantized) trains as the unquantized model does up to fp32 rounding,
and the comparison rows are there for the steps named, with nothing to tell apart."""

import math

import pytest
import torch

from cli_run import benchmark_script

TINY = ["--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "2", "--seq", "32", "--batch", "4",
        "--steps", "6", "--eval-windows", "8", "--limit-bytes", "100000", "--device", "cpu"]


@pytest.fixture(scope="module")
def script():
    return benchmark_script("fp8_train_bisect")


def test_the_ablation_harness_is_the_recipe_and_each_part_moves_it(script, tmp_path):
    res = script.main([str(tmp_path), *TINY, "--compare-steps", "",
                       "--splits", "bf16,reference,abl-none,abl-w,abl-dgrad,abl-all"])
    runs = {n: v["losses"] for n, v in res["variants"].items()}
    assert runs["abl-none"] == runs["reference"]  # the script's formulas are the reference path's, bit for bit
    assert runs["reference"] != runs["bf16"]  # FP8 really ran
    for part in ("abl-w", "abl-dgrad"):
        assert runs[part] != runs["abl-none"], part
    # nothing quantized: the model's own fp32 MLP, gradients by hand instead of autograd (fp32 rounding apart)
    assert max(abs(a - b) for a, b in zip(runs["abl-all"], runs["bf16"])) < 1e-3
    assert all(math.isfinite(v["held_out_loss"]) for v in res["variants"].values())


def test_the_harness_groupings_are_the_recipes_where_they_meet(script):
    """_round_trip with amax scales in 128-groups (rows, tokens) and whole columns is the recipe's own round trip bit
    for bit; with power-of-two scales the values keep e4m3's significant bits, and the error stays e4m3's."""
    from mlpfuse import reference as R

    t = torch.randn(300, 520, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(script._round_trip(t, -1, 128, False), R._round_trip_rows(t))
    assert torch.equal(script._round_trip(t, 0, 128, False), R._round_trip_tokens(t))
    assert torch.equal(script._round_trip(t, 0, None, False), R._round_trip_channels(t))
    p = script._round_trip(t, -1, 128, True)
    # an e4m3 value times a power of two keeps e4m3's four significant bits; times amax/448 it does not
    assert torch.equal(torch.frexp(p).mantissa * 16, (torch.frexp(p).mantissa * 16).round())
    amax_scaled = torch.frexp(R._round_trip_rows(t)).mantissa * 16
    assert not torch.equal(amax_scaled, amax_scaled.round())
    assert ((p - t).norm() / t.norm()) < 0.04


def test_the_rowwise_and_pow2_recipes_train(script, tmp_path):
    res = script.main([str(tmp_path), *TINY, "--compare-steps", "", "--splits", "abl-none,pow2,rowwise-all"])
    runs = {n: v["losses"] for n, v in res["variants"].items()}
    assert runs["pow2"] != runs["abl-none"] and runs["rowwise-all"] != runs["abl-none"]
    assert all(r[-1] < r[0] for r in runs.values())


def test_the_comparison_rows_cover_every_mlp_at_the_steps_named(script, tmp_path):
    res = script.main([str(tmp_path), *TINY, "--compare-steps", "0,3", "--splits", "kernels"])
    rows = res["variants"]["kernels"]["comparison"]
    assert sorted({(r["step"], r["pass"]) for r in rows}) == [(0, "backward"), (0, "forward"), (3, "backward"),
                                                               (3, "forward")]
    for r in rows:  # one layer: one forward and one backward a step; on a CPU both sides are the reference path
        if r["pass"] == "forward":
            assert r["y"] == 0 and r["g_code_mismatch"] == 0 and r["g_scale_ratio_max"] == 1
        else:
            assert r["dx"] == 0 and r["dwd"] == 0 and r["dwd_ref_norm"] > 0


def test_several_seeds_repeat_every_split_from_its_own_start(script, tmp_path, capsys):
    res = script.main([str(tmp_path), *TINY, "--compare-steps", "", "--splits", "bf16,abl-none", "--seeds", "0,1"])
    for name in ("bf16", "abl-none"):
        runs = res["repeats"][name]
        assert [r["seed"] for r in runs] == [0, 1] and runs[0]["losses"] != runs[1]["losses"]
    assert res["variants"]["abl-none"]["losses"] == res["repeats"]["abl-none"][0]["losses"]
    # --stop-after: the first steps of the same schedule, the same numbers as the whole run's first steps
    short = script.main([str(tmp_path / "short"), *TINY, "--compare-steps", "", "--splits", "abl-none",
                         "--stop-after", "3"])
    assert short["variants"]["abl-none"]["losses"] == res["repeats"]["abl-none"][0]["losses"][:3]
    out = capsys.readouterr().out
    assert "seeds 0, 1: mean, min–max" in out and "abl-none" in out


def test_an_unknown_split_is_one_line(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["/tmp/unused", "--splits", "bf16,fp4"])
    assert e.value.code == 2
    assert "--splits: expected names from" in capsys.readouterr().err
