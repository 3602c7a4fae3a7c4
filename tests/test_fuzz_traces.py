"""Property-based: mutated real traces (and saved analyses) through the real CLI entry.

Every mutation of a committed GPU trace -- fields dropped, retyped, negated, made NaN or huge; events duplicated;
odd unicode and markup in names; deep nesting; bytes cut or garbled; gzip or not -- must end in exactly one of:
  exit 0 with strict JSON whose numbers are finite, non-negative and consistent with each other (per-step values
  are the means of the step table, busy <= window, idle = window - busy, table counts add up), and text output
  that carries no control character; or
  exit 2 with exactly one line on stderr.
Never a traceback, never a hang (each case runs under an alarm). Reproducible: derandomized, no example database.
"""

import contextlib
import copy
import gzip
import io
import json
import math
import os
import random
import signal
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cli_run import HANG_S

from mlpfuse.cli import main
from mlpfuse.profiling import expect

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "traces")
NAMES = sorted(f[: -len(".json.gz")] for f in os.listdir(FIXTURES) if f.endswith(".json.gz"))
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
_DOCS = {}

SETTINGS = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def doc(name):
    if name not in _DOCS:
        with gzip.open(os.path.join(FIXTURES, name + ".json.gz")) as fh:
            _DOCS[name] = json.load(fh)
    return copy.deepcopy(_DOCS[name])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@contextlib.contextmanager
def time_limit(seconds):
    def expired(signum, frame):
        raise TimeoutError(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with time_limit(HANG_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own refusals (an option value that looks like an option)
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def strict(text):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------- strategies

def nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


ODD_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates and controls included
HOSTILE_NAMES = st.sampled_from([
    "[bold red]fake_kernel[/bold red]", "oops[/]", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "\u202eevil", "\ud800",
    "\x9b2J", ":thumbs_up:", "", "ProfilerStep#1", "ProfilerStep#x", "at::native::" * 50, "a\nb\rc\x00",
    "triton_poi_fused__unsafe_view_gelu_mul_0", "void at::native::reduce_kernel<512, 1>",
])
VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(10**400), 2**53, 2**53 + 1, 2**63, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    ODD_TEXT, HOSTILE_NAMES,
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(1, 60).map(nested),
)
FIELDS = st.sampled_from(["name", "cat", "ph", "ts", "dur", "tid", "pid", "args"])
ARG_KEYS = st.sampled_from(["correlation", "External id"])
INDEX = st.integers(0, 10**6)

MUTATIONS = st.one_of(
    st.tuples(st.just("set"), INDEX, FIELDS, VALUES),
    st.tuples(st.just("drop"), INDEX, FIELDS),
    st.tuples(st.just("set_arg"), INDEX, ARG_KEYS, VALUES),
    st.tuples(st.just("negate"), INDEX, st.sampled_from(["ts", "dur"])),
    st.tuples(st.just("shift"), INDEX, st.sampled_from(["ts", "dur"]),
              st.floats(-1e6, 1e6, allow_nan=False)),
    st.tuples(st.just("dup"), INDEX),
    st.tuples(st.just("name"), INDEX, st.one_of(HOSTILE_NAMES, ODD_TEXT,
                                                 st.integers(1, 40_000).map(lambda n: "k" * n))),
    st.tuples(st.just("replace"), INDEX, VALUES),
    st.tuples(st.just("top"), st.sampled_from(["deviceProperties", "mlpfuse_label", "schema"]), VALUES),
)
_BYTE_OPS = [
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    st.tuples(st.just("insert"), st.floats(0.0, 1.0), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("deep"), st.integers(900, 5000)),
]
# Mostly well-formed JSON, so that most cases reach the analysis; one in four damaged at the byte level.
BYTES = st.integers(0, 11).flatmap(lambda k: _BYTE_OPS[k - 9] if k >= 9 else st.just(("none",)))


def mutate(trace, mutations):
    events = trace["traceEvents"]
    for m in mutations:
        kind = m[0]
        if kind == "top":
            trace[m[1]] = m[2]
            continue
        i = m[1] % len(events)
        ev = events[i]
        if kind == "replace":
            events[i] = m[2]
        elif kind == "dup":
            events.insert(i, copy.deepcopy(ev))
        elif not isinstance(ev, dict):
            continue
        elif kind == "set":
            ev[m[2]] = m[3]
        elif kind == "drop":
            ev.pop(m[2], None)
        elif kind == "set_arg":
            if isinstance(ev.get("args"), dict):
                ev["args"][m[2]] = m[3]
        elif kind == "negate":
            if isinstance(ev.get(m[2]), (int, float)) and not isinstance(ev.get(m[2]), bool):
                ev[m[2]] = -ev[m[2]]
        elif kind == "shift":
            if type(ev.get(m[2])) in (int, float):
                ev[m[2]] = ev[m[2]] + m[3]
        elif kind == "name":
            ev["name"] = m[2]
    return trace


def encode(trace, byte_op, gz):
    if byte_op[0] == "deep":
        trace["traceEvents"].append({"ph": "X", "args": nested(1)})
        raw = json.dumps(trace).replace("[1]", "[" * byte_op[1] + "1" + "]" * byte_op[1], 1).encode()
    else:
        raw = json.dumps(trace, allow_nan=True).encode()
    if byte_op[0] == "truncate":
        raw = raw[: int(len(raw) * byte_op[1])]
    elif byte_op[0] == "insert":
        at = int(len(raw) * byte_op[1])
        raw = raw[:at] + byte_op[2] + raw[at:]
    return gzip.compress(raw, compresslevel=1) if gz else raw


# ---------------------------------------------------------------- the properties

EPS = 1e-6


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=EPS)


