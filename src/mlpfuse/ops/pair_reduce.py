"""The down projection summed over two ranks through the GPUs' copy engines, behind its own GEMMs.

NCCL's all-reduce runs as kernels: a chunk's all-reduce launched beside the next chunk's GEMM waits until that GEMM,
which holds every SM, ends (ops/reduce_overlap.py). Here nothing of the sum needs an SM while a GEMM runs. The
block's rows are cut in n chunks; chunk c is owned by rank c % 2. Each rank first computes the chunks it does not
own into its symmetric buffer P (torch.distributed._symmetric_memory: memory the peer can read) and flags each to
its owner with a stream memory write. The owner's second stream waits on the flag (cuStreamWaitValue32, executed by
the GPU's front end) and pulls the peer's partial into its own symmetric buffer F with a peer copy (a copy
engine); its compute stream then adds its own product in place (`addmm_`: the sum in cuBLAS's epilogue) and flags
the peer, which pulls the finished chunk into its output while its own GEMMs run. Both ranks end with the same sum.

Safe reuse of P and F from one call to the next follows from the flags' order: a rank writes P[c] again only after
it pulled the finished chunk c that the peer made from it, and F[c] only after the peer flagged the next call's
partial, which the peer writes after its previous call's pulls were joined. Flags carry the call's epoch and are
waited on with "greater or equal"; before the epoch could wrap, both ranks zero the flags between two barriers.

Opt-in (MLPFUSE_TP_REDUCE=copy-engine in every rank's environment): reduce_overlap then uses it for groups of two
CUDA ranks when every rank can (`for_group` agrees once per group, over the group itself); otherwise, and under CUDA
graph capture, the NCCL chunks run. Not the default: on two H200s at 16384 tokens × 4096×14336
(benchmarks/results/nvidia-h200-x2/tp-copy-engine/) one machine gave the forward 4.522 ms against 4.644 for the NCCL
chunks, another 4.498 against 4.476 (4.376 / 4.314 with no sum at all); on two H100s 4.646 against 4.571, forward+
backward 14.294 against 13.831 (benchmarks/results/nvidia-h100-x2/tp-copy-engine/). A rank that stops between
flags leaves its peer's copy stream waiting with no timeout, where NCCL's watchdog would abort.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

ENV_VAR = "MLPFUSE_TP_REDUCE"  # "copy-engine": sum two ranks' chunks through the copy engines; else NCCL's chunks
CHOICE = "copy-engine"
FINAL = 32  # flag index of chunk c's finished sum: FINAL + c (partials at c)
MAX_CHUNKS = FINAL
_EPOCH_LIMIT = 1 << 31

# group name -> the group's PairReduce, or None where it cannot use one (keyed by name as PyTorch keys its own
# symmetric-memory workspaces: a mesh hands the same group back through its name)
_groups: dict = {}
_wait_value = None


def _stream_wait_value32():
    """cuStreamWaitValue32 from the CUDA driver (the stream waits until a 32-bit word is >= a value), or None."""
    global _wait_value
    if _wait_value is None:
        fn = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            for name in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                    fn.restype = ctypes.c_int
                    break
        except OSError:
            fn = None
        _wait_value = fn or False
    return _wait_value or None


def _can(device: torch.device, want: Optional[bool] = None) -> bool:
    """Whether this process offers to take part: asked for (`want`, else MLPFUSE_TP_REDUCE=copy-engine), a CUDA
    device, PyTorch's symmetric memory with stream writes, and the driver's stream wait."""
    if want is None:
        want = os.environ.get(ENV_VAR, "").strip().lower() == CHOICE
    if not want or device.type != "cuda":
        return False
    try:
        from torch.distributed._symmetric_memory import _SymmetricMemory
    except ImportError:
        return False
    return hasattr(_SymmetricMemory, "stream_write_value32") and _stream_wait_value32() is not None


def for_group(group, h: Tensor, want: Optional[bool] = None) -> "Optional[PairReduce]":
    """The group's PairReduce for a call on h (this rank's [rows, hidden] slice), or None: the NCCL chunks. Decided
    once per group, at its first call, by every rank together (an all-reduce of what each can do), so no rank waits
    on a flag the other never writes. `want` (True / False) asks for the group's choice instead of
    MLPFUSE_TP_REDUCE; it counts only while the group has not chosen yet."""
    if not h.is_cuda or torch.cuda.is_current_stream_capturing() or h.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return None
    name = group.group_name
    if name not in _groups:
        pair = None
        if dist.get_world_size(group) == 2:
            ok = torch.tensor([1 if _can(h.device, want) else 0], device=h.device, dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
            if int(ok) == 1:
                pair = PairReduce(group, h.device)
        _groups[name] = pair
    return _groups[name]


def cuts(m: int, n: int) -> list[tuple[int, int]]:
    """n row ranges of about equal size covering [0, m), every boundary a multiple of 8 rows."""
    bounds = [i * m // n // 8 * 8 for i in range(n)] + [m]
    return list(zip(bounds, bounds[1:]))


class PairReduce:
    """Two ranks' copy-engine sum of a chunked down projection (see the module doc). Holds the symmetric buffers,
    grown (collectively, the ranks in step) to the largest call so far; the flags; the copy stream; the epoch."""

    def __init__(self, group, device: torch.device):
        from torch.distributed._symmetric_memory import _SymmetricMemory

        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.peer = 1 - self.rank
        self.write = _SymmetricMemory.stream_write_value32
        self.wait_value = _stream_wait_value32()
        self.stream = torch.cuda.Stream(device)
        self.flags, handle = self._symmetric(2 * FINAL, torch.int32)
        self.flags.zero_()
        self.peer_flags = handle.get_buffer(self.peer, (2 * FINAL,), torch.int32, 0).view(torch.uint32)
        self.flag_address = self.flags.data_ptr()
        self.epoch = 0
        self.buffer = None  # (dtype, capacity in elements per half, P|F buffer, its handle)
        self.views: dict = {}
        self._quiet()

    def _quiet(self) -> None:
        """Both ranks' GPUs idle and every rank here: nothing reads or writes the symmetric memory now."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _symmetric(self, numel: int, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm

        t = symm.empty(numel, dtype=dtype, device=self.device)
        return t, symm.rendezvous(t, self.group.group_name)

    def _buffers(self, m: int, d: int, dtype: torch.dtype):
        """(P, F, the peer's P, the peer's F) as [m, d] views. A call larger than the buffer (or in another dtype)
        grows it; both ranks make the same calls, so they get here together."""
        held = self.buffer
        if held is None or held[0] != dtype or held[1] < m * d:
            self._quiet()  # the peer may still be pulling from the old buffer
            self.views.clear()
            self.buffer = None
            buf, handle = self._symmetric(2 * m * d, dtype)
            self.buffer = held = (dtype, m * d, buf, handle)
        views = self.views.get((m, d))
        if views is None:
            if len(self.views) >= 64:  # row counts that vary call to call: keep the table small
                self.views.clear()
            _, cap, buf, handle = held
            views = (buf[: m * d].view(m, d), buf[cap: cap + m * d].view(m, d),
                     handle.get_buffer(self.peer, (m, d), dtype, 0), handle.get_buffer(self.peer, (m, d), dtype, cap))
            self.views[(m, d)] = views
        return views

    def _next_epoch(self) -> int:
        if self.epoch + 1 >= _EPOCH_LIMIT:  # both ranks reach this on the same call
            self._quiet()
            self.flags.zero_()
            self._quiet()
            self.epoch = 0
        self.epoch += 1
        return self.epoch

    def _wait(self, stream: torch.cuda.Stream, index: int, value: int) -> None:
        rc = self.wait_value(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self.flag_address + 4 * index),
                             ctypes.c_uint32(value), 0)  # CU_STREAM_WAIT_VALUE_GEQ
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")

    def __call__(self, h: Tensor, wd: Tensor, n: int) -> Tensor:
        """h·wdᵀ summed over both ranks: h [m, k] this rank's rows (contiguous), wd [d, k] its down weight slice."""
        m, d = h.shape[0], wd.shape[0]
        n = max(1, min(n, MAX_CHUNKS))
        P, F, peer_P, peer_F = self._buffers(m, d, h.dtype)
        e = self._next_epoch()
        compute, copy = torch.cuda.current_stream(self.device), self.stream
        wdt = wd.t()
        y = h.new_empty(m, d)
        copy.wait_stream(compute)  # y's memory and h are ready for the copy stream too
        parts = cuts(m, n)
        mine = [c for c in range(n) if c % 2 == self.rank]
        theirs = [c for c in range(n) if c % 2 != self.rank]
        for c in theirs:  # the peer's chunks first: their partials go out while this rank's GEMMs run
            a, b = parts[c]
            torch.mm(h[a:b], wdt, out=P[a:b])
            self.write(self.peer_flags, c, e)
        pulled = {}
        with torch.cuda.stream(copy):
            for c in mine:
                a, b = parts[c]
                self._wait(copy, c, e)
                F[a:b].copy_(peer_P[a:b])
                pulled[c] = copy.record_event()
        finished = {}
        for c in mine:
            a, b = parts[c]
            compute.wait_event(pulled[c])
            F[a:b].addmm_(h[a:b], wdt)
            self.write(self.peer_flags, FINAL + c, e)
            finished[c] = compute.record_event()
        with torch.cuda.stream(copy):
            for i in range(max(len(mine), len(theirs))):  # in the order the chunks finish on both ranks
                if i < len(mine):
                    a, b = parts[mine[i]]
                    copy.wait_event(finished[mine[i]])
                    y[a:b].copy_(F[a:b])
                if i < len(theirs):
                    a, b = parts[theirs[i]]
                    self._wait(copy, FINAL + theirs[i], e)
                    y[a:b].copy_(peer_F[a:b])
        compute.wait_stream(copy)
        return y
