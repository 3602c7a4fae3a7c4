"""Trace files and saved analyses as hostile input, through the real CLI.

Each test is one way a file can lie: a malformed field must be skipped or repaired with a count in the output (the
numbers then match an oracle computed here from the raw events), or end in exactly one error line with exit code 2;
never a traceback, a hang, a silent wrong number, or text that reaches the terminal as anything but text.
"""

import copy
import gzip
import json
import os
import subprocess
import sys
import time
import zlib

import pytest

from cli_run import HANG_S

from mlpfuse.cli import main
from mlpfuse.profiling import kernel_names, trace as trace_mod

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "traces")
LINEAR = os.path.join(FIXTURES, "linear_eager.json.gz")
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
KNOWN_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "kernel", "gpu_memset", "gpu_memcpy"}


def strict_loads(text: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def write(tmp_path, doc, name="t.json", gz=False) -> str:
    """Write like a hostile tool would: NaN / Infinity tokens allowed, lone surrogates escaped."""
    raw = json.dumps(doc, allow_nan=True).encode()
    path = tmp_path / (name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def analyze_json(capsys, path, *extra):
    code, out, err = run(capsys, "analyze", path, "--json", *extra)
    assert code == 0, err
    return strict_loads(out)


def one_error_line(code, err, *words):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlpfuse: error:"), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


def fixture(name="linear_eager"):
    with gzip.open(os.path.join(FIXTURES, name + ".json.gz")) as fh:
        return json.load(fh)


# ---------------------------------------------------------------- a small GPU trace with known answers

STEPS = 3
KERNELS = ((10.0, 30.0), (50.0, 20.0), (100.0, 40.0))  # (offset in the step, dur), disjoint


def gpu_trace():
    """3 ProfilerStep spans of 500 us; in each, aten::mm launches 3 kernels (runtime call -> correlation id)."""
    events, corr = [], 0
    for s in range(STEPS):
        t0 = 10_000.0 * (s + 1)
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": t0, "dur": 500.0})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t0 + 1, "dur": 9.0,
                       "args": {"External id": 100 + s}})
        for i, (offset, dur) in enumerate(KERNELS):
            corr += 1
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                           "ts": t0 + 2 + 2 * i, "dur": 1.5, "args": {"correlation": corr, "External id": 100 + s}})
            events.append({"ph": "X", "cat": "kernel", "name": f"gemm_kernel_{i}", "pid": 0, "tid": 7,
                           "ts": t0 + offset, "dur": dur, "args": {"correlation": corr, "External id": 100 + s}})
    return {"traceEvents": events, "deviceProperties": [{"name": "Test GPU"}]}


def valid_time(v):
    return type(v) in (int, float) and 0 <= v <= 2**53  # NaN fails the comparison; ints never overflow here


def oracle(doc):
    """Per-step kernel count and GPU busy time from the raw events: kernels with valid times, launched (runtime
    call) inside a step whose span has valid times. Kernels within a step are disjoint by construction."""
    ev = doc["traceEvents"]
    steps = [e for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")
             and valid_time(e.get("ts")) and valid_time(e.get("dur"))]
    launches = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime"}
    kernels = [e for e in ev if e.get("cat") == "kernel" and valid_time(e.get("ts")) and valid_time(e.get("dur"))]
    count, busy = 0, 0.0
    for k in kernels:
        t = launches[k["args"]["correlation"]]
        if any(s["ts"] <= t <= s["ts"] + s["dur"] for s in steps):
            count += 1
            busy += k["dur"]
    return {"steps": len(steps), "gpu_kernels": count / len(steps), "gpu_busy_us": busy / len(steps)}


def first(doc, cat, name_prefix=""):
    return next(e for e in doc["traceEvents"] if e.get("cat") == cat and str(e.get("name", "")).startswith(name_prefix))


def test_the_synthetic_trace_matches_its_oracle(tmp_path, capsys):
    doc = gpu_trace()
    data = analyze_json(capsys, write(tmp_path, doc))
    want = oracle(doc)
    assert data["steps"] == want["steps"] == 3 and data["per_step"]["gpu_kernels"] == want["gpu_kernels"] == 3
    assert data["per_step"]["gpu_busy_us"] == pytest.approx(want["gpu_busy_us"]) == 90.0
    assert data["skipped_events"] == {} and data["repaired_events"] == {}


