"""Run the cases × variants grid: build, check against fp64, time in rounds, profile, derive the roofline numbers.

Per case: make the shared problem and its fp64 reference; build each variant and time its first call; check
its outputs (and gradients) against the reference — a variant that disagrees is marked `wrong` and never
timed; time the survivors interleaved; count kernels and launches per call with mlpfuse's profiler; then
compare each with the best peer of the same case. Anything that raises (out of memory, a missing peer, a
compile error) becomes that row's one-line error and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from mlpfuse.bench import roofline, timing
from mlpfuse.bench.presets import Case
from mlpfuse.bench.variants import Problem, Variant, check, make_problem, reference


@dataclass
class Settings:
    rounds: int = 10
    target_ms: float = 20.0  # time per variant per round and clock
    warmup: int = 3
    profile: bool = True
    seed: int = 0


@dataclass
class BenchResult:
    meta: dict
    rows: list[dict] = field(default_factory=list)


def _empty_row(case: Case, variant: Variant) -> dict:
    return {
        **case.to_dict(),
        "case": case.label,
        "variant": variant.name,
        "peer": variant.peer,
        "floor": variant.floor,
        "status": "ok",
        "error": None,
        "max_rel_error": None,
        "errors": None,
        "tolerance": variant.tolerance(case),
        "gpu_us": None,
        "gpu_spread_pct": None,
        "wall_us": None,
        "wall_spread_pct": None,
        "kernels": None,
        "launches": None,
        "memsets": None,
        "memcpys": None,
        "cpu_ops": None,
        "peak_mem_mb": None,
        "resident_mb": None,
        "setup_ms": None,
        "first_call_ms": None,
        "compile_ms": None,
        "flops": roofline.flops(case),
        "min_bytes": roofline.min_bytes(case),
        "intensity": roofline.intensity(case),
        "floor_us": None,
        "tflops": None,
        "gbps": None,
        "pct_of_floor": None,
        "vs_best_peer": None,
        "vs_best_peer_wall": None,
        "speedup": None,
        "speedup_wall": None,
        "best_peer": None,
        "best_peer_wall": None,
        "vs_gemms": None,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _mem(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _profile_counts(step, label: str) -> dict:
    """Kernels, launches, memsets, copies per call, from mlpfuse's own profiler (None where it is unavailable)."""
    from mlpfuse.profiling import profile

    # Counts only, not times: the bench's thread setting stays; the trace is not kept.
    per = profile(step, label=label, record_shapes=False, threads=None).to_dict()["per_step"]
    return {
        "kernels": per.get("gpu_kernels"),
        "launches": per.get("launch_calls"),
        "memsets": per.get("gpu_memsets"),
        "memcpys": per.get("gpu_memcpys"),
        "cpu_ops": per.get("cpu_ops"),
    }


class _Case:
    """The state of one case while it runs."""

    def __init__(self, case: Case, variants: list[Variant], device: torch.device):
        self.case = case
        self.rows = {v.name: _empty_row(case, v) for v in variants}
        self.steps: dict[str, object] = {}
        self.device = device

    def fail(self, name: str, status: str, message: str) -> None:
        self.rows[name].update(status=status, error=message)
        self.steps.pop(name, None)


def run(
    cases: list[Case],
    variants: list[Variant],
    device: torch.device,
    peaks: roofline.Peaks,
    settings: Settings | None = None,
    progress=None,
    command: str | None = None,
    on_case=None,
) -> BenchResult:
    """Benchmark every variant on every case. `progress(advance, description)` is called as rows complete;
    `on_case(result)` after each case (the CLI writes its files there, so a run cut short keeps what it did)."""
    settings = settings or Settings()
    progress = progress or (lambda advance, description: None)
    meta = environment(device, peaks, settings, command)
    result = BenchResult(meta)
    if device.type == "cuda":
        roofline.spin_up(device, 1.0)
    for case in cases:
        state = _Case(case, variants, device)
        try:
            _run_case(state, variants, settings, peaks, progress)
        except Exception as exc:  # noqa: BLE001 - the problem itself failed (e.g. OOM making the weights)
            for v in variants:
                if state.rows[v.name]["status"] == "ok" and state.rows[v.name]["wall_us"] is None:
                    state.fail(v.name, "error", timing.one_line(exc))
                    progress(1, case.label)
        finally:
            state.steps.clear()
            _reset_compiler()
            _free(device)
        _derive(list(state.rows.values()), peaks, device)
        result.rows.extend(state.rows.values())
        progress(0, case.label)
        if on_case:
            on_case(result)
    return result


