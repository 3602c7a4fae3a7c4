"""`mlpfuse walkthrough`: the nn.Linear -> fused MLP story, end to end, on this machine.

Profiles Linear eager vs torch.compile, the GeGLU MLP eager vs torch.compile, and the MLP through mlpfuse's fused
modules where they import; prints each profile and the diffs between them; where transformers is installed, ends
with one Llama-3-8B-shaped layer before and after `mlpfuse.patch` (toy widths on a CPU); writes traces, analysis
JSON and a summary.md to the results folder, each file replaced atomically. A variant that fails (no C++ compiler
for torch.compile on CPU, fused modules not importable) is recorded with its one-line reason and the walkthrough
goes on.
"""

from __future__ import annotations

import json
import os
import time

# (case name, workload, variant)
CASES = [
    ("linear-eager", "linear", "eager"),
    ("linear-compile", "linear", "compile"),
    ("geglu-mlp-eager", "geglu-mlp", "eager"),
    ("geglu-mlp-compile", "geglu-mlp", "compile"),
    ("linear-mlpfuse", "linear", "mlpfuse"),
    ("geglu-mlp-mlpfuse", "geglu-mlp", "mlpfuse"),
]
DIFFS = [
    ("linear-eager", "linear-compile"),
    ("geglu-mlp-eager", "geglu-mlp-compile"),
    ("linear-eager", "linear-mlpfuse"),
    ("geglu-mlp-eager", "geglu-mlp-mlpfuse"),
    ("geglu-mlp-compile", "geglu-mlp-mlpfuse"),
]


def register(subparsers) -> None:
    p = subparsers.add_parser("walkthrough", help="the nn.Linear -> fused MLP walkthrough, end to end",
                              description=__doc__.splitlines()[0])
    p.add_argument("--device", help="cpu | cuda (default cuda when present)")
    p.add_argument("--dtype", help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--out", help="results folder (default ./mlpfuse-results/walkthrough-<device>)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per case: 1 wait, 1 warm-up, rest active")
    p.set_defaults(func=run)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run(args) -> int:
    from rich.console import Console

    from mlpfuse import workloads
    from mlpfuse._io import atomic_write_text
    from mlpfuse.errors import InputError
    from mlpfuse.profiling import diff, profile, render

    console = Console()
    device = workloads.resolve_device(args.device)
    if args.steps < 3:
        raise InputError(f"--steps: expected >= 3 (1 wait + 1 warm-up + >= 1 active), got {args.steps}")
    out = args.out or os.path.join("mlpfuse-results", f"walkthrough-{device.split(':')[0]}")
    workloads.results_folder(out, "--out")

    analyses, described, failed = {}, {}, {}
    started = time.perf_counter()
    for case, workload, variant in CASES:
        ok, reason = workloads.VARIANTS[variant].available()
        if not ok:
            failed[case] = f"unavailable: {reason}"
            console.print(f"[yellow]{case}: skipped ({failed[case]})[/yellow]")
            continue
        try:
            built = workloads.build(workload, variant=variant, device=device, dtype=args.dtype)
            console.rule(f"{case}: {built.describe()}")
            result = profile(built.fn, built.x, steps=args.steps, wait=1, warmup=1, active=args.steps - 2,
                             label=case, trace_path=os.path.join(out, f"{case}.pt.trace.json.gz"))
        except InputError:
            raise
        except Exception as exc:  # e.g. torch.compile without a working C++ compiler: record it and go on
            failed[case] = _one_line(exc)
            console.print(f"[red]{case}: failed ({failed[case]})[/red]")
            continue
        data = result.to_dict()
        data["workload"] = described[case] = built.describe()
        atomic_write_text(os.path.join(out, f"{case}.analysis.json"), json.dumps(data, indent=1))
        tables = render.analysis_tables(data)
        console.print(tables[0])
        console.print(tables[1])  # the kernel table, or the CPU op table on a CPU-only run
        console.print(render.verdict_line(data))
        analyses[case] = result

    diffs = {}
    for a, b in DIFFS:
        if a in analyses and b in analyses:
            console.rule(f"diff {a} -> {b}")
            d = diff(analyses[a], analyses[b])
            diffs[f"{a} -> {b}"] = d.to_dict()
            render.print_diff(d.to_dict(), console)

    model_part = _model_layer(device, args.dtype, os.path.join(out, "model"), console, failed)
    if model_part is not None:
        diffs[f"{model_part.label}: eager -> mlpfuse.patch"] = model_part.diff.to_dict()

    summary = _summary_md(device, analyses, described, failed, diffs, time.perf_counter() - started)
    atomic_write_text(os.path.join(out, "summary.md"), summary)
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(
        {"device": device, "cases": {c: a.to_dict() for c, a in analyses.items()}, "failed": failed, "diffs": diffs},
        indent=1))
    console.print(f"results: {out}/ (summary.md, traces *.pt.trace.json.gz open in https://ui.perfetto.dev)")
    return 0


