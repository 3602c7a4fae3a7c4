"""`mlpfuse profile -- python SCRIPT.py ARGS`: profile the user's own training script.

The script runs in this process (mlpfuse.profiling.script); its steps (optimizer steps, or calls of `--step-fn`)
drive the same wait/warmup/active window as the built-in workloads, and the results are written the same way:
tables or --json on stdout, `<script>.pt.trace.json.gz`, `<script>.analysis.json` and report.html in the folder.
"""

from __future__ import annotations

import os
import sys

from mlpfuse import _host, _outputs
from mlpfuse.errors import InputError, printable

# Options of the built-in workloads and of --model that mean nothing for a script (it builds its own model).
_NOT_FOR_SCRIPTS = ("model", "tiny", "tokens", "batch", "in_dim", "out_dim", "bias", "seq", "dim", "hidden", "dtype",
                    "device", "variant", "steps")


def run_script_profile(args, words: list[str]) -> int:
    from mlpfuse.commands.profile import DEFAULT_OUT, write_results
    from mlpfuse.profiling import expect as expect_mod
    from mlpfuse.profiling import script
    from mlpfuse.profiling.capture import check_schedule

    given = [f"--{k.replace('_', '-')}" for k in _NOT_FOR_SCRIPTS if getattr(args, k, None) is not None]
    given += ["--compile"] * bool(args.compile) + ["--layers"] * (args.layers != 1)
    if given:
        raise InputError(f"{given[0]}: does not apply to a script (it builds and runs its own model and loop)")
    for e in args.expect:  # a typo fails before the script runs
        expect_mod.parse(e)
    window = args.wait + args.warmup + args.active
    check_schedule(window, args.wait, args.warmup, args.active)
    _host.check_threads(args.threads, "--threads")
    target = script.parse_command(words)
    program = script.load(target, args.step_fn)
    args.out = _outputs.prepare(args.out, default=DEFAULT_OUT, force=args.force)
    trace_path = os.path.join(args.out, f"{target.label}.pt.trace.json.gz")
    print(f"profiling {printable(target.describe())}: steps {args.wait + args.warmup + 1}-{window} of its "
          f"{'calls of ' + args.step_fn + '()' if args.step_fn else 'optimizer steps'} "
          f"(after {args.wait} waited and {args.warmup} warm-up); its output follows on stderr", file=sys.stderr)
    with _host.cli_run(args.threads):
        run = script.run(program, trace_path=trace_path, wait=args.wait, warmup=args.warmup, active=args.active)
    if run.trace_path is None:
        ends = f"calls of {args.step_fn}()" if args.step_fn else "optimizer steps (torch.optim.Optimizer.step())"
        hint = ("name the function that runs one step with --step-fn NAME" if run.steps_run == 0 and not args.step_fn
                else "lower --wait and --warmup")
        raise InputError(f"your script made {run.steps_run} {ends}; the profiler records from step "
                         f"{args.wait + args.warmup + 1} (--wait {args.wait}, --warmup {args.warmup}): nothing was "
                         f"recorded; {hint}")

    from mlpfuse.profiling.analysis import analyze

    result = analyze(run.trace_path, graph_map=args.map)
    data = result.to_dict()
    note = None
    if run.recorded < args.active:
        note = (f"your script ended after {run.steps_run} steps ({run.marker}): {run.recorded} of the "
                f"{args.active} active steps were recorded and are analysed")
        print(f"note: {note}", file=sys.stderr)
    data["workload"] = target.describe()
    data["script"] = {"command": target.describe(), "step_ends_at": run.marker, "steps_run": run.steps_run,
                      "wait": args.wait, "warmup": args.warmup, "active": args.active, "recorded": run.recorded,
                      "threads": args.threads, "note": note}
    return write_results(args, target.label, data, run.trace_path, target.describe(), result.check(args.expect))
