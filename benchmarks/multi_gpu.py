"""The gated MLP on several GPUs under tensor parallelism (NCCL): throughput, scaling and communication share.

    PYTHONPATH=src python3 benchmarks/multi_gpu.py --out DIR                  # every visible GPU
    PYTHONPATH=src python3 benchmarks/multi_gpu.py --gpus 2 --tokens 8192,16384 --mode fwd,fwd+bwd --out DIR
    PYTHONPATH=src python3 benchmarks/multi_gpu.py --cpu-gloo --out DIR       # smoke run: CPU processes, gloo

One process per GPU, started by this script. For each tokens × mode, the variants under the same plan (gate and
up column-parallel, down row-parallel, one all-reduce per block; `--sequence-parallel`: the tokens sharded at the
block's edges, all-gather + reduce-scatter):
- eager: nn.Linear projections and the activation as transformers writes them, `parallelize_module` with
  ColwiseParallel / RowwiseParallel;
- mlpfuse: `GatedMLP` over the same weights, `mlpfuse.parallel.tensor_parallel` (the block's all-reduce in row
  chunks behind its own down GEMM, dx's behind its weight gradients);
- mlpfuse-serial (on request): the same with `overlap=False`, the all-reduce after the block as eager's;
- mlpfuse-ce (on request): mlpfuse on a process group of its own that sums its chunks through the copy engines
  (ops/pair_reduce.py, chosen for that group alone; two CUDA ranks, else the same as mlpfuse),
  so the two sums are timed in the same rounds;
and each unsharded on one GPU (rank 0's, the other ranks waiting; the baseline, timed in the same rounds as the
sharded variants: a baseline timed before them ran at other clocks and temperatures).

Each row: the step time (CUDA events around `--reps` steps, ranks lined up by a barrier first, the slowest rank's
time per round, variants interleaved over `--rounds` rounds, median and spread, every round's value in
results.json); beside it, from the same rounds, the wall time per step by a second clock (perf_counter to the end of
the synchronized work: the check on the CUDA-event figure), the host time per step (the launch loop alone) and the
peak memory one step allocates above what it starts with (the largest rank's); throughput in tokens/s; speed-up
against the same variant on one GPU and scaling efficiency (speed-up / GPUs); mlpfuse against eager under the same
plan; and, from a few steps profiled on every rank (one trace per rank under DIR/traces/<case>/, read back with
mlpfuse's per-rank analysis, `mlpfuse analyze DIR/traces/<case>`), the time per step in NCCL kernels, its share of
the step, the share of it overlapped by compute, and the rank skew. Outputs are checked first against an fp32
evaluation of the unsharded block. DIR gets results.json and results.md; the table is printed last.
"""

from __future__ import annotations

import os

# NVLink multicast (NCCL's NVLS, PyTorch's symmetric-memory multicast, NVSHMEM's NVLS) stays off in this process
# and in every process it starts: on shared multi-GPU hosts a program using it can take the GPUs out of service.
# Set before torch and NCCL load; the workers inherit the environment and set it again before initialising NCCL.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

MODES = ("fwd", "fwd+bwd")
VARIANTS = ("eager", "mlpfuse", "mlpfuse-serial", "mlpfuse-ce")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")
# bf16 bound of the benchmark lab (mlpfuse bench): relative error of the output and gradients against fp32.
TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 5e-3}
CPU_DEFAULTS = {"tokens": "64", "dim": 32, "hidden": 64, "rounds": 3, "reps": 2, "dtype": "fp32"}
GPU_DEFAULTS = {"tokens": "8192,16384", "dim": 4096, "hidden": 14336, "rounds": 10, "reps": 5, "dtype": "bf16"}