def numbers(value, where="analysis"):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{where}[{i}]")


def check_analysis(data):
    for where, x in numbers(data):
        assert math.isfinite(x) and x >= 0, (where, x)
    n = data["steps"]
    rows = data["step_table"]
    used = [r for r in rows if r["in_averages"]]
    assert n >= 1 and len(used) == n == len(data["step_names"]) and len(rows) == data["steps_found"]
    assert len(rows) - n == len(data["steps_left_out"])
    per = data["per_step"]
    for key in ("gpu_kernels", "gpu_memsets", "gpu_memcpys", "launch_calls", "cpu_ops", "gpu_busy_us", "step_us",
                "gpu_idle_us", "gpu_window_us"):
        assert close(per[key], sum(r[key] for r in used) / n), key
    any_gpu = any(r["gpu_kernels"] + r["gpu_memsets"] + r["gpu_memcpys"] for r in rows)
    previous_end = -math.inf
    for r in rows:
        assert r["gpu_busy_us"] <= r["gpu_window_us"] * (1 + 1e-12) + EPS
        assert close(r["gpu_window_us"], r["gpu_window_end_us"] - r["gpu_window_start_us"])
        if any_gpu:
            assert close(r["gpu_idle_us"], r["gpu_window_us"] - r["gpu_busy_us"])
            assert r["gpu_window_start_us"] >= previous_end - EPS  # GPU windows never overlap
            previous_end = r["gpu_window_end_us"]
        else:
            assert r["gpu_busy_us"] == 0 and r["gpu_idle_us"] == 0
        # a step is left out of the averages exactly when it has no GPU work of its own and another step has some
        own = r["gpu_kernels"] + r["gpu_memsets"] + r["gpu_memcpys"]
        assert r["in_averages"] == (own > 0 or not any_gpu)
    gpu_total = sum(r["gpu_kernels"] + r["gpu_memsets"] + r["gpu_memcpys"] for r in used)
    assert sum(k["count"] for k in data["kernels"]) == gpu_total
    assert sum(sum(ks.values()) for ks in data["kernels_by_op"].values()) == gpu_total
    for k in data["kernels"]:
        assert k["min_us"] - EPS <= k["avg_us"] <= k["max_us"] + EPS and close(k["total_us"], k["avg_us"] * k["count"])
        assert close(k["per_step"], k["count"] / n) and sum(k["ops"].values()) == k["count"]
    assert sum(o["count"] for o in data["ops"]) == sum(r["cpu_ops"] for r in used)
    share = data["verdict"]["gpu_busy_share"]
    assert (share is None) == (gpu_total == 0) and (share is None or 0 <= share <= 1 + 1e-12)
    for counts in (data["skipped_events"], data["repaired_events"]):
        assert all(type(v) is int and v >= 1 for v in counts.values())


def check_text(out):
    for ch in out:
        assert ch == "\n" or ch.isprintable() or "\u2500" <= ch <= "\u257f", repr(ch)  # box drawing


def one_line(err):
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlpfuse: error: "), err
    return lines[0]


@settings(max_examples=150, **SETTINGS)
@given(name=st.sampled_from(NAMES), mutations=st.lists(MUTATIONS, min_size=1, max_size=6), byte_op=BYTES,
       gz=st.booleans())
