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

__all__ = ["profile", "record_graph_map", "analyze", "analyze_ranks", "diff", "Analysis", "Diff", "RankAnalysis",
           "ExpectationResult"]


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
    modules: Any = None,
    graph_map: str | None = None,
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
    `modules`: the model (an nn.Module) whose submodules' forwards are annotated while profiling, so that the
    analysis gives GPU time per module path (`analysis.to_dict()["modules"]`).
    `graph_map`: for an `fn` that replays a CUDA graph (torch.cuda.graph, `reduce-overhead`): the map file written
    beforehand by `record_graph_map` from one eager run of the same computation; the replay's kernels are then
    attributed to modules through it (profiling.modules says how, and what is never guessed).
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
                       record_shapes=record_shapes, with_stack=with_stack, trace_path=path, modules=modules, **kwargs)
        result = analyze(path, graph_map=graph_map)
    if not kept:
        result.data["trace"] = None
    result.expectations = expect_mod.check(result, expectations, "expect") if expectations else []
    return result


def record_graph_map(fn: Callable[..., Any], modules: Any, path: str, *args: Any, **kwargs: Any) -> int:
    """Run `fn(*args, **kwargs)` once, eagerly, under the profiler with `modules`' forwards annotated, and write the
    map of the kernels it launched, in order, with their module paths and ops, to `path` (JSON): what
    `profile(..., graph_map=path)` and `mlpfuse analyze --map` attribute a CUDA-graph replay of the same computation
    through. `fn` must launch what the graph replays: the eager form of the captured callable, warmed up (cuBLAS
    and autotuning settled). Returns the number of kernels mapped."""
    import tempfile

    from mlpfuse.errors import InputError
    from mlpfuse.profiling import modules as modules_mod
    from mlpfuse.profiling.capture import capture
    from mlpfuse.profiling.trace import load

    if not callable(fn):
        raise InputError(f"fn: expected a callable, got {type(fn).__name__}")
    if modules is None:
        raise InputError("modules: expected the model whose submodules the map names")
    with tempfile.TemporaryDirectory(prefix="mlpfuse-map-") as folder:
        trace_path = capture(fn, *args, steps=1, wait=0, warmup=0, active=1, label="map",
                             trace_path=f"{folder}/map.json.gz", modules=modules, **kwargs)
        return modules_mod.write_map(load(trace_path), path)
