"""Load any Chrome / Kineto trace (.json or .json.gz) into a small event model.

Only the standard library (and msgspec, which parses faster, where it is installed): `mlpfuse analyze` must start
fast and run where torch is not installed.
Every way a file can fail to be a trace ends in one `InputError` line naming the file.

A trace file is untrusted input: only regular files are read, at most a set number of bytes read or inflated,
and every field of every event is checked. A malformed event is skipped, and a bad id or an oversized name
repaired, with a count by reason (`Trace.skipped`, `Trace.repaired`) that the analysis reports; the numbers the
analyses see are finite, non-negative times below 2^53 us, so nothing downstream can overflow or go negative.

Kineto writes complete events (`"ph": "X"`) in categories that changed spelling over PyTorch releases
(`cpu_op` / `Operator`, `cuda_runtime` / `Runtime`, `kernel` / `Kernel`, ...); they are normalised here so the
analyses see one vocabulary.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import itertools
import json
import math
import operator
import os
import re
import stat
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from mlpfuse.errors import InputError
from mlpfuse.profiling import jsondecode

# Normalised categories.
CPU_OP = "cpu_op"
ANNOTATION = "user_annotation"
RUNTIME = "runtime"  # CUDA runtime and driver API calls (launches, memcpy/memset, syncs, occupancy queries)
KERNEL = "kernel"
MEMSET = "memset"
MEMCPY = "memcpy"
PYTHON = "python_function"  # Python frames, in traces captured with with_stack=True (read by the report only)

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
    "python_function": PYTHON,
}
GPU_CATEGORIES = (KERNEL, MEMSET, MEMCPY)


class Event(NamedTuple):
    """One complete event. Times are microseconds on the trace's clock (CPU and GPU share it in Kineto).

    A named tuple: large traces hold millions, built straight from the parser's tuples without a Python call.
    """

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


def event_field(name: str) -> Callable[[tuple], Any]:
    """A getter of one Event field by position: `map(event_field("ts"), events)` runs in C, where `e.ts` per event
    goes through a Python-level loop — on a million events the difference is a large part of a pass."""
    return operator.itemgetter(Event._fields.index(name))


@dataclass
class Trace:
    path: str
    cpu_ops: list[Event] = field(default_factory=list)
    annotations: list[Event] = field(default_factory=list)
    runtime: list[Event] = field(default_factory=list)
    gpu: list[Event] = field(default_factory=list)  # kernels, memsets and memcpys
    python: list[Event] = field(default_factory=list)  # Python frames (with_stack=True), for flamegraphs
    metadata: dict[str, Any] = field(default_factory=dict)  # top-level keys other than traceEvents
    n_events: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> malformed events left out
    repaired: dict[str, int] = field(default_factory=dict)  # fix -> events kept with a field fixed or dropped
    skipped_steps: int = 0  # ProfilerStep# spans among the skipped
    unread: dict[str, int] = field(default_factory=dict)  # category -> events not read (python_function, ...)
    # (ts, tid, pid, name) of a CPU op -> its inputs' (dims, dtypes), where the trace recorded shapes and they pass
    # op_inputs' checks (read by the roofline: profiling/costs.py)
    op_inputs: dict = field(default_factory=dict)

    def inputs_of(self, op: Event):
        """(dims, dtypes) of a CPU op's inputs as the trace recorded them (record_shapes), or None."""
        return self.op_inputs.get((op.ts, op.tid, op.pid, op.name))

    @property
    def devices(self) -> list[str]:
        props = self.metadata.get("deviceProperties")
        if not isinstance(props, list):
            return []
        names = (p.get("name") for p in props[:MAX_DEVICES] if isinstance(p, dict))
        return [clean_name(n) for n in names if isinstance(n, str) and n]


# ---------------------------------------------------------------- reading: the file is untrusted