# ---------------------------------------------------------------- silent wrong analyses


def test_a_step_without_dur_is_skipped_and_counted(tmp_path, capsys):
    doc = gpu_trace()
    del first(doc, "user_annotation", "ProfilerStep#1")["dur"]
    data = analyze_json(capsys, write(tmp_path, doc))
    want = oracle(doc)
    assert data["steps"] == want["steps"] == 2 and data["step_names"] == ["ProfilerStep#0", "ProfilerStep#2"]
    assert data["per_step"]["gpu_kernels"] == want["gpu_kernels"] == 3
    assert data["skipped_events"] == {"dur missing": 1}
    assert data["verdict"]["kind"] != "cpu-only"


def test_no_step_with_a_dur_is_an_error_not_a_cpu_only_verdict(tmp_path, capsys):
    doc = gpu_trace()
    for e in doc["traceEvents"]:
        if e["name"].startswith("ProfilerStep#"):
            del e["dur"]
    code, out, err = run(capsys, "analyze", write(tmp_path, doc), "--json")
    one_error_line(code, err, "3 ProfilerStep# spans are malformed", "dur missing 3")
    assert out == ""


@pytest.mark.parametrize("field,value,reason", [
    ("dur", -500.0, "dur negative"),
    ("dur", float("nan"), "dur not finite"),
    ("dur", float("inf"), "dur not finite"),
    ("ts", float("-inf"), "ts not finite"),
    pytest.param("dur", 10**400, "dur over 2^53 us", id="dur-int-of-401-digits"),
    pytest.param("ts", 10**400, "ts over 2^53 us", id="ts-int-of-401-digits"),
    ("ts", -5, "ts negative"),
    ("dur", "abc", "dur not a number"),
    ("dur", [1.0], "dur not a number"),
    ("ts", {"v": 1}, "ts not a number"),
    ("dur", True, "dur not a number"),
    ("dur", None, "dur missing"),
])
def test_a_kernel_with_a_bad_time_is_skipped_and_counted(tmp_path, capsys, field, value, reason):
    doc = gpu_trace()
    kernel = first(doc, "kernel", "gemm_kernel_1")
    if value is None:
        del kernel[field]
    else:
        kernel[field] = value
    data = analyze_json(capsys, write(tmp_path, doc))
    want = oracle(doc)
    assert data["per_step"]["gpu_kernels"] == pytest.approx(want["gpu_kernels"]) == pytest.approx(8 / 3)
    assert data["per_step"]["gpu_busy_us"] == pytest.approx(want["gpu_busy_us"]) == pytest.approx(250 / 3)
    assert data["skipped_events"] == {reason: 1}
    for row in data["step_table"]:
        assert 0 <= row["gpu_busy_us"] <= row["gpu_window_us"] and row["gpu_idle_us"] >= 0
    assert 0 <= data["verdict"]["gpu_busy_share"] <= 1


def test_numeric_strings_still_read_as_times(tmp_path, capsys):
    doc = gpu_trace()
    kernel = first(doc, "kernel", "gemm_kernel_1")
    kernel["ts"], kernel["dur"] = str(kernel["ts"]), str(kernel["dur"])
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["per_step"]["gpu_kernels"] == 3 and data["skipped_events"] == {}


def test_duplicated_events_count_once(tmp_path, capsys):
    doc = fixture()
    original = analyze_json(capsys, write(tmp_path, doc, "a.json"))
    doubled = copy.deepcopy(doc)
    doubled["traceEvents"] = doc["traceEvents"] + copy.deepcopy(doc["traceEvents"])
    data = analyze_json(capsys, write(tmp_path, doubled, "b.json"))
    n_known = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in KNOWN_CATEGORIES)
    assert data.pop("skipped_events") == {"duplicate event": n_known}
    original.pop("skipped_events")
    for d in (original, data):
        d.pop("trace")
        d.pop("unread_categories")  # events the analysis does not read are counted, never deduplicated
    assert data == original


