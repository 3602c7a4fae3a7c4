"""The model lab on a GPU: whole transformers models, eager against torch.compile, Liger, mlpfuse.patch and
mlpfuse.patch + compile, with the targets mlpfuse is held to checked at the end.

    PYTHONPATH=src python3 benchmarks/model_lab_gpu.py [--out DIR] [--budget-s 480] [--full] [--only STEP,...]

Liger is used where importable (e.g. `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and
PYTHONPATH=/tmp/site:src). Each step is one `mlpfuse bench --model ...` in its own process under its own time limit:
a step that fails or runs out of time is recorded with its error and the next one runs; inside a step, a variant
that fails is a row with its error and the others are still timed. Everything goes to DIR (default $OUT, else
./mlpfuse-results/model-lab-gpu): one folder per step (results.json / .csv / .md, the step's log), summary.json,
and summary.md; the short table printed last says, for each target, the measured ratio and whether it was met.
Without --full the compile variants run only where a target needs them (Llama-8B decode), so the whole run fits
in about eight minutes on an H200; --full adds them everywhere (compiling 32 layers takes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL = "eager,compile,liger,mlpfuse,mlpfuse-compile"
QUICK = "eager,liger,mlpfuse"

# name, seconds allowed, flags of `mlpfuse bench` (variants added below), variants without --full
STEPS = [
    ("llama8b-prefill-32l", 150, ["--model", "llama3-8b", "--tokens", "1x8192", "--mode", "prefill"], QUICK),
    ("llama8b-decode-4l", 210, ["--model", "llama3-8b", "--layers", "4", "--tokens", "1x128", "--mode", "decode"],
     ALL),
    ("llama8b-train-4l", 90, ["--model", "llama3-8b", "--layers", "4", "--tokens", "2x2048", "--mode", "train"],
     QUICK),
    ("gemma2-2b", 90, ["--model", "gemma2-2b", "--tokens", "1x128,8x128", "--mode", "prefill,train"], QUICK),
    ("gpt2", 60, ["--model", "gpt2", "--tokens", "1x128,8x128", "--mode", "prefill,decode,train"], QUICK),
    ("bert-base", 45, ["--model", "bert-base", "--tokens", "1x128,8x128", "--mode", "prefill,train"], QUICK),
    # A family outside mlpfuse's name table, patched by structure: the same rows as Llama's (past the default
    # budget: run them with --only olmo2-7b-prefill-32l,olmo2-7b-decode-4l,olmo2-7b-train-4l).
    ("olmo2-7b-prefill-32l", 150, ["--model", "olmo2-7b", "--tokens", "1x4096", "--mode", "prefill"], QUICK),
    ("olmo2-7b-decode-4l", 150, ["--model", "olmo2-7b", "--layers", "4", "--tokens", "1x128", "--mode", "decode"],
     QUICK),
    ("olmo2-7b-train-4l", 90, ["--model", "olmo2-7b", "--layers", "4", "--tokens", "2x2048", "--mode", "train"],
     QUICK),
]

# (step, mode, variant, field, bound, what the issue asks)
TARGETS = [
    ("llama8b-prefill-32l", "prefill", "mlpfuse", "vs_eager", 0.96, "Llama-8B 32 layers, 8192-token prefill"),
    ("llama8b-decode-4l", "decode", "mlpfuse-compile", "vs_compile", 0.93, "decode, static cache + compile"),
    ("llama8b-decode-4l", "decode", "mlpfuse", "vs_eager", 1.00, "decode, plain generate"),
    ("llama8b-train-4l", "train", "mlpfuse", "vs_eager", 0.97, "training step"),
    ("llama8b-train-4l", "train", "mlpfuse", "mem_vs_eager", 0.90, "training peak memory"),
    ("gpt2", "prefill", "mlpfuse", "vs_eager", 0.85, "GPT-2 small prefill"),
    ("gpt2", "train", "mlpfuse", "vs_eager", 0.85, "GPT-2 small training step"),
    ("bert-base", "prefill", "mlpfuse", "vs_eager", 0.85, "BERT-base forward"),
    ("bert-base", "train", "mlpfuse", "vs_eager", 0.85, "BERT-base training step"),
    ("olmo2-7b-prefill-32l", "prefill", "mlpfuse", "vs_eager", 0.96, "OLMo-2-7B (by structure) 32 layers, prefill"),
    ("olmo2-7b-decode-4l", "decode", "mlpfuse", "vs_eager", 1.00, "OLMo-2-7B decode, plain generate"),
    ("olmo2-7b-train-4l", "train", "mlpfuse", "vs_eager", 0.97, "OLMo-2-7B training step"),
    ("olmo2-7b-train-4l", "train", "mlpfuse", "mem_vs_eager", 0.90, "OLMo-2-7B training peak memory"),
]
ERROR_BOUND = 1.1  # every family: logits error against fp32 at most 1.1x eager bf16's


def run_step(name, secs, flags, variants, out: Path, env, extra=()) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlpfuse", "bench", *flags, "--variants", variants, *extra, "--out", str(folder)]
    t0 = time.perf_counter()
    status, error = "ok", None
    with open(folder / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=secs, cwd=ROOT).returncode
            if rc != 0:
                status, error = "failed", f"exit code {rc} (see {folder / 'log.txt'})"
        except subprocess.TimeoutExpired:
            status, error = "timeout", f"over its {secs} s limit (rows finished before are kept)"
    seconds = time.perf_counter() - t0
    rows = []
    results = folder / "results.json"
    if results.exists():
        try:
            rows = json.loads(results.read_text())["rows"]
        except (OSError, ValueError, KeyError) as exc:
            status, error = "failed", f"unreadable results.json ({exc})"
    if status != "ok" and not rows:
        tail = (folder / "log.txt").read_text().strip().splitlines()[-3:]
        error = f"{error}: {' | '.join(tail)}"
    return {"step": name, "status": status, "error": error, "seconds": round(seconds, 1),
            "command": " ".join(cmd[1:]), "rows": rows}


def check_targets(steps: dict) -> list[dict]:
    out = []
    for step, mode, variant, field, bound, what in TARGETS:
        rows = [r for r in steps.get(step, {}).get("rows", []) if r["mode"] == mode and r["variant"] == variant]
        for r in rows or [None]:
            value = r.get(field) if r else None
            shape = f"{r['batch']}x{r['seq']}" if r else "-"
            why = None if r is None else (r["error"] if r["status"] != "ok" else None)
            out.append({"target": what, "shape": shape, "measure": f"{variant} {field}", "bound": bound,
                        "value": value, "met": None if value is None else value <= bound,
                        "note": why or ("not run" if r is None else None)})
    for step in steps.values():
        for r in step["rows"]:
            if r["variant"].startswith("mlpfuse") and r["mode"] == "prefill" and r["status"] == "ok":
                value = r["err_vs_eager"]
                out.append({"target": f"{r['model']} logits error vs eager's", "shape": f"{r['batch']}x{r['seq']}",
                            "measure": f"{r['variant']} err_vs_eager", "bound": ERROR_BOUND, "value": value,
                            "met": None if value is None else value <= ERROR_BOUND, "note": None})
    return out


def _finite(value):
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def table(targets: list[dict]) -> list[str]:
    lines = ["| target | shape | measure | value | bound | met |", "|---|---|---|---|---|---|"]
    for t in targets:
        value = "–" if t["value"] is None else f"{t['value']:.3f}"
        met = {True: "yes", False: "NO", None: "–"}[t["met"]] + (f" ({t['note']})" if t["note"] else "")
        lines.append(f"| {t['target']} | {t['shape']} | {t['measure']} | {value} | ≤ {t['bound']} | {met} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "mlpfuse-results/model-lab-gpu")
    parser.add_argument("--budget-s", type=float, default=480, help="stop starting steps after this many seconds")
    parser.add_argument("--full", action="store_true", help="every variant in every step (much longer)")
    parser.add_argument("--only", help="comma list of step names")
    parser.add_argument("--extra", default="", help="flags added to every step, e.g. '--tiny --device cpu "
                        "--tokens 1x16 --rounds 1' for a dry run of this script on a CPU")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    chosen = [s for s in STEPS if not args.only or s[0] in args.only.split(",")]
    t0 = time.perf_counter()
    steps: dict[str, dict] = {}
    for name, secs, flags, variants in chosen:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 30:
            steps[name] = {"step": name, "status": "skipped", "error": "time budget spent", "seconds": 0,
                           "command": "", "rows": []}
            continue
        print(f"[{time.perf_counter() - t0:5.0f} s] {name} ...", flush=True)
        steps[name] = run_step(name, min(secs * (3 if args.full else 1), max(left, 30)), flags,
                               ALL if args.full else variants, out, env, args.extra.split())
        print(f"        {steps[name]['status']} in {steps[name]['seconds']} s {steps[name]['error'] or ''}",
              flush=True)
    targets = check_targets(steps)
    summary = {"steps": {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in steps.items()},
               "targets": targets, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1, allow_nan=False) + "\n")
    md = ["# mlpfuse model lab on a GPU", "", f"`{' '.join(sys.argv)}` — {summary['seconds']} s", ""]
    md += [f"- {s['step']}: {s['status']} in {s['seconds']} s" + (f" — {s['error']}" if s["error"] else "")
           + (f"  \n  `{s['command']}`" if s["command"] else "") for s in steps.values()]
    md += ["", *table(targets), ""]
    for s in steps.values():
        results = out / s["step"] / "results.md"
        if results.exists():
            md += ["", results.read_text()]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print()
    for s in steps.values():
        print(f"{s['step']:22s} {s['status']:8s} {s['seconds']:6.1f} s  {s['error'] or ''}")
    print()
    print("\n".join(table(targets)))
    print(f"\nwrote {out}/summary.md, summary.json and one folder per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
