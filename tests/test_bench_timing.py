"""The timing loop interleaves variants round by round, and drops (and reports) one that starts failing."""

import itertools
import time

import torch

from mlpfuse.bench import timing

CPU = torch.device("cpu")


def test_rounds_interleave_variants_and_median_is_over_rounds():
    log = []

    def make(name, seconds):
        def step():
            log.append(name)
            # Busy-wait rather than sleep: on a 2-core machine whose cores are held by the previous tests' spinning
            # thread pools, a sleeping step woke up to 5 ms late and the ordering below came out wrong.
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        return step

    # Durations 3x apart: a busy core preempts a spinning step for a millisecond or more now and then (seen on a
    # loaded 2-core CI machine with 2 / 1 / 0.5 ms steps), which must not reorder the medians.
    steps = {"a": make("a", 0.009), "b": make("b", 0.001), "c": make("c", 0.003)}
    gpu, wall, errors = timing.interleaved(steps, CPU, rounds=3, target_ms=18.0)
    assert errors == {} and gpu == {"a": None, "b": None, "c": None}
    # after one sizing call each, the order is blocks of a, b, c repeated once per round
    blocks = [name for name, _ in itertools.groupby(log[3:])]
    assert blocks == ["a", "b", "c"] * 3
    assert wall["a"].median_us > wall["c"].median_us > wall["b"].median_us
    assert 9000 <= wall["a"].median_us < 90000  # a 9 ms step is at least 9 ms per call
    # each round repeats a step until about target_ms is spent: the quick step runs more often than the slow one
    assert log.count("b") > log.count("a") and wall["a"].samples == log.count("a") - 1


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