def test_a_kernel_starting_before_its_step_never_makes_busy_exceed_the_window(tmp_path, capsys):
    doc = gpu_trace()
    kernel = first(doc, "kernel", "gemm_kernel_0")
    kernel["ts"] -= 400.0  # starts 390 us before its step, ends 360 us before it
    data = analyze_json(capsys, write(tmp_path, doc))
    for row in data["step_table"]:
        assert 0 <= row["gpu_busy_us"] <= row["gpu_window_us"]
        assert row["gpu_idle_us"] == pytest.approx(row["gpu_window_us"] - row["gpu_busy_us"])
    assert data["step_table"][0]["gpu_busy_us"] == pytest.approx(60.0)  # the early kernel counts from step start


# ---------------------------------------------------------------- wrong types: handled, counted, no traceback


def test_infinite_correlation_id_is_dropped_and_the_kernel_kept(tmp_path, capsys):
    doc = gpu_trace()
    first(doc, "kernel", "gemm_kernel_2")["args"]["correlation"] = float("inf")
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["repaired_events"] == {"correlation not an integer id (dropped)": 1}
    assert data["per_step"]["gpu_kernels"] == 3  # its own step still holds it; External id names the op
    assert data["kernels_by_op"]["aten::mm"]["gemm_kernel_2"] == 3


@pytest.mark.parametrize("value", [float("nan"), -1, 2**64, "12x", [3], {"id": 3}, True, 1.5])
def test_bad_ids_are_dropped_with_a_count(tmp_path, capsys, value):
    doc = gpu_trace()
    first(doc, "cuda_runtime")["args"]["External id"] = value
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["repaired_events"] == {"External id not an integer id (dropped)": 1}
    assert data["per_step"]["gpu_kernels"] == 3


@pytest.mark.parametrize("field,value,reason", [
    ("tid", [1], "pid or tid not a number or string"),
    ("pid", {"a": 1}, "pid or tid not a number or string"),
    ("cat", ["kernel"], "cat not a string"),
    ("cat", {"k": 1}, "cat not a string"),
    ("name", ["gemm"], "name missing or not a string"),
    ("name", 12, "name missing or not a string"),
    ("name", None, "name missing or not a string"),
])
def test_wrong_types_where_scalars_belong(tmp_path, capsys, field, value, reason):
    doc = gpu_trace()
    kernel = first(doc, "kernel", "gemm_kernel_1")
    want = oracle({"traceEvents": [e for e in doc["traceEvents"] if e is not kernel]})
    if value is None:
        del kernel[field]
    else:
        kernel[field] = value
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["skipped_events"] == {reason: 1}
    assert data["per_step"]["gpu_kernels"] == pytest.approx(want["gpu_kernels"]) == pytest.approx(8 / 3)
    assert data["per_step"]["gpu_busy_us"] == pytest.approx(want["gpu_busy_us"])


def test_a_cpu_op_with_a_list_tid_is_skipped_not_a_crash_in_nesting(tmp_path, capsys):
    doc = gpu_trace()
    first(doc, "cpu_op")["tid"] = [[1]]
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["skipped_events"] == {"pid or tid not a number or string": 1}
    assert data["ops"][0]["count"] == 2


def test_args_not_an_object(tmp_path, capsys):
    doc = gpu_trace()
    first(doc, "cpu_op")["args"] = [1, 2]
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["repaired_events"] == {"args not an object (ids ignored)": 1}


@pytest.mark.parametrize("props,devices", [
    (5, []), ("H100", []), ({"name": "H100"}, []), ([1, "x", None], []),
    ([{"name": ["a"]}, {"name": {"b": 1}}, {"name": "H100"}], ["H100"]),
    ([{"name": "\x1b[2J" + "G" * 100_000}], None),
])
def test_device_properties_of_any_shape(tmp_path, capsys, props, devices):
    doc = gpu_trace()
    doc["deviceProperties"] = props
    data = analyze_json(capsys, write(tmp_path, doc))
    if devices is not None:
        assert data["devices"] == devices
    else:
        assert len(data["devices"]) == 1 and len(data["devices"][0]) < 17_000
    code, out, err = run(capsys, "analyze", write(tmp_path, doc))
    assert code == 0 and "\x1b" not in out


