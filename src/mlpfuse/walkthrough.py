"""`mlpfuse walkthrough`: the nn.Linear -> fused MLP story, end to end, on this machine.

Profiles Linear eager vs torch.compile, the GeGLU MLP eager vs torch.compile, and the MLP through mlpfuse's fused
modules where they import; prints each profile and the diffs between them; where transformers is installed, ends
with one Llama-3-8B-shaped layer before and after `mlpfuse.patch` (toy widths on a CPU); writes traces, analysis
JSON, a summary.md and report.html (`mlpfuse.report`) to the results folder, each file replaced atomically. A
variant that fails (no C++ compiler for torch.compile on CPU, fused modules not importable) is recorded with its
one-line reason and the walkthrough goes on.
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
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads during the run (default 1: threads competing for a few cores make CPU "
                        "timings swing from run to run; the previous setting is restored afterwards)")
    p.set_defaults(func=run)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run(args) -> int:
    import torch

    from mlpfuse import workloads
    from mlpfuse.errors import InputError

    device = workloads.resolve_device(args.device)
    if args.steps < 3:
        raise InputError(f"--steps: expected >= 3 (1 wait + 1 warm-up + >= 1 active), got {args.steps}")
    if isinstance(args.threads, bool) or not isinstance(args.threads, int) or args.threads < 1:
        raise InputError(f"--threads: expected an integer >= 1, got {args.threads!r}")
    out = args.out or os.path.join("mlpfuse-results", f"walkthrough-{device.split(':')[0]}")
    workloads.results_folder(out, "--out")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, device, out)
    finally:
        torch.set_num_threads(previous)


def _run(args, device: str, out: str) -> int:
    from mlpfuse import workloads
    from mlpfuse._console import Console
    from mlpfuse._io import atomic_write_text
    from mlpfuse.errors import InputError
    from mlpfuse.profiling import diff, profile, render

    console = Console()
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
        tables = render.analysis_tables(data, console.width)
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

    summary = _summary_md(device, analyses, described, failed, diffs, time.perf_counter() - started, args.threads)
    atomic_write_text(os.path.join(out, "summary.md"), summary)
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(
        {"device": device, "threads": args.threads, "cases": {c: a.to_dict() for c, a in analyses.items()},
         "failed": failed, "diffs": diffs}, indent=1))
    report = _report(out, device, analyses, described, failed, diffs)
    console.print(f"results: {out}/ (report.html, summary.md, traces *.pt.trace.json.gz open in "
                  "https://ui.perfetto.dev)")
    console.print(f"report: {report}", markup=False, highlight=False)
    return 0


def _report(out, device, analyses, described, failed, diffs) -> str:
    from mlpfuse.report import Variant, write

    variants = []
    for case, _, _ in CASES:
        if case in analyses:
            variants.append(Variant(case, analyses[case].to_dict(), about=described[case],
                                    trace_path=os.path.join(out, f"{case}.pt.trace.json.gz")))
        elif case in failed:
            variants.append(Variant(case, error=failed[case]))
    notes = []
    if not any(a.data.get("devices") for a in analyses.values()):
        notes.append("No GPU in this run: the pages show CPU ops only. Kernels, launches, GPU lanes and the "
                     "fused MLP's story need a CUDA device.")
    return write(os.path.join(out, "report.html"), f"mlpfuse walkthrough ({device})", variants,
                 diffs=list(diffs.items()), notes=notes, what="--out")


# What a run on the CPU can tell, said once in its summary.
CPU_NOTE = (
    "This run used the CPU, so its traces hold CPU ops only. They show which ATen ops each variant dispatches "
    "(nn.Linear's `aten::t` is metadata only, its bias is folded into `aten::addmm`, torch.compile removes the view "
    "ops, mlpfuse's modules appear as one `mlpfuse::` op) and the CPU time of each. They cannot show the kernel "
    "story: which GEMM kernels run, what gets fused, launches, GPU busy and idle time. That needs CUDA: run "
    "`mlpfuse walkthrough` on a machine with a GPU. CPU step times are wall times of the CPU kernels, noisy on a "
    "shared machine: intra-op threads were pinned to {threads} for this run (--threads)."
)


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


def _summary_md(device, analyses, described, failed, diffs, seconds, threads=1) -> str:
    from mlpfuse.profiling.render import short

    lines = [f"# mlpfuse walkthrough ({device})", ""]
    devices = sorted({d for a in analyses.values() for d in a.data.get("devices", [])})
    lines += [f"GPU: {', '.join(devices) or 'none (CPU activity only)'}; total time {seconds:.0f} s.", ""]
    if not device.startswith("cuda"):
        lines += [CPU_NOTE.format(threads=threads), ""]
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
        lines += [f"## diff {title}", ""] + _diff_lines(d, short) + [""]
    return "\n".join(lines)


def _diff_lines(d: dict, short) -> list[str]:
    """A diff's kernels and CPU ops, both ways; never an empty section."""
    lines = []
    for key, word in (("kernels_removed", "removed"), ("kernels_added", "added"), ("kernels_unchanged", "same")):
        for k in d[key]:
            lines.append(f"- {word}: `{short(k['name'], 100)}` ({k['family']})")
    for key, word in (("ops_removed", "CPU ops gone"), ("ops_added", "CPU ops new")):
        names = ", ".join(f"`{o['name']}` x{o['per_step']:g}" for o in d[key])
        if names:
            lines.append(f"- {word}: {names}")
    if not lines:
        lines.append("- the same kernels and the same CPU ops on both sides")
    a, b = d["per_step"]["a"], d["per_step"]["b"]
    lines.append(f"- per step: {a['cpu_ops']:g} -> {b['cpu_ops']:g} CPU ops, {a['gpu_kernels']:g} -> "
                 f"{b['gpu_kernels']:g} kernels, step {a['step_us']:.1f} -> {b['step_us']:.1f} us")
    return lines
