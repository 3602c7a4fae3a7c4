"""`mlpfuse walkthrough`: the nn.Linear -> fused MLP story, end to end, on this machine.

Profiles Linear eager vs torch.compile, the GeGLU MLP eager vs torch.compile, and the MLP through mlpfuse's fused
modules where they import, each in interleaved rounds (`walkthrough_rounds`); prints each case's median round and
the diffs between them, then the medians with their min–max and the verdict sentences; where transformers is
installed, ends with one Llama-3-8B-shaped layer before and after `mlpfuse.patch` (toy widths on a CPU); writes
traces, analysis JSON, a summary.md, readme-table.md and report.html (`mlpfuse.report`) to the results folder, each
file replaced atomically. A variant that fails (no C++ compiler for torch.compile on CPU, fused modules not
importable) is recorded with its one-line reason and the walkthrough goes on; every output lists what did not run.
"""

from __future__ import annotations

import json
import os
import time

# (case name, workload, variant), in the order the first round runs them (round_order varies it by round)
CASES = [
    ("linear-eager", "linear", "eager"),
    ("linear-compile", "linear", "compile"),
    ("linear-mlpfuse", "linear", "mlpfuse"),
    ("geglu-mlp-eager", "geglu-mlp", "eager"),
    ("geglu-mlp-compile", "geglu-mlp", "compile"),
    ("geglu-mlp-mlpfuse", "geglu-mlp", "mlpfuse"),
    # the block in FP8, on GPUs with FP8 tensor cores: the rowwise chain with its quantization ops (eager,
    # compiled) against mlpfuse's FP8 recipe, whose quantization passes live inside its GEMMs
    ("geglu-mlp-fp8-eager", "geglu-mlp-fp8", "eager"),
    ("geglu-mlp-fp8-compile", "geglu-mlp-fp8", "compile"),
    ("geglu-mlp-fp8-mlpfuse", "geglu-mlp-fp8", "mlpfuse"),
]
# Profiled steps per case and round. A round's step figure is the mean of its active steps: with six, one step the
# host stalled moves it by a sixth of the stall, not a third (host stalls decided single rounds on H100 and H200).
STEPS = 8
_WORKLOAD_OF = {case: workload for case, workload, _ in CASES}
_VARIANT_OF = {case: variant for case, _, variant in CASES}
_DESIGN_RANK = {"eager": 0, "mlpfuse": 1}  # round_order's design places these first
DIFFS = [
    ("linear-eager", "linear-compile"),
    ("geglu-mlp-eager", "geglu-mlp-compile"),
    ("linear-eager", "linear-mlpfuse"),
    ("geglu-mlp-eager", "geglu-mlp-mlpfuse"),
    ("geglu-mlp-compile", "geglu-mlp-mlpfuse"),
    ("geglu-mlp-fp8-eager", "geglu-mlp-fp8-mlpfuse"),
    ("geglu-mlp-fp8-compile", "geglu-mlp-fp8-mlpfuse"),
    ("geglu-mlp-mlpfuse", "geglu-mlp-fp8-mlpfuse"),
]


DESCRIPTION = """\
The nn.Linear -> fused MLP story, end to end, on this machine: nn.Linear and a GeGLU MLP, each eager, under
torch.compile and through mlpfuse's fused modules, profiled in interleaved rounds; on a GPU with FP8 tensor cores
the same MLP in FP8 (the rowwise torch._scaled_mm chain with its quantization ops, eager and compiled, against
mlpfuse's FP8 block); then the diffs between them (kernels removed, added, unchanged) and, where transformers is
installed, one Llama-3-8B-shaped layer before and after mlpfuse.patch (toy widths on a CPU).

Writes the traces (open them in https://ui.perfetto.dev), each case's analysis JSON, summary.md, readme-table.md
and report.html to a new results folder. A case that cannot run here is listed with its reason and the rest go on.
On a CPU the traces hold CPU ops only: the kernel story needs a CUDA GPU.
"""