def test_non_object_entries_and_unknown_categories_are_ignored(tmp_path, capsys):
    doc = gpu_trace()
    doc["traceEvents"] += [1, "x", None, [1], {"ph": "X", "cat": "Trace", "name": "f", "ts": "bad"}]
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["per_step"]["gpu_kernels"] == 3 and data["skipped_events"] == {}


def test_malformed_python_frames_are_counted(tmp_path, capsys):
    # Python frames (with_stack=True) are read for the report's flamegraph, so they are checked like any event.
    doc = gpu_trace()
    doc["traceEvents"] += [{"ph": "X", "cat": "python_function", "name": "f", "pid": 1, "tid": 1, "ts": "bad",
                            "dur": 1.0},
                           {"ph": "X", "cat": "python_function", "name": "g", "pid": 1, "tid": 1, "ts": 5.0,
                            "dur": 1.0}]
    data = analyze_json(capsys, write(tmp_path, doc))
    assert data["per_step"]["gpu_kernels"] == 3 and data["skipped_events"] == {"ts not a number": 1}
    assert [e.name for e in trace_mod.load(write(tmp_path, doc, "b.json")).python] == ["g"]


@pytest.mark.parametrize("where", ["document", "event args"])
def test_json_nested_3000_deep_is_one_line(tmp_path, capsys, where):
    deep = "[" * 3000 + "]" * 3000
    if where == "document":
        raw = deep
    else:
        raw = json.dumps(gpu_trace()).replace('"args": {', '"args": {"deep": ' + deep + ", ", 1)
    path = tmp_path / "deep.json"
    path.write_text(raw)
    code, out, err = run(capsys, "analyze", str(path), "--json")
    one_error_line(code, err, "nested too deeply")


def test_an_integer_of_5000_digits_is_one_line(tmp_path, capsys):
    path = tmp_path / "digits.json"
    path.write_text(json.dumps(gpu_trace()).replace('"dur": 500.0', '"dur": ' + "9" * 5000, 1))
    code, out, err = run(capsys, "analyze", str(path), "--json")
    one_error_line(code, err, "number")


def test_every_event_malformed_names_the_reasons(tmp_path, capsys):
    doc = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": -1.0}] * 2
           + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": float("nan"), "dur": 1.0}]}
    code, out, err = run(capsys, "analyze", write(tmp_path, doc))
    one_error_line(code, err, "no CPU op, annotation, runtime or GPU events", "dur negative 2", "ts not finite 1")


# ---------------------------------------------------------------- saved analysis JSON


def saved_analysis(capsys, tmp_path):
    code, out, err = run(capsys, "analyze", LINEAR, "--json")
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize("mutate,words", [
    (lambda d: d["per_step"].pop("gpu_kernels"), "analysis.per_step.gpu_kernels is missing"),
    (lambda d: d["kernels"][0].pop("family"), "analysis.kernels[0].family is missing"),
    (lambda d: d["per_step"].__setitem__("gpu_kernels", "5"), "analysis.per_step.gpu_kernels is a string"),
    (lambda d: d["per_step"].__setitem__("step_us", float("nan")), "analysis.per_step.step_us is nan"),
    (lambda d: d["per_step"].__setitem__("step_us", -1.0), "expected a finite number >= 0"),
    (lambda d: d["kernels"][0]["decoded"].__setitem__("tile", float("inf")), "is inf"),
    (lambda d: d["verdict"].__setitem__("kind", None), "analysis.verdict.kind is null"),
    (lambda d: d.__setitem__("kernels", {}), "analysis.kernels is an object, expected a list"),
    (lambda d: d.__setitem__("steps", 0), "analysis.steps"),
    (lambda d: d.__setitem__("steps", True), "analysis.steps"),
    (lambda d: d["kernels_by_op"].__setitem__("x", [1]), "analysis.kernels_by_op['x'] is a list"),
    (lambda d: d["kernels"][0]["decoded"].__setitem__("epilogue", [1]), "decoded['epilogue']"),
    (lambda d: d.__setitem__("extra", {"deep": [float("-inf")]}), "analysis['extra']['deep'][0] is -inf"),
    (lambda d: d.__setitem__("skipped_events", {"x": "y"}), "analysis.skipped_events['x']"),
])
@pytest.mark.parametrize("command", ["analyze", "analyze --json", "diff"])
def test_malformed_saved_analysis_is_one_line(tmp_path, capsys, mutate, words, command):
    data = saved_analysis(capsys, tmp_path)
    mutate(data)
    path = write(tmp_path, data, "saved.json")
    argv = ["diff", LINEAR, path] if command == "diff" else [*command.split(), path]
    code, out, err = run(capsys, *argv)
    one_error_line(code, err, "not an mlpfuse analysis JSON", words)


