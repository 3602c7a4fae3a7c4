"""A group of CPU processes joined by gloo, kept for a whole test module, that run named test cases on every rank.

Starting processes that import torch costs seconds each; a case costs milliseconds. So a module starts its group
once (`Group`), and each test sends the name of a function (in an importable module) for every rank to run with
(rank, world, mesh, **kwargs). A rank that raises returns its traceback, and the test fails with it.

How long a case takes depends on the machine and on whatever else runs there (a loaded 2-core CI machine stretched a
case past two minutes), so nothing here fails on a short clock: the test waits for as long as every rank it waits
for is alive, fails at once when one has exited, and gives up only after HANG_S, far above any plausible run, which
only a hang (ranks stuck in a collective) reaches. After a failure the group is started afresh.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback

import torch.distributed as dist

AVAILABLE = dist.is_available() and dist.is_gloo_available()
WHY_NOT = "torch.distributed with the gloo backend is not available in this torch build"
HANG_S = 30 * 60  # a case of seconds on an idle machine: only a hang runs this long, however busy the machine
_POLL_S = 1.0  # how often a wait looks whether the ranks it waits for are still alive
_GRACE_S = 10.0  # after one rank failed, how long the others may take to report theirs (the test fails either way)


def _serve(rank: int, world: int, store_path: str, path: list, inbox, outbox) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks on a small CI machine: no thread oversubscription
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=HANG_S))
    mesh = init_device_mesh("cpu", (world,))
    outbox.put((rank, "ready", None))
    while True:
        task = inbox.get()
        if task is None:
            break
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            result = fn(rank, world, mesh, **kwargs)
            outbox.put((rank, "ok", result))
        except BaseException:  # noqa: BLE001 - any failure goes back to the test as text
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class Group:
    """`world` spawned processes in one gloo group with a 1-D CPU device mesh."""

    def __init__(self, world: int = 2, timeout: float = HANG_S):
        self.world, self.timeout = world, timeout
        self.procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        fd, self._store = tempfile.mkstemp(prefix="mlpfuse-gloo-")
        os.close(fd)
        os.unlink(self._store)  # the FileStore creates it; a stale file would be read as an old group's
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_serve, args=(r, self.world, self._store, list(sys.path), self.inboxes[r],
                                                      self.outbox), daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self._collect("start", restart=False)

    def _collect(self, what: str, restart: bool = True) -> list:
        results: list = [None] * self.world
        errors, pending = [], set(range(self.world))
        give_up, failed_at, problem = time.monotonic() + self.timeout, None, None
        while pending and problem is None:
            try:
                rank, status, value = self.outbox.get(timeout=_POLL_S)
            except queue.Empty:
                dead = {r: self.procs[r].exitcode for r in sorted(pending) if not self.procs[r].is_alive()}
                if dead:
                    problem = f"{what}: rank(s) exited without answering (exit codes {dead})"
                elif failed_at is not None and time.monotonic() > failed_at + _GRACE_S:
                    break  # the rest may wait in a collective for the rank that failed: its traceback says why
                elif time.monotonic() > give_up:
                    problem = f"{what}: no answer from rank(s) {sorted(pending)} in {self.timeout:.0f} s (a hang)"
                continue
            pending.discard(rank)
            if status == "error":
                failed_at = failed_at or time.monotonic()
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        if problem is not None or errors:
            # A rank that failed or died may leave the others waiting in a collective: start a fresh group.
            self.close()
            if restart:
                self._start()
            raise AssertionError("\n".join([problem or f"{what} failed", *errors]))
        return results

    def run(self, module: str, name: str, **kwargs) -> list:
        """Run module.name(rank, world, mesh, **kwargs) on every rank; the ranks' return values, by rank."""
        for box in self.inboxes:
            box.put((module, name, kwargs))
        return self._collect(f"{module}.{name}")

    def close(self) -> None:
        for box, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                try:
                    box.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
        if os.path.exists(self._store):
            os.unlink(self._store)
