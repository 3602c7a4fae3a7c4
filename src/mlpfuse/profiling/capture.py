"""Capture: run a callable under torch.profiler and write a gzipped Chrome trace.

The only profiling module that imports torch; everything downstream reads the trace file, so a trace written
here and one written by anyone's own `torch.profiler` go through the same analysis.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
import warnings
from typing import Any, Callable, Iterator

from mlpfuse._io import atomic_path
from mlpfuse.errors import InputError


TEMP_PREFIX = "mlpfuse-trace-"


def _trace_name(label: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(label))[:100] or "trace"
    return f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json.gz"


def _default_trace_path(label: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix=TEMP_PREFIX), _trace_name(label))


@contextlib.contextmanager
def trace_file(trace_path: str | os.PathLike | None, label: str, keep: bool) -> Iterator[tuple[str, bool]]:
    """(path to capture into, whether it outlives the block).

    A given trace_path is the caller's and always kept. Without one the trace goes to a fresh temporary folder,
    removed when the block ends unless `keep`, and always when the block fails (there is no trace to keep).
    """
    if trace_path is not None:
        yield os.fspath(trace_path), True
        return
    folder = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    failed = True
    try:
        yield os.path.join(folder, _trace_name(label)), keep
        failed = False
    finally:
        if failed or not keep:
            shutil.rmtree(folder, ignore_errors=True)


def check_schedule(steps: int, wait: int, warmup: int, active: int, label: str = "step") -> None:
    """Validate the profiler schedule before anything runs."""
    for name, value, low in (("steps", steps, 1), ("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
        if not isinstance(value, int) or value < low:
            raise InputError(f"{name}: expected an integer >= {low}, got {value!r}")
    if steps < wait + warmup + active:
        raise InputError(f"steps: expected >= wait + warmup + active = {wait + warmup + active}, got {steps}")
    if not label or not isinstance(label, str):
        raise InputError(f"label: expected a non-empty string, got {label!r}")


@contextlib.contextmanager
def module_annotations(root: Any) -> Iterator[None]:
    """While open, every forward of `root` and of its submodules runs inside a profiler annotation named
    `mlpfuse.module: <path>` (profiling.modules.PREFIX; the root's path is ""), which the analysis reads to attribute
    kernels to modules. Hooks only: the modules are not changed, and the hooks are removed on exit. Each annotation
    costs a few µs of host time per module call; GPU times are not affected. None: nothing is annotated."""
    if root is None:
        yield
        return
    import torch
    from torch.profiler import record_function

    from mlpfuse.profiling.modules import PREFIX

    if not isinstance(root, torch.nn.Module):
        raise InputError(f"modules: expected the torch.nn.Module whose submodules to annotate, got "
                         f"{type(root).__name__}")
    open_spans: list = []
    handles = []

    def enter(path):
        def pre(module, args):
            span = record_function(PREFIX + path)
            span.__enter__()
            open_spans.append(span)
        return pre

    def leave(module, args, output):
        if open_spans:
            open_spans.pop().__exit__(None, None, None)

    try:
        for path, module in root.named_modules():
            handles.append(module.register_forward_pre_hook(enter(path)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        while open_spans:
            open_spans.pop().__exit__(None, None, None)


def capture(
    fn: Callable[..., Any],
    *args: Any,
    steps: int = 5,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    label: str = "step",
    record_shapes: bool = True,
    with_stack: bool = False,
    trace_path: str | os.PathLike | None = None,
    modules: Any = None,
    **kwargs: Any,
) -> str:
    """Run `fn(*args, **kwargs)` `steps` times under the profiler schedule; return the trace path (.json.gz).

    Without trace_path the trace goes to a new temporary folder that the caller owns (`profile` removes it).

    Each step is wrapped in `record_function(label)` and ends with a device synchronize, so a step's span covers
    the GPU work it launched and step windows are comparable across eager and compiled code.
    `modules`: an nn.Module whose submodules' forwards are annotated while the profiler runs (module_annotations).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    check_schedule(steps, wait, warmup, active, label)
    path = str(trace_path) if trace_path is not None else _default_trace_path(label)
    if not path.endswith(".json.gz"):
        path = path[:-5] + ".json.gz" if path.endswith(".json") else path + ".json.gz"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    sync()
    with module_annotations(modules), warnings.catch_warnings():
        # torch warns that a schedule cycle clears earlier events; one cycle (repeat=1) is what we ask for.
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
        with profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            record_shapes=record_shapes,
            with_stack=with_stack,
        ) as prof:
            for index in range(steps):
                if index == wait + warmup:
                    # The label travels inside the trace (top-level key) so analysis finds the steps even where
                    # ProfilerStep spans are absent; metadata is only accepted while the profiler is recording.
                    prof.add_metadata("mlpfuse_label", label)
                with record_function(label):
                    fn(*args, **kwargs)
                    sync()
                prof.step()
    # Written beside the target and renamed into place: a reader never sees half a trace.
    with atomic_path(path, suffix=".json.gz") as temp:
        prof.export_chrome_trace(temp)
    return path
