"""A tensor-parallel gated block that sums its ranks' outputs while its own GEMMs still run.

Under the Megatron split (gate and up column-parallel, down row-parallel) each rank ends its block with a partial
output that one all-reduce sums; run after the block, that all-reduce is time the GPU spends on nothing else
(at 16384 tokens × 4096×14336 on two GPUs, 128 MB per block). Here the block runs its down projection in row
chunks and starts each chunk's all-reduce as soon as that chunk is written, so every transfer but the last runs
behind the next chunk's GEMM. In the backward, dx (a partial sum on each rank too) is all-reduced as soon as it
exists, behind the weight gradients dWu and dWg that are computed after it.

Taken by `ops.sharded.gated` for a block whose down projection was sharded by `mlpfuse.parallel`'s all-reduce plan
(`REDUCES`), in plain eager calls from CHUNK_ROWS·2 tokens on the TORCH, SPLIT and GATED paths; the result is the
sum, replicated, and x's gradient comes back summed. Elsewhere (compiled calls, sequence parallelism, the decode and
CUDA paths, fewer tokens) the block's output stays a partial sum for DTensor to reduce after it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from mlpfuse import activations
from mlpfuse.ops import _checks, dispatch, pair_reduce
from mlpfuse.ops._util import autocast_dtype, hold, plain_eager, rows, take_held, unrows
from mlpfuse.ops.gated_mlp import hidden, hidden_gradients

# A projection carrying this attribute (True) is row-parallel with a replicated output: its output hook only
# passes on a sum that is already replicated. Set by mlpfuse.parallel's plan, read by ops.sharded.
REDUCES = "_mlpfuse_reduces_output"
# Measured at 16384 tokens × 4096×14336, bf16 (benchmarks/multi_gpu.py): on two H200s four chunks with the last
# about half the others' took 4.520 ms forward against 4.571 with four equal chunks and 4.761 with the all-reduce
# after the block (eager TP 5.098), and eight chunks of 2048 rows lost to four equal ones (4.556 vs 4.475 ms: more
# NCCL kernels beside the down GEMM; benchmarks/results/nvidia-h200-x2/tp-overlap); on two H100s chunks shrinking
# as below took 4.374 ms on average against 4.505 for the last-half chunking, three processes each
# (benchmarks/results/nvidia-h100-x2/tp-chunks-shrink).
CHUNK_ROWS = 1024  # one chunk of the down projection per this many rows, ...
MAX_CHUNKS = 4  # ... at most this many chunks (each adds one GEMM launch and one collective)
# Each chunk's all-reduce runs behind the next chunk's GEMM, so the next chunk need only last as long as that
# all-reduce: chunks shrink by the ratio of an all-reduce's time per row (∝ model width × 2(w-1)/w over the link)
# to the down GEMM's (∝ model width × hidden per rank), about SHRINK_WIDTH / (hidden per rank) for two ranks. On two
# H100s at 16384 tokens × 4096×14336 the NCCL kernels ran 0.797 ms beside ~1.38 ms of down GEMM (hidden 7168 per
# rank): 0.58, so SHRINK_WIDTH = 4096. The last chunk, whose all-reduce nothing hides, is then the smallest.
# Clamped: below 0.5 the last chunks get too short for an efficient GEMM; above 0.75 (all-reduce as long as the
# GEMM) shrinking buys nothing but a smaller tail.
SHRINK_WIDTH = 4096
SHRINK_RANGE = (0.5, 0.75)
_PATHS = (dispatch.TORCH, dispatch.SPLIT, dispatch.GATED)


def plan(x: Tensor, grad: bool, hidden_size: int, backend: str) -> Optional[tuple[int, str]]:
    """(chunks, path) for a call on x (this rank's replicated input, a plain tensor) that takes the overlapped path,
    else None. grad: whether the call needs a gradient (autograd's rule, decided by the caller)."""
    x2 = rows(x)
    n = min(MAX_CHUNKS, x2.shape[0] // CHUNK_ROWS)
    if n < 2 or not plain_eager(x) or autocast_dtype(x) is not None:
        return None
    path = dispatch.gated_mlp_path(backend, x2, hidden_size, grad)
    return (n, path) if path in _PATHS else None


def gated(x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor], activation: str,
          grad: bool, n: int, path: str, group) -> Tensor:
    """The sum over `group`'s ranks of down(act(x·Wgᵀ + bg)·(x·Wuᵀ + bu)) for this rank's hidden slice (no down
    bias), with `plan`'s chunks and path. Under autograd (`grad`), x's gradient is the sum over ranks too."""
    _checks.gated_mlp_args(x, wg, wu, wd, bg, bu, None)
    act = activations.get(activation)
    if grad:
        return _Overlapped.apply(x, wg, wu, wd, bg, bu, activation, path, group, n)
    h = hidden(rows(x), wg, wu, bg, bu, act, path, False)[0]
    return unrows(_down_all_reduce(h, wd, group, n), x)


def _down_all_reduce(h: Tensor, wd: Tensor, group, n: int) -> Tensor:
    """h·Wdᵀ summed over the group's ranks, computed in n shrinking row chunks (`bounds`), each chunk's all-reduce
    started as soon as the chunk is written and waited for (by the current stream, not the host, on NCCL) at the
    end. With MLPFUSE_TP_REDUCE=copy-engine, two CUDA ranks sum through the copy engines instead
    (ops/pair_reduce.py)."""
    pair = pair_reduce.for_group(group, h)
    if pair is not None:
        return pair(h, wd, n)
    y = h.new_empty(h.shape[0], wd.shape[0])
    wdt = wd.t()
    pending = []
    for start, stop in bounds(h.shape[0], n, shrink(h.shape[1], dist.get_world_size(group))):
        part = y[start:stop]
        torch.mm(h[start:stop], wdt, out=part)
        pending.append(dist.all_reduce(part, group=group, async_op=True))
    for work in pending:
        work.wait()
    return y


def shrink(hidden_per_rank: int, world: int) -> float:
    """Each chunk's rows over the rows of the chunk before it (see SHRINK_WIDTH)."""
    ratio = SHRINK_WIDTH * (2 * (world - 1) / world) / max(hidden_per_rank, 1)
    return min(SHRINK_RANGE[1], max(SHRINK_RANGE[0], ratio))


def bounds(m: int, n: int, q: float) -> list[tuple[int, int]]:
    """n row ranges covering [0, m), each q times the one before (q < 1: the last, whose all-reduce nothing runs
    behind, the smallest), every boundary a multiple of 8 rows (chunk addresses stay as aligned as the whole
    tensor's)."""
    weights = [q ** i for i in range(n)]
    total, acc, cuts = sum(weights), 0.0, [0]
    for w in weights[:-1]:
        acc += w
        cuts.append(int(m * acc / total) // 8 * 8)
    cuts.append(m)
    return list(zip(cuts, cuts[1:]))


class _Overlapped(torch.autograd.Function):
    """Training: the forward keeps g and u (as eager training does, ops.gated_mlp `_EagerTraining`) and not h;
    the backward all-reduces dx behind dWu and dWg."""

    @staticmethod
    def forward(ctx, x, wg, wu, wd, bg, bu, activation: str, path: str, group, n: int):
        x2 = rows(x)
        h, g, u = hidden(x2, wg, wu, bg, bu, activations.get(activation), path, True)
        y = _down_all_reduce(h, wd, group, n)
        ctx.activation, ctx.path, ctx.group = activation, path, group
        hold(ctx, (x, wg, wu, wd, bg, bu), g, u)
        return unrows(y, x)

    @staticmethod
    def backward(ctx, dy):
        saved, held = take_held(ctx)
        x, wg, wu, wd, bg, bu = saved[:6]
        x2 = rows(x)
        if held is None:  # a second backward through the graph (retain_graph=True): the first consumed g and u
            held = list(hidden(x2, wg, wu, bg, bu, activations.get(ctx.activation), ctx.path, True)[1:])
        need = ctx.needs_input_grad
        pending = []
        group = ctx.group

        def reduce_dx(dx):
            pending.append(dist.all_reduce(dx, group=group, async_op=True))

        bias_grads = (bg is not None and need[4], bu is not None and need[5], False)
        dx, dwg, dwu, dwd, dbg, dbu, _ = hidden_gradients(
            ctx.path, rows(dy.to(x.dtype)), x2, wg, wu, wd, held, ctx.activation, need[0],
            need[1] or need[2] or need[3], bias_grads, reduce_dx)
        del held
        for work in pending:
            work.wait()
        if dx is not None and x.dim() != 2:
            dx = dx.reshape(x.shape)
        grads = (dx, dwg, dwu, dwd, dbg, dbu)
        return (*(t if need[i] else None for i, t in enumerate(grads)), None, None, None, None)