class BadArgs(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadArgs(message)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise BadArgs(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BadArgs(f"{what}: expected integers >= 1, got {text!r}")
    return values


def _names(text: str, what: str, allowed) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    wrong = [n for n in names if n not in allowed]
    if not names or wrong:
        raise BadArgs(f"{what}: expected some of {', '.join(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse(argv=None) -> argparse.Namespace:
    p = _Parser(prog="multi_gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, help="processes, one per GPU (default: every visible GPU; --cpu-gloo: 2)")
    p.add_argument("--tokens", help="tokens per step, comma-separated (default 8192,16384; --cpu-gloo 64)")
    p.add_argument("--dim", type=int, help="model width (default 4096)")
    p.add_argument("--hidden", type=int, help="hidden width (default 14336)")
    p.add_argument("--activation", default="silu", help=f"{' | '.join(ACTIVATIONS)} (default silu: SwiGLU)")
    p.add_argument("--mode", default="fwd,fwd+bwd", help="fwd, fwd+bwd (comma-separated)")
    p.add_argument("--variants", default="eager,mlpfuse",
                   help="eager, mlpfuse, mlpfuse-serial, mlpfuse-ce (comma-separated)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 (--cpu-gloo: fp32)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch", "cuda"), help="mlpfuse's backend")
    p.add_argument("--sequence-parallel", action="store_true", help="tokens sharded at the blocks' edges")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds (default 10)")
    p.add_argument("--reps", type=int, help="steps per variant per round (default 5)")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-GPU runs")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled steps (no communication figures)")
    p.add_argument("--cpu-gloo", action="store_true", help="CPU processes joined by gloo, tiny sizes: a smoke run")
    p.add_argument("--out", default=None, help="output folder (default ./mlpfuse-results/multi-gpu-<time>)")
    args = p.parse_args(argv)
    d = CPU_DEFAULTS if args.cpu_gloo else GPU_DEFAULTS
    args.tokens = _ints(args.tokens or d["tokens"], "--tokens")
    for key in ("dim", "hidden", "rounds", "reps"):
        value = getattr(args, key)
        value = d[key] if value is None else value
        if value < 1:
            raise BadArgs(f"--{key}: expected an integer >= 1, got {value}")
        setattr(args, key, value)
    args.dtype = args.dtype or d["dtype"]
    args.mode = _names(args.mode, "--mode", MODES)
    args.variants = _names(args.variants, "--variants", VARIANTS)
    if args.activation not in ACTIVATIONS:
        raise BadArgs(f"--activation: expected one of {', '.join(ACTIVATIONS)}, got {args.activation!r}")
    if args.gpus is not None and args.gpus < 1:
        raise BadArgs(f"--gpus: expected an integer >= 1, got {args.gpus}")
    return args


def resolve_world(args) -> int:
    """How many processes: --gpus, else every visible GPU (2 for --cpu-gloo); checked against the sizes."""
    import torch

    if args.cpu_gloo:
        world = args.gpus or 2
        if args.dtype != "fp32":
            raise BadArgs("--dtype: --cpu-gloo runs in fp32 (CPU matmuls in bf16/fp16 say nothing about GPUs)")
    else:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        world = args.gpus or found
        if found < max(world, 1):
            raise BadArgs(f"--gpus: {max(world, 1)} CUDA GPU(s) needed, {found} visible; --cpu-gloo runs a smoke "
                          f"test on CPUs")
    if args.hidden % world:
        raise BadArgs(f"--hidden: {args.hidden} is not divisible by {world} GPUs (each holds hidden/GPUs columns)")
    if args.sequence_parallel and any(t % world for t in args.tokens):
        raise BadArgs(f"--tokens: with --sequence-parallel every token count must be divisible by {world}")
    return world


# ---------------------------------------------------------------- the workers


@functools.lru_cache(maxsize=1)
def _weights(dim: int, hidden: int):
    """gate, up, down weights ~ N(0, 1/fan_in) on the CPU in fp32, the same on every rank (seeded), made once."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    return tuple(torch.randn(out, fan_in, generator=gen) / fan_in ** 0.5
                 for out, fan_in in ((hidden, dim), (hidden, dim), (dim, hidden)))


def _blocks(args, device, dtype, variants=VARIANTS):
    """The eager block (nn.Linear projections, the activation between them) and mlpfuse's GatedMLP, each over its
    own copy of the same weights."""
    import torch.nn as nn

    from mlpfuse import GatedMLP
    from mlpfuse.activations import get as activation

    act = activation(args.activation).forward

    class EagerGatedMLP(nn.Module):
        def __init__(self, gate, up, down):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = gate, up, down

        def forward(self, x):
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))

    def linears():
        out = []
        for w in _weights(args.dim, args.hidden):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w.to(device, dtype))
            out.append(lin)
        return out

    built = {}
    if "eager" in variants:
        built["eager"] = EagerGatedMLP(*linears())
    for name in ("mlpfuse", "mlpfuse-serial", "mlpfuse-ce"):
        if name in variants:
            built[name] = GatedMLP.from_linears(*linears(), args.activation, backend=args.backend)
    return built


def _copy_engine_mesh(world: int, device, dtype):
    """A mesh over a process group of its own, whose blocks sum through the copy engines where two CUDA ranks can
    (the group's choice, made here, once)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from mlpfuse.ops import pair_reduce

    group = dist.new_group(list(range(world)))
    if device.type == "cuda":
        pair_reduce.for_group(group, torch.empty(8, 8, device=device, dtype=dtype), want=True)
    return DeviceMesh.from_group(group, device.type)


def _plans(blocks, meshes: dict, sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mlpfuse.parallel import tensor_parallel

    acts = Shard(0) if sequence_parallel else Replicate()
    mesh = meshes["default"]
    if "eager" in blocks:
        parallelize_module(blocks["eager"], mesh, {"gate_proj": ColwiseParallel(input_layouts=acts),
                                                   "up_proj": ColwiseParallel(input_layouts=acts),
                                                   "down_proj": RowwiseParallel(output_layouts=acts)})
    for name, overlap in (("mlpfuse", True), ("mlpfuse-serial", False), ("mlpfuse-ce", True)):
        if name in blocks:
            tensor_parallel(blocks[name], meshes.get(name, mesh), sequence_dim=0 if sequence_parallel else None,
                            overlap=overlap)


def _step(module, x, dy, mode: str):
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    params = list(module.parameters())
    if mode == "fwd":
        def step():
            with torch.no_grad():
                y = module(x)
                # The block's last all-reduce runs on NCCL's stream and is waited for only where y is used; use it
                # here, as the next layer would, so that the step's time includes it.
                if isinstance(y, AsyncCollectiveTensor):
                    y.wait()
    else:
        def step():
            x.grad = None
            for p in params:
                p.grad = None
            module(x).backward(dy)
    return step


class _Clock:
    """Per step, over `reps` steps back to back: GPU time (CUDA events; perf_counter on a CPU), host time (the launch
    loop, before any sync) and wall time (perf_counter to the end of the work, synchronized) -- the second clock a
    CUDA-event figure is checked against."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def time(self, step, reps: int) -> tuple[float, float, float]:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            for _ in range(reps):
                step()
            end.record()
            host = time.perf_counter() - t0
            end.synchronize()
            wall = time.perf_counter() - t0
            return start.elapsed_time(end) / 1e3 / reps, host / reps, wall / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        t = (time.perf_counter() - t0) / reps
        return t, t, t


def _peak_mb(step, device) -> Optional[float]:
    """Peak memory allocated during one step, above what was allocated before it (None on a CPU)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _timed(steps: dict, solo: Optional[dict], clock: _Clock, args, device) -> tuple[dict, dict]:
    """Median (and spread) over interleaved rounds of each step's GPU, host and wall time: `steps` on every rank (a
    round's figures the slowest rank's, and the largest peak), and `solo` (None: no baseline) on rank 0 alone while
    the other ranks wait, in the same rounds, so that the one-GPU baseline meets the same clocks and temperatures
    as the sharded steps (the solo steps run first in even rounds, last in odd ones). Rank 0's solo dict holds its
    steps; the other ranks pass an empty one."""
    import torch
    import torch.distributed as dist

    rounds = {name: [] for name in steps}
    solo_rounds = {name: [] for name in solo or {}}

    def run_solo():
        dist.barrier()
        for name, step in (solo or {}).items():
            solo_rounds[name].append(clock.time(step, args.reps))
        dist.barrier()

    for i in range(args.rounds):
        if solo is not None and i % 2 == 0:
            run_solo()
        for name, step in steps.items():
            dist.barrier()
            t = clock.time(step, args.reps)
            worst = torch.tensor(t, dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rounds[name].append(tuple(worst.tolist()))
        if solo is not None and i % 2 == 1:
            run_solo()
    return (_summary(rounds, steps, device, True),
            _summary(solo_rounds, solo, device, False) if solo_rounds else {})


def _summary(rounds: dict, steps: dict, device, group: bool) -> dict:
    import torch
    import torch.distributed as dist

    out = {}
    for name, ts in rounds.items():
        gpu, host, wall = zip(*ts)
        med = statistics.median(gpu)
        peak = _peak_mb(steps[name], device)
        if group and peak is not None:
            most = torch.tensor([peak], dtype=torch.float64, device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            peak = most.item()
        out[name] = {"step_ms": med * 1e3, "spread_pct": (max(gpu) - min(gpu)) / med * 100 if med > 0 else 0.0,
                     "rounds_ms": [t * 1e3 for t in gpu], "host_ms": statistics.median(host) * 1e3,
                     "wall_ms": statistics.median(wall) * 1e3, "peak_mb": peak}
    return out


def _rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(blocks, reference, x, dy, mode: str, world: int, rank: int, sequence_parallel: bool, bound: float):
    """Each variant's output (and, training, dx and down_proj's weight gradient) against the fp32 unsharded block."""
    import torch

    ref_x = x.detach().float().requires_grad_(mode != "fwd")
    with torch.set_grad_enabled(mode != "fwd"):
        ref_y = reference(ref_x)
    if mode != "fwd":
        ref_y.backward(dy.float())
    errors = {}
    for name, block in blocks.items():
        xs = x.detach().clone().requires_grad_(mode != "fwd")
        mine = slice(None)
        if sequence_parallel:
            n = x.shape[0] // world
            mine = slice(rank * n, (rank + 1) * n)
            xs = x[mine].detach().clone().requires_grad_(mode != "fwd")
        with torch.set_grad_enabled(mode != "fwd"):
            y = block(xs)
        errs = [_rel_err(y, ref_y[mine])]
        if mode != "fwd":
            y.backward(dy[mine])
            errs += [_rel_err(xs.grad, ref_x.grad[mine]),
                     _rel_err(_full(block.down_proj.weight.grad), reference.down_proj.weight.grad)]
            for p in block.parameters():
                p.grad = None
        worst = max(errs)
        errors[name] = worst
        if not worst <= bound:
            raise RuntimeError(f"{name}: relative error {worst:.3g} against fp32 is over {bound}")
    return errors


def _profile(step, folder: str, rank: int, device) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(folder, f"rank{rank}.json.gz")
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(5):
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.step()


def _comm_figures(folder: str) -> dict:
    from mlpfuse.profiling.ranks import analyze_ranks

    data = analyze_ranks(folder).to_dict()
    m, s = data["merged"], data["skew"]
    return {"comm_ms": m["comm_us"] / 1e3, "comm_share": m["comm_share"], "overlap_share": m["overlap_share"],
            "skew_ms": s["skew_us"] / 1e3, "slowest_rank": s["slowest_rank"], "traces": folder}


def worker(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    os.environ.update(NO_MULTICAST)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from mlpfuse.bench.roofline import spin_up

    device = torch.device("cpu") if args.cpu_gloo else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if args.cpu_gloo else "nccl"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10), **kwargs)
    try:
        dtype = getattr(torch, DTYPES[args.dtype])
        meshes = {"default": init_device_mesh(device.type, (world,))}
        if "mlpfuse-ce" in args.variants:
            meshes["mlpfuse-ce"] = _copy_engine_mesh(world, device, dtype)
        clock = _Clock(device)
        spin_up(device, 1.0)
        rows = []
        for tokens in args.tokens:
            for mode in args.mode:
                rows += _case(rank, world, args, meshes, device, dtype, clock, tokens, mode, out)
        if rank == 0:
            _write(out, args, world, rows, device)
    finally:
        dist.destroy_process_group()


def _case(rank, world, args, meshes, device, dtype, clock, tokens, mode, out) -> list[dict]:
    import torch
    import torch.distributed as dist

    label = f"{tokens}x{args.dim}x{args.hidden} {mode}"
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, args.dim, generator=gen).to(device, dtype)
    dy = torch.randn(tokens, args.dim, generator=gen).to(device, dtype)

    # One GPU, unsharded: rank 0 alone, the other ranks wait (timed in the rounds of the sharded steps).
    solo = None
    if not args.no_baseline:
        solo = {}
        if rank == 0:
            solo = {name: _step(b, x.detach().clone().requires_grad_(mode != "fwd"), dy, mode)
                    for name, b in _blocks(args, device, dtype, args.variants).items()}
            for step in solo.values():
                for _ in range(3):
                    step()

    # All GPUs, one plan.
    blocks = _blocks(args, device, dtype, args.variants)
    reference = _blocks(args, device, torch.float32, ("eager",))["eager"]
    _plans(blocks, meshes, args.sequence_parallel)
    errors = _check(blocks, reference, x, dy, mode, world, rank, args.sequence_parallel, TOLERANCE[args.dtype])
    del reference
    if args.sequence_parallel:
        n = tokens // world
        x, dy = x[rank * n:(rank + 1) * n].contiguous(), dy[rank * n:(rank + 1) * n].contiguous()
    steps = {name: _step(b, x.detach().clone().requires_grad_(mode != "fwd"), dy, mode) for name, b in blocks.items()}
    for step in steps.values():
        for _ in range(3):
            step()
    timed, timed_solo = _timed(steps, solo, clock, args, device)
    for name, t in timed_solo.items():
        rows.append(_row(label, tokens, mode, name, 1, t))
    del solo
    comm = {}
    if not args.no_profile:
        for name, step in steps.items():
            folder = os.path.join(out, "traces", f"{tokens}-{mode.replace('+', '')}-{name}-{world}gpu")
            if rank == 0:
                os.makedirs(folder, exist_ok=True)
            dist.barrier()
            _profile(step, folder, rank, device)
            dist.barrier()
            if rank == 0:
                comm[name] = _comm_figures(folder)
    for name, t in timed.items():
        rows.append(_row(label, tokens, mode, name, world, t, errors[name], comm.get(name)))
    del blocks, steps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"done: {label} on {world} GPU(s)", flush=True)
    return rows


def _row(label, tokens, mode, variant, gpus, timing, error=None, comm=None) -> dict:
    return {"case": label, "tokens": tokens, "mode": mode, "variant": variant, "gpus": gpus, **timing,
            "tokens_per_s": tokens / (timing["step_ms"] / 1e3), "rel_error": error, **(comm or {})}


def _derive(rows: list[dict]) -> None:
    """Speed-up against the same variant on one GPU, scaling efficiency, and mlpfuse against eager."""
    one = {(r["case"], r["variant"]): r for r in rows if r["gpus"] == 1}
    many = {(r["case"], r["variant"], r["gpus"]): r for r in rows}
    for r in rows:
        base = one.get((r["case"], r["variant"]))
        r["speedup"] = base["step_ms"] / r["step_ms"] if base else None
        r["efficiency"] = r["speedup"] / r["gpus"] if base else None
        eager = many.get((r["case"], "eager", r["gpus"]))
        r["vs_eager"] = r["step_ms"] / eager["step_ms"] if eager and r["variant"] != "eager" else None
        r["vs_eager_wall"] = (r["wall_ms"] / eager["wall_ms"] if eager and r["variant"] != "eager"
                              and r.get("wall_ms") and eager.get("wall_ms") else None)


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    head = ("case", "variant", "GPUs", "step ms", "spread", "tokens/s", "vs 1 GPU", "efficiency", "vs eager",
            "wall ms", "wall vs eager", "host ms", "peak MB", "NCCL ms", "comm share", "overlapped", "skew ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r["case"], r["variant"], str(r["gpus"]), f"{r['step_ms']:.3f}", f"{r['spread_pct']:.1f}%",
                 f"{r['tokens_per_s']:.4g}", _fmt(r.get("speedup"), ".3f"), _fmt(r.get("efficiency"), ".1%"),
                 _fmt(r.get("vs_eager"), ".3f"), _fmt(r.get("wall_ms"), ".3f"), _fmt(r.get("vs_eager_wall"), ".3f"),
                 _fmt(r.get("host_ms"), ".3f"), _fmt(r.get("peak_mb"), ".0f"), _fmt(r.get("comm_ms"), ".3f"),
                 _fmt(r.get("comm_share"), ".1%"),
                 _fmt(r.get("overlap_share"), ".1%"), _fmt(r.get("skew_ms"), ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write(out: str, args, world: int, rows: list[dict], device) -> None:
    import torch

    _derive(rows)
    rows.sort(key=lambda r: (r["tokens"], MODES.index(r["mode"]), r["gpus"], r["variant"]))
    info = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "args": {k: v for k, v in vars(args).items()},
        "world": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "environment": {k: os.environ.get(k) for k in NO_MULTICAST},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"info": info, "rows": rows}, fh, indent=1)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(f"# Tensor-parallel gated MLP, {world} x {info['device']}\n\n`{info['command']}`\n\n"
                 f"torch {info['torch']}, NCCL {info['nccl']}, {args.dtype}, activation {args.activation}, "
                 f"{'sequence parallel' if args.sequence_parallel else 'replicated activations'}; "
                 f"{' '.join(f'{k}={v}' for k, v in info['environment'].items())}\n\n{table(rows)}\n")


def main(argv=None) -> int:
    try:
        args = parse(argv)
        world = resolve_world(args)
    except BadArgs as exc:
        print(f"multi_gpu.py: error: {exc}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    out = args.out or os.path.join("mlpfuse-results", "multi-gpu-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    fd, store = tempfile.mkstemp(prefix="mlpfuse-store-")
    os.close(fd)
    os.unlink(store)
    try:
        mp.start_processes(worker, args=(world, args, store, out), nprocs=world, start_method="spawn")
    finally:
        if os.path.exists(store):
            os.unlink(store)
    with open(os.path.join(out, "results.json")) as fh:
        rows = json.load(fh)["rows"]
    print(f"results: {out}/results.md, traces: {out}/traces/")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