def register(subparsers) -> None:
    from mlpfuse.commands._help import add_parser, examples

    p = add_parser(subparsers, "walkthrough", help="the nn.Linear -> fused MLP walkthrough, end to end",
                   description=DESCRIPTION, epilog=examples(
                       ("mlpfuse walkthrough", "every case, 3 rounds; on CUDA when present, else the CPU"),
                       ("mlpfuse walkthrough --rounds 1 --steps 3 --out quick", "a first look: one short round"),
                   ))
    p.add_argument("--device", help="cpu | cuda (default cuda when present)")
    p.add_argument("--dtype", help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--out", help="results folder (default: a new ./mlpfuse-results/walkthrough-<device>/<date-time>); "
                   "one holding an earlier run's results needs --force")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds an earlier run's "
                   "results (files of the same name are replaced)")
    p.add_argument("--steps", type=int, default=STEPS,
                   help=f"profiled steps per case and round: 1 wait, 1 warm-up, rest active (default {STEPS})")
    p.add_argument("--rounds", type=int, default=3,
                   help="profiled runs of every case, interleaved (eager, compile, mlpfuse; then compile, mlpfuse, "
                        "eager; ...); the tables show the median over rounds with its min-max (default 3)")
    from mlpfuse._host import DEFAULT_THREADS, THREADS_HELP

    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    p.set_defaults(func=run)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _positive(value, flag: str, low: int) -> None:
    from mlpfuse.errors import InputError

    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{flag}: expected an integer >= {low}, got {value!r}")


def run(args) -> int:
    from mlpfuse import workloads
    from mlpfuse.errors import InputError

    device = workloads.resolve_device(args.device)
    if args.steps < 3:
        raise InputError(f"--steps: expected >= 3 (1 wait + 1 warm-up + >= 1 active), got {args.steps}")
    _positive(args.threads, "--threads", 1)
    _positive(getattr(args, "rounds", 3), "--rounds", 1)
    from mlpfuse import _outputs

    out = _outputs.prepare(args.out, default=os.path.join("mlpfuse-results", f"walkthrough-{device.split(':')[0]}"),
                           force=args.force)
    from mlpfuse import _host

    with _host.cli_run(args.threads):
        return _run(args, device, out)


def _build_cases(device, dtype, console, failed) -> dict:
    """Every case's workload, built once: the rounds then profile the same modules (compiled once)."""
    from mlpfuse import workloads
    from mlpfuse.errors import InputError

    built = {}
    for case, workload, variant in CASES:
        if workloads.unavailable(workload, device):  # the FP8 cases: a device without FP8 tensor cores leaves
            continue  # them out (a CPU run's summary says where they run; a GPU run prints one note)
        ok, reason = workloads.VARIANTS[variant].available()
        if not ok:
            failed[case] = f"unavailable: {reason}"
            console.print(f"[yellow]{case}: skipped ({failed[case]})[/yellow]")
            continue
        try:
            built[case] = workloads.build(workload, variant=variant, device=device, dtype=dtype)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, and the walkthrough goes on
            failed[case] = _one_line(exc)
            console.print(f"[red]{case}: failed ({failed[case]})[/red]")
    return built


