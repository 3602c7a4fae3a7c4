"""One of `auto`'s switches, A/B in one `mlpfuse bench` run: the drop-in module as shipped ("mlpfuse") beside the
same module with one `mlpfuse.ops.dispatch` setting changed around each of its steps ("mlpfuse-NAME"), and both
replayed from CUDA graphs, interleaved with the peers on the same problem. Two processes minutes apart differed by
5 % in their eager baselines (results/nvidia-h100-x1/probe-glu-backward), so a switch is decided in one.

    PYTHONPATH=src python3 benchmarks/ab_switch.py MERGED_DW_MAX_M=0 twodw -- --tokens 64,256,1024 --dim 768 \\
        --hidden 3072 --workload geglu,swiglu --mode fwd+bwd --rounds 7 --no-profile --out DIR

Everything after `--` goes to `mlpfuse bench`; `--variants` is set here (eager, compile, eager's graph, both
modules and both graphs). The value is read as a Python literal (0, 1024, "fused").
"""

from __future__ import annotations

import ast
import sys

from mlpfuse.bench import variants as V
from mlpfuse.cli import main as cli_main
from mlpfuse.ops import dispatch


def _switched(build, name: str, value):
    def wrapped(problem):
        step = build(problem)

        def switched_step():
            kept = getattr(dispatch, name)
            setattr(dispatch, name, value)
            try:
                return step()
            finally:
                setattr(dispatch, name, kept)

        return switched_step

    return wrapped


def main(argv: list[str]) -> int:
    if len(argv) < 3 or "=" not in argv[0] or argv[2] != "--":
        print("ab_switch.py: error: usage: ab_switch.py SETTING=VALUE NAME -- BENCH-ARGS...", file=sys.stderr)
        return 2
    setting, text = argv[0].split("=", 1)
    if not hasattr(dispatch, setting):
        print(f"ab_switch.py: error: mlpfuse.ops.dispatch has no setting {setting!r}", file=sys.stderr)
        return 2
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    name = f"mlpfuse-{argv[1]}"
    build = _switched(V._mlpfuse_builder("auto"), setting, value)
    V.VARIANTS[name] = V.Variant(name, build, about=f"the drop-in module with dispatch.{setting} = {value!r}")
    V.VARIANTS[f"{name}-cudagraph"] = V.Variant(f"{name}-cudagraph", V._captured(build), needs_cuda=True,
                                                about=f"{name} replayed from a CUDA graph")
    variants = f"eager,compile,eager-cudagraph,mlpfuse,{name},mlpfuse-cudagraph,{name}-cudagraph"
    return cli_main(["bench", *argv[3:], "--variants", variants])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
