"""Where the walkthrough's host time goes (issue 29), on one GPU.

C: host time per call (call return - call start, synchronized between calls) and profiled step time, interleaved
   rounds: linear eager / mlpfuse; geglu eager / mlpfuse. Without and with the profiler.
"""
import cProfile
import gzip
import io
import json
import os
import pstats
import statistics as S
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mlpfuse import workloads
from mlpfuse.profiling.capture import capture

OUT = os.environ.get("OUT", "/tmp/hostprobe")
os.makedirs(OUT, exist_ok=True)
torch.set_num_threads(1)
dev = os.environ.get("DEV", "cuda")
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
DT = "bf16" if dev == "cuda" else "fp32"
b = {}
for w in ("linear", "geglu-mlp"):
    for v in ("eager", "mlpfuse"):
        b[(w, v)] = workloads.build(w, variant=v, device=dev, dtype=DT)
lin = b[("linear", "eager")].fn
wt = lin.weight.t()
bias = lin.bias
xl = b[("linear", "eager")].x


def held_addmm(x):
    return torch.addmm(bias, x, wt)


fns = {
    "linear-eager": (b[("linear", "eager")].fn, xl),
    "linear-mlpfuse": (b[("linear", "mlpfuse")].fn, b[("linear", "mlpfuse")].x),
    "geglu-eager": (b[("geglu-mlp", "eager")].fn, b[("geglu-mlp", "eager")].x),
    "geglu-mlpfuse": (b[("geglu-mlp", "mlpfuse")].fn, b[("geglu-mlp", "mlpfuse")].x),
}
for name, (f, x) in fns.items():
    for _ in range(20):
        f(x)
sync()
lines = []
ACTS = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])


def say(*a):
    s = " ".join(str(t) for t in a)
    print(s)
    lines.append(s)


# ---------------------------------------------------------------- C


def host_times(f, x, n):
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter_ns()
        f(x)
        t1 = time.perf_counter_ns()
        out.append((t1 - t0) / 1e3)
    sync()
    return S.median(out)


def step_times(f, x, n):
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter_ns()
        with record_function("s"):
            f(x)
            sync()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return S.median(out)


res = {}
names = list(fns)
for prof_on in (False, True):
    for r in range(9):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order = order[::-1]
        ctx = profile(activities=ACTS, record_shapes=True) if prof_on \
            else None
        if ctx:
            ctx.__enter__()
        for name in order:
            f, x = fns[name]
            h = host_times(f, x, 60)
            s = step_times(f, x, 60)
            res.setdefault((prof_on, name), []).append((h, s))
        if ctx:
            ctx.__exit__(None, None, None)
say("C: medians over 9 interleaved rounds of per-round medians (60 calls); host = call return - start; step = "
    "call + sync wall")
for prof_on in (False, True):
    for name in names:
        hs = [h for h, _ in res[(prof_on, name)]]
        ss = [s for _, s in res[(prof_on, name)]]
        say(f"  profiler={int(prof_on)} {name:15s} host {S.median(hs):7.1f} ({min(hs):.1f}-{max(hs):.1f})  step "
            f"{S.median(ss):7.1f} ({min(ss):.1f}-{max(ss):.1f})")
with open(os.path.join(OUT, "hostprobe.txt"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
