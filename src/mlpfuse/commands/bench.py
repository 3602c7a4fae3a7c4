"""`mlpfuse bench`: parse the flags, run the grid with a progress bar, print the table, write the files."""

from __future__ import annotations

import shlex
from pathlib import Path

from mlpfuse import _outputs
from mlpfuse.commands._help import add_parser, examples
from mlpfuse.errors import InputError

DESCRIPTION = """\
Benchmark every variant of an MLP block on the same weights and inputs: outputs checked against fp64 first, then
GPU time (CUDA events), wall time per call, kernels and launches per call, peak memory and the distance to this
device's measured roofline. Variants are timed in interleaved rounds; the tables show medians with their spread.

Presets (--list): blog (GeGLU 8192x768x3072 bf16, the default on CUDA), llama-8b, gemma-2b, decode (1..64 tokens x
4096x14336), small (the default on a CPU). --model runs a whole transformers model instead (the model lab: eager,
compile, liger, mlpfuse, mlpfuse-compile; prefill, decode, train), e.g. --model llama3-8b --tokens 1x8192 on a GPU,
or a local model folder.
"""

EPILOG = examples(
    ("mlpfuse bench", "the default preset, every variant"),
    ("mlpfuse bench --list", "presets, workloads and variants"),
    ("mlpfuse bench --tokens 1,256 --dim 256 --hidden 1024 --variants eager,mlpfuse", "your own sizes"),
    ("mlpfuse bench --model llama3-8b --tiny --mode prefill --variants eager,mlpfuse", "the model lab, toy widths"),
) + """

exit status: 0 ok, 1 a variant disagreed with the fp64 reference (model lab: gave non-finite logits), 2 bad input.
"""


def register(subparsers) -> None:
    p = add_parser(subparsers, "bench", help="benchmark eager, torch.compile, Liger, CUDA graphs and mlpfuse side by "
                   "side", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--preset", help="comma list of blog, llama-8b, gemma-2b, decode, small (default blog; small on CPU)")
    p.add_argument("--tokens", help="comma list of token counts; AxB means batch x sequence (e.g. 1,64,4x2048)")
    p.add_argument("--dim", help="comma list of model dims (D)")
    p.add_argument("--hidden", help="comma list of hidden sizes (H)")
    p.add_argument("--dtype", help="comma list of bf16, fp16, fp32 (default bf16; fp32 on CPU)")
    p.add_argument("--activation", help="comma list for gated/mlp/linear workloads (default gelu_tanh)")
    p.add_argument("--workload", help="comma list of geglu, swiglu, gated, mlp, linear (default geglu)")
    p.add_argument("--mode", help="comma list of fwd, fwd+bwd (default fwd)")
    p.add_argument("--variants", help="comma list of variants or 'all' (see --list)")
    p.add_argument("--compile-mode", help="mode of the compile variant: default, max-autotune, reduce-overhead")
    p.add_argument("--precision", help="fp8: without --variants, bf16's rows beside the FP8 ones (the FP8 GEMMs "
                   "alone, the compiled _scaled_mm chain, torchao float8, mlpfuse FP8), each with its error")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cuda, cuda:N or cpu")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 10 on GPU, 3 on CPU)")
    p.add_argument("--target-ms", type=float, help="time per variant per round (default 20 ms on GPU, 50 on CPU)")
    p.add_argument("--no-profile", action="store_true", help="skip counting kernels and launches per call")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--remeasure-peaks", action="store_true", help="measure this device's GEMM peak and bandwidth again")
    p.add_argument("--out", help="output folder (default: a new ./mlpfuse-results/bench-<device>/<date-time>); one "
                   "holding an earlier run's results needs --force")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds an earlier run's "
                   "results (files of the same name are replaced)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--list", action="store_true", help="list presets, workloads and variants, then exit")
    lab = p.add_argument_group("model lab (with --model)", "--tokens, --mode, --variants, --dtype, --rounds, "
                               "--target-ms, --device, --out and --json apply too")
    lab.add_argument("--model", help="llama3-8b, gemma2-2b, qwen3-4b, olmo2-7b, gpt2, bert-base, or a local model "
                     "folder")
    lab.add_argument("--layers", type=int, help="decoder layers to build (default: the model's own count)")
    lab.add_argument("--tiny", action="store_true", help="the built-in model at toy widths (CPU runs, tests)")
    lab.add_argument("--new-tokens", type=int, help="decode: tokens generated per timed call (default 32)")
    lab.add_argument("--backend", help="mlpfuse backend of the patched variants: auto, triton, torch (default auto)")
    lab.add_argument("--compile-backend", help="torch.compile backend of the compile variants (default inductor; "
                     "aot_eager compiles fast, for checks)")
    p.set_defaults(func=run_command)


