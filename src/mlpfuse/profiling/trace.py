"""Load any Chrome / Kineto trace (.json or .json.gz) into a small event model.

Only the standard library: `mlpfuse analyze` must start fast and run where torch is not installed.
Every way a file can fail to be a trace ends in one `InputError` line naming the file.

Kineto writes complete events (`"ph": "X"`) in categories that changed spelling over PyTorch releases
(`cpu_op` / `Operator`, `cuda_runtime` / `Runtime`, `kernel` / `Kernel`, ...); they are normalised here so the
analyses see one vocabulary.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

from mlpfuse.errors import InputError

# Normalised categories.
CPU_OP = "cpu_op"
ANNOTATION = "user_annotation"
RUNTIME = "runtime"  # CUDA runtime and driver API calls (launches, memcpy/memset, syncs, occupancy queries)
KERNEL = "kernel"
MEMSET = "memset"
MEMCPY = "memcpy"

_CATEGORIES = {
    "cpu_op": CPU_OP,
    "operator": CPU_OP,
    "user_annotation": ANNOTATION,
    "cuda_runtime": RUNTIME,
    "cuda_driver": RUNTIME,
    "runtime": RUNTIME,
    "kernel": KERNEL,
    "gpu_memset": MEMSET,
    "memset": MEMSET,
    "gpu_memcpy": MEMCPY,
    "memcpy": MEMCPY,
}
GPU_CATEGORIES = (KERNEL, MEMSET, MEMCPY)


@dataclass(slots=True)
class Event:
    """One complete event. Times are microseconds on the trace's clock (CPU and GPU share it in Kineto)."""

    name: str
    cat: str
    tid: Any
    ts: float
    dur: float
    correlation: int | None  # runtime call <-> GPU activity
    external_id: int | None  # CPU op <-> runtime call / GPU activity (Kineto "External id")
    pid: Any = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Trace:
    path: str
    cpu_ops: list[Event] = field(default_factory=list)
    annotations: list[Event] = field(default_factory=list)
    runtime: list[Event] = field(default_factory=list)
    gpu: list[Event] = field(default_factory=list)  # kernels, memsets and memcpys
    metadata: dict[str, Any] = field(default_factory=dict)  # top-level keys other than traceEvents
    n_events: int = 0

    @property
    def devices(self) -> list[str]:
        props = self.metadata.get("deviceProperties") or []
        return [str(p.get("name")) for p in props if isinstance(p, dict) and p.get("name")]


def _read_bytes(path: str) -> bytes:
    if not os.path.exists(path):
        raise InputError(f"TRACE {path}: no such file")
    if os.path.isdir(path):
        raise InputError(f"TRACE {path}: is a directory, expected a .json or .json.gz trace file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InputError(f"TRACE {path}: cannot be read ({exc.strerror or exc})") from None
    if not raw.strip():
        raise InputError(f"TRACE {path}: file is empty, expected a Chrome trace")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise InputError(f"TRACE {path}: gzip data is truncated or corrupt ({exc})") from None
        if not raw.strip():
            raise InputError(f"TRACE {path}: gzip holds an empty file, expected a Chrome trace")
    return raw


def load_json(path: str | os.PathLike) -> Any:
    """Read a .json or gzipped JSON file (detected by content, not suffix)."""
    path = os.fspath(path)
    raw = _read_bytes(path)
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise InputError(f"TRACE {path}: not text JSON (binary data), expected a Chrome trace") from None
    except json.JSONDecodeError as exc:
        what = "truncated JSON" if exc.pos >= len(raw.rstrip()) - 1 else "not valid JSON"
        raise InputError(f"TRACE {path}: {what} (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def from_json(data: Any, path: str = "<trace>") -> Trace:
    """Build the event model from parsed Chrome-trace JSON (object with traceEvents, or a bare event array)."""
    if isinstance(data, dict):
        events = data.get("traceEvents")
        if not isinstance(events, list):
            raise InputError(f"TRACE {path}: JSON has no 'traceEvents' list; not a Chrome/Kineto trace")
        metadata = {k: v for k, v in data.items() if k != "traceEvents"}
    elif isinstance(data, list):
        events, metadata = data, {}
    else:
        raise InputError(f"TRACE {path}: JSON is a {type(data).__name__}, expected a Chrome trace object")

    trace = Trace(path=path, metadata=metadata, n_events=len(events))
    buckets = {CPU_OP: trace.cpu_ops, ANNOTATION: trace.annotations, RUNTIME: trace.runtime, KERNEL: trace.gpu,
               MEMSET: trace.gpu, MEMCPY: trace.gpu}
    categories = _CATEGORIES
    complete = 0
    # The hot loop of `analyze` on large traces: keep it to dict lookups and one object per kept event.
    for ev in events:
        if type(ev) is not dict or ev.get("ph") != "X":
            continue
        complete += 1
        cat = ev.get("cat")
        norm = categories.get(cat)
        if norm is None:
            if not isinstance(cat, str) or (norm := categories.get(cat.lower())) is None:
                continue
        ts = ev.get("ts")
        dur = ev.get("dur", 0.0)
        if type(ts) is not float or type(dur) is not float:
            try:
                ts, dur = float(ts), float(dur)
            except (TypeError, ValueError):
                continue  # a malformed event is skipped, not fatal: the rest of the trace still tells the story
        args = ev.get("args")
        corr = ext = None
        if type(args) is dict:
            corr = args.get("correlation")
            ext = args.get("External id")
            if corr is not None and type(corr) is not int:
                corr = _int_or_none(corr)
            if ext is not None and type(ext) is not int:
                ext = _int_or_none(ext)
        name = ev.get("name", "")
        buckets[norm].append(Event(name if type(name) is str else str(name), norm, ev.get("tid"), ts, dur, corr,
                                   ext, ev.get("pid")))
    if complete == 0:
        raise InputError(f"TRACE {path}: no complete ('ph': 'X') events; not a profiler trace or an empty one")
    if not (trace.cpu_ops or trace.annotations or trace.gpu):
        raise InputError(f"TRACE {path}: no CPU op, annotation or GPU events; not a PyTorch profiler trace")
    return trace


def load(path: str | os.PathLike) -> Trace:
    path = os.fspath(path)
    return from_json(load_json(path), path)