def test_a_saved_analysis_round_trips(tmp_path, capsys):
    data = saved_analysis(capsys, tmp_path)
    again = analyze_json(capsys, write(tmp_path, data, "saved.json"))
    assert again == data


# ---------------------------------------------------------------- denial of service


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "mlpfuse", "analyze", str(fifo)], capture_output=True, text=True,
                          timeout=HANG_S, env={**os.environ, "PYTHONPATH": SRC})
    one_error_line(proc.returncode, proc.stderr, "FIFO")


def test_dev_zero_is_refused_at_once():
    if not os.path.exists("/dev/zero"):
        pytest.skip("needs /dev/zero")
    proc = subprocess.run([sys.executable, "-m", "mlpfuse", "analyze", "/dev/zero"], capture_output=True,
                          text=True, timeout=HANG_S, env={**os.environ, "PYTHONPATH": SRC})
    one_error_line(proc.returncode, proc.stderr, "character device")


def test_symlink_loop_and_dangling_link(tmp_path, capsys):
    loop = tmp_path / "loop.json"
    os.symlink(loop, loop)
    code, out, err = run(capsys, "analyze", str(loop))
    one_error_line(code, err, "symbolic link loop")
    dangling = tmp_path / "dangling.json"
    os.symlink(tmp_path / "gone.json", dangling)
    code, out, err = run(capsys, "analyze", str(dangling))
    one_error_line(code, err, "dangling symbolic link")


def test_a_path_with_a_nul_byte(tmp_path):
    from mlpfuse.errors import InputError
    from mlpfuse.profiling import analyze

    with pytest.raises(InputError, match="not a valid file name"):
        analyze(str(tmp_path / "a\0b.json"))


def _bomb(path, inflated: int) -> None:
    """A gzip file of `inflated` zero bytes (about a thousandth of that on disk)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (1 << 24)
    with open(path, "wb") as fh:
        for _ in range(inflated // len(zeros)):
            fh.write(comp.compress(zeros))
        fh.write(comp.flush())


def test_a_gzip_bomb_is_refused_without_inflating_it(tmp_path):
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux /proc")
    bomb = tmp_path / "bomb.json.gz"
    _bomb(bomb, 512 << 20)
    assert bomb.stat().st_size < 1 << 20
    # VmHWM: this process's peak resident memory (ru_maxrss would carry over pytest's own from before exec)
    code = ("import sys; from mlpfuse.cli import main; rc = main(sys.argv[1:]); "
            "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM'))); "
            "sys.exit(rc)")
    for how in (["--max-bytes", "16M"], []):
        env = {**os.environ, "PYTHONPATH": SRC, "MLPFUSE_MAX_TRACE_BYTES": "16M"}
        proc = subprocess.run([sys.executable, "-c", code, "analyze", str(bomb), *how], capture_output=True,
                              text=True, timeout=HANG_S, env=env)
        one_error_line(proc.returncode, proc.stderr, "gzip data inflates to more than the 16 MiB limit")
        peak_mib = int(proc.stdout) / 1024  # /proc reports kB
        assert peak_mib < 200, peak_mib  # inflating it all would take 512 MiB more


def _one_member_bomb(path, inflated: int) -> None:
    """One gzip member of `inflated` spaces, written without compressing them all: after a full flush deflate
    forgets its history, so every 16 MiB of spaces compresses to the same block, which is written again and again."""
    chunk = b" " * (1 << 24)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: the gzip header and trailer are written here
    block = comp.compress(chunk) + comp.flush(zlib.Z_FULL_FLUSH)
    crc, count = 0, inflated // len(chunk)
    with open(path, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff")
        for _ in range(count):
            fh.write(block)
            crc = zlib.crc32(chunk, crc)
        fh.write(comp.flush())
        fh.write(crc.to_bytes(4, "little") + (count * len(chunk) & 0xFFFFFFFF).to_bytes(4, "little"))


def _analyze_capped(path, address_space: int, *how):
    """`python3 -m mlpfuse analyze PATH` with its address space capped like `ulimit -v` does."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop(trace_mod.MAX_BYTES_ENV, None)
    return subprocess.run([sys.executable, "-m", "mlpfuse", "analyze", str(path), *how], capture_output=True,
                          text=True, timeout=HANG_S, env=env, preexec_fn=cap)


