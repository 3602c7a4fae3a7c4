"""Capture for a user's own program: run a script (or `-m module`) in this process under torch.profiler.

The script runs as `python script.py ARGS` would run it: `__name__ == "__main__"`, `sys.argv` = [script, *ARGS],
its folder first on `sys.path` (the current folder for `-m`). A step ends at each `torch.optim.Optimizer.step()`
return (a global post-hook on every optimizer), or at each return of the function named by `step_fn` (a top-level
`def` of the script). The profiler's schedule (wait, warmup, active) is driven by those step ends; once the active
steps are recorded the trace is written and the profiler stops, and the script runs on at full speed to its end.

The code is compiled here rather than through runpy so that `step_fn` can be wrapped the moment the script defines
it: one assignment, `NAME = <wrapper>(NAME)`, is compiled in after the `def`. The file itself is never changed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import re
import sys
import types
import warnings
from typing import Callable, Iterator

from mlpfuse._io import atomic_path
from mlpfuse.errors import InputError

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_WRAPPER = "__mlpfuse_step_fn__"  # the global the compiled-in assignment calls
TAIL = "(after the script's last step)"  # the name a partial last step gets in the trace


@dataclasses.dataclass(frozen=True)
class Target:
    """What to run: a source file or a module, and the arguments it gets."""

    path: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def label(self) -> str:
        """A file-name-safe name for its results: the script's stem or the module's name."""
        stem = self.module or os.path.splitext(os.path.basename(self.path))[0]
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)[:100] or "script"

    def describe(self) -> str:
        head = f"python -m {self.module}" if self.module else f"python {self.path}"
        return " ".join([head, *self.args])


def looks_like_command(words: list[str]) -> bool:
    """Whether the words after `mlpfuse profile` are a program to run, not a built-in workload's name."""
    return bool(words) and (bool(_PYTHON.match(os.path.basename(words[0]))) or words[0] == "-m"
                            or words[0].endswith(".py") or len(words) > 1)


def parse_command(words: list[str]) -> Target:
    """`python script.py ARGS`, `script.py ARGS` or `python -m module ARGS` (the interpreter word optional)."""
    words = list(words)
    if words and words[0] == "--":
        words = words[1:]
    if words and _PYTHON.match(os.path.basename(words[0])):
        words = words[1:]
    if not words:
        raise InputError("SCRIPT: expected a script to run after `--`, e.g. mlpfuse profile -- python train.py")
    if words[0] == "-m":
        if len(words) < 2 or not words[1] or words[1].startswith("-"):
            raise InputError("SCRIPT: expected a module name after -m, e.g. mlpfuse profile -- python -m mypkg.train")
        return Target(None, words[1], tuple(words[2:]))
    if words[0].startswith("-"):
        raise InputError(f"SCRIPT: python's own options are not supported here (got {words[0]}); give the script "
                         "or -m MODULE right after python")
    return Target(words[0], None, tuple(words[1:]))


@dataclasses.dataclass
class Run:
    """What happened while the script ran."""

    steps_run: int  # step ends the script reached in all
    recorded: int  # complete steps in the trace (the active steps, or fewer when the script ended first)
    trace_path: str | None  # None when the script ended before a single step was recorded
    marker: str  # what ended a step, in words


@dataclasses.dataclass
class Program:
    """A script compiled and ready to run: its code, the `__main__` module it runs in, and what a step end calls."""

    target: Target
    code: types.CodeType
    main: types.ModuleType
    step_fn: str | None
    on_step: Callable[[], None] = lambda: None


def load(target: Target, step_fn: str | None = None) -> Program:
    """Read and compile the script (a missing file, a syntax error, a `--step-fn` it does not define: one
    InputError before anything runs)."""
    if step_fn is not None and not re.fullmatch(r"[A-Za-z_]\w*", step_fn):
        raise InputError(f"--step-fn: expected the name of a function your script defines at top level, got "
                         f"{step_fn!r}")
    code, main = _load(target, step_fn)
    program = Program(target, code, main, step_fn)
    if step_fn is not None:
        def wrapper(fn):
            @functools.wraps(fn)
            def step(*args, **kwargs):
                result = fn(*args, **kwargs)
                program.on_step()
                return result

            return step

        setattr(main, _WRAPPER, wrapper)
    return program