def round_order(cases: list[str], r: int) -> list[str]:
    """The cases in round r's order: each workload's variants together, in a carry-over-balanced order (a Williams
    design: rounds alternate between an order turned by r // 2 places and that order reversed; over 2·n rounds
    every variant runs right after every other one equally often). The design is laid over eager, mlpfuse, then
    the rest, so that in the first three rounds — eager, mlpfuse, compile; compile, mlpfuse, eager; mlpfuse,
    compile, eager — each variant runs first once and the two compared, eager and mlpfuse, each follow a different
    variant in the other two (turning the order alone kept compile right before mlpfuse in two rounds of three);
    with three variants one of them must repeat its predecessor, and compile does."""
    groups: dict[str, list[str]] = {}
    for case in cases:
        groups.setdefault(_WORKLOAD_OF[case], []).append(case)
    order = []
    for group in groups.values():
        group = sorted(group, key=lambda case: _DESIGN_RANK.get(_VARIANT_OF[case], len(_DESIGN_RANK)))
        k = (r // 2) % len(group)
        turned = group[k:] + group[:k]
        order += turned[::-1] if r % 2 else turned
    return order


def _profile_rounds(args, built, staging, console, failed):
    """Each case profiled once per round, the cases interleaved; a case that fails is dropped with its reason."""
    from mlpfuse.errors import InputError
    from mlpfuse.profiling import profile
    from mlpfuse.commands.walkthrough_rounds import Rounds

    rounds = Rounds({case: (workload, variant) for case, workload, variant in CASES if case in built})
    for r in range(args.rounds):
        console.rule(f"round {r + 1} of {args.rounds}")
        for case in round_order(list(built), r):
            b = built[case]
            if case in failed:
                continue
            try:
                result = profile(b.fn, b.x, steps=args.steps, wait=1, warmup=1, active=args.steps - 2, label=case,
                                 trace_path=os.path.join(staging, f"{case}.round{r + 1}.pt.trace.json.gz"),
                                 threads=None)  # pinned once for the whole walkthrough (--threads)
            except InputError:
                raise
            except Exception as exc:  # e.g. torch.compile without a working C++ compiler: record it and go on
                failed[case] = _one_line(exc)
                rounds.drop(case)
                console.print(f"[red]{case}: failed ({failed[case]})[/red]")
                continue
            rounds.add(r, case, result)
            p = result.per_step
            gpu = f", GPU busy {p['gpu_busy_us']:.1f} us" if rounds.gpu(case) else ""
            console.print(f"{case}: step {p['step_us']:.1f} us{gpu}", markup=False, highlight=False)
    return rounds


def _keep_median_traces(out, staging, rounds) -> None:
    """The median round's trace of each case becomes `<case>.pt.trace.json.gz`; the other rounds' are removed."""
    import shutil

    for case in rounds.runs:
        analysis = rounds.representative(case)
        final = os.path.join(out, f"{case}.pt.trace.json.gz")
        os.replace(os.path.join(staging, f"{case}.round{rounds.median_round(case) + 1}.pt.trace.json.gz"), final)
        analysis.data["trace"] = final
    shutil.rmtree(staging, ignore_errors=True)


def _run(args, device: str, out: str) -> int:
    from mlpfuse._console import Console

    from mlpfuse import workloads
    from mlpfuse._io import atomic_write_text
    from mlpfuse._outputs import literal
    from mlpfuse.profiling import diff, render
    from mlpfuse.commands.walkthrough_rounds import readme_table, verdicts

    console = Console()
    failed = {}
    started = time.perf_counter()
    import torch
    from mlpfuse.ops import dispatch

    fp8_note = workloads.fp8_unavailable(device) if device.startswith("cuda") else None
    for note in (dispatch.take_triton_note(), dispatch.untuned_note(torch.device(device)),
                 fp8_note and f"the MLP in FP8 (geglu-mlp-fp8) is left out: it {fp8_note}"):
        if note:
            console.print(f"note: {note}", markup=False)
    built = _build_cases(device, args.dtype, console, failed)
    described = {case: b.describe() for case, b in built.items()}
    staging = os.path.join(out, "rounds")
    os.makedirs(staging, exist_ok=True)
    # The folder above holds the run's own note; this one is for whoever opens rounds/ itself after a stopped run
    # (a finished run removes the folder, note and all).
    from mlpfuse._outputs import NOTE

    atomic_write_text(os.path.join(staging, NOTE), "Every case's trace of every round, while the walkthrough runs: "
                      "when it finishes it keeps each case's median round in the folder above and removes this "
                      "folder. If you can read this, the run did not finish and these traces are partial.\n")
    rounds = _profile_rounds(args, built, staging, console, failed)
    _keep_median_traces(out, staging, rounds)

    analyses = {}
    for case in rounds.runs:
        result = analyses[case] = rounds.representative(case)
        data = result.to_dict()
        data["workload"] = described[case]
        atomic_write_text(os.path.join(out, f"{case}.analysis.json"), json.dumps(data, indent=1))
        console.rule(f"{case}: {described[case]} (round {rounds.median_round(case) + 1}: the median step of "
                     f"{rounds.count})")
        tables = render.analysis_tables(data, console.width)
        console.print(tables[0])
        console.print(tables[1])  # the kernel table, or the CPU op table on a CPU-only run
        console.print(render.verdict_line(data))

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

    _print_rounds(rounds, console)
    sentences = verdicts(rounds)
    gpu_name = _gpu_name(analyses)
    summary = _summary_md(device, analyses, described, failed, diffs, time.perf_counter() - started, args.threads,
                          rounds, sentences, gpu_name)
    atomic_write_text(os.path.join(out, "summary.md"), summary)
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(
        {"device": device, "gpu": gpu_name, "threads": args.threads, "rounds": rounds.to_dict(),
         "verdicts": sentences, "cases": {c: a.to_dict() for c, a in analyses.items()}, "failed": failed,
         "diffs": diffs}, indent=1))
    atomic_write_text(os.path.join(out, "readme-table.md"),
                      readme_table(rounds, gpu_name or f"CPU ({device})", _command(args), _versions(analyses)))
    report = _report(out, device, analyses, described, failed, diffs, rounds, sentences)
    for case, reason in failed.items():
        console.print(f"not run: {case} — {reason}", markup=False, highlight=False, style="yellow")
    console.print(literal("results: ", out, "/ (report.html, summary.md, readme-table.md, traces *.pt.trace.json.gz "
                          "open in https://ui.perfetto.dev)"))
    console.print(literal("report: ", report))
    return 0


