"""Where the walkthrough's host time goes, on one GPU. SECTIONS (default A,B,C) picks the parts; HELD=0 drops the
bare held-view variant from C; ROUNDS (default 7) sets C's rounds. As run: first SECTIONS=A,B,C (the defaults),
later SECTIONS=C HELD=0 ROUNDS=9.

A: the mlpfuse geglu step under the profiler with with_stack: self time per Python function / op inside the
   mlpfuse::gated_mlp span, and one step's timeline up to the first launch.
B: cProfile of the mlpfuse geglu call, with and without torch.profiler recording.
C: host time per call (call return - call start, synchronized between calls) and profiled step time, interleaved
   rounds: linear eager / mlpfuse / addmm over a held w.t(); geglu eager / mlpfuse. Without and with the profiler.
"""
import cProfile
import gzip
import io
import json
import os
import pstats
import statistics as S
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


SECTIONS = os.environ.get("SECTIONS", "A,B,C").split(",")
ROUNDS = int(os.environ.get("ROUNDS", "7"))
fns = {
    "linear-eager": (b[("linear", "eager")].fn, xl),
    "linear-mlpfuse": (b[("linear", "mlpfuse")].fn, b[("linear", "mlpfuse")].x),
    **({"linear-heldT": (held_addmm, xl)} if os.environ.get("HELD", "1") == "1" else {}),
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


# ---------------------------------------------------------------- A


def section_a():
    f, x = fns["geglu-mlpfuse"]
    path = capture(f, x, steps=10, wait=1, warmup=1, active=8, label="g", with_stack=True,
                   trace_path=os.path.join(OUT, "geglu-mlpfuse-stack.pt.trace.json.gz"))
    ev = json.load(gzip.open(path))["traceEvents"]
    cpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation",
                                                                       "cuda_runtime", "cuda_driver")]
    spans = sorted([e for e in cpu if e["name"] == "mlpfuse::gated_mlp"], key=lambda e: e["ts"])
    steps = sorted([e for e in cpu if e["name"].startswith("ProfilerStep#")], key=lambda e: e["ts"])
    say("A: spans", len(spans), "durs", [round(s["dur"], 1) for s in spans])
    selfs = {}
    tot = {}
    for s in spans:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = sorted([e for e in cpu if e is not s and lo <= e["ts"] and e["ts"] + e["dur"] <= hi + 0.01
                         and e.get("tid") == s.get("tid")], key=lambda e: (e["ts"], -e["dur"]))
        for e in inside:
            kids = [k for k in inside if k is not e and e["ts"] <= k["ts"] and k["ts"] + k["dur"] <= e["ts"] + e["dur"]]
            # direct children only: not inside another kid
            direct = [k for k in kids if not any(o is not k and o["ts"] <= k["ts"] and k["ts"] + k["dur"] <= o["ts"] + o["dur"]
                                                  and o["dur"] > k["dur"] for o in kids)]
            own = e["dur"] - sum(k["dur"] for k in direct)
            key = f'{e.get("cat")}: {e["name"][:110]}'
            selfs[key] = selfs.get(key, 0) + own / len(spans)
            tot[key] = tot.get(key, 0) + e["dur"] / len(spans)
        kids = [k for k in inside if not any(o is not k and o["ts"] <= k["ts"] and k["ts"] + k["dur"] <= o["ts"] + o["dur"]
                                             and o["dur"] > k["dur"] for o in inside)]
        selfs["(span own)"] = selfs.get("(span own)", 0) + (s["dur"] - sum(k["dur"] for k in kids)) / len(spans)
    say("A: self time per span call (us), top 45")
    for k, v in sorted(selfs.items(), key=lambda kv: -kv[1])[:45]:
        say(f"  {v:8.2f} self  {tot.get(k, 0):8.2f} total  {k}")
    # one step's timeline (the 4th active step) up to the end of the span
    st = steps[min(3, len(steps) - 1)]
    say("A: timeline of", st["name"], "dur", round(st["dur"], 1))
    seq = sorted([e for e in cpu if st["ts"] <= e["ts"] <= st["ts"] + st["dur"] and e.get("tid") == st.get("tid")],
                 key=lambda e: (e["ts"], -e["dur"]))
    for e in seq[:160]:
        say(f'  +{e["ts"] - st["ts"]:8.1f} {e["dur"]:8.1f}  {e.get("cat")[:6]} {e["name"][:120]}')


if "A" in SECTIONS:
    section_a()

# ---------------------------------------------------------------- B


def cprof(name, under_profiler, n=300):
    f, x = fns[name]
    pr = cProfile.Profile()
    ctx = profile(activities=ACTS, record_shapes=True) if under_profiler \
        else None
    if ctx:
        ctx.__enter__()
    for i in range(n):
        pr.enable()
        f(x)
        pr.disable()
        sync()
    if ctx:
        ctx.__exit__(None, None, None)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    say(f"B: cProfile {name} profiler={under_profiler} ({n} calls)")
    for ln in s.getvalue().splitlines():
        if ln.strip():
            say("   " + ln[:200])


for name in ("geglu-mlpfuse", "linear-mlpfuse") if "B" in SECTIONS else ():
    cprof(name, False)
    cprof(name, True)

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




def section_c():
    res = {}
    names = list(fns)
    for prof_on in (False, True):
        for r in range(ROUNDS):
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
    say(f"C: medians over {ROUNDS} interleaved rounds of per-round medians (60 calls); host = call return - start; step = "
        "call + sync wall")
    for prof_on in (False, True):
        for name in names:
            hs = [h for h, _ in res[(prof_on, name)]]
            ss = [s for _, s in res[(prof_on, name)]]
            say(f"  profiler={int(prof_on)} {name:15s} host {S.median(hs):7.1f} ({min(hs):.1f}-{max(hs):.1f})  step "
                f"{S.median(ss):7.1f} ({min(ss):.1f}-{max(ss):.1f})")


if "C" in SECTIONS:
    section_c()
with open(os.path.join(OUT, "hostprobe.txt"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