class _Steps:
    """Drives the profiler schedule from the script's step ends; stops the profiler when the window is recorded."""

    def __init__(self, prof, window: int, stop: Callable[[], None]):
        self.prof, self.window, self.stop = prof, window, stop
        self.count = 0

    def end(self) -> None:
        self.count += 1
        if self.count <= self.window:
            self.prof.step()
            if self.count == self.window:  # the active steps are recorded: write the trace now, not at script end
                self.stop()


def run(program: Program, *, trace_path: str, wait: int = 1, warmup: int = 1, active: int = 3,
        record_shapes: bool = True, with_stack: bool = False) -> Run:
    """Run a loaded script under the profiler; the trace goes to `trace_path` (.json.gz). The script's own
    exceptions become one-line InputErrors; SystemExit(0) is a normal end. Run a Program once."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    step_fn = program.step_fn
    window = wait + warmup + active
    written: list[BaseException | None] = []

    def export(prof) -> None:
        # Called inside the script's optimizer step: a failure is kept and reported after the script, not raised
        # into the user's code (where it would read as their script's error).
        try:
            with atomic_path(trace_path, suffix=".json.gz") as temp:
                prof.export_chrome_trace(temp)
            written.append(None)
        except Exception as exc:  # noqa: BLE001 - re-raised as an InputError below
            written.append(exc)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with warnings.catch_warnings():
        # torch warns that a schedule cycle clears earlier events; one cycle (repeat=1) is what we ask for.
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
        prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                       record_shapes=record_shapes, with_stack=with_stack, on_trace_ready=export)
    with contextlib.ExitStack() as profiling, contextlib.ExitStack() as hooks:
        steps = _Steps(prof, window, profiling.close)
        program.on_step = steps.end
        if step_fn is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            hooks.callback(register_optimizer_step_post_hook(lambda opt, args, kwargs: steps.end()).remove)
        profiling.enter_context(prof)
        _execute(program.code, program.main, program.target)
        profiling.close()  # the script ended inside the window: what was recorded is written now
    if written and written[0] is not None:
        exc = written[0]
        raise InputError(f"--out: cannot write {trace_path} ({getattr(exc, 'strerror', None) or exc})")
    marker = f"{step_fn}() returned" if step_fn else "torch.optim.Optimizer.step()"
    recorded = max(0, min(steps.count, window) - wait - warmup)
    if recorded == 0:  # at most the script's tail after its last step was recorded: no step to analyse
        if written:
            with contextlib.suppress(OSError):
                os.unlink(trace_path)
        return Run(steps.count, 0, None, marker)
    if steps.count < window:
        _name_the_tail(trace_path, steps.count)
    return Run(steps.count, recorded, trace_path, marker)


def _load(target: Target, step_fn: str | None) -> tuple[types.CodeType, types.ModuleType]:
    """The script's code, compiled (with the step function's wrapper call), and the `__main__` module it runs
    in."""
    main = types.ModuleType("__main__")
    if target.module is not None:
        path, source, spec = _module_source(target.module)
        main.__spec__, main.__package__, main.__loader__ = spec, spec.parent, spec.loader
    else:
        path = target.path
        if not os.path.isfile(path):
            raise InputError(f"SCRIPT {path}: no such file" if not os.path.exists(path)
                             else f"SCRIPT {path}: not a file")
        try:
            with open(path, "rb") as fh:
                source = fh.read()
        except OSError as exc:
            raise InputError(f"SCRIPT {path}: cannot read it ({exc.strerror or exc})") from None
    main.__file__ = path
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise InputError(f"your script does not compile: {type(exc).__name__}: {exc.args[0] if exc.args else exc}"
                         f"{where}") from None
    if step_fn is not None:
        _wrap_after_def(tree, step_fn, path)
    return compile(tree, path, "exec"), main


def _wrap_after_def(tree: ast.Module, name: str, path: str) -> None:
    """After each top-level `def NAME`, insert `NAME = __mlpfuse_step_fn__(NAME)` (at the def's last line, so
    tracebacks keep the file's line numbers)."""
    body = []
    found = False
    for node in tree.body:
        body.append(node)
        if isinstance(node, ast.FunctionDef) and node.name == name:
            found = True
            wrap = ast.Assign(targets=[ast.Name(name, ast.Store())],
                              value=ast.Call(ast.Name(_WRAPPER, ast.Load()), [ast.Name(name, ast.Load())], []))
            for part in ast.walk(wrap):
                part.lineno = part.end_lineno = node.end_lineno
                part.col_offset = part.end_col_offset = 0
            body.append(wrap)
    if not found:
        raise InputError(f"--step-fn {name}: {path} has no top-level `def {name}(...)` (the function must be defined "
                         "at the start of a line in the script itself)")
    tree.body = body


def _module_source(name: str):
    # As `python -m`: found with the current folder first on sys.path; a package runs its __main__.
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError) as exc:
        raise InputError(f"SCRIPT -m {name}: cannot find it ({exc})") from None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        raise InputError(f"SCRIPT -m {name}: no module of that name on sys.path")
    getter = getattr(spec.loader, "get_source", None)
    source = getter(spec.name) if getter is not None else None
    if source is None or not spec.origin:
        raise InputError(f"SCRIPT -m {name}: no Python source to run (a compiled or built-in module)")
    return spec.origin, source, spec