def _device(text: str):
    import torch

    text = (text or "auto").lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise InputError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device: CUDA was asked for but torch sees no CUDA device")
    return device


def _print_list() -> int:
    from mlpfuse.bench import presets, variants

    print("presets:")
    for name, p in presets.PRESETS.items():
        tokens = ",".join(map(str, p.tokens))
        print(f"  {name:10s} tokens {tokens} x dim {p.dim} x hidden {p.hidden}: {p.about}")
    print("workloads:")
    for name, about in presets.WORKLOAD_HELP.items():
        print(f"  {name:10s} {about}")
    print("variants (default: " + ",".join(variants.DEFAULT_VARIANTS) + "):")
    for v in variants.VARIANTS.values():
        tag = "peer" if v.peer else "mlpfuse"
        print(f"  {v.name:24s} [{tag}{', CUDA' if v.needs_cuda else ''}] {v.about}")
    return 0


_SWEEP_ONLY = ("preset", "dim", "hidden", "activation", "workload", "compile_mode", "remeasure_peaks", "no_profile",
               "no_plots")
_LAB_ONLY = ("layers", "tiny", "new_tokens", "backend", "compile_backend")


def run_command(args) -> int:
    if args.list:
        return _print_list()
    if args.model is not None:
        return run_model_lab(args)
    for name in _LAB_ONLY:
        if getattr(args, name, None) not in (None, False):
            raise InputError(f"--{name.replace('_', '-')}: applies to the model lab only (give --model)")
    from mlpfuse._console import Console

    from mlpfuse.bench import outputs, presets, roofline, sweep, variants

    # Validate everything before touching the device.
    device = _device(args.device)
    on_cpu = device.type != "cuda"
    notes: list[str] = []
    cases = presets.build_cases(
        preset=args.preset,
        tokens=args.tokens,
        dim=args.dim,
        hidden=args.hidden,
        dtype=args.dtype,
        activation=args.activation,
        workload=args.workload,
        mode=args.mode,
        on_cpu=on_cpu,
        notes=notes,
    )
    chosen = variants.parse_variants(args.variants, args.compile_mode, args.precision)
    if args.rounds is not None and args.rounds < 1:
        raise InputError(f"--rounds: expected an integer >= 1, got {args.rounds}")
    if args.target_ms is not None and args.target_ms <= 0:
        raise InputError(f"--target-ms: expected a positive number of milliseconds, got {args.target_ms}")
    settings = sweep.Settings(
        rounds=args.rounds or (3 if on_cpu else 10),
        target_ms=args.target_ms or (50.0 if on_cpu else 20.0),
        profile=not args.no_profile,
    )

    from mlpfuse.ops import dispatch

    notes += [note for note in (dispatch.take_triton_note(), dispatch.untuned_note(device)) if note]
    err = Console(stderr=True)
    out = Console() if not args.json else None
    for note in notes:
        err.print(f"[yellow]note:[/] {note}")
    folder = _out_folder(args, device)  # before the peaks: a bad --out fails before seconds of measuring
    peaks = roofline.load_peaks(
        device, sorted({c.dtype for c in cases}), remeasure=args.remeasure_peaks,
        log=lambda m: err.print(m, markup=False, highlight=False, soft_wrap=True),  # paths: never markup
    )
    if args.json:  # otherwise the table prints them
        err.print(outputs.peaks_line({"peaks": peaks.to_dict()}))

    def write_tables(result) -> list[Path]:
        result.meta["notes"] = notes
        return [
            outputs.write_json(result, folder / "results.json"),
            outputs.write_csv(result, folder / "results.csv"),
            outputs.write_markdown(result, folder / "results.md"),
        ]

    result = _run_with_progress(sweep, cases, chosen, device, peaks, settings, err, _command_line(args), write_tables)
    written = write_tables(result)
    if not args.no_plots:
        from mlpfuse.bench import plots

        written += [p for p in (plots.speedup_plot(result, folder / "speedup.png"),
                                plots.roofline_plot(result, folder / "roofline.png")) if p]
    written.append(_report(folder, result, [p for p in written if p.suffix == ".png"]))
    if args.json:
        print(outputs.to_json(result))
    else:
        outputs.print_table(result, out)
    err.print(_outputs.literal("wrote ", ", ".join(map(str, written))))
    wrong = [f"{r['variant']} on {r['case']}" for r in result.rows if r["status"] == "wrong"]
    if wrong:
        err.print("[red]disagreed with the fp64 reference:[/] " + "; ".join(wrong))
        return 1
    return 0


