"""The `mlpfuse` console script run as a user runs it (a subprocess, stdout a pipe), and the tables it prints read
back into cells, so tests can hold every printed number and name against the JSON of the same run; and the
scripts under benchmarks/ imported as modules."""

from __future__ import annotations

import importlib.util
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The wall-clock limit on a child process: only a hang reaches it. A command of seconds on an idle machine takes ten
# times as long on a loaded one, so a limit must sit far above that, or the machine's load decides the test.
HANG_S = 30 * 60
SRC = os.path.join(ROOT, "src")


def benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module (the scripts are not a package)."""
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_env(**extra) -> dict:
    """This checkout's sources first, no terminal width, no forced colour: what `mlpfuse ... | cat` sees."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, cwd=None, timeout: float = HANG_S, memory_cap: int | None = None, env: dict | None = None,
            **env_extra) -> subprocess.CompletedProcess:
    """`python3 -m mlpfuse ARGS` with stdout and stderr pipes. `memory_cap` (bytes) caps the address space, so a
    command that would allocate more than the machine can give fails at once instead of swapping."""

    def cap():
        if memory_cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))

    return subprocess.run([sys.executable, "-m", "mlpfuse", *map(str, args)], cwd=cwd or ROOT,
                          env=env or cli_env(**env_extra), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cap if memory_cap is not None else None)


def run_for(args, seconds: float, *, cwd, memory_cap: int | None = None, env: dict | None = None):
    """`python3 -m mlpfuse ARGS` for at most `seconds`: (exit code, or None when it was still running and was
    stopped, with everything it had started; stdout; stderr)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))

    # Its own process group: a timeout stops the compile workers and the like it started, too.
    proc = subprocess.Popen([sys.executable, "-m", "mlpfuse", *map(str, args)], cwd=cwd, env=env or cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=cap if memory_cap is not None else None)
    try:
        out, err = proc.communicate(timeout=seconds)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def assert_one_error_line(proc: subprocess.CompletedProcess) -> str:
    """Exit 2 with exactly one `mlpfuse: error:` line on stderr (warnings aside), no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mlpfuse: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@dataclass
class Table:
    title: str
    header: list[str] | None
    rows: list[list[str]] = field(default_factory=list)

    def dicts(self) -> list[dict]:
        return [dict(zip(self.header, row)) for row in self.rows]


_TOP, _BOTTOM, _RULES = "┏┌", "└┗", "┡├╇┼━─"


def tables(text: str) -> list[Table]:
    """Every box-drawn table in `text`, titled by the line just above it. A row split over two lines would read
    back as two rows, the second with empty cells: tests compare row counts with the JSON to catch that."""
    out: list[Table] = []
    lines = text.splitlines()
    current = None
    for i, line in enumerate(lines):
        s = line.strip() or " "
        if current is None:
            if s[:1] in _TOP:
                current = Table(title=lines[i - 1].strip() if i else "", header=None)
            continue
        if s[:1] in _BOTTOM:
            out.append(current)
            current = None
        elif s[:1] == "┃":
            current.header = [c.strip() for c in s[1:-1].split("┃")]
        elif s[:1] == "│":
            current.rows.append([c.strip() for c in s[1:-1].split("│")])
        elif s[:1] not in _RULES:
            raise AssertionError(f"line {i + 1} inside a table is no row: {line!r}")
    assert current is None, "a table without its bottom border"
    return out


def table(text: str, title_start: str) -> Table:
    found = [t for t in tables(text) if t.title.startswith(title_start)]
    assert len(found) == 1, (title_start, [t.title for t in tables(text)])
    return found[0]


def number(cell: str) -> float:
    """The leading number of a cell: `12651.9 ±17.6%` -> 12651.9, `0.371×` -> 0.371, `56%` -> 56."""
    head = cell.split()[0].rstrip("×%x")
    return float(head)


def close_as_shown(cell: str, value: float) -> bool:
    """The printed cell is `value` rounded to the places the cell itself shows: for numbers printed with an exponent
    (`6.3e-07`), whose last place moves with the value, so that no expected precision is derived from a value that a
    random draw decides (6.25e-07 prints as 6.3e-07: one place short of its own exponent's)."""
    head = cell.split()[0].rstrip("×%x")
    mantissa, _, exponent = head.lower().partition("e")
    unit = 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))
    return abs(float(head) - value) <= 0.5 * unit * (1 + 1e-9)


def close(cell: str, value: float, decimals: int) -> bool:
    """The printed cell is `value` rounded to `decimals` places (half a unit of the last place, plus float slack)."""
    return abs(number(cell) - value) <= 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(value))
