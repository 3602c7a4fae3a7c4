"""The trace reader's JSON decoding: msgspec where it is installed, `json.loads` otherwise; the two give the same
document or the same error, on edge cases of the format, on fuzzed documents, and through the trace loader.

The oracle is `json.loads` itself (`jsondecode.loads(raw, fast=False)` is exactly it). The comparisons are
skipped, with the reason, where msgspec is not installed (there both sides would be `json.loads`); under CI, which
installs it (`bash install.sh test`), its absence is a failure.
"""

import gzip
import json
import math
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlpfuse.errors import InputError
from mlpfuse.profiling import analysis, jsondecode, trace as trace_mod

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "traces")
TRACES = sorted(os.path.join(root, f) for root, _, files in os.walk(FIXTURES) for f in files if f.endswith(".json.gz"))

needs_fast = pytest.mark.skipif(not jsondecode.available(), reason="msgspec is not installed: json.loads is the only "
                                "decoder, nothing to compare it with")


def test_msgspec_is_there_under_ci():
    if os.environ.get("CI") and not jsondecode.available():
        pytest.fail("msgspec is not importable under CI: the comparisons below would all be skipped")


SETTINGS = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def same(a, b) -> bool:
    """Equal as documents: same types (1 is not 1.0 or True), floats bit for bit (-0.0, NaN), keys in order.
    Iterative: documents here nest thousands deep."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if type(x) is float:
            if struct.pack("<d", x) != struct.pack("<d", y):
                return False
        elif type(x) is dict:
            if list(x) != list(y):
                return False
            pending.extend(zip(x.values(), y.values()))
        elif type(x) is list:
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y))
        elif x != y:
            return False
    return True


def outcome(raw: bytes, fast: bool):
    try:
        return "ok", jsondecode.loads(raw, fast=fast)
    except Exception as exc:  # the type and the message are what the reader's error line is made from
        return "error", (type(exc), str(exc), getattr(exc, "pos", None))


def assert_same_outcome(raw: bytes) -> None:
    want, got = outcome(raw, fast=False), outcome(raw, fast=True)
    assert want[0] == got[0], (raw[:80], want, got)
    if want[0] == "ok":
        assert same(want[1], got[1]), raw[:80]
    else:
        assert want[1] == got[1], raw[:80]


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * (depth // 2) + b"[" * (depth - depth // 2) + inner + b"]" * (depth - depth // 2) + b"}" * (
        depth // 2)


# Where msgspec and json could part: each is either read alike, or refused by msgspec and left to json.
EDGE = {
    "nan and infinities": b'[NaN, Infinity, -Infinity, {"x": NaN}]',
    "float overflow": b"[1e400, -1e400, 1e309]",
    "float underflow": b"[1e-400, 2e-324, 4.9e-324, -0e0, -0.0, 0e99999]",
    "float rounding": b"[0.1000000000000000055511151231257827021181583404541015625, 9007199254740993.0, 1e23, "
                      b"2.2250738585072014e-308, 1.7976931348623157e308, 123456789012345678901234567890.5]",
    "64-bit edges": b"[18446744073709551615, 18446744073709551616, -9223372036854775808, -9223372036854775809]",
    "big integers": b"[" + b"9" * 100 + b", -" + b"9" * 4000 + b"]",
    "integer past the digit limit": b"[1, " + b"7" * 5000 + b"]",
    "negative zero integer": b"[-0, 0, -1]",
    "exponent forms": b"[1E2, 1e+2, 1e-2, 10E0]",
    "duplicate keys": b'{"a": 1, "b": 2, "a": 3, "traceEvents": [], "traceEvents": [{"ph": "X", "ph": "B"}]}',
    "lone high surrogate": b'["\\ud800"]',
    "lone low surrogate": b'{"name": "\\udc00x"}',
    "reversed pair": b'["\\udc00\\ud800"]',
    "surrogate pair": b'["\\ud83d\\ude00", "\\uD83D\\uDE00"]',
    "surrogate as UTF-8 bytes": b'["\xed\xa0\x80"]',
    "invalid UTF-8": b'["\xff"]',
    "overlong UTF-8": b'["\xc0\x80"]',
    "truncated UTF-8": b'["\xe2\x82"]',
    "past U+10FFFF": b'["\xf4\x90\x80\x80"]',
    "UTF-8 BOM": b'\xef\xbb\xbf{"traceEvents": []}',
    "UTF-16 with BOM": '{"traceEvents": []}'.encode("utf-16"),
    "UTF-16 LE": '{"traceEvents": []}'.encode("utf-16-le"),
    "UTF-32 BE": '{"a": 1}'.encode("utf-32-be"),
    "non-ASCII text": '["é", "漢字", "\u2028", "\U0001f600"]'.encode(),
    "escapes": b'["\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000\\u00e9\\u00E9"]',
    "bad escape": b'["\\x"]',
    "bad unicode escape": b'["\\u12g4"]',
    "control character": b'["a\x01b"]',
    "DEL character": b'["a\x7fb"]',
    "whitespace": b' \t\r\n{ "a" : [ 1 , 2 ] }\n ',
    "form feed as space": b"\x0c[1]",
    "NUL after document": b"[1]\x00",
    "trailing data": b"[1, 2] x",
    "trailing comma": b"[1, 2,]",
    "trailing comma in object": b'{"a": 1,}',
    "leading zero": b"[01]",
    "bare dot": b"[1.]",
    "leading dot": b"[.5]",
    "plus sign": b"[+1]",
    "hex": b"[0x10]",
    "single quotes": b"{'a': 1}",
    "unquoted key": b"{a: 1}",
    "missing colon": b'{"a" 1}',
    "truncated": b'{"traceEvents": [{"ph": "X"',
    "empty": b"",
    "only whitespace": b"  \n",
    "literals": b"[true, false, null]",
    "bad literal": b"[tru]",
    "capital literal": b"[True]",
    "scalar document": b"42",
    "string document": b'"trace"',
}
DEPTHS = [1, 5, jsondecode.FAST_DEPTH - 1, jsondecode.FAST_DEPTH, jsondecode.FAST_DEPTH + 1, 60, 900, 990, 995,
          1000, 3000]


@needs_fast
@pytest.mark.parametrize("raw", EDGE.values(), ids=EDGE.keys())
def test_edge_cases_decode_as_json_does(raw):
    assert_same_outcome(raw)


@needs_fast
@pytest.mark.parametrize("depth", DEPTHS)
def test_nesting_depth_decodes_as_json_does(depth):
    assert_same_outcome(nested(depth))
    assert_same_outcome(b'{"traceEvents": [' + nested(depth) + b"]}")


@needs_fast
@pytest.mark.parametrize("name", ["nan and infinities", "float overflow", "lone high surrogate", "surrogate as UTF-8 bytes",
                                  "UTF-8 BOM", "UTF-16 LE", "invalid UTF-8", "integer past the digit limit"])
def test_msgspec_refuses_what_it_would_read_differently(name):
    """These reach json.loads because msgspec refuses them: the fallback, not luck, keeps the outcomes alike."""
    with pytest.raises(Exception):
        jsondecode._fast()(EDGE[name])


@needs_fast
def test_msgspec_reads_integers_past_64_bits_exactly():
    raw = EDGE["64-bit edges"] + b"\n"
    assert same(jsondecode._fast()(raw), [(1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 63) - 1])


@needs_fast
def test_msgspec_reads_the_fixture_traces_itself():
    """The fast path is taken on real traces, not always left to json."""
    for path in TRACES:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
        assert same(jsondecode._fast()(raw), json.loads(raw)), path


@needs_fast
def test_deeper_than_fast_depth_goes_to_json():
    with pytest.raises(Exception):
        jsondecode._fast()(nested(jsondecode.FAST_DEPTH + 1))
    assert same(jsondecode._fast()(nested(jsondecode.FAST_DEPTH)), json.loads(nested(jsondecode.FAST_DEPTH)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_under_a_memory_cap_room_is_the_cap_less_what_is_mapped():
    """msgspec crashes the process when an allocation fails, so under a cap the fast path needs room: the room
    measured against /proc's own account of the mapped address space, read in the same capped process."""
    import subprocess
    import sys

    cap = 900 << 20
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (%d, %d)); "
            "from mlpfuse.profiling import jsondecode; room = jsondecode.room(); "
            "vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')); "
            "print(room, vm * 1024)" % (cap, cap))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    room, mapped = float(out[0]), int(out[1])
    assert abs(room - (cap - mapped)) < 1 << 20, (room, cap, mapped)


