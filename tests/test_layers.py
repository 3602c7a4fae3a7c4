"""mlpfuse's layers only look down: every import in src/mlpfuse (at any depth, inside functions too) goes from a
module to one in its own layer or a layer below. And the profiler reads traces with torch alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from cli_run import HANG_S

SRC = Path(__file__).resolve().parents[1] / "src"
# The package's front door (mlpfuse/__init__.py) re-exports the public API of every layer: it sits on top, and only
# its `__version__` may be imported from below.
TOP = "mlpfuse"
PACKAGE = SRC / "mlpfuse"

# Bottom to top. A module may import its own layer and any layer listed before it. A name matches a module and
# everything under it ("mlpfuse.ops" covers mlpfuse.ops.dispatch); the longest matching name wins.
LAYERS = (
    ("base", ("mlpfuse.errors", "mlpfuse._io", "mlpfuse._cache", "mlpfuse._console", "mlpfuse._host",
              "mlpfuse._outputs", "mlpfuse._peaks", "mlpfuse.activations", "mlpfuse.fp8", "mlpfuse.reference")),
    ("kernels", ("mlpfuse.kernels", "mlpfuse.csrc")),
    ("ops", ("mlpfuse.ops",)),
    ("modules", ("mlpfuse.modules",)),
    ("patching", ("mlpfuse.patching",)),
    ("parallel", ("mlpfuse.parallel",)),
    ("workloads", ("mlpfuse.workloads",)),
    ("profiling", ("mlpfuse.profiling",)),
    ("bench", ("mlpfuse.bench",)),
    ("report", ("mlpfuse.report",)),
    ("commands", ("mlpfuse.commands", "mlpfuse.cli", "mlpfuse.__main__")),
    ("front door", (TOP,)),
)

# Beside the order above: the profiler uses nothing of the compute side (it reads traces with torch alone), and
# the report renders what it is handed, whoever measured it.
FORBIDDEN = {
    "profiling": {"kernels", "ops", "modules", "parallel", "patching", "workloads"},
    "report": {"kernels", "ops", "modules", "parallel", "patching", "workloads", "bench"},
}

_RANK = {layer: i for i, (layer, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, names in LAYERS:
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = layer, len(name)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, relative ones resolved, names under `from X import`
    counted as X.name when that is a module of mlpfuse."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from mlpfuse import ops` imports a module, `from mlpfuse import patch` a name
                sub = f"{base}.{alias.name}"
                if _is_module(sub):
                    found.append((node.lineno, sub))
                elif not (base == TOP and alias.name == "__version__"):  # the version is metadata, not a layer
                    found.append((node.lineno, base))
    return sorted({(line, m) for line, m in found if m == TOP or m.startswith(TOP + ".")})


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert sources(), PACKAGE
    missing = [module_name(p) for p in sources() if layer_of(module_name(p)) is None]
    assert not missing, f"modules outside the layer table: {missing}"


def test_imports_only_look_down():
    wrong = []
    for path in sources():
        mine = layer_of(module_name(path))
        for line, target in imports_of(path):
            theirs = layer_of(target)
            if theirs is None:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {target}, which is in no layer")
            elif _RANK[theirs] > _RANK[mine] or theirs in FORBIDDEN.get(mine, ()):
                wrong.append(f"{path.relative_to(SRC)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_checker_sees_nested_imports():
    # The walk must see an import inside a function: profile() imports capture only when called.
    nested = [(line, m) for line, m in imports_of(PACKAGE / "profiling" / "__init__.py")
              if m == "mlpfuse.profiling.capture"]
    assert nested, "the import of profiling.capture inside profile() was not seen"


_BLOCKED = ("triton", "transformers")
_PROBE = r"""
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked")
        return None
sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
import importlib, pkgutil
import mlpfuse.profiling as profiling
for info in pkgutil.iter_modules(profiling.__path__):  # every part of the profiler, capture included (torch only)
    importlib.import_module(f"mlpfuse.profiling.{{info.name}}")
from mlpfuse.profiling import analyze, diff
from mlpfuse.profiling.trace import load
trace = load(sys.argv[1])
a = analyze(sys.argv[1])
d = diff(sys.argv[1], sys.argv[1])
leaked = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)
print(trace.n_events, a.steps, len(a.kernels), leaked)
"""


def test_profiling_runs_without_triton_or_transformers():
    trace = Path(__file__).parent / "fixtures" / "traces" / "geglu_eager.json.gz"
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _PROBE.format(blocked=_BLOCKED), str(trace)], env=env,
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    events, steps, kernels, leaked = out.stdout.split(" ", 3)
    assert int(events) > 0 and int(steps) > 0 and int(kernels) > 0
    assert leaked.strip() == "[]"