@contextlib.contextmanager
def _as_main(main: types.ModuleType, target: Target) -> Iterator[None]:
    """sys.argv, sys.path[0] and sys.modules['__main__'] as the script expects them; all restored afterwards,
    and the warning filters the script sets end with it. The script's prints go to stderr, so that stdout holds
    mlpfuse's tables or JSON only."""
    argv, path, previous = sys.argv, list(sys.path), sys.modules.get("__main__")
    sys.argv = [main.__file__, *target.args]
    sys.path.insert(0, os.getcwd() if target.module else os.path.dirname(os.path.abspath(target.path)))
    sys.modules["__main__"] = main  # pickling the script's classes (torch.save, DataLoader workers) finds them
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            yield
    finally:
        sys.argv = argv
        sys.path[:] = path
        if previous is not None:
            sys.modules["__main__"] = previous


def _execute(code: types.CodeType, main: types.ModuleType, target: Target) -> None:
    with _as_main(main, target):
        try:
            exec(code, main.__dict__)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise InputError(f"your script exited with status {exc.code}") from None
        except (KeyboardInterrupt, InputError):
            raise
        except Exception as exc:  # noqa: BLE001 - the user's error, shown as one line with where it happened
            raise InputError(f"your script raised {type(exc).__name__}: {_first_line(exc)}{_where(exc, code)}") \
                from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "")[:300]


def _where(exc: BaseException, code: types.CodeType) -> str:
    """` (file, line N)` of the innermost frame in the script's own file, or ''."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == code.co_filename:
            found = tb
        tb = tb.tb_next
    return f" ({os.path.basename(code.co_filename)}, line {found.tb_lineno})" if found else ""


def _name_the_tail(path: str, count: int) -> None:
    """The script ended inside the window: its last ProfilerStep span runs from its last step's end to the
    profiler's stop (whatever the script did after its loop), not a step. Renamed, it stays visible in the trace
    and out of the per-step figures."""
    last = f"ProfilerStep#{count}"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    for event in data.get("traceEvents", []) if isinstance(data, dict) else []:
        if isinstance(event, dict) and event.get("name") == last:
            event["name"] = TAIL
    with atomic_path(path, suffix=".json.gz") as temp, gzip.open(temp, "wt", encoding="utf-8") as fh:
        json.dump(data, fh)