MODEL = "llama3-8b"  # one layer of it, before and after mlpfuse.patch


def _model_layer(device, dtype, out, console, failed):
    """The story on a real model's layer, where transformers is installed; None (and said why) otherwise."""
    import importlib.util

    from rich.text import Text

    case = f"{MODEL} layer: eager -> mlpfuse.patch"
    if importlib.util.find_spec("transformers") is None:
        failed[case] = "unavailable: transformers is not installed (pip install 'mlpfuse[models]')"
        console.print(Text(f"{case}: skipped ({failed[case]})", style="yellow"))
        return None
    from mlpfuse.bench import model_diff
    from mlpfuse.profiling import render

    try:
        result = model_diff.profile_model(MODEL, device=device, dtype=dtype, out=out)
    except Exception as exc:  # noqa: BLE001 - the walkthrough goes on, as for the other cases
        failed[case] = _one_line(exc)
        console.print(Text(f"{case}: failed ({failed[case]})", style="red"))
        return None
    console.rule(f"{result.label}: eager -> mlpfuse.patch")
    console.print(result.report.summary(), markup=False, highlight=False)
    render.print_diff(result.diff.to_dict(), console)
    return result


def _summary_md(device, analyses, described, failed, diffs, seconds) -> str:
    from mlpfuse.profiling.render import short

    lines = [f"# mlpfuse walkthrough ({device})", ""]
    devices = sorted({d for a in analyses.values() for d in a.data.get("devices", [])})
    lines += [f"GPU: {', '.join(devices) or 'none (CPU activity only)'}; total time {seconds:.0f} s.", ""]
    lines += ["| case | workload | kernels/step | launches/step | GPU busy us | step us | verdict |",
              "|---|---|---|---|---|---|---|"]
    for case, a in analyses.items():
        p = a.per_step
        lines.append(f"| {case} | {described[case]} | {p['gpu_kernels']:g} | {p['launch_calls']:g} | "
                     f"{p['gpu_busy_us']:.1f} | {p['step_us']:.1f} | {a.verdict['kind']} |")
    for case, reason in failed.items():
        lines.append(f"| {case} | - | - | - | - | - | not run: {reason} |")
    lines.append("")
    for case, a in analyses.items():
        lines += [f"## {case}", ""]
        for k in a.kernels:
            lines.append(f"- `{short(k['name'], 100)}` ({k['family']}) x{k['per_step']:g}/step, "
                         f"{k['avg_us']:.1f} us, launched by {', '.join(k['ops'])}")
        if not a.kernels:
            top = sorted(a.ops, key=lambda o: -o["cpu_self_us"])[:8]
            lines.append("- CPU ops by self time per step: " + ", ".join(
                f"`{o['name']}` x{o['per_step']:g} {o['cpu_self_us'] / a.steps:.0f} us" for o in top))
        zero = ", ".join(f"`{z['name']}`" for z in a.data["zero_kernel_ops"])
        if zero:
            lines.append(f"- ops that launched nothing: {zero}")
        lines += [f"- verdict: {a.verdict['kind']} — {a.verdict['reason']}", ""]
    for title, d in diffs.items():
        lines += [f"## diff {title}", ""]
        for key, word in (("kernels_removed", "removed"), ("kernels_added", "added"), ("kernels_unchanged", "same")):
            for k in d[key]:
                lines.append(f"- {word}: `{short(k['name'], 100)}` ({k['family']})")
        gone = ", ".join(f"`{o['name']}`" for o in d["ops_removed"])
        if gone:
            lines.append(f"- CPU ops gone: {gone}")
        lines.append("")
    return "\n".join(lines)
