"""The timing loop interleaves variants round by round, and drops (and reports) one that starts failing."""

import types

import pytest
import torch

from mlpfuse.bench import timing

CPU = torch.device("cpu")


def test_rounds_interleave_variants_and_median_is_over_rounds(monkeypatch):
    # The loop reads time.perf_counter. Here each step moves a clock of the test's own by its exact cost instead of
    # spinning for it: spinning steps on a loaded machine came back late by whole scheduler slices (one 1 ms step
    # measured as slow as a 3 ms one), so their order and the repetition counts were the machine's load, not the
    # loop's. With this clock every figure the loop reports has one right value.
    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    log = []

    def make(name, seconds):
        def step():
            log.append(name)
            now[0] += seconds

        return step

    steps = {"a": make("a", 0.009), "b": make("b", 0.001), "c": make("c", 0.003)}
    gpu, wall, errors = timing.interleaved(steps, CPU, rounds=3, target_ms=18.0)
    assert errors == {} and gpu == {"a": None, "b": None, "c": None}
    # one sizing call each, then per round a block of each step, repeated to fill about target_ms: 2, 18, 6 calls
    assert log[:3] == ["a", "b", "c"]
    assert log[3:] == (["a"] * 2 + ["b"] * 18 + ["c"] * 6) * 3
    for name, us in (("a", 9000), ("b", 1000), ("c", 3000)):
        assert wall[name].median_us == pytest.approx(us) and wall[name].spread_pct == pytest.approx(0, abs=1e-6)
        assert wall[name].samples == log.count(name) - 1  # the sizing call is not a sample


def test_a_step_that_starts_failing_is_dropped():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("illegal memory access\nmore")

    steps = {"ok": lambda: None, "flaky": flaky}
    _, wall, errors = timing.interleaved(steps, CPU, rounds=3, target_ms=1.0)
    assert errors == {"flaky": "RuntimeError: illegal memory access"}
    assert "flaky" not in wall and wall["ok"].median_us >= 0


def test_stat_spread():
    s = timing.Stat.of_rounds([10.0, 12.0, 11.0], samples=30)
    assert s.median_us == 11.0 and abs(s.spread_pct - 2 / 11 * 100) < 1e-9


def test_reps_fill_the_round_within_bounds():
    assert timing.reps_for(1000.0, 20.0, 5, 200) == 20
    assert timing.reps_for(1.0, 20.0, 5, 200) == 200
    assert timing.reps_for(1e6, 20.0, 5, 200) == 5
