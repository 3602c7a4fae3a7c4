"""Where a module call's host time goes, layer by layer (CUDA GPU, bf16, GeGLU).

    PYTHONPATH=src python3 benchmarks/host_profile.py [--out DIR]

For the forward (no_grad) at 1024×768×3072 and the training step at 8192×768×3072: host µs per call of each
layer, from the outside in — the GatedMLP module, the op layer (`ops.gated_mlp`'s implementation), the kernel
API, the cuBLAS GEMM — measured over short bursts started on an idle GPU (as benchmarks/host_paths.py), so the
differences are what each layer adds. Then each path under cProfile, the functions with the most own time first.
The training step's backward runs on autograd's device thread, which cProfile does not follow: it is profiled by
calling the backward's implementation (`_gradients`) directly, on the same tensors.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import importlib
import pstats

import torch
import torch.nn.functional as F

import mlpfuse
from host_overhead import Eager  # this folder is on sys.path when run
from host_paths import measure, spin_up, training_step
from mlpfuse.kernels import gated_gemm
from mlpfuse.ops import dispatch

G = importlib.import_module("mlpfuse.ops.gated_mlp")  # the module: the package's `gated_mlp` is the function
GELU = mlpfuse.activations.get("gelu_tanh").id


def timed(fns: dict, rounds=9, burst=8):
    """Host µs per call of each function (host_paths.measure without its wall rounds)."""
    return {k: r["host"] for k, r in measure(fns, rounds, burst, 0).items()}


def profile(fn, n, top=25):
    """n calls of fn under cProfile: the `top` functions with the most own time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    spin_up()
    report = []

    def show(title, res):
        report.append(f"\n## {title}\n| layer | host µs median | min | max |\n|---|---|---|---|")
        for k, r in res.items():
            report.append(f"| {k} | {r['median']:.1f} | {r['min']:.1f} | {r['max']:.1f} |")
        print("\n".join(report[-len(res) - 1:]), flush=True)

    eager = Eager(768, 3072).to(dev, dt)
    tri = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh", backend="triton")
    auto = mlpfuse.GatedMLP.from_module(eager, activation="gelu_tanh")
    wg, wu, wd = tri.gate_proj.weight, tri.up_proj.weight, tri.down_proj.weight

    # Forward, no_grad, 1024 tokens.
    x = torch.randn(1024, 768, device=dev, dtype=dt)

    def nograd(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    with torch.no_grad():
        tri(x)  # makes the module's entry and the gated GEMM's launch plan
    plan = gated_gemm.cached_plan(x, wg, wu, activation=GELU, allow_tf32=dispatch.allow_tf32())
    fwd = {
        "eager module": nograd(lambda: eager(x)),
        "GatedMLP triton": nograd(lambda: tri(x)),
        "GatedMLP auto": nograd(lambda: auto(x)),
        "CallPlan (module's memo, hit)": nograd(lambda: tri._plan(x, wg, wu, wd, None, None, None, "gelu_tanh",
                                                                  "triton")),
        "plan.run + F.linear": nograd(lambda: F.linear(plan.run(x, wg, wu, None, None), wd)),
        "gated_mlp_call": nograd(lambda: G.gated_mlp_call(x, wg, wu, wd, None, None, None, "gelu_tanh", "triton")),
        "_forward": nograd(lambda: G._forward(x, wg, wu, wd, None, None, None, "gelu_tanh", "triton", False, False)),
        "_forward, path given": nograd(lambda: G._forward(x, wg, wu, wd, None, None, None, "gelu_tanh", "triton",
                                                          False, False, dispatch.GATED)),
        "gated_gemm + F.linear": nograd(lambda: F.linear(gated_gemm.gated_gemm(x, wg, wu, None, None,
                                                                                 activation=GELU), wd)),
        "gated_gemm": nograd(lambda: gated_gemm.gated_gemm(x, wg, wu, None, None, activation=GELU)),
        "F.linear x3": nograd(lambda: (F.linear(x, wg), F.linear(x, wu), F.linear(x, wg))),
        "_checks.gated_mlp_args": lambda: G._checks.gated_mlp_args(x, wg, wu, wd, None, None, None),
        "dispatch.gated_mlp_path": lambda: dispatch.gated_mlp_path("triton", x, 3072, False),
    }
    show("forward, no_grad, 1024x768x3072", timed(fwd))
    prof_fwd = profile(fwd["GatedMLP triton"], 3000)

    # Training step, 8192 tokens.
    x = torch.randn(8192, 768, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(8192, 768, device=dev, dtype=dt)
    params = list(eager.parameters())

    def step(mod):
        return training_step(mod, x, dy, params)

    def fwd_only(mod):
        return lambda: mod(x)

    xd = x.detach()

    def direct_forward():
        return G._forward(xd, wg, wu, wd, None, None, None, "gelu_tanh", "triton", True, True, dispatch.GATED)

    def direct_step():
        y, _, g, u = direct_forward()
        return G._gradients(dy, xd, wg, wu, wd, None, None, g, u, G.nothing(xd), "gelu_tanh", "triton", False,
                            True, True, False, False, False, held=[g, u])

    def same_thread(run):
        # Autograd runs a CUDA graph's backward on its own device thread; this runs it on the calling one, which
        # tells the thread hand-off (and, for Python nodes, the GIL moving between threads) from the work itself.
        def inner():
            with torch.autograd.set_multithreading_enabled(False):
                run()
        return inner

    class PyEager(torch.autograd.Function):
        """eager's kernels, in one Python autograd node instead of eager's C++ ones: the Python node's own cost."""

        @staticmethod
        def forward(ctx, xx, a, b, c):
            g, u = F.linear(xx, a), F.linear(xx, b)
            h = F.gelu(g, approximate="tanh") * u
            ctx.save_for_backward(xx, a, b, c, g, u, h)
            return F.linear(h, c)

        @staticmethod
        def backward(ctx, d):
            xx, a, b, c, g, u, h = ctx.saved_tensors
            dh = d.mm(c)
            act = F.gelu(g, approximate="tanh")
            dg = torch.ops.aten.gelu_backward(dh * u, g, approximate="tanh")
            du = dh * act
            return dg.mm(a) + du.mm(b), dg.t().mm(xx), du.t().mm(xx), d.t().mm(h)

    py_eager_step = training_step(
        lambda t: PyEager.apply(t, eager.gate_proj.weight, eager.up_proj.weight, eager.down_proj.weight), x, dy,
        params)

    train = {
        "eager module step": step(eager),
        "eager module step, backward on the calling thread": same_thread(step(eager)),
        "GatedMLP triton step, backward on the calling thread": same_thread(step(tri)),
        "eager kernels in one Python autograd node, step": py_eager_step,
        "GatedMLP triton step": step(tri),
        "GatedMLP auto step": step(auto),
        "eager module forward (grad)": fwd_only(eager),
        "GatedMLP triton forward (grad)": fwd_only(tri),
        "_forward + _gradients, no autograd": direct_step,
        "_forward save, no autograd": direct_forward,
    }
    show("training, 8192x768x3072", timed(train, burst=3))
    prof_step = profile(train["GatedMLP triton step"], 300)
    prof_direct = profile(direct_step, 300)

    ops_tables = ""
    for name in ("eager module step", "GatedMLP triton step"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for _ in range(20):
                train[name]()
            torch.cuda.synchronize()
        ops_tables += (f"\n## torch.profiler CPU ops: {name}, 20 steps\n"
                       + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

    text = "\n".join(report) + "\n\n## cProfile: GatedMLP triton forward, 3000 calls\n" + prof_fwd
    text += "\n## cProfile: GatedMLP triton training step (main thread only), 300 steps\n" + prof_step
    text += "\n## cProfile: _forward + _gradients directly, 300 steps\n" + prof_direct + ops_tables
    print(text[-16000:])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