def _reset_compiler() -> None:
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def _run_case(state: _Case, variants, settings: Settings, peaks, progress) -> None:
    case, device = state.case, state.device
    progress(0, f"{case.label}: reference")
    problem: Problem = make_problem(case, device, settings.seed)
    ref = reference(problem)
    cuda = device.type == "cuda"

    for v in variants:
        progress(0, f"{case.label}: {v.name} (build, check)")
        reason = None
        if v.needs_cuda and not cuda:
            reason = "skipped: needs CUDA"
        elif v.missing():
            reason = f"skipped: {v.missing()}"
        elif v.skip(case):
            reason = f"skipped: {v.skip(case)}"
        if reason:
            state.fail(v.name, "skipped", reason)
            progress(1, case.label)
            continue
        row = state.rows[v.name]
        try:
            before = _mem(device)
            t0 = time.perf_counter()
            step = v.build(problem)
            row["setup_ms"] = (time.perf_counter() - t0) * 1e3
            out, row["first_call_ms"] = timing.first_call_ms(step, device)
            errors = None if v.floor else check(problem, out, ref)  # a floor computes something else
            del out
            row["errors"] = errors
            row["max_rel_error"] = max(errors.values()) if errors else None
            row["resident_mb"] = (_mem(device) - before) / 2**20 if cuda else None
            if errors is not None and not row["max_rel_error"] <= v.tolerance(case):
                worst = max(errors, key=errors.get)
                state.fail(v.name, "wrong", f"{worst} rel. error {errors[worst]:.3g} > {v.tolerance(case):g}")
                progress(1, case.label)
                continue
            for _ in range(settings.warmup):
                step()
            if cuda:
                timing.sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                step()
                timing.sync(device)
                row["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            state.steps[v.name] = step
        except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the sweep
            state.fail(v.name, "error", timing.one_line(exc))
            progress(1, case.label)
            _free(device)
    del ref
    _free(device)

    if state.steps:
        progress(0, f"{case.label}: timing {len(state.steps)} variants in {settings.rounds} rounds")
        if cuda:
            roofline.spin_up(device, 0.2)
        gpu, wall, errors = timing.interleaved(
            state.steps, device, rounds=settings.rounds, target_ms=settings.target_ms, queue_ahead=True
        )
        for name, message in errors.items():
            state.fail(name, "error", message)
            progress(1, case.label)
        for name in list(state.steps):
            row = state.rows[name]
            if gpu.get(name):
                row["gpu_us"], row["gpu_spread_pct"] = gpu[name].median_us, gpu[name].spread_pct
            if wall.get(name):
                row["wall_us"], row["wall_spread_pct"] = wall[name].median_us, wall[name].spread_pct

    for name, step in list(state.steps.items()):
        if settings.profile:
            progress(0, f"{case.label}: profiling {name}")
            try:
                state.rows[name].update(_profile_counts(step, f"{name}"))
            except Exception as exc:  # noqa: BLE001 - counts are extra; the timing still stands
                state.rows[name]["error"] = f"profile: {timing.one_line(exc)}"
        progress(1, case.label)


def _derive(rows: list[dict], peaks: roofline.Peaks, device: torch.device) -> None:
    """Roofline numbers and time ratios to the best peer of this case (`vs_best_peer`: < 1 is faster; `speedup`,
    its inverse, is kept for readers of older results)."""
    for row in rows:
        case = Case(*(row[k] for k in ("workload", "activation", "tokens", "dim", "hidden", "dtype", "mode")))
        if row["status"] != "ok":
            continue
        t = row["gpu_us"] if row["gpu_us"] is not None else row["wall_us"]
        if t is None:
            continue
        if case.dtype in peaks.gemm_tflops and peaks.copy_gbps:
            row["floor_us"] = peaks.floor_us(case)
            row["pct_of_floor"] = row["floor_us"] / t * 100
        row["tflops"] = row["flops"] / t / 1e6
        row["gbps"] = row["min_bytes"] / t / 1e3
        if row["wall_us"] is not None and row["first_call_ms"] is not None:
            # What building and the first call cost beyond a steady call: compilation, autotuning, graph
            # capture, kernel JIT, module loading.
            once = (row["setup_ms"] or 0.0) + row["first_call_ms"] - row["wall_us"] / 1e3
            row["compile_ms"] = max(once, 0.0)
    for key, suffix in (("gpu_us", ""), ("wall_us", "_wall")):
        peers = [r for r in rows if r["peer"] and r["status"] == "ok" and r[key] is not None]
        if not peers:
            continue
        best = min(peers, key=lambda r: r[key])
        for row in rows:
            if row["status"] == "ok" and row[key]:
                row["vs_best_peer" + suffix] = row[key] / best[key]
                row["speedup" + suffix] = best[key] / row[key]
                row["best_peer" + suffix] = best["variant"]
    # Fusion efficiency: time over the case's GEMMs alone (1.00 = the activation and its traffic are free).
    key = "gpu_us" if device.type == "cuda" else "wall_us"
    floor = next((r for r in rows if r["variant"] == "gemms-alone" and r["status"] == "ok" and r[key]), None)
    if floor is not None:
        for row in rows:
            if row["status"] == "ok" and row[key]:
                row["vs_gemms"] = row[key] / floor[key]
    # On a CPU there is no GPU time: the headline ratio is the wall-time one.
    if device.type != "cuda":
        for row in rows:
            row["vs_best_peer"], row["speedup"], row["best_peer"] = (row["vs_best_peer_wall"], row["speedup_wall"],
                                                                     row["best_peer_wall"])


def environment(device: torch.device, peaks: roofline.Peaks, settings: Settings, command: str | None) -> dict:
    from mlpfuse import __version__

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        from importlib.metadata import version

        liger_version = version("liger-kernel")
    except Exception:  # noqa: BLE001
        liger_version = None
    return {
        "command": command or " ".join(["mlpfuse", *sys.argv[1:]]),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": roofline.device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "liger_kernel": liger_version,
        "mlpfuse": __version__,
        "python": platform.python_version(),
        "peaks": peaks.to_dict(),
        "settings": {
            "rounds": settings.rounds,
            "target_ms_per_round": settings.target_ms,
            "warmup": settings.warmup,
            "profile": settings.profile,
            "seed": settings.seed,
            # What this run did: a CPU run takes no GPU time, and its wall clock needs no synchronize.
            "gpu_time": ("CUDA events per call, L2 flushed before each and the call queued ahead of the GPU (no "
                         "launch gaps), median per round, median over rounds") if device.type == "cuda" else None,
            "wall_time": ("N calls back to back between synchronizes, per call, median over rounds"
                          if device.type == "cuda" else "N calls back to back on the host clock, per call, median "
                          "over rounds"),
        },
    }
