"""Where a command's results go: checked and created before any work, never over another run's results.

walkthrough, profile and bench each get their folder from `prepare`:
- `--out DIR` that already holds results of an earlier run is refused (one error line naming `--force`);
- no `--out`: a fresh folder `mlpfuse-results/<kind>/<YYYYmmdd-HHMMSS>[-N]`, made with an exclusive mkdir, so two
  runs started in the same second (or in the same folder at once) never share one;
- a path the filesystem cannot hold (a name or the whole path too long, not writable) fails here, not after
  minutes of measuring when the first file is written.

While the CLI runs a command (`noted`), each such folder holds a note file: a run that is stopped (Ctrl-C,
SIGTERM, a kill) or fails leaves it, saying the files there are partial; a run that finishes removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from typing import Iterator

from rich.text import Text

from mlpfuse.errors import InputError, Terminated, printable

NOTE = "INCOMPLETE.txt"

# What mlpfuse writes into a results folder: any of these there means the folder holds a run's results. The note
# alone does not: a run stopped before it wrote anything left nothing to lose.
_RESULT_FILES = {
    "results.json", "results.csv", "results.md", "report.html", "summary.md", "summary.json",
    "readme-table.md", "model-diff.json", "speedup.png", "roofline.png",
}
_RESULT_SUFFIXES = (".analysis.json", ".pt.trace.json.gz")
_RESULT_SUBFOLDERS = ("rounds", "model")  # the walkthrough's staged traces and its model layer

# Bytes kept free after the folder's own path for what goes inside it: a subfolder, the longest file name
# (`rounds/geglu-mlp-mlpfuse.round12.pt.trace.json.gz`) and the decoration of an atomic write's temporary name.
_ROOM = 128


def prepare(out: str | os.PathLike | None, *, default: str, force: bool = False, option: str = "--out") -> str:
    """The folder this run writes to, created and writable. `out` None: a new folder under `default`."""
    if out is None:
        return _started(_fresh(default, option))
    path = os.fspath(out)
    check_path(path, option)  # before isdir: a 4 kB path is one clear line, not ENAMETOOLONG later
    if os.path.isdir(path) and not force and holds_results(path):
        raise InputError(f"{option} {shown(path)}: holds the results of an earlier run; give another folder, or "
                         "--force to write over them")
    return _started(make_folder(path, option))


def make_folder(path: str, option: str = "--out") -> str:
    """Create the folder `path` (it may exist) and check that files can be written in it."""
    check_path(path, option)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{option} {shown(path)}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".mlpfuse-probe-")
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:  # a parent is a file
        raise InputError(f"{option} {shown(path)}: a part of the path is a file, not a folder") from None
    except OSError as exc:
        raise InputError(f"{option} {shown(path)}: cannot write there ({exc.strerror or exc})") from None
    return path


def _fresh(base: str, option: str) -> str:
    make_folder(base, option)
    stamp = _stamp()
    for n in range(1, 10_000):
        path = os.path.join(base, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)  # exclusive: the run that creates the name owns the folder
        except FileExistsError:
            continue
        except OSError as exc:
            raise InputError(f"{option}: cannot create {shown(path)} ({exc.strerror or exc})") from None
        return path
    raise InputError(f"{option}: {shown(base)} already holds 10000 runs started in this second")


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")  # sorts by time, and `-N` suffixes sort after their second


def check_path(path: str, option: str = "--out") -> None:
    """One error line for a path no folder of results can live at: empty, a NUL, a name longer than the
    filesystem's NAME_MAX, or with the file names written inside it longer than PATH_MAX."""
    if not path:
        raise InputError(f"{option}: expected a folder, got an empty path")
    try:
        full = os.fsencode(os.path.realpath(path))
    except (ValueError, UnicodeError) as exc:
        raise InputError(f"{option} {shown(path)}: not a usable path ({exc})") from None
    if b"\0" in full:
        raise InputError(f"{option} {shown(path)}: not a usable path (it holds a NUL character)")
    name_max, path_max = _limits(os.fsdecode(full))
    longest = max(full.split(os.fsencode(os.sep)), key=len)
    if len(longest) > name_max:
        raise InputError(f"{option} {shown(path)}: a name in it is {len(longest)} bytes long; this filesystem "
                         f"allows {name_max}")
    if len(full) + _ROOM > path_max:
        raise InputError(f"{option} {shown(path)}: the path is {len(full)} bytes long; with the files written "
                         f"inside it, it must stay under {path_max - _ROOM} bytes here")


def _limits(full: str) -> tuple[int, int]:
    existing = full
    while not os.path.isdir(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    try:
        return os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no answer: the usual Linux limits
        return 255, 4096


def holds_results(folder: str) -> bool:
    def marked(name: str) -> bool:
        return name in _RESULT_FILES or name.endswith(_RESULT_SUFFIXES)

    try:
        names = os.listdir(folder)
        return any(marked(n) for n in names) or any(
            any(marked(m) for m in os.listdir(os.path.join(folder, sub)))
            for sub in _RESULT_SUBFOLDERS if os.path.isdir(os.path.join(folder, sub)))
    except OSError:  # unreadable: make_folder's probe says why it cannot be used
        return False


@dataclasses.dataclass
class _Run:
    command: str
    folders: list[str] = dataclasses.field(default_factory=list)


_run: _Run | None = None  # the CLI command running now; None for library callers, who get no note


@contextlib.contextmanager
def noted(command: str) -> Iterator[None]:
    """Around a CLI command: each folder `prepare` hands out holds the note until the command returns; when it
    does not return (stopped, failed) the note stays and says why."""
    global _run
    _run = run = _Run(command)
    try:
        yield
    except BaseException as exc:
        for folder in run.folders:
            _leave_note(folder, command, exc)
        raise
    else:
        for folder in run.folders:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, NOTE))
    finally:
        _run = None


def _started(folder: str) -> str:
    # Written first, so that even a run killed outright (SIGKILL, power) leaves the note behind.
    if _run is not None:
        _write_note(os.path.join(folder, NOTE), f"`{_run.command}` is writing here, or was killed before it "
                                                 "finished: the files in this folder may be partial.\n")
        _run.folders.append(folder)
    return folder


def _leave_note(folder: str, command: str, exc: BaseException) -> None:
    if isinstance(exc, Terminated):
        why = "was stopped by SIGTERM"
    elif isinstance(exc, KeyboardInterrupt):
        why = "was interrupted (Ctrl-C)"
    else:
        why = f"failed ({printable(_first_line(exc))})"
    _write_note(os.path.join(folder, NOTE), f"`{command}` {why} before it finished: the files in this folder "
                                             "are partial or missing.\n")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _write_note(path: str, text: str) -> None:
    from mlpfuse._io import atomic_write_text

    with contextlib.suppress(OSError):
        atomic_write_text(path, text)


def shown(path) -> str:
    """A path as a one-line message shows it: escaped, and a very long one shortened in the middle."""
    text = printable(os.fspath(path))
    return text if len(text) <= 160 else f"{text[:70]}…{text[-70:]} ({len(text)} characters)"


def literal(*parts) -> Text:
    """A line of text (paths included) for a rich console: never read as markup, emoji codes or highlighting,
    control characters escaped; `[bold]` in a folder name prints as `[bold]`."""
    return Text("".join(printable(os.fspath(p) if isinstance(p, os.PathLike) else str(p)) for p in parts))