DEFAULT_MAX_TRACE_BYTES = 2 << 30  # on the bytes read and on what gzip inflates; env or --max-bytes change it
MAX_BYTES_ENV = "MLPFUSE_MAX_TRACE_BYTES"
_CHUNK = 16 << 20
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.I)
_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def parse_size(text: str, what: str) -> int:
    """'2G', '512M', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text) if isinstance(text, str) else None
    if not m or int(m.group(1)) <= 0:
        raise InputError(f"{what}: expected a positive size in bytes like 500000000, 512M or 2G, got {text!r}")
    return int(m.group(1)) << (10 * "kmgt".index(m.group(2).lower()) + 10 if m.group(2) else 0)


def max_trace_bytes(max_bytes: int | str | None = None) -> int:
    """The read / inflate limit: the argument, else $MLPFUSE_MAX_TRACE_BYTES, else 2 GiB. Anything past 2^60
    (no limit, in effect) is taken as 2^60, which zlib's and the reader's sizes can hold."""
    if max_bytes is None:
        env = os.environ.get(MAX_BYTES_ENV)
        limit = DEFAULT_MAX_TRACE_BYTES if env is None else parse_size(env, MAX_BYTES_ENV)
    elif isinstance(max_bytes, str):
        limit = parse_size(max_bytes, "--max-bytes")
    elif isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise InputError(f"max_bytes: expected a positive integer, got {max_bytes!r}")
    else:
        limit = max_bytes
    return min(limit, 1 << 60)


def _over(path: str, what: str, limit: int) -> InputError:
    return InputError(f"TRACE {path}: {what} more than the {_human(limit)} limit; raise it with --max-bytes or "
                      f"{MAX_BYTES_ENV} if the trace is genuine")


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _open_regular(path: str) -> int:
    """A descriptor of a regular file. Special files are refused before they are opened or read: a FIFO would
    block, /dev/zero never ends. O_NONBLOCK keeps a path swapped for a FIFO after the check from blocking open()."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputError(f"TRACE {path}: {_stat_problem(path, exc)}") from None
    except ValueError:  # a NUL byte, which no file name holds
        raise InputError(f"TRACE {path!r}: not a valid file name") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"TRACE {path}: is a directory, expected a .json or .json.gz trace file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise InputError(f"TRACE {path}: is {kind}, expected a regular .json or .json.gz trace file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"TRACE {path}: cannot be opened ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"TRACE {path}: changed into a special file while being opened; expected a regular file")
    return fd


