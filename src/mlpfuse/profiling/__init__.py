"""Profiler: capture -> trace -> analyses -> renderers.

`analyze` and `diff` read any Chrome/Kineto trace without importing torch; `profile` (capture) imports torch
only when called.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from mlpfuse.profiling.analysis import Analysis, analyze
from mlpfuse.profiling.diff import Diff, diff
from mlpfuse.profiling.expect import Result as ExpectationResult

__all__ = ["profile", "analyze", "diff", "Analysis", "Diff", "ExpectationResult"]


def profile(
    fn: Callable[..., Any],
    *args: Any,
    steps: int = 5,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    label: str = "step",
    record_shapes: bool = True,
    with_stack: bool = False,
    trace_path: str | None = None,
    expect: Iterable[str] | None = None,
    **kwargs: Any,
) -> Analysis:
    """Run `fn(*args, **kwargs)` under torch.profiler and return the analysis of the trace it wrote.

    With `expect`, the expectations are parsed before anything runs (a typo fails fast) and their results are
    stored on the analysis as `analysis.expectations` (list of ExpectationResult).
    """
    from mlpfuse.profiling import expect as expect_mod
    from mlpfuse.profiling.capture import capture

    expectations = list(expect or [])
    for e in expectations:
        expect_mod.parse(e)
    path = capture(fn, *args, steps=steps, wait=wait, warmup=warmup, active=active, label=label,
                   record_shapes=record_shapes, with_stack=with_stack, trace_path=trace_path, **kwargs)
    result = analyze(path)
    result.expectations = result.check(expectations) if expectations else []
    return result
