"""`mlpfuse profile`, `mlpfuse analyze`, `mlpfuse diff`.

analyze and diff never import torch (they start in well under a second); profile imports it when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from mlpfuse import _outputs
from mlpfuse.errors import InputError, printable
from mlpfuse.profiling.steps import AUTO, SOURCES

_SIZE_OPTIONS = {
    "linear": ("batch", "in_dim", "out_dim"),
    "geglu-mlp": ("batch", "seq", "dim", "hidden"),
    "geglu-mlp-fp8": ("batch", "seq", "dim", "hidden"),
}


DEFAULT_OUT = os.path.join("mlpfuse-results", "profile")
DEFAULT_STEPS = 5
_MAX_BYTES_HELP = ("most bytes read from a trace file or inflated from its gzip, e.g. 500M or 8G "
                   "(default $MLPFUSE_MAX_TRACE_BYTES, else 2G)")
_HTML_HELP = "also write a self-contained HTML report (timeline, flamegraph, tables) to FILE"


# The examples of analyze and diff read what profile's examples write (tests/test_cli_help.py runs them in order).
_AFTER_PROFILE = "eager/ and fused/: the folders `mlpfuse profile --help`'s first two examples write."

ANALYZE = """\
Per-step kernels, launches, CPU ops, GPU idle time and a verdict, from a Chrome/Kineto trace (torch.profiler's
export_chrome_trace or tensorboard_trace_handler; .json or .json.gz) or from a saved `analyze --json` file. A folder
of per-rank traces: each rank, the ranks merged, communication and skew.
"""

DIFF = """\
What changed between two traces (or saved analyses) of the same step: kernels removed, added and unchanged, grouped
by the op that launched them, CPU ops gone and new, and the per-step figures side by side. A folder of per-rank
traces alone compares two of its ranks (default: the fastest and the slowest).
"""

PROFILE = """\
Capture a trace with torch.profiler and analyse it: kernels, launches and CPU ops per step, GPU idle time, a
verdict; --expect turns the figures into checks (exit 1 when one fails). What runs: your own script, after `--`
(`mlpfuse profile -- python train.py ARGS`: in this process, a step ending at each optimizer.step(), or at each
return of --step-fn NAME); a built-in workload (linear, geglu-mlp, geglu-mlp-fp8); or, with --model, a small
transformers model (one decoder layer by default) eager and after mlpfuse.patch, with what changed. Each run writes its trace,
analysis JSON and report.html to a results folder (--out).
"""


def register(subparsers) -> None:
    from mlpfuse.commands._help import add_parser, examples

    p = add_parser(subparsers, "analyze", help="analyse a Chrome/Kineto trace (.json or .json.gz)",
                   description=ANALYZE, epilog=examples(
                       ("mlpfuse analyze eager/*.trace.json.gz", "tables and a verdict"),
                       ("mlpfuse analyze eager/*.trace.json.gz --json", "the same as JSON (docs/profiler.md)"),
                       ("mlpfuse analyze eager/*.trace.json.gz --html eager.html", "a page with a timeline"),
                   ) + "\n\n" + _AFTER_PROFILE)
    p.add_argument("trace", metavar="TRACE", help="trace file (.json or .json.gz), a saved `analyze --json` file, "
                                                  "or a folder holding one trace per rank of a run")
    p.add_argument("--allow-missing-ranks", action="store_true",
                   help="folder: analyse the ranks present when some of the run's ranks have no trace")
    p.add_argument("--label", metavar="NAME",
                   help="use the spans of this record_function label as steps (any name, '## ...' ones included)")
    p.add_argument("--steps-from", choices=SOURCES, default=AUTO,
                   help="where steps come from: ProfilerStep#N spans, --label spans, or the whole trace as one window "
                        "(default auto: ProfilerStep#N spans, else the whole trace)")
    p.add_argument("--map", metavar="MAP", help="the map of the CUDA graph the trace replays (written by "
                   "mlpfuse.profiling.record_graph_map): replayed kernels are attributed to modules through it "
                   "(default: TRACE's name with .map.json, when that file exists)")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON (schema in docs/profiler.md)")
    p.add_argument("--max-bytes", metavar="SIZE", help=_MAX_BYTES_HELP)
    p.add_argument("--html", metavar="FILE", help=_HTML_HELP)
    p.set_defaults(func=run_analyze)

    p = add_parser(subparsers, "diff", help="what changed between two traces (or saved analysis JSON)",
                   description=DIFF, epilog=examples(
                       ("mlpfuse diff eager/*.trace.json.gz fused/*.trace.json.gz", "kernels and ops, both ways"),
                       ("mlpfuse diff eager/*.analysis.json fused/*.analysis.json --json", "as JSON"),
                   ) + "\n\n" + _AFTER_PROFILE)
    p.add_argument("a", metavar="A", help="the trace (or saved analysis) before the change, or a folder of per-rank "
                                          "traces (then B is left out)")
    p.add_argument("b", metavar="B", nargs="?", help="the trace (or saved analysis) after the change")
    p.add_argument("--ranks", metavar="R,S", help="folder: the two ranks to compare (default: fastest, slowest)")
    p.add_argument("--allow-missing-ranks", action="store_true",
                   help="folder: use the ranks present when some of the run's ranks have no trace")
    p.add_argument("--json", action="store_true", help="print the diff as JSON (schema in docs/profiler.md)")
    p.add_argument("--max-bytes", metavar="SIZE", help=_MAX_BYTES_HELP)
    p.add_argument("--html", metavar="FILE", help=_HTML_HELP)
    p.set_defaults(func=run_diff)

    from mlpfuse._host import DEFAULT_THREADS, THREADS_HELP

    p = add_parser(subparsers, "profile", help="profile your own script (-- python SCRIPT.py ARGS), a built-in "
                   "workload (linear, geglu-mlp, geglu-mlp-fp8), or one layer of a transformers model before and "
                   "after mlpfuse.patch (--model)",
                   description=PROFILE, epilog=examples(
                       ("mlpfuse profile geglu-mlp --out eager", "a GeGLU MLP, eager"),
                       ("mlpfuse profile geglu-mlp --variant mlpfuse --out fused", "the same, mlpfuse's GatedMLP"),
                       ("mlpfuse profile --model llama3-8b", "one Llama-3-8B-shaped layer, eager and patched"),
                   ))
    # nargs="*": after `--` come a script and its own arguments (argparse drops the `--`); else one workload name.
    p.add_argument("workload", metavar="WORKLOAD", nargs="*",
                   help="linear | geglu-mlp | geglu-mlp-fp8 (or give --model); or `-- python SCRIPT.py ARGS` "
                        "(also `-- SCRIPT.py ARGS`, "
                        "`-- python -m MODULE ARGS`): your script, run in this process, a step ending at each "
                        "torch.optim.Optimizer.step()")
    p.add_argument("--step-fn", metavar="NAME",
                   help="script: a step ends each time the function NAME, defined at top level in the script, "
                        "returns (instead of at each optimizer step)")
    p.add_argument("--map", metavar="MAP",
                   help="script: the map of the CUDA graph your script replays, written by it with "
                        "mlpfuse.profiling.record_graph_map: the replays' kernels are attributed to modules")
    model = p.add_argument_group("a model's layer before and after mlpfuse.patch (needs transformers)")
    model.add_argument("--model", help="llama3-8b, gemma2-2b, qwen3-4b, gpt2, bert-base, or a local model folder")
    model.add_argument("--layers", type=int, default=1, help="decoder layers to build (default 1)")
    model.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                       help="toy widths (default on CPU; the published widths on CUDA)")
    model.add_argument("--tokens", help="BATCHxSEQ of the prompt (default 1x2048 on CUDA, 1x64 on CPU)")
    model.add_argument("--by-module", action="store_true",
                       help="also GPU time per module path (model.layers.*.mlp, ...), both sides; each module call "
                            "then opens a profiler annotation, a few us of host time each (docs/profiler.md)")
    model.add_argument("--decode-step", action="store_true",
                       help="profile one decode step with a static cache after the prompt instead of the prompt's "
                            "forward: on CUDA replayed from a CUDA graph, its kernels attributed to modules through "
                            "a map of the eager step (implies --by-module)")
    sizes = p.add_argument_group("sizes (defaults: walkthrough shapes on CUDA, small ones on CPU)")
    sizes.add_argument("--batch", type=int, help="rows of x (linear) or sequences (geglu-mlp, geglu-mlp-fp8)")
    sizes.add_argument("--in-dim", type=int, help="linear: input features")
    sizes.add_argument("--out-dim", type=int, help="linear: output features")
    sizes.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None, help="linear: bias (default on)")
    sizes.add_argument("--seq", type=int, help="geglu-mlp(-fp8): tokens per sequence")
    sizes.add_argument("--dim", type=int, help="geglu-mlp(-fp8): model width")
    sizes.add_argument("--hidden", type=int, help="geglu-mlp(-fp8): hidden width")
    p.add_argument("--dtype", help="bf16 | fp16 | fp32 (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", help="cpu | cuda (default cuda when present)")
    p.add_argument("--compile", action="store_true", help="same as --variant compile")
    p.add_argument("--variant", default=None, help="eager | compile | mlpfuse (default eager)")
    p.add_argument("--steps", type=int, help="workloads: steps run in all (>= wait + warmup + active; default 5); "
                   "a script runs its own loop")
    p.add_argument("--wait", type=int, default=1, help="steps run before the profiler starts (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="profiled steps thrown away as warm-up (default 1)")
    p.add_argument("--active", type=int, default=3, help="steps recorded and analysed (default 3)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    p.add_argument("--out", help="folder for trace, JSON and report.html (default: a new "
                   "mlpfuse-results/profile/<date-time>); one holding an earlier run's results needs --force")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds an earlier run's "
                   "results (files of the same name are replaced)")
    p.add_argument("--expect", action="append", default=[], metavar="EXPR",
                   help="kernels=N, launches=N, FAMILY=N, op=NAME, no-op=NAME, kernel~=TEXT (repeatable)")
    p.add_argument("--json", action="store_true", help="print the analysis and expectation results as JSON")
    p.set_defaults(func=run_profile)


def _dump(obj) -> None:
    # Strict JSON: the analysis holds finite numbers only, and a NaN that slipped through fails loudly here.
    json.dump(obj, sys.stdout, indent=1, allow_nan=False)
    sys.stdout.write("\n")


def _write_json(path: str, obj) -> None:
    """Write whole or not at all: a temporary file in the same folder, renamed over `path` (concurrent runs on
    one --out leave one complete file, never a mix)."""
    folder = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(obj, fh, indent=1, allow_nan=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise InputError(f"--out: cannot write {path} ({exc.strerror or exc})") from None


def run_analyze(args) -> int:
    if os.path.isdir(args.trace):
        from mlpfuse.profiling.ranks import run_analyze_dir

        return run_analyze_dir(args, _dump)
    from mlpfuse.profiling import render
    from mlpfuse.profiling.analysis import analyze

    if args.html:
        from mlpfuse.report import analyze_to_html

        result = analyze_to_html(args.trace, args.html, label=args.label, max_bytes=args.max_bytes,
                                 steps_from=args.steps_from, graph_map=args.map)
        print(f"report: {printable(args.html)}", file=sys.stderr)
    else:
        result = analyze(args.trace, label=args.label, max_bytes=args.max_bytes, steps_from=args.steps_from,
                         graph_map=args.map)
    if args.json:
        _dump(result.to_dict())
    else:
        render.print_analysis(result.to_dict())
    return 0


def run_diff(args) -> int:
    if os.path.isdir(args.a) and args.b is None:
        from mlpfuse.profiling.ranks import run_diff_dir

        return run_diff_dir(args, _dump)
    if args.b is None:
        raise InputError("B: expected a second trace (B may be left out only when A is a folder of per-rank traces)")
    if args.ranks is not None:
        raise InputError("--ranks: applies when A is a folder of per-rank traces")
    from mlpfuse.profiling import render
    from mlpfuse.profiling.diff import diff

    if args.html:
        from mlpfuse.report import diff_to_html

        result = diff_to_html(args.a, args.b, args.html, max_bytes=args.max_bytes)
        print(f"report: {printable(args.html)}", file=sys.stderr)
    else:
        result = diff(args.a, args.b, max_bytes=args.max_bytes)
    if args.json:
        _dump(result.to_dict())
    else:
        render.print_diff(result.to_dict())
    return 0


def _triton_note() -> None:
    """Where Triton is missing, say once, as a line of its own, that the mlpfuse side runs its PyTorch path."""
    from mlpfuse.ops import dispatch

    note = dispatch.take_triton_note()
    if note:
        print(f"note: {note}", file=sys.stderr)


def run_profile(args) -> int:
    from mlpfuse.profiling.script import looks_like_command

    words = list(args.workload or [])
    if words[:1] == ["--"]:  # some Python versions keep it
        words = words[1:]
    if len(words) > 1 and words[0] in _SIZE_OPTIONS:
        raise InputError(f"WORKLOAD: expected one workload, got {' '.join(words)!r}")
    if looks_like_command(words):
        from mlpfuse.commands.profile_script import run_script_profile

        return run_script_profile(args, words)
    for flag, given in (("--step-fn", args.step_fn is not None), ("--map", args.map is not None)):
        if given:
            raise InputError(f"{flag}: applies to a script (mlpfuse profile -- python SCRIPT.py ARGS)")
    args.workload = words[0] if words else None
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if args.model is not None:
        return run_model_profile(args)
    for flag, given in (("--tiny", args.tiny is not None), ("--tokens", args.tokens is not None),
                        ("--layers", args.layers != 1), ("--by-module", args.by_module),
                        ("--decode-step", args.decode_step)):
        if given:
            raise InputError(f"{flag}: applies with --model only")
    if args.workload is None:
        raise InputError(f"WORKLOAD: expected one of {', '.join(_SIZE_OPTIONS)} (or --model NAME)")
    from mlpfuse.profiling import expect as expect_mod

    from mlpfuse.profiling.capture import check_schedule

    for e in args.expect:  # fail on a typo before spending time on capture
        expect_mod.parse(e)
    check_schedule(args.steps, args.wait, args.warmup, args.active)
    variant = args.variant or ("compile" if args.compile else "eager")
    if args.compile and variant != "compile":
        raise InputError(f"--compile conflicts with --variant {variant}")
    workload = args.workload
    if workload not in _SIZE_OPTIONS:
        raise InputError(f"WORKLOAD: expected one of {', '.join(_SIZE_OPTIONS)}, got {workload!r} (your own "
                         "script: mlpfuse profile -- python SCRIPT.py ARGS)")
    all_sizes = {"batch", "in_dim", "out_dim", "seq", "dim", "hidden"}
    wrong = [k for k in all_sizes - set(_SIZE_OPTIONS[workload]) if getattr(args, k) is not None]
    if wrong:
        raise InputError(f"{workload}: option(s) {', '.join('--' + w.replace('_', '-') for w in sorted(wrong))} "
                         f"do not apply; expected {', '.join('--' + s.replace('_', '-') for s in _SIZE_OPTIONS[workload])}")
    if args.bias is not None and workload != "linear":
        raise InputError("--bias/--no-bias: applies to the linear workload only")

    from mlpfuse import _host, workloads
    from mlpfuse.profiling import profile

    _host.check_threads(args.threads, "--threads")
    sizes = {k: getattr(args, k) for k in _SIZE_OPTIONS[workload]}
    if variant == "mlpfuse":
        _triton_note()
    built = workloads.build(workload, variant=variant, device=args.device, dtype=args.dtype, bias=args.bias, **sizes)
    args.out = _outputs.prepare(args.out, default=DEFAULT_OUT, force=args.force)
    trace_path = os.path.join(args.out, f"{built.label}.pt.trace.json.gz")
    if not args.json:
        print(f"profiling {built.describe()}", file=sys.stderr)
    with _host.cli_run(args.threads):
        result = profile(built.fn, built.x, steps=args.steps, wait=args.wait, warmup=args.warmup,
                         active=args.active, label=built.label, trace_path=trace_path, expect=args.expect,
                         threads=None)  # pinned by cli_run
    data = result.to_dict()
    data["workload"] = built.describe()
    return write_results(args, built.label, data, trace_path, built.describe(), result.expectations)


def write_results(args, label: str, data: dict, trace_path: str, about: str, expectations: list) -> int:
    """What every single-trace profile leaves: `<label>.analysis.json` and report.html in args.out, then the tables
    (or --json) on stdout. The exit code: 1 when an expectation is broken."""
    from mlpfuse.profiling import render
    from mlpfuse.report import Variant, write

    _write_json(os.path.join(args.out, f"{label}.analysis.json"), data)
    report = write(os.path.join(args.out, "report.html"), f"mlpfuse profile: {label}",
                   [Variant(label, data, trace_path=trace_path, about=about)], what="--out")
    if args.json:
        _dump({**data, "expectations": [r.to_dict() for r in expectations]})
    else:
        render.print_analysis(data)
        render.print_expectations(expectations)
        print(f"trace: {printable(trace_path)}  (open in https://ui.perfetto.dev)")
        print(f"report: {printable(report)}")
    return 1 if any(not r.ok for r in expectations) else 0


def run_model_profile(args) -> int:
    """`mlpfuse profile --model NAME`: one layer eager and patched, each analysis, then the diff."""
    from mlpfuse.profiling.capture import check_schedule

    if args.workload is not None:
        raise InputError(f"WORKLOAD: give a workload or --model, not both (got {args.workload!r} and --model)")
    wrong = [f"--{k.replace('_', '-')}" for k in ("batch", "in_dim", "out_dim", "seq", "dim", "hidden")
             if getattr(args, k) is not None]
    if wrong or args.bias is not None or args.compile or args.variant or args.expect:
        flags = wrong + [f for f, on in (("--bias", args.bias is not None), ("--compile", args.compile),
                                         ("--variant", args.variant), ("--expect", args.expect)) if on]
        raise InputError(f"{flags[0]}: does not apply with --model")
    if args.layers < 1:
        raise InputError(f"--layers: expected an integer >= 1, got {args.layers}")
    check_schedule(args.steps, args.wait, args.warmup, args.active)
    from mlpfuse import _host

    _host.check_threads(args.threads, "--threads")
    from mlpfuse.bench import model_diff, model_lab, models
    from mlpfuse.profiling import render

    models.resolve(args.model)
    models.transformers_or_error()
    if args.tokens is not None and len(model_lab.parse_shapes(args.tokens, ())) != 1:
        raise InputError(f"--tokens: expected one BATCHxSEQ shape for a profile, got {args.tokens!r}")
    args.out = _outputs.prepare(args.out, default=DEFAULT_OUT, force=args.force)
    _triton_note()
    if not args.json:
        print(f"profiling {printable(args.model)} ({args.layers} layer{'s' if args.layers > 1 else ''}) eager and "
              "patched", file=sys.stderr)
    with _host.cli_run(args.threads):
        result = model_diff.profile_model(args.model, layers=args.layers, tiny=args.tiny, tokens=args.tokens,
                                          device=args.device, dtype=args.dtype, out=args.out, steps=args.steps,
                                          wait=args.wait, warmup=args.warmup, active=args.active,
                                          by_module=args.by_module or args.decode_step,
                                          decode_step=args.decode_step)
    data = {"model": result.label, "patch": result.report.to_dict(), "eager": result.before.to_dict(),
            "mlpfuse": result.after.to_dict(), "diff": result.diff.to_dict()}
    _write_json(os.path.join(args.out, "model-diff.json"), data)
    report = _model_report(args.out, result, data)
    if args.json:
        _dump(data)
        return 0
    print(result.report.summary())
    for side in ("eager", "mlpfuse"):
        print(f"\n{printable(result.label)} [{side}]")
        render.print_analysis(data[side])
    print(f"\ndiff {printable(result.label)}: eager -> mlpfuse")
    render.print_diff(data["diff"])
    print(f"traces: {printable(args.out)}/model-eager.pt.trace.json.gz, model-mlpfuse.pt.trace.json.gz")
    print(f"report: {printable(report)}")
    return 0


def _model_report(out: str, result, data: dict) -> str:
    """report.html of a --model run: both sides in depth, their diff, and what mlpfuse.patch swapped."""
    from mlpfuse.report import Variant, write

    sides = [Variant(f"model-{side}", data[side], about=f"{result.label} [{side}]",
                     trace_path=os.path.join(out, f"model-{side}.pt.trace.json.gz")) for side in ("eager", "mlpfuse")]
    return write(os.path.join(out, "report.html"), f"mlpfuse profile --model: {result.label}", sides,
                 diffs=[(f"{result.label}: eager -> mlpfuse.patch", data["diff"])],
                 notes=result.report.summary().splitlines(), what="--out")