# ---------------------------------------------------------------- fuzzed documents

_SCALARS = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True)
            | st.text(st.characters(codec="utf-8") | st.sampled_from("\ud800\udfff\x00\x1f\"\\"), max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=3), inner, max_size=4), max_leaves=30)
_NOISE = st.sampled_from([b"", b" ", b"\n", b"\t", b",", b":", b"[", b"]", b"{", b"}", b'"', b"\\", b"-", b"0", b"1",
                          b".", b"e", b"E", b"+", b"N", b"I", b"\x00", b"\x7f", b"\x80", b"\xc3", b"\xed\xa0\x80",
                          b"\xef\xbb\xbf", b"\\u", b"\\ud800", b"nul", b"tru", b"9" * 25])


@needs_fast
@settings(max_examples=400, **SETTINGS)
@given(_VALUES, st.booleans(), st.integers(0, 3))
def test_generated_documents_decode_as_json_does(value, ascii_only, indent):
    assert_same_outcome(json.dumps(value, ensure_ascii=ascii_only, indent=indent or None).encode("utf-8",
                                                                                                "surrogatepass"))


@needs_fast
@settings(max_examples=600, **SETTINGS)
@given(_VALUES, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3), _NOISE), min_size=1, max_size=4))
def test_damaged_documents_decode_as_json_does(value, edits):
    raw = bytearray(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    for at, cut, noise in edits:
        at %= len(raw) + 1
        raw[at:at + cut] = noise
    assert_same_outcome(bytes(raw))


# ---------------------------------------------------------------- through the trace loader

@pytest.fixture
def json_only(monkeypatch):
    monkeypatch.setattr(jsondecode, "_fast", lambda: None)


def _loaded(path):
    try:
        tr = trace_mod.load(path)
    except InputError as exc:
        return "error", str(exc)
    fields = ("cpu_ops", "annotations", "runtime", "gpu", "python", "metadata", "n_events", "skipped", "repaired",
              "skipped_steps", "unread")
    return "ok", {f: getattr(tr, f) for f in fields}, analysis.analyze(tr).to_dict()


def _both(path, monkeypatch):
    fast = _loaded(path)
    with monkeypatch.context() as m:
        m.setattr(jsondecode, "_fast", lambda: None)
        slow = _loaded(path)
    return fast, slow


@needs_fast
@pytest.mark.parametrize("path", TRACES, ids=lambda p: os.path.relpath(p, FIXTURES))
def test_fixture_traces_load_and_analyse_alike(path, monkeypatch):
    fast, slow = _both(path, monkeypatch)
    assert json.dumps(fast, default=repr) == json.dumps(slow, default=repr)
    assert fast[0] == "ok" or "execution trace" in fast[1]


_EVENT = ('{"ph": "X", "cat": "kernel", "name": %s, "pid": 0, "tid": 7, "ts": %s, "dur": 2.0, '
          '"args": {"correlation": %s}}')
HOSTILE = {
    "NaN start": _EVENT % ('"k"', "NaN", "1"),
    "infinite start": _EVENT % ('"k"', "1e400", "1"),
    "huge integer id": _EVENT % ('"k"', "5.0", "1" + "0" * 30),
    "5000-digit id": _EVENT % ('"k"', "5.0", "1" * 5000),
    "lone surrogate name": _EVENT % ('"\\ud800k"', "5.0", "1"),
    "deep args": (_EVENT % ('"k"', "5.0", "1")).replace('"args": {', '"args": {"deep": %s, ' % nested(3000).decode()),
}


@needs_fast
@pytest.mark.parametrize("event", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_traces_load_alike(event, tmp_path, monkeypatch):
    launch = (_EVENT % ('"cudaLaunchKernel"', "1.0", "1")).replace('"kernel"', '"cuda_runtime"')
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": [%s, %s]}' % (launch, event), encoding="utf-8")
    fast, slow = _both(str(path), monkeypatch)
    assert json.dumps(fast, default=repr) == json.dumps(slow, default=repr)


def test_without_msgspec_the_reader_is_json_loads(json_only, tmp_path):
    """Where msgspec is missing (here: made to look missing) every document goes to json.loads."""
    assert not jsondecode.available()
    assert math.isnan(jsondecode.loads(b"[NaN]")[0])
    with pytest.raises(json.JSONDecodeError) as exc:
        jsondecode.loads(b"[1,]")
    assert exc.value.msg == "Expecting value" and exc.value.pos == 3
    path = tmp_path / "t.json"
    path.write_bytes(b'{"traceEvents": [1,]}')
    with pytest.raises(InputError, match=r"not valid JSON \(line 1, column 20: Expecting value\)"):
        trace_mod.load(str(path))