def test_the_bomb_builder_writes_a_valid_gzip(tmp_path):
    small = tmp_path / "small.json.gz"
    _one_member_bomb(small, 48 << 20)
    assert gzip.decompress(small.read_bytes()) == b" " * (48 << 20)  # gzip checks the CRC and the length


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_a_gzip_bomb_under_a_memory_cap_is_one_error_line(tmp_path):
    # 2 GiB of spaces in one member, under `ulimit -v 3000000`: at the default 2 GiB limit inflating stops one byte
    # past it, which a 3 GB address space cannot hold; with a larger limit, the same
    bomb = tmp_path / "bomb.json.gz"
    _one_member_bomb(bomb, (2 << 30) + (1 << 24))
    assert bomb.stat().st_size < 4 << 20
    for how in ([], ["--max-bytes", "100G"]):
        proc = _analyze_capped(bomb, 3000000 * 1024, *how)
        one_error_line(proc.returncode, proc.stderr, str(bomb), "not enough memory", "--max-bytes")
        assert proc.stdout == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_a_trace_too_large_to_parse_under_a_memory_cap_is_one_error_line(tmp_path):
    # 120 MB of valid events read whole within the cap, but the parsed objects take several times that
    event = json.dumps({"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "pid": 0, "tid": 7}).encode()
    path = tmp_path / "large.json"
    with open(path, "wb") as fh:
        fh.write(b"[")
        batch = b",".join([event] * 100_000)
        for i in range((120 << 20) // len(batch) + 1):
            fh.write((b"," if i else b"") + batch)
        fh.write(b"]")
    proc = _analyze_capped(path, 700 << 20)
    one_error_line(proc.returncode, proc.stderr, str(path), "not enough memory")


def test_gzip_members_padding_and_trailing_garbage(tmp_path, capsys):
    raw = json.dumps(gpu_trace()).encode()
    half = len(raw) // 2
    members = gzip.compress(raw[:half]) + gzip.compress(raw[half:])  # concatenated members are one stream
    path = tmp_path / "m.json.gz"
    path.write_bytes(members + b"\0" * 8)
    assert analyze_json(capsys, str(path))["per_step"]["gpu_kernels"] == 3
    path.write_bytes(members + b"junk")
    one_error_line(*run(capsys, "analyze", str(path))[::2], "gzip data is corrupt")
    path.write_bytes(members[:-9])
    one_error_line(*run(capsys, "analyze", str(path))[::2], "gzip data is truncated")


def test_size_limits(tmp_path, capsys, monkeypatch):
    plain = tmp_path / "plain.json"
    plain.write_bytes(gzip.decompress(open(LINEAR, "rb").read()))
    size = plain.stat().st_size
    code, out, err = run(capsys, "analyze", str(plain), "--max-bytes", "1K")
    one_error_line(code, err, "more than the 1 KiB limit", "--max-bytes", "MLPFUSE_MAX_TRACE_BYTES")
    assert run(capsys, "analyze", str(plain), "--max-bytes", str(size))[0] == 0
    one_error_line(*run(capsys, "analyze", str(plain), "--max-bytes", str(size - 1))[::2], "limit")
    code, out, err = run(capsys, "analyze", LINEAR, "--max-bytes", "10K")  # 5 KB gzip inflating past 10 KiB
    one_error_line(code, err, "gzip data inflates to more than the 10 KiB limit")
    for bad in ("0", "-1", "lots", "1.5G", "1e9"):
        one_error_line(*run(capsys, "analyze", LINEAR, "--max-bytes", bad)[::2], "--max-bytes")
    monkeypatch.setenv("MLPFUSE_MAX_TRACE_BYTES", "2K")
    one_error_line(*run(capsys, "diff", LINEAR, str(plain))[::2], "2 KiB limit")
    monkeypatch.setenv("MLPFUSE_MAX_TRACE_BYTES", "two gigs")
    one_error_line(*run(capsys, "analyze", LINEAR)[::2], "MLPFUSE_MAX_TRACE_BYTES")
    monkeypatch.delenv("MLPFUSE_MAX_TRACE_BYTES")
    assert trace_mod.max_trace_bytes() == 2 << 30
    assert analyze_json(capsys, LINEAR, "--max-bytes", str(2**63 - 1))["steps"] == 3  # past ssize_t: no limit
    assert analyze_json(capsys, LINEAR, "--max-bytes", "9" * 100)["steps"] == 3
    assert trace_mod.parse_size("512M", "x") == 512 << 20 and trace_mod.parse_size("3GiB", "x") == 3 << 30


NAME_SHAPES = {
    "at::native repeated": lambda n: "at::native::" * (n // 12),
    "norm components": lambda n: "at::native::" + "norm" * (n // 4),
    "reduce components": lambda n: "at::native::" + "_reduce" * (n // 7),
    "kernel then namespaces": lambda n: "void at::native::vectorized_elementwise_kernel<" + "at::native::" * (n // 12),
    "inductor underscores": lambda n: "triton_poi_fused" + "_" * n + "_1",
    "inductor ops": lambda n: "triton_poi_fused_" + "_unsafe_view" * (n // 12) + "_0",
    "nvjet tokens": lambda n: "nvjet_" + "_" * n,
    "word": lambda n: "a" * n,
    "cutlass": lambda n: "cutlass_80_" * (n // 11),
}


@pytest.mark.parametrize("shape", list(NAME_SHAPES))
def test_a_1mb_kernel_name_decodes_in_well_under_a_second(shape):
    name = NAME_SHAPES[shape](1 << 20)
    kernel_names.decode.cache_clear()
    start = time.process_time()
    decoded = kernel_names.decode(name)
    assert time.process_time() - start < 0.5
    assert decoded.family in kernel_names.FAMILIES


def test_huge_names_are_truncated_distinctly_and_counted(tmp_path, capsys):
    doc = gpu_trace()
    prefix = "void at::native::" + "at::native::" * 10_000
    names = [prefix + "first_kernel", prefix + "second_kernel"]
    for k, name in zip([e for e in doc["traceEvents"] if e.get("cat") == "kernel"][:2], names):
        k["name"] = name
    start = time.process_time()
    data = analyze_json(capsys, write(tmp_path, doc))
    assert time.process_time() - start < 5
    assert data["repaired_events"] == {f"name truncated (over {trace_mod.MAX_NAME_CHARS} chars)": 2}
    long_rows = [k for k in data["kernels"] if k["name"].startswith("void at::native::")]
    assert len(long_rows) == 2 and long_rows[0]["name"] != long_rows[1]["name"]
    assert all(len(k["name"]) < trace_mod.MAX_NAME_CHARS + 64 and "more chars, #" in k["name"] for k in long_rows)


# ---------------------------------------------------------------- terminal injection

HOSTILE_NAMES = {
    "markup": "[bold red]fake_kernel[/bold red]",
    "unbalanced": "oops[/]",
    "ansi": "\x1b[31mred\x1b[0m",
    "osc": "\x1b]0;owned\x07title",
    "c1": "\x9b31mcsi",
    "bidi": "\u202eevil",
    "emoji code": ":thumbs_up:",
    "newline": "two\nlines",
}


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping, so names can be found whole in the table text


def hostile_trace():
    doc = gpu_trace()
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    for k, name in zip(kernels, HOSTILE_NAMES.values()):
        k["name"] = name
    first(doc, "cpu_op")["name"] = "[link=http://x]op[/link]\x1b[8m"
    kernels[-1]["name"] = "lone \ud800 surrogate"
    return doc


def assert_terminal_safe(out):
    for ch in out:
        assert ch == "\n" or ch.isprintable() or ch in "│┃━─┏┓┗┛┡┩└┘┌┐├┤┼╇┳┻┴┬╋", repr(ch)
    assert "\x1b" not in out and "\ud800" not in out


def test_trace_text_is_never_markup_or_control_sequences(tmp_path, capsys, wide):
    path = write(tmp_path, hostile_trace())
    code, out, err = run(capsys, "analyze", path)
    assert code == 0, err
    assert_terminal_safe(out)
    for shown in ("[bold red]fake_kernel[/bold red]", "oops[/]", "\\x1b[31mred\\x1b[0m", "\\x1b]0;owned\\x07title",
                  "\\x9b31mcsi", "\\u202eevil", ":thumbs_up:", "two\\x0alines", "[link=http://x]op[/link]\\x1b[8m",
                  "lone \ufffd surrogate"):
        assert shown in out, shown
    data = analyze_json(capsys, path)
    names = {k["name"] for k in data["kernels"]}
    assert "lone \ufffd surrogate" in names
    assert data["repaired_events"] == {"name had lone surrogates (now U+FFFD)": 1}
    assert set(HOSTILE_NAMES.values()) <= names  # the JSON keeps names exact


def test_diff_and_expectations_text_is_safe(tmp_path, capsys, wide):
    path = write(tmp_path, hostile_trace())
    code, out, err = run(capsys, "diff", LINEAR, path)
    assert code == 0, err
    assert_terminal_safe(out)
    assert "[bold red]fake_kernel[/bold red]" in out and "oops[/]" in out

    import io

    from rich.console import Console

    from mlpfuse.profiling import analyze, render

    results = analyze(path).check(["kernel~=fake", "no-op=[/]\x1b[2J"])
    buf = io.StringIO()
    render.print_expectations(results, Console(file=buf, width=400))
    text = buf.getvalue()
    assert_terminal_safe(text)
    assert "[bold red]fake_kernel[/bold red]" in text and "no-op=[/]\\x1b[2J" in text


def test_an_error_line_stays_one_line(tmp_path, capsys):
    code, out, err = run(capsys, "analyze", str(tmp_path / "a\nb\x1b[2J.json"))
    one_error_line(code, err, "a\\x0ab\\x1b[2J.json", "no such file")


def _closed_pipe_run(argv):
    proc = subprocess.Popen([sys.executable, "-m", "mlpfuse", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": SRC})
    proc.stdout.close()  # the reader is gone before the first write, like `| head` after its lines
    err = proc.stderr.read().decode()
    return proc.wait(timeout=HANG_S), err


@pytest.mark.parametrize("argv", [["analyze", LINEAR, "--json"], ["analyze", LINEAR], ["diff", LINEAR, LINEAR]])
def test_a_closed_stdout_pipe_exits_quietly(argv):
    code, err = _closed_pipe_run(argv)
    assert code == 141 and err == ""


# ---------------------------------------------------------------- smaller CLI checks


@pytest.mark.parametrize("bad", ["kernels=nan", "kernels=-1", "kernels=1e400", "kernels=inf", "gemm=-0.5",
                                 "launches=NaN"])
def test_expected_counts_must_be_finite_and_non_negative(tmp_path, capsys, bad):
    code, out, err = run(capsys, "profile", "linear", "--device", "cpu", "--expect", bad, "--out", str(tmp_path))
    one_error_line(code, err, "--expect", "finite count >= 0")
    assert os.listdir(tmp_path) == []  # refused before anything ran
