"""The host a profile runs on: CPU threads pinned for the run, and a warning when the machine is too busy to time.

On a shared CPU, intra-op threads that compete with other processes for a few cores make step times swing by orders
of magnitude (a small train step measured 207,824 µs/step with torch's default threads on a loaded machine, 1,059 µs
with one). walkthrough, profile and `mlpfuse.profile()` pin the threads the same way and warn with the same words.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator

from mlpfuse.errors import InputError

DEFAULT_THREADS = 1
THREADS_HELP = ("CPU intra-op threads during the run (default 1: threads competing for a few cores make CPU timings "
                "swing from run to run; the previous setting is restored afterwards)")


class HostLoadWarning(UserWarning):
    """The machine was busy when a profile started: its timings are inflated and noisy."""


def check_threads(threads, flag: str = "threads") -> None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InputError(f"{flag}: expected an integer >= 1, got {threads!r}")


@contextlib.contextmanager
def pinned_threads(threads: int | None, flag: str = "threads") -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside the block and restored after it; None leaves them alone."""
    check_threads(threads, flag)
    if threads is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (a container's share), not the host's
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy(load: float | None = None, cores: int | None = None) -> str | None:
    """A one-line warning when more tasks wanted a CPU over the last minute than there are cores (someone waited,
    so CPU timings are inflated), else None. `load` and `cores` default to this machine's; where the load average
    is unknown (Windows) there is no warning."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    cores = cores or _cores()
    if load <= cores:
        return None
    return (f"this machine is busy (load average {load:.1f} on {cores} core{'s' * (cores != 1)}): CPU timings "
            "will be inflated and noisy; compare runs made under the same load, or wait until it is idle")


def warn_if_busy(stacklevel: int = 3, load: float | None = None, cores: int | None = None) -> str | None:
    """`busy()` as a HostLoadWarning (the Python API's way); returns the message."""
    message = busy(load, cores)
    if message is not None:
        warnings.warn(f"mlpfuse: {message}", HostLoadWarning, stacklevel=stacklevel)
    return message


@contextlib.contextmanager
def cli_run(threads: int | None, flag: str = "--threads", stream=None) -> Iterator[None]:
    """A CLI command's profiled run: the busy warning printed once as a `mlpfuse: warning:` line, threads pinned.
    (The CLI ignores the API's HostLoadWarning: a walkthrough profiles dozens of times; one line says it.)"""
    import sys

    check_threads(threads, flag)
    message = busy()
    if message is not None:
        print(f"mlpfuse: warning: {message}", file=stream or sys.stderr)
    with pinned_threads(threads, flag):
        yield