def _gpu_name(analyses) -> str:
    return ", ".join(sorted({d for a in analyses.values() for d in a.data.get("devices", [])}))


def _versions(analyses) -> str:
    import torch

    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"Triton {triton.__version__}")
    except ImportError:
        pass
    dtypes = sorted({a.data.get("workload", "").rpartition("dtype=")[2].split()[0] for a in analyses.values()
                     if "dtype=" in a.data.get("workload", "")})
    return ", ".join(parts + dtypes)


def _command(args) -> str:
    """The command line that repeats this run (its non-default flags)."""
    words = ["python3 -m mlpfuse walkthrough"]
    for flag, value, default in (("--device", args.device, None), ("--dtype", args.dtype, None),
                                 ("--out", args.out, None), ("--steps", args.steps, STEPS),
                                 ("--rounds", getattr(args, "rounds", 3), 3), ("--threads", args.threads, 1)):
        if value is not None and value != default:
            words.append(f"{flag} {value}")
    return " ".join(words)


def _print_rounds(rounds, console) -> None:
    from rich.table import Table

    from mlpfuse.profiling.render import cell
    from mlpfuse.commands.walkthrough_rounds import FIGURES, cells, verdicts

    n = rounds.count
    table = Table(title=f"Median over {n} interleaved round{'s' * (n != 1)} (min–max)")
    for head in ["case", *(h for _, h, _ in FIGURES), "verdict"]:
        table.add_column(head, justify="left" if head in ("case", "verdict") else "right")
    for case in rounds.runs:
        table.add_row(*(cell(v) for v in [case, *cells(rounds, case), rounds.representative(case).verdict["kind"]]))
    console.print(table)
    for sentence in verdicts(rounds):
        console.print(cell(sentence))


