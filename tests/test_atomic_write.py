"""Atomic result files (mlpfuse._io): concurrent writers and readers of one path only ever see a complete file.

The writers are real threads and processes hammering the same path while a reader polls it; every read must be one
of the complete payloads, byte for byte. A plain `open(path, "w")` fails this (the reader catches the file empty or
cut short), which is what the bench and walkthrough outputs used to do.
"""

import json
import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from mlpfuse._io import atomic_open, atomic_path, atomic_write_bytes, atomic_write_text
from mlpfuse.bench import outputs
from mlpfuse.bench.sweep import BenchResult

# Large enough that one write takes many syscalls: a non-atomic writer is caught mid-way.
PAYLOADS = [bytes([65 + i]) * (1 << 20) + b"\n" for i in range(4)]


def _strays(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def _write_many(path: str, index: int, count: int) -> None:
    for _ in range(count):
        atomic_write_bytes(path, PAYLOADS[index])


def _read_while(path: Path, busy) -> tuple[int, list[int]]:
    """Poll `path` while `busy()`: (complete reads, lengths of any read that was not a complete payload)."""
    good, bad = 0, []
    while busy():
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        if data in PAYLOADS:
            good += 1
        else:
            bad.append(len(data))
    return good, bad


def test_threads_writing_one_path_leave_only_complete_files(tmp_path):
    path = tmp_path / "results.bin"
    writers = [threading.Thread(target=_write_many, args=(str(path), i, 15)) for i in range(len(PAYLOADS))]
    for w in writers:
        w.start()
    good, bad = _read_while(path, lambda: any(w.is_alive() for w in writers))
    for w in writers:
        w.join()
    assert bad == [] and good > 0
    assert path.read_bytes() in PAYLOADS
    assert _strays(tmp_path) == []


def test_processes_writing_one_path_leave_only_complete_files(tmp_path):
    path = tmp_path / "results.bin"
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
    procs = [ctx.Process(target=_write_many, args=(str(path), i, 15)) for i in range(2)]
    for p in procs:
        p.start()
    good, bad = _read_while(path, lambda: any(p.is_alive() for p in procs))
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    assert bad == []
    assert path.read_bytes() in PAYLOADS[:2]
    assert _strays(tmp_path) == []


def _bench_result(tag: str) -> BenchResult:
    rows = [{"case": f"case{i}", "variant": tag, "status": "ok", "wall_us": float(i), "error": None}
            for i in range(3000)]
    return BenchResult(meta={"command": tag, "peaks": {}}, rows=rows)


def _write_results(folder: str, tag: str, count: int) -> None:
    result = _bench_result(tag)
    for _ in range(count):
        outputs.write_json(result, Path(folder) / "results.json")
        outputs.write_csv(result, Path(folder) / "results.csv")


def test_two_bench_runs_on_one_out_folder_leave_valid_results(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_results, args=(str(tmp_path), tag, 10)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    seen = set()
    while any(p.is_alive() for p in procs):
        try:
            text = (tmp_path / "results.json").read_text()
        except FileNotFoundError:
            continue
        data = json.loads(text)  # never half a document
        assert len(data["rows"]) == 3000
        seen.add(data["meta"]["command"])
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["meta"]["command"] in ("a", "b") and seen <= {"a", "b"}
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert len(lines) == 3001 and lines[0].startswith("workload,")
    assert _strays(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "summary.md"
    atomic_write_text(path, "old\n")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_open(path, "w") as fh:
            fh.write("new, half written")
            raise RuntimeError("boom")
    assert path.read_text() == "old\n"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(path, suffix=".md") as temp:
            Path(temp).write_text("also half")
            raise RuntimeError("boom")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.md"]


def test_a_symlinked_target_is_written_through(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_text(link, '{"a": 1}')
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}


def test_new_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o640


def test_writing_onto_a_folder_raises_oserror_and_leaves_it(tmp_path):
    (tmp_path / "results.json").mkdir()
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "results.json", "{}")
    assert (tmp_path / "results.json").is_dir() and _strays(tmp_path) == []
