"""Capture the small real traces that the profiler tests read (tests/fixtures/traces/).

Uses mlpfuse's own capture code and built-in workloads at the walkthrough's shapes (bf16 on CUDA):
linear 8192x768 -> 3072 with bias, GeGLU MLP 8x1024 tokens x 768 -> 3072; eager and torch.compile each.
A trace's size depends on its event count, not on tensor sizes, so the real shapes stay small on disk.

    PYTHONPATH=src python3 benchmarks/capture_fixtures.py --out DIR [--extra]

Writes DIR/<name>.json.gz, DIR/env.json (GPU, torch, CUDA) and prints each trace's kernels per step. --extra also
captures a GeGLU forward+backward trace and the mlpfuse variant where it is importable (not committed as
fixtures; useful for kernel-name decoding work).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import traceback

FIXTURES = [
    # file name, workload, variant, extra build options
    ("linear_eager", "linear", "eager", {}),
    ("linear_compile", "linear", "compile", {}),
    ("geglu_eager", "geglu-mlp", "eager", {}),
    ("geglu_compile", "geglu-mlp", "compile", {}),
]


def _env() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def _kernel_names(path: str) -> list[str]:
    # Deliberately independent of mlpfuse.profiling: a raw listing to compare the analysis against.
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "kernel"]


def _train_step(built):
    """Forward + backward of an eager module (built for inference, so switch its gradients back on)."""
    built.fn.requires_grad_(True)
    x = built.x.detach().requires_grad_(True)

    def step():
        built.fn(x).float().pow(2).mean().backward()

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", action="store_true")
    args = parser.parse_args(argv)

    from mlpfuse import workloads
    from mlpfuse.errors import InputError
    from mlpfuse.profiling.capture import capture

    os.makedirs(args.out, exist_ok=True)
    env = _env()
    print(json.dumps(env))
    with open(os.path.join(args.out, "env.json"), "w") as fh:
        json.dump(env, fh, indent=1)

    jobs = list(FIXTURES)
    if args.extra:
        jobs.append(("linear_nobias_eager", "linear", "eager", {"bias": False}))
        jobs.append(("geglu_eager_train", "geglu-mlp", "eager", {"train": True}))
        for workload in ("linear", "geglu-mlp"):
            jobs.append((f"{workload.split('-')[0]}_mlpfuse", workload, "mlpfuse", {}))

    failures = 0
    for name, workload, variant, options in jobs:
        options = dict(options)
        train = options.pop("train", False)
        try:
            built = workloads.build(workload, variant=variant, **options)
            path = os.path.join(args.out, f"{name}.json.gz")
            if train:
                capture(_train_step(built), label=built.label + "-train", trace_path=path)
            else:
                capture(built.fn, built.x, label=built.label, trace_path=path)
        except Exception as exc:  # record and go on: one broken variant must not cost the other captures
            failures += 1
            print(f"== {name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if not isinstance(exc, InputError):
                traceback.print_exc(limit=3)
            continue
        names = _kernel_names(path)
        print(f"== {name}: {built.describe()}  {os.path.getsize(path)} bytes, {len(names)} kernels in trace")
        for kernel in dict.fromkeys(names):
            print(f"   {names.count(kernel):3d} x {kernel}")
    return 1 if failures and not args.extra else 0


if __name__ == "__main__":
    sys.exit(main())