def _report(folder: Path, result, plots: list[Path]) -> Path:
    from mlpfuse.bench.outputs import page_layout
    from mlpfuse.report import Bench, write

    meta = result.meta
    title = f"mlpfuse bench — {meta.get('device', '')}"
    bench = Bench(rows=result.rows, plots=plots, **page_layout(meta))
    return Path(write(folder / "report.html", title, bench=bench, what="--out"))


_OPTIONS = ("preset", "tokens", "dim", "hidden", "dtype", "activation", "workload", "mode", "variants",
            "precision", "compile_mode", "device", "rounds", "target_ms", "no_profile", "no_plots", "remeasure_peaks",
            "out", "json")
_LAB_OPTIONS = ("model", "layers", "tiny", "tokens", "mode", "new_tokens", "variants", "precision", "dtype",
                "backend", "compile_backend", "device", "rounds", "target_ms", "out", "json")


def _command_line(args, options=_OPTIONS) -> str:
    """The command that reproduces this run, rebuilt from the parsed flags (however main() was called)."""
    words = ["mlpfuse", "bench"]
    for name in options:
        value = getattr(args, name, None)
        if value in (None, False) or (name == "device" and value == "auto"):
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(shlex.quote(str(value)))
    return " ".join(words)


def _out_folder(args, device, kind: str = "bench") -> Path:
    from mlpfuse.bench.roofline import device_slug

    default = str(Path("mlpfuse-results") / f"{kind}-{device_slug(device)}")
    return Path(_outputs.prepare(args.out, default=default, force=args.force))


def _run_with_progress(sweep, cases, chosen, device, peaks, settings, console, command, on_case):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("bench", total=len(cases) * len(chosen))

        def advance(n: int, description: str) -> None:
            bar.update(task, advance=n, description=description)

        return sweep.run(cases, chosen, device, peaks, settings, progress=advance, command=command, on_case=on_case)


def _lab_report(folder: Path, result) -> Path:
    """report.html beside the lab's results: the same tables as results.md, and what was run."""
    from mlpfuse.bench import lab_outputs
    from mlpfuse.report import Bench, write

    meta = result.meta
    notes = [f"Command: {meta.get('command')}", *meta.get("notes", [])]
    bench = Bench({}, result.rows, [], columns=lab_outputs.table_columns, caption=lab_outputs.case_caption)
    return Path(write(folder / "report.html", f"mlpfuse model lab ({meta.get('device')})", bench=bench, notes=notes,
                      what="--out"))


