"""Profiler: capture -> trace -> analyses -> renderers.

`analyze` and `diff` read any Chrome/Kineto trace without importing torch; `profile` (capture) imports torch
only when called.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from mlpfuse.profiling.analysis import Analysis, analyze
from mlpfuse.profiling.diff import Diff, diff
from mlpfuse.profiling.expect import Result as ExpectationResult
from mlpfuse.profiling.ranks import RankAnalysis, analyze_ranks

__all__ = ["profile", "analyze", "analyze_ranks", "diff", "Analysis", "Diff", "RankAnalysis", "ExpectationResult"]


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
    keep_trace: bool = False,
    threads: int | None = 1,
    **kwargs: Any,
) -> Analysis:
    """Run `fn(*args, **kwargs)` under torch.profiler and return the analysis of the trace it wrote.

    The trace goes to `trace_path` when given (and stays there); otherwise to a temporary folder that is removed
    once the trace is analysed, unless `keep_trace` — then `analysis.trace_path` names it. A removed trace leaves
    `analysis.trace_path` None; the analysis itself is complete without the file.
    With `expect`, the expectations are parsed before anything runs (a typo fails fast) and their results are
    stored on the analysis as `analysis.expectations` (list of ExpectationResult).
    `threads`: torch's CPU intra-op threads while `fn` runs (default 1, as `mlpfuse walkthrough --threads`: threads
    competing for a few cores make CPU timings swing), restored afterwards; None leaves them as they are. A
    HostLoadWarning says when the machine is too busy to time.
    """
    from mlpfuse import _host
    from mlpfuse.errors import InputError
    from mlpfuse.profiling import expect as expect_mod
    from mlpfuse.profiling.capture import capture, check_schedule, trace_file

    if not callable(fn):
        raise InputError(f"fn: expected a callable to run once per step (a function or a module), got "
                         f"{type(fn).__name__} {fn!r:.80}")
    # One string is one expectation, not a list of its characters.
    expectations = [expect] if isinstance(expect, str) else list(expect or [])
    for e in expectations:
        expect_mod.parse(e, "expect")
    if not isinstance(keep_trace, bool):
        raise InputError(f"keep_trace: expected True or False, got {keep_trace!r}")
    _host.check_threads(threads)
    check_schedule(steps, wait, warmup, active, label)  # bad input first: no warning about a run that never starts
    _host.warn_if_busy()
    with trace_file(trace_path, label, keep_trace) as (path, kept), _host.pinned_threads(threads):
        path = capture(fn, *args, steps=steps, wait=wait, warmup=warmup, active=active, label=label,
                       record_shapes=record_shapes, with_stack=with_stack, trace_path=path, **kwargs)
        result = analyze(path)
    if not kept:
        result.data["trace"] = None
    result.expectations = expect_mod.check(result, expectations, "expect") if expectations else []
    return result
