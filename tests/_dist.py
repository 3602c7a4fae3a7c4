"""A group of CPU processes joined by gloo, kept for a whole test module, that run named test cases on every rank.

Starting processes that import torch costs seconds each; a case costs milliseconds. So a module starts its group
once (`Group`), and each test sends the name of a function (in an importable module) for every rank to run with
(rank, world, mesh, **kwargs). A rank that raises returns its traceback, and the test fails with it; a case that
hangs (a rank stuck in a collective) is stopped after `timeout` seconds and the group is started afresh.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback

import torch.distributed as dist

AVAILABLE = dist.is_available() and dist.is_gloo_available()
WHY_NOT = "torch.distributed with the gloo backend is not available in this torch build"


def _serve(rank: int, world: int, store_path: str, path: list, inbox, outbox) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks on a small CI machine: no thread oversubscription
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
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

    def __init__(self, world: int = 2, timeout: float = 120.0):
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
        errors = []
        for _ in range(self.world):
            try:
                rank, status, value = self.outbox.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                if restart:
                    self._start()
                raise AssertionError(f"{what}: a rank did not answer within {self.timeout:.0f} s") from None
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = value
        if errors:
            # A rank that failed may leave the other waiting in a collective: start a fresh group for what follows.
            self.close()
            if restart:
                self._start()
            raise AssertionError(f"{what} failed\n" + "\n".join(errors))
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
