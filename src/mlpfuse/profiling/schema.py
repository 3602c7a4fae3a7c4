"""The shape of a saved analysis (`analyze --json`), checked when one is read back.

A saved file is as untrusted as a trace: the renderers, `diff` and `--expect` index it without further checks, so
every key they read is checked here once, with its type, and every number in the document must be finite (Python's
json accepts NaN and Infinity; the output never carries them).
"""

from __future__ import annotations

import math
from typing import Any

from mlpfuse.errors import InputError

SCHEMA = "mlpfuse.analysis/1"


class _Spec:
    def __init__(self, what: str, test):
        self.what, self.test = what, test


def _number(v: Any) -> bool:
    return type(v) in (int, float) and 0 <= v < math.inf  # NaN fails the comparison too


NUM = _Spec("a finite number >= 0", _number)
COUNT = _Spec("an integer >= 1", lambda v: type(v) is int and v >= 1)
STR = _Spec("a string", lambda v: type(v) is str)
FIELD = _Spec("a string, number, boolean or list of strings",
              lambda v: type(v) in (str, bool) or _number(v) or (type(v) is list and all(type(x) is str for x in v)))


class MapOf:
    """An object with string keys and values of one spec."""

    def __init__(self, value):
        self.value = value


class Maybe:
    """A key that may be absent (analyses saved before it existed)."""

    def __init__(self, spec):
        self.spec = spec


COUNTS = MapOf(NUM)
NUM_OR_NULL = _Spec("a finite number >= 0 or null", lambda v: v is None or _number(v))
STR_OR_NULL = _Spec("a string or null", lambda v: v is None or type(v) is str)

_PER_STEP = {key: NUM for key in ("gpu_kernels", "gpu_memsets", "gpu_memcpys", "launch_calls", "cpu_ops",
                                  "gpu_busy_us", "gpu_idle_us", "gpu_window_us", "step_us", "occupancy_queries",
                                  "launch_cpu_us")}
ANALYSIS = {
    "schema": STR,
    "trace": STR,
    "steps": COUNT,
    "step_source": STR,
    "devices": [STR],
    "per_step": {**_PER_STEP, "launch_calls_by_name": COUNTS, "families": COUNTS,
                 **{key: Maybe(NUM_OR_NULL) for key in ("cpu_ahead_us", "launch_to_start_us", "cpu_ahead_steps")}},
    "kernels": [{"name": STR, "family": STR, "count": NUM, "per_step": NUM, "total_us": NUM, "avg_us": NUM,
                 "ops": COUNTS, "decoded": MapOf(FIELD)}],
    "ops": [{"name": STR, "count": NUM, "per_step": NUM, "cpu_total_us": NUM, "cpu_self_us": NUM, "kernels": NUM}],
    "kernels_by_op": MapOf(COUNTS),
    "zero_kernel_ops": [{"name": STR, "per_step": NUM}],
    "gpu_gaps": [{"step": STR, "start_us": NUM, "dur_us": NUM, "after": STR, "before": STR}],
    "verdict": {"kind": STR, "reason": STR},
}
OPTIONAL = {"skipped_events": COUNTS, "repaired_events": COUNTS, "unread_categories": COUNTS, "steps_found": COUNT,
            "steps_left_out": [{"name": STR, "reason": STR}], "step_source_kind": STR, "step_label": STR_OR_NULL,
            "step_source_reason": STR,
            "modules": {"steps": COUNT, "kernel_us": NUM, "attributed_us": NUM, "attributed_share": NUM,
                        "replays": NUM, "replay_idle_us": NUM, "map": STR_OR_NULL,
                        "rows": [{"module": STR, "depth": NUM, "kernels": NUM, "gpu_us": NUM, "share": NUM}],
                        "kinds": [{"module": STR, "depth": NUM, "kernels": NUM, "gpu_us": NUM, "share": NUM,
                                   "ops": Maybe([{"op": STR, "gpu_us": NUM}])}],
                        "unattributed": [{"reason": STR, "kernels": NUM, "gpu_us": NUM}],
                        "busy_us": Maybe(NUM), "between": Maybe({"kernels": NUM, "gpu_us": NUM}),
                        "roofline": Maybe({"rows": [{
                            "module": STR, "op": STR, "kernel": STR, "inputs": STR, "dtypes": Maybe([STR]), "kind": STR,
                            "calls": NUM,
                            "us_per_call": NUM, "bytes": NUM, "flops": NUM,
                            **{k: NUM_OR_NULL for k in ("gbps", "tflops", "of_bandwidth", "of_compute")}}],
                            "costed_share": NUM, "bytes_per_step": NUM, "floor_us_per_step": NUM_OR_NULL}),
                        "fusions": Maybe([{"module": STR, "runs": NUM, "kernels": NUM, "gpu_us": NUM, "bytes": NUM,
                                           "bytes_saved": NUM, "ops": [STR], "mlpfuse": STR}])}}


def _kind(v: Any) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), repr(v) if isinstance(v, float) else f"a {type(v).__name__}")


def _key(key: str) -> str:
    return repr(key) if len(key) <= 60 else repr(key[:60]) + "..."


def _check(value: Any, spec: Any, where: str) -> str | None:
    """None when `value` fits `spec`, else where and why not (the first problem found)."""
    if isinstance(spec, _Spec):
        return None if spec.test(value) else f"{where} is {_kind(value)}, expected {spec.what}"
    if isinstance(spec, list):
        if type(value) is not list:
            return f"{where} is {_kind(value)}, expected a list"
        for i, item in enumerate(value):
            if problem := _check(item, spec[0], f"{where}[{i}]"):
                return problem
        return None
    if type(value) is not dict:
        return f"{where} is {_kind(value)}, expected an object"
    if isinstance(spec, MapOf):
        for key, item in value.items():
            if problem := _check(item, spec.value, f"{where}[{_key(key)}]"):
                return problem
        return None
    for key, item_spec in spec.items():
        if isinstance(item_spec, Maybe):
            if key not in value:
                continue
            item_spec = item_spec.spec
        if key not in value:
            return f"{where}.{key} is missing"
        if problem := _check(value[key], item_spec, f"{where}.{key}"):
            return problem
    return None


def _non_finite(doc: Any) -> str | None:
    """Where the document holds NaN or +-Infinity, anywhere (iterative: nesting depth is the file's choice)."""
    stack = [(doc, "analysis")]
    while stack:
        value, where = stack.pop()
        if type(value) is float and not math.isfinite(value):
            return f"{where} is {value!r}, expected a finite number"
        if type(value) is dict:
            stack.extend((v, f"{where}[{_key(k)}]") for k, v in value.items())
        elif type(value) is list:
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
    return None


def validate(data: Any, path: str) -> None:
    """Raise one InputError line naming the first key that does not fit the schema."""
    if type(data) is not dict or data.get("schema") != SCHEMA:
        raise InputError(f"{path}: not an mlpfuse analysis JSON (schema {SCHEMA!r})")
    problem = _check(data, ANALYSIS, "analysis") or _non_finite(data)
    for key, spec in OPTIONAL.items():
        if not problem and key in data:
            problem = _check(data[key], spec, f"analysis.{key}")
    if problem:
        raise InputError(f"{path}: not an mlpfuse analysis JSON ({SCHEMA}): {problem}")