def _stat_problem(path: str, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "symbolic link loop (the link points back to itself)"
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return f"dangling symbolic link (points to {os.readlink(path)!r}, which does not exist)"
        return "no such file"
    if exc.errno == errno.ENOTDIR:
        return "a part of the path is not a folder"
    if exc.errno == errno.EACCES:
        return "permission denied"
    return f"cannot be read ({exc.strerror or exc})"


def _read_capped(fh, limit: int, path: str, size_hint: int) -> bytes:
    # One read of the size fstat reports; chunks past it (procfs reports 0, a file may grow) are counted.
    first = fh.read(size_hint + 1) if 0 < size_hint <= limit else b""
    chunks, total = [first], len(first)
    if total > limit:
        raise _over(path, "file holds", limit)
    while True:
        chunk = fh.read(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise _over(path, "file holds", limit)
        chunks.append(chunk)
    return first if len(chunks) == 1 else b"".join(chunks)


def _inflate(packed: bytes, limit: int, path: str) -> bytes:
    """Gzip members one after another, each inflated by zlib with `max_length`: the output stops one byte past the
    limit, so a gzip bomb costs the limit in memory, never its inflated size (and one call per member keeps the
    common case as fast as `gzip.decompress`)."""
    pieces, total = [], 0
    try:
        while packed:
            member = zlib.decompressobj(wbits=31)
            piece = member.decompress(packed, limit + 1 - total)
            total += len(piece)
            if total > limit:
                raise _over(path, "gzip data inflates to", limit)
            if not member.eof:
                raise InputError(f"TRACE {path}: gzip data is truncated")
            pieces.append(piece)
            packed = member.unused_data
            if packed[:2] != b"\x1f\x8b" and not packed.strip(b"\0"):
                break  # zero padding after the last member, as gzip allows
    except zlib.error as exc:
        raise InputError(f"TRACE {path}: gzip data is corrupt ({exc})") from None
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _read_bytes(path: str, max_bytes: int | str | None = None) -> bytes:
    limit = max_trace_bytes(max_bytes)
    fd = _open_regular(path)
    size = os.fstat(fd).st_size
    with os.fdopen(fd, "rb") as fh:
        if size > limit:
            raise _over(path, f"file is {_human(size)},", limit)
        try:
            raw = _read_capped(fh, limit, path, size)
        except OSError as exc:
            raise InputError(f"TRACE {path}: cannot be read ({exc.strerror or exc})") from None
    gzipped = raw[:2] == b"\x1f\x8b"
    if gzipped:
        raw = _inflate(raw, limit, path)
    if not raw or raw.isspace():
        what = "gzip holds an empty file" if gzipped else "file is empty"
        raise InputError(f"TRACE {path}: {what}, expected a Chrome trace")
    return raw


@contextlib.contextmanager
def no_gc():
    """Pause the cyclic garbage collector while millions of small acyclic objects are built: it would otherwise
    rescan the growing heap again and again (measured: 2.1 s -> 0.2 s to build 570k events)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _decode(raw: bytes, path: str) -> Any:
    try:
        return jsondecode.loads(raw)
    except UnicodeDecodeError:
        raise InputError(f"TRACE {path}: not text JSON (binary data), expected a Chrome trace") from None
    except json.JSONDecodeError as exc:
        what = "truncated JSON" if exc.pos >= len(raw.rstrip()) - 1 else "not valid JSON"
        raise InputError(f"TRACE {path}: {what} (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise InputError(f"TRACE {path}: JSON nested too deeply to be a trace") from None
    except ValueError as exc:  # an integer literal of thousands of digits (Python's int conversion limit)
        raise InputError(f"TRACE {path}: a number in the JSON cannot be read ({str(exc).split(':')[0]})") from None


def within_memory(path: str, fn: Callable[..., Any], *args) -> Any:
    """`fn(*args)`, with running out of memory (a capped address space, a large --max-bytes) turned into one
    InputError line. The error is raised after the handler has ended, so the failed attempt's buffers (held by the
    MemoryError's traceback) are freed first and the message itself has room to be made."""
    try:
        return fn(*args)
    except MemoryError:
        pass
    raise InputError(f"TRACE {path}: not enough memory to read it (the file, inflated or parsed, needs more than "
                     "this process may allocate); free memory, or lower --max-bytes to refuse such files sooner")


def _read_json(path: str, max_bytes: int | str | None) -> Any:
    return _decode(_read_bytes(path, max_bytes), path)


def load_json(path: str | os.PathLike, max_bytes: int | str | None = None) -> Any:
    """Read a .json or gzipped JSON file (detected by content, not suffix), at most `max_bytes` read or inflated."""
    path = os.fspath(path)
    return within_memory(path, _read_json, path, max_bytes)


# ---------------------------------------------------------------- events: every field is checked

MAX_TIME_US = float(1 << 53)  # past 2^53 us (285 years) a float no longer holds whole microseconds
MAX_ID = (1 << 63) - 1
MAX_NAME_CHARS = 16384  # longer names are cut, keeping a hash of the whole so distinct names stay distinct
MAX_DEVICES = 256
MAX_UNREAD_CATEGORIES = 32  # distinct unread categories counted (a hostile trace may invent millions)
MAX_INPUTS = 64  # an op's recorded inputs kept for the roofline; an op with more keeps none
MAX_DIMS = 8
MAX_DIM = 1 << 48
MAX_TYPE_CHARS = 64


def op_inputs(dims, types):
    """A CPU op's recorded "Input Dims" and "Input type" as (tuple of dims tuples, tuple of dtype strings), or None
    when they are not lists of that shape (untrusted: at most MAX_INPUTS inputs of MAX_DIMS non-negative ints each,
    short strings)."""
    if type(dims) is not list or type(types) is not list or len(dims) != len(types) or len(dims) > MAX_INPUTS:
        return None
    out = []
    for d in dims:
        if type(d) is not list or len(d) > MAX_DIMS or not all(type(v) is int and 0 <= v <= MAX_DIM for v in d):
            return None
        out.append(tuple(d))
    if not all(type(t) is str and len(t) <= MAX_TYPE_CHARS for t in types):
        return None
    return tuple(out), tuple(types)


_SURROGATES = re.compile("[\ud800-\udfff]")

DUPLICATE = "duplicate event"
BAD_THREAD = "pid or tid not a number or string"


def clean_name(name: str, repaired: Counter | None = None) -> str:
    """A name safe to key tables and to write as strict JSON: bounded length, no lone surrogates."""
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
        name = f"{name[:MAX_NAME_CHARS]}…[{len(name) - MAX_NAME_CHARS} more chars, #{digest}]"
        if repaired is not None:
            repaired[f"name truncated (over {MAX_NAME_CHARS} chars)"] += 1
    if not name.isascii() and _SURROGATES.search(name):
        name = _SURROGATES.sub("\ufffd", name)
        if repaired is not None:
            repaired["name had lone surrogates (now U+FFFD)"] += 1
    return name


def _time(value: Any, field: str) -> float | str:
    """The value as a float of microseconds, or why it is not one."""
    if value is None:
        return f"{field} missing"
    if type(value) is str:
        try:
            value = float(value)
        except ValueError:
            return f"{field} not a number"
    elif type(value) is not int and type(value) is not float:  # bool is not a time either
        return f"{field} not a number"
    if value != value or value in (math.inf, -math.inf):
        return f"{field} not finite"
    if value < 0:
        return f"{field} negative"
    if value > MAX_TIME_US:  # compared before float(): an int of 400 digits does not fit one
        return f"{field} over 2^53 us"
    return float(value)


def _id(value: Any, field: str, repaired: Counter) -> int | None:
    """A correlation / External id as a non-negative int; anything else is dropped (the event stays)."""
    if type(value) is float and value.is_integer():
        value = int(value)
    elif type(value) is str and 0 < len(value) <= 20 and value.strip().isdigit():
        value = int(value)
    if type(value) is int and 0 <= value <= MAX_ID:
        return value
    repaired[f"{field} not an integer id (dropped)"] += 1
    return None


def _checked(ev: dict, name: Any, tid: Any, pid: Any) -> tuple[float, float] | str:
    """The slow path of `_extract`: (ts, dur), or the reason the event is skipped."""
    if type(name) is not str:
        return "name missing or not a string"
    if type(tid) not in _SCALARS or type(pid) not in _SCALARS:
        return BAD_THREAD
    ts = _time(ev.get("ts"), "ts")
    if type(ts) is str:
        return ts
    dur = _time(ev.get("dur"), "dur")
    if type(dur) is str:
        return dur
    return ts, dur


_SCALARS = frozenset((str, int, float, bool, type(None)))  # JSON's hashable values: usable as pid / tid

Row = tuple  # (name, category, tid, ts, dur, correlation, external_id, pid): an Event's fields, in its order
_NAME, _TS = event_field("name"), event_field("ts")
_FIELDS = operator.itemgetter("name", "ts", "dur", "tid", "pid")


@dataclass
class Extracted:
    rows: list[Row]
    complete: int  # complete ('ph': 'X') events, kept or not
    skipped: Counter  # reason -> events left out
    repaired: Counter  # what was fixed -> events kept after a fix
    skipped_steps: int  # ProfilerStep# spans among the skipped
    unread: Counter  # category -> complete events of a category the analyses do not read
    inputs: dict  # (ts, tid, pid, name) of a CPU op -> op_inputs(...)


def _extract(events: list) -> Extracted:
    """Complete events of the known categories as plain tuples; malformed ones skipped with a reason.

    The hot loop of `analyze` on large traces: one combined test keeps well-formed events on a fast path of dict
    lookups; anything unusual goes through `_checked`. Names and duplicates are checked after it, in bulk.
    """
    rows: list[Row] = []
    append = rows.append
    categories = _CATEGORIES
    scalars = _SCALARS
    skipped: Counter = Counter()
    repaired: Counter = Counter()
    unread: Counter = Counter()
    inputs: dict = {}
    complete = skipped_steps = 0
    max_time, max_id = MAX_TIME_US, MAX_ID
    fields = _FIELDS
    # The parser makes a new str for every name; one object per distinct name keeps the events small and makes
    # every later pass over names (tests, hashing, counting) touch a few hot strings instead of a million cold ones.
    same_name = {}.setdefault
    for ev in events:
        if type(ev) is not dict or ev.get("ph") != "X":
            continue
        complete += 1
        cat = ev.get("cat")
        if type(cat) is not str:
            if cat is not None:
                skipped["cat not a string"] += 1
            continue
        norm = categories.get(cat)
        if norm is None and (norm := categories.get(cat.lower())) is None:
            if cat in unread or len(unread) < MAX_UNREAD_CATEGORIES:
                unread[cat] += 1
            continue
        try:
            name, ts, dur, tid, pid = fields(ev)  # one call where a well-formed event has them all
        except KeyError:
            name, ts, dur, tid, pid = ev.get("name"), ev.get("ts"), ev.get("dur"), ev.get("tid"), ev.get("pid")
        if (type(ts) is not float or type(dur) is not float or not 0.0 <= ts <= max_time
                or not 0.0 <= dur <= max_time or type(name) is not str or type(tid) not in scalars
                or type(pid) not in scalars):
            times = _checked(ev, name, tid, pid)
            if type(times) is str:
                skipped[times] += 1
                skipped_steps += type(name) is str and name.startswith("ProfilerStep#")
                continue
            ts, dur = times
        args = ev.get("args")
        corr = ext = None
        if type(args) is dict:
            corr = args.get("correlation")
            ext = args.get("External id")
            if ext is None:
                ext = args.get("external id")  # PyTorch 1.8's spelling
            if corr is not None and (type(corr) is not int or not 0 <= corr <= max_id):
                corr = _id(corr, "correlation", repaired)
            if ext is not None and (type(ext) is not int or not 0 <= ext <= max_id):
                ext = _id(ext, "External id", repaired)
            if norm == CPU_OP and "Input Dims" in args:
                shapes = op_inputs(args["Input Dims"], args.get("Input type"))
                if shapes is not None:
                    inputs[(ts, tid, pid, name)] = shapes
        elif args is not None:
            repaired["args not an object (ids ignored)"] += 1
        append((same_name(name, name), norm, tid, ts, dur, corr, ext, pid))
    rows = _dedupe(_clean_names(rows, repaired), skipped)
    return Extracted(rows, complete, skipped, repaired, skipped_steps, unread, inputs)


def _clean_names(rows: list[Row], repaired: Counter) -> list[Row]:
    """Over-long names and lone surrogates, checked once per distinct name (hashing the names here costs little:
    the analyses hash every one of them anyway, and a str keeps its hash)."""
    fixed: dict[str, tuple[str, Counter]] = {}
    for name in set(map(_NAME, rows)):
        if len(name) > MAX_NAME_CHARS or not name.isascii():
            why: Counter = Counter()
            if (clean := clean_name(name, why)) != name:
                fixed[name] = clean, why
    if not fixed:
        return rows
    out = []
    for row in rows:
        fix = fixed.get(row[0])
        if fix is not None:
            row = (fix[0], *row[1:])
            repaired.update(fix[1])
        out.append(row)
    return out


def _dedupe(rows: list[Row], skipped: Counter) -> list[Row]:
    """Exact duplicates (the same name, category, pid, tid, ts, dur and ids) would count twice: keep the first.

    Duplicates share a start time. Sorting the start times is cheap (they come nearly in order) and, in real
    traces, shows no two equal, so whole rows are compared only when it shows some."""
    ts = sorted(map(_TS, rows))
    if not any(map(operator.eq, ts, itertools.islice(ts, 1, None))):
        return rows
    unique = dict.fromkeys(rows)
    if len(unique) < len(rows):
        skipped[DUPLICATE] += len(rows) - len(unique)
        rows = list(unique)
    return rows


def describe(counts: dict) -> str:
    """{'dur missing': 2, 'duplicate event': 1} -> 'dur missing 2, duplicate event 1'."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def is_execution_trace(data: Any) -> bool:
    """PyTorch's execution trace (ET, `ExecutionTraceObserver`): a graph of op nodes, no timeline events."""
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "traceEvents" not in data


def refuse_execution_trace(data: Any, path: str) -> None:
    if is_execution_trace(data):
        raise InputError(f"TRACE {path}: this is a PyTorch execution trace (ET), not a Kineto trace; export a "
                         "timeline with torch.profiler (prof.export_chrome_trace or a tensorboard_trace_handler)")


def _own_output(data: dict, path: str) -> str | None:
    """What to pass instead, when `data` is one of mlpfuse's own result files rather than a trace (None if not)."""
    folder = os.path.dirname(path) or "."
    if {"rounds", "cases", "verdicts"} <= data.keys():
        cases = data["cases"] if isinstance(data["cases"], dict) else {}
        example = next((str(c)[:80] for c in cases), "CASE")
        return (f"this is mlpfuse walkthrough's summary, not a trace: pass one of the traces beside it "
                f"({os.path.join(folder, example)}.pt.trace.json.gz, or its saved {example}.analysis.json); the "
                "report.html beside it shows every case")
    if {"model", "patch", "eager", "mlpfuse", "diff"} <= data.keys():
        return (f"this is mlpfuse profile --model's model-diff.json, not a trace: pass "
                f"{os.path.join(folder, 'model-eager.pt.trace.json.gz')} or model-mlpfuse.pt.trace.json.gz beside it")
    if {"meta", "rows"} <= data.keys():
        return ("this is mlpfuse bench's results.json (timings, not a trace): open the report.html beside it, or "
                "trace one shape with `mlpfuse profile`")
    return None


def _split_document(data: Any, path: str) -> tuple[list, dict]:
    refuse_execution_trace(data, path)
    if isinstance(data, dict):
        events = data.get("traceEvents")
        if not isinstance(events, list):
            own = _own_output(data, path)
            if own:
                raise InputError(f"TRACE {path}: {own}")
            raise InputError(f"TRACE {path}: JSON has no 'traceEvents' list; not a Chrome/Kineto trace")
        return events, {k: v for k, v in data.items() if k != "traceEvents"}
    if isinstance(data, list):
        return data, {}
    raise InputError(f"TRACE {path}: JSON is a {type(data).__name__}, expected a Chrome trace object")


def _build(ex: Extracted, n_events: int, metadata: dict, path: str) -> Trace:
    unread: Counter = Counter()
    for cat, count in ex.unread.items():
        unread[clean_name(cat[:200])] += count
    trace = Trace(path=path, metadata=metadata, n_events=n_events, skipped=dict(ex.skipped),
                  repaired=dict(ex.repaired), skipped_steps=ex.skipped_steps, unread=dict(unread.most_common()),
                  op_inputs=ex.inputs)
    buckets = {CPU_OP: trace.cpu_ops, ANNOTATION: trace.annotations, RUNTIME: trace.runtime, KERNEL: trace.gpu,
               MEMSET: trace.gpu, MEMCPY: trace.gpu, PYTHON: trace.python}
    # Made here, in a pass of their own, rather than in `_extract`'s loop: then the events lie densely in memory,
    # and every later pass over them is faster (made in that loop, 1M events took 0.2-1.7 s longer end to end).
    make = tuple.__new__
    for row in ex.rows:
        buckets[row[1]].append(make(Event, row))
    if ex.complete == 0:
        raise InputError(f"TRACE {path}: no complete ('ph': 'X') events; not a profiler trace or an empty one")
    if not (trace.cpu_ops or trace.annotations or trace.runtime or trace.gpu):
        why = f" (skipped as malformed: {describe(ex.skipped)})" if ex.skipped else ""
        raise InputError(f"TRACE {path}: no CPU op, annotation, runtime or GPU events{why}; not a PyTorch profiler "
                         "trace")
    return trace


def from_json(data: Any, path: str = "<trace>") -> Trace:
    """Build the event model from parsed Chrome-trace JSON (object with traceEvents, or a bare event array)."""
    events, metadata = _split_document(data, path)
    return _build(_extract(events), len(events), metadata, path)


def _from_own_json(data: Any, path: str) -> Trace:
    """`from_json` of a document parsed here, which nothing else holds: once read, its events are freed in the
    order the parser made them. A list frees its items last to first, so it is reversed first: a million parsed
    events then take 0.3 s to free instead of 0.5 (measured; memory is walked forwards, as it was filled)."""
    try:
        return within_memory(path, from_json, data, path)
    finally:
        events = data.get("traceEvents") if isinstance(data, dict) else data
        if isinstance(events, list):
            events.reverse()


def load(path: str | os.PathLike, max_bytes: int | str | None = None) -> Trace:
    path = os.fspath(path)
    with no_gc():
        return _from_own_json(load_json(path, max_bytes), path)


def load_trace_or_json(path: str | os.PathLike, max_bytes: int | str | None = None) -> Trace | dict:
    """A Trace, or the parsed JSON object when the file is not a trace but a saved document with a 'schema' key
    (an mlpfuse analysis); the caller decides what to do with that."""
    path = os.fspath(path)
    data = load_json(path, max_bytes)
    refuse_execution_trace(data, path)
    if isinstance(data, dict) and "schema" in data and "traceEvents" not in data:
        return data
    return _from_own_json(data, path)