def _report(out, device, analyses, described, failed, diffs, rounds, sentences) -> str:
    from mlpfuse.report import Variant, write

    variants = []
    for case, _, _ in CASES:
        if case in analyses:
            variants.append(Variant(case, analyses[case].to_dict(), about=described[case],
                                    trace_path=os.path.join(out, f"{case}.pt.trace.json.gz")))
        elif case in failed:
            variants.append(Variant(case, error=failed[case]))
    known = {case for case, _, _ in CASES}
    # the model step, skipped or failed: its place on the page says why
    variants += [Variant(case, error=reason) for case, reason in failed.items() if case not in known]
    notes = [f"Not run: {case} — {reason}" for case, reason in failed.items()]
    if not any(a.data.get("devices") for a in analyses.values()):
        notes.append("No GPU in this run: the pages show CPU ops only, and n/a where a CPU run measures nothing "
                     "(GPU window, busy and idle time, kernels, launches). Kernels, launches, GPU lanes and the "
                     "fused MLP's story need a CUDA device.")
    return write(os.path.join(out, "report.html"), f"mlpfuse walkthrough ({device})", variants,
                 diffs=list(diffs.items()), notes=notes, what="--out",
                 sections=[("Rounds", _rounds_html(rounds, sentences))] if rounds.runs else [])


def _rounds_html(rounds, sentences) -> str:
    from mlpfuse.report.markup import esc
    from mlpfuse.report.tables import table
    from mlpfuse.commands.walkthrough_rounds import FIGURES, cells

    n = rounds.count
    rows = [[esc(case), *map(esc, cells(rounds, case)), esc(rounds.representative(case).verdict["kind"])]
            for case in rounds.runs]
    heads = ["case", *(esc(h) for _, h, _ in FIGURES), "verdict (median round)"]
    return (f"<p>Every case was profiled in {n} interleaved round{'s' * (n != 1)} (eager, compile, mlpfuse; "
            "then compile, mlpfuse, eager; ...): each figure is the median over rounds, with the rounds' min–max in "
            "brackets. The sections below show each case's median round.</p>"
            + table(heads, rows, "rounds", numeric=range(1, len(FIGURES) + 1))
            + "<ul>" + "".join(f"<li>{esc(s, 2000)}</li>" for s in sentences) + "</ul>")


# What a run on the CPU can tell, said once in its summary.
CPU_NOTE = (
    "This run used the CPU, so its traces hold CPU ops only. They show which ATen ops each variant dispatches "
    "(nn.Linear's `aten::t` is metadata only, its bias is folded into `aten::addmm`, torch.compile removes the view "
    "ops, mlpfuse's modules appear as one `mlpfuse::` op) and the CPU time of each. They cannot show the kernel "
    "story: which GEMM kernels run, what gets fused, launches, GPU busy and idle time. That needs CUDA: run "
    "`mlpfuse walkthrough` on a machine with a GPU (one with FP8 tensor cores, compute capability 8.9+, also "
    "profiles the MLP in FP8). CPU step times are wall times of the CPU kernels, noisy on a "
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


def _summary_md(device, analyses, described, failed, diffs, seconds, threads, rounds, sentences, gpu_name) -> str:
    from mlpfuse.profiling.render import short
    from mlpfuse.commands.walkthrough_rounds import FIGURES, markdown_table

    lines = [f"# mlpfuse walkthrough ({device})", ""]
    n = rounds.count
    lines += [f"GPU: {gpu_name or 'none (CPU activity only)'}; {n} interleaved round{'s' * (n != 1)}; total time "
              f"{seconds:.0f} s.", ""]
    if not device.startswith("cuda"):
        lines += [CPU_NOTE.format(threads=threads), ""]
    if failed:
        lines += ["Not run:", ""] + [f"- {case}: {reason}" for case, reason in failed.items()] + [""]
    lines += ["Median over the rounds, min–max in brackets; n/a where this run cannot measure the figure.", ""]
    lines += markdown_table(rounds, described)
    for case, reason in failed.items():
        lines.append(f"| {case} | - | " + "- | " * len(FIGURES) + f"not run: {reason} |")
    lines.append("")
    if sentences:
        lines += ["## Verdicts", ""] + [f"- {s}" for s in sentences] + [""]
    for case, a in analyses.items():
        lines += [f"## {case}", "", f"- the median round: round {rounds.median_round(case) + 1} of {n}"]
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
