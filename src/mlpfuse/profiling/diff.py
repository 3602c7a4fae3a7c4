"""What changed between two profiles, and what stayed the same.

Kernels are compared by byte-identical name: a GEMM that keeps its cuBLAS name under torch.compile is the same
kernel; a fused Triton kernel that replaces two ATen kernels shows as two removed and one added. Works on traces
or saved analysis JSON (anything `analyze` accepts).
"""

from __future__ import annotations

from typing import Any

from mlpfuse.profiling.analysis import Analysis, analyze

_PER_STEP_KEYS = ("gpu_kernels", "gpu_memsets", "gpu_memcpys", "launch_calls", "cpu_ops", "gpu_busy_us",
                  "gpu_idle_us", "step_us")


class Diff:
    def __init__(self, data: dict, a: Analysis, b: Analysis):
        self.data = data
        self.a, self.b = a, b

    def to_dict(self) -> dict:
        return self.data

    @property
    def kernels_removed(self) -> list[dict]:
        return self.data["kernels_removed"]

    @property
    def kernels_added(self) -> list[dict]:
        return self.data["kernels_added"]

    @property
    def kernels_unchanged(self) -> list[dict]:
        return self.data["kernels_unchanged"]


def _kernels(an: Analysis) -> dict[str, dict]:
    return {k["name"]: k for k in an.kernels}


def diff(a: Any, b: Any, max_bytes: int | str | None = None) -> Diff:
    a, b = analyze(a, max_bytes=max_bytes), analyze(b, max_bytes=max_bytes)
    ka, kb = _kernels(a), _kernels(b)

    def row(k: dict) -> dict:
        return {"name": k["name"], "family": k["family"], "per_step": k["per_step"], "avg_us": k["avg_us"],
                "ops": k["ops"]}

    removed = [row(ka[n]) for n in ka if n not in kb]
    added = [row(kb[n]) for n in kb if n not in ka]
    unchanged = [
        {"name": n, "family": ka[n]["family"], "per_step": {"a": ka[n]["per_step"], "b": kb[n]["per_step"]},
         "avg_us": {"a": ka[n]["avg_us"], "b": kb[n]["avg_us"]}, "ops": {"a": ka[n]["ops"], "b": kb[n]["ops"]}}
        for n in ka if n in kb
    ]
    ops_a = {o["name"]: o for o in a.ops}
    ops_b = {o["name"]: o for o in b.ops}
    per_a = {k: a.per_step[k] for k in _PER_STEP_KEYS}
    per_b = {k: b.per_step[k] for k in _PER_STEP_KEYS}
    data = {
        "a": a.trace_path,
        "b": b.trace_path,
        "kernels_removed": removed,
        "kernels_added": added,
        "kernels_unchanged": unchanged,
        "per_step": {"a": per_a, "b": per_b, "delta": {k: per_b[k] - per_a[k] for k in _PER_STEP_KEYS}},
        "families": {"a": a.per_step.get("families", {}), "b": b.per_step.get("families", {})},
        "ops_removed": [{"name": n, "per_step": ops_a[n]["per_step"]} for n in ops_a if n not in ops_b],
        "ops_added": [{"name": n, "per_step": ops_b[n]["per_step"]} for n in ops_b if n not in ops_a],
        "kernels_by_op": {"a": a.data.get("kernels_by_op", {}), "b": b.data.get("kernels_by_op", {})},
        "verdict": {"a": a.verdict["kind"], "b": b.verdict["kind"]},
        "skipped_events": {"a": a.data.get("skipped_events", {}), "b": b.data.get("skipped_events", {})},
        "repaired_events": {"a": a.data.get("repaired_events", {}), "b": b.data.get("repaired_events", {})},
    }
    return Diff(data, a, b)