def test_mutated_traces(folder, name, mutations, byte_op, gz):
    path = folder / ("case.json.gz" if gz else "case.json")
    path.write_bytes(encode(mutate(doc(name), mutations), byte_op, gz))
    code, out, err = cli("analyze", str(path), "--json")
    if code == 0:
        assert err == ""
        data = strict(out)
        check_analysis(data)
        event(f"exit 0, {'clean' if not (data['skipped_events'] or data['repaired_events']) else 'counted'}")
    else:
        assert code == 2 and out == ""
        event(f"exit 2: {one_line(err).split(': ', 3)[-1][:40]}")
    text_code, text, text_err = cli("analyze", str(path))
    assert text_code == code and (text_err == err)
    check_text(text)


@settings(max_examples=60, **SETTINGS)
@given(name=st.sampled_from(NAMES), path_in_doc=st.lists(st.integers(0, 50), min_size=1, max_size=4),
       value=VALUES, drop=st.booleans())
def test_mutated_saved_analyses(folder, name, path_in_doc, value, drop):
    """A saved `analyze --json` with one value replaced or removed: analyze and diff read it or refuse it."""
    code, out, err = cli("analyze", os.path.join(FIXTURES, name + ".json.gz"), "--json")
    assert code == 0
    data = strict(out)
    node, key = data, None
    for step in path_in_doc:  # walk down to some container, choosing children by index
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        if not children:
            break
        k, child = children[step % len(children)]
        if not isinstance(child, (dict, list)) or not child:
            key = k
            break
        node, key = child, None
    if key is None:
        key = next(iter(node)) if isinstance(node, dict) else 0
    if drop and isinstance(node, dict):
        del node[key]
    else:
        node[key] = value
    saved = folder / "saved.json"
    saved.write_text(json.dumps(data, allow_nan=True))
    for argv in (["analyze", str(saved), "--json"], ["analyze", str(saved)],
                 ["diff", str(saved), os.path.join(FIXTURES, name + ".json.gz"), "--json"],
                 ["diff", os.path.join(FIXTURES, name + ".json.gz"), str(saved)]):
        code, out, err = cli(*argv)
        if code == 0:
            assert err == ""
            if "--json" in argv:
                strict(out)
            else:
                check_text(out)
        else:
            assert code == 2 and out == ""
            line = one_line(err)  # without its schema key the file is neither an analysis nor a trace
            assert "not an mlpfuse analysis JSON" in line or "not a Chrome/Kineto trace" in line


@settings(max_examples=150, **SETTINGS)
@given(text=st.one_of(ODD_TEXT, st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
    ["kernels", "memsets", "launches", "cpu-ops", "gemm", "op", "kernel~", "bogus"]),
    st.one_of(ODD_TEXT, st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str)))))
def test_expectation_parsing(text):
    try:
        e = expect.parse(text)
    except ValueError as exc:
        assert type(exc).__name__ == "InputError" and "--expect" in str(exc)
        return
    if e.op == "=" and e.key not in ("op", "no-op"):
        assert 0 <= float(e.value) < math.inf


@settings(max_examples=40, **SETTINGS)
@given(size=st.one_of(ODD_TEXT, st.integers(-5, 2**70).map(str), st.sampled_from(["1K", "2G", "512MiB", "1.5G"])))
def test_max_bytes_option(size):
    code, out, err = cli("analyze", os.path.join(FIXTURES, "linear_eager.json.gz"), "--json", "--max-bytes", size)
    if code == 0:
        check_analysis(strict(out))
    else:
        assert code == 2 and out == ""
        one_line(err)


def test_mutated_traces_through_a_real_process(tmp_path):
    """A few cases as a user runs them: `python -m mlpfuse analyze`, to a pipe read whole and one closed early."""
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": SRC}
    for case in range(4):
        trace = doc(NAMES[case % len(NAMES)])
        for _ in range(5):
            ev = trace["traceEvents"][rng.randrange(len(trace["traceEvents"]))]
            ev[rng.choice(["ts", "dur", "name", "tid"])] = rng.choice(
                [float("nan"), -1.0, 10**400, [1], "\x1b[2J[red]x", None])
        path = tmp_path / f"case{case}.json"
        path.write_text(json.dumps(trace, allow_nan=True))
        for argv in (["analyze", str(path), "--json"], ["analyze", str(path)]):
            proc = subprocess.run([sys.executable, "-m", "mlpfuse", *argv], capture_output=True, text=True,
                                  timeout=HANG_S, env=env)
            assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr
            if proc.returncode == 0:
                check_analysis(strict(proc.stdout)) if "--json" in argv else check_text(proc.stdout)
            else:
                one_line(proc.stderr)
            early = subprocess.Popen([sys.executable, "-m", "mlpfuse", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
            early.stdout.close()
            err = early.stderr.read().decode()
            code = early.wait(timeout=HANG_S)
            assert (code, err) == (141, "") or (code == 2 and len(err.splitlines()) == 1), (code, err)