def run_model_lab(args) -> int:
    """`mlpfuse bench --model ...`: every flag checked before the model is built."""
    from mlpfuse._console import Console

    from mlpfuse.bench import footprint, lab_outputs, model_lab, models
    from mlpfuse.ops import dispatch

    for name in _SWEEP_ONLY:
        if getattr(args, name, None) not in (None, False):
            raise InputError(f"--{name.replace('_', '-')}: does not apply to the model lab (--model)")
    device = _device(args.device)
    on_cpu = device.type != "cuda"
    spec = models.resolve(args.model)
    models.transformers_or_error()
    if args.layers is not None and args.layers < 1:
        raise InputError(f"--layers: expected an integer >= 1, got {args.layers}")
    if args.tiny and not isinstance(spec, models.ModelSpec):
        raise InputError("--tiny: applies to the built-in models, not to a local folder")
    notes = []
    tiny = args.tiny
    if on_cpu and not tiny and isinstance(spec, models.ModelSpec) and args.layers is None:
        # A published model on a CPU takes hours a case (and a 32-layer fp32 Llama-3-8B is 32 GB): the same code at
        # toy widths unless the run asks for the real widths by choosing how many layers to build.
        tiny = True
        notes.append(f"on CPU the model lab runs {spec.name} at toy widths (as --tiny); give --layers N for its "
                     "published widths")
    if args.new_tokens is not None and args.new_tokens < 1:
        raise InputError(f"--new-tokens: expected an integer >= 1, got {args.new_tokens}")
    if args.rounds is not None and args.rounds < 1:
        raise InputError(f"--rounds: expected an integer >= 1, got {args.rounds}")
    if args.target_ms is not None and args.target_ms <= 0:
        raise InputError(f"--target-ms: expected a positive number of milliseconds, got {args.target_ms}")
    from mlpfuse.bench import presets

    dtypes = presets.parse_dtypes(args.dtype)
    if len(dtypes) > 1:
        raise InputError("--dtype: the model lab runs one dtype per run")
    dtype_name = dtypes[0] if dtypes else ("fp32" if on_cpu else "bf16")
    backend = dispatch.check_backend_name(args.backend or "auto")
    default_shapes = spec.tokens if isinstance(spec, models.ModelSpec) else ("1x128",)
    if tiny and not args.tokens:
        default_shapes = ("1x16",)
    settings = model_lab.LabSettings(
        rounds=args.rounds or 5,
        target_ms=args.target_ms or (50.0 if on_cpu else 200.0),
        new_tokens=args.new_tokens or (4 if tiny else 32),
        backend=backend,
        compile_backend=args.compile_backend or "inductor",
    )
    shapes = model_lab.parse_shapes(args.tokens, default_shapes)
    modes = model_lab.parse_modes(args.mode)
    variants = model_lab.parse_variants(args.variants, args.precision)
    footprint.check(args.model, layers=args.layers, tiny=tiny, shapes=shapes, modes=modes,
                    dtype=presets.DTYPES[dtype_name], device=device)

    from mlpfuse.ops import dispatch

    notes += [note for note in (dispatch.take_triton_note(), dispatch.untuned_note(device)) if note]
    err = Console(stderr=True)
    out = Console() if not args.json else None
    for note in notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    folder = _out_folder(args, device, "model-lab")

    def write(result) -> list[Path]:
        result.meta["notes"] = notes
        return [lab_outputs.write_json(result, folder / "results.json"),
                lab_outputs.write_csv(result, folder / "results.csv"),
                lab_outputs.write_markdown(result, folder / "results.md")]

    with err.status("model lab") as status:
        result = model_lab.run(
            args.model, layers=args.layers, tiny=tiny, shapes=shapes, modes=modes, variants=variants,
            dtype=presets.DTYPES[dtype_name], dtype_name=dtype_name, device=device, settings=settings,
            command=_command_line(args, _LAB_OPTIONS), on_case=write,
            progress=lambda text: status.update(f"model lab: {text}"),
        )
    written = write(result)
    written.append(_lab_report(folder, result))
    if args.json:
        print(lab_outputs.to_json(result))
    else:
        lab_outputs.print_tables(result, out)
    err.print(_outputs.literal("wrote ", ", ".join(map(str, written))))
    wrong = [f"{r['variant']} on {r['case']}" for r in result.rows if r["status"] == "wrong"]
    if wrong:
        err.print("non-finite logits: " + "; ".join(wrong), markup=False)
        return 1
    return 0
