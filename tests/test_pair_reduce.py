"""The two-rank copy-engine sum of the tensor-parallel down projection (ops/pair_reduce.py).

On a CPU: the chunking, and that CPU tensors never take the path. On two CUDA devices (NCCL): every call's sum
equals an independent fp64 sum of both ranks' partial products (gathered through NCCL) to bf16 rounding and is the
same on both ranks, across repeated calls (the flags' epochs), a larger call after a smaller one (the buffer grows),
an odd chunk count, and equals what the NCCL chunks compute. The path is opt-in (MLPFUSE_TP_REDUCE=copy-engine):
without it the NCCL chunks run.
"""

from __future__ import annotations

import os

import pytest
import torch

from cli_run import HANG_S

from mlpfuse.ops import pair_reduce


@pytest.mark.parametrize("m,n", [(16, 2), (2200, 2), (4100, 3), (16384, 4), (16385, 4), (8 * 7, 7)])
def test_cuts_cover_the_rows_in_about_equal_aligned_chunks(m, n):
    parts = pair_reduce.cuts(m, n)
    assert len(parts) == n and parts[0][0] == 0 and parts[-1][1] == m
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert all(a % 8 == 0 for a, _ in parts)
    sizes = [b - a for a, b in parts]
    assert max(sizes) - min(sizes) <= 8 + m % 8, sizes


def test_cpu_tensors_never_take_the_copy_engines():
    assert pair_reduce.for_group(None, torch.zeros(4, 4)) is None


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ[pair_reduce.ENV_VAR] = pair_reduce.CHOICE
    from mlpfuse.ops import reduce_overlap

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    out = []
    try:
        for step, (m, k, d, n) in enumerate([(2048, 256, 512, 2), (2048, 256, 512, 2), (4104, 384, 512, 3),
                                             (4104, 384, 512, 3), (8192, 512, 1024, 4), (2048, 256, 512, 2)]):
            g = torch.Generator(device="cuda").manual_seed(100 * step + rank)
            h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            wd = torch.randn(d, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
            pair = pair_reduce.for_group(group, h)
            y = reduce_overlap._down_all_reduce(h, wd, group, n)
            partial = (h.double() @ wd.double().t())
            both = [torch.empty_like(partial) for _ in range(2)]
            dist.all_gather(both, partial)
            want = both[0] + both[1]
            err = float((y.double() - want).norm() / want.norm())
            ys = [torch.empty_like(y) for _ in range(2)]
            dist.all_gather(ys, y)
            pair_reduce._groups.pop(group.group_name)  # the NCCL chunks, for the same call
            assert pair_reduce.for_group(group, h, want=False) is None
            nccl = reduce_overlap._down_all_reduce(h, wd, group, n)
            pair_reduce._groups[group.group_name] = pair
            out.append({"step": step, "pair": pair is not None, "err": err, "ranks_equal": bool(torch.equal(*ys)),
                        "vs_nccl": float((y.double() - nccl.double()).norm() / nccl.double().norm())})
        results.put((rank, out))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_ranks_sum_through_the_copy_engines():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=HANG_S) for _ in procs)
    for p in procs:
        p.join(timeout=HANG_S)
    for rank in range(2):
        assert not isinstance(got[rank], str), got[rank]
        for row in got[rank]:
            assert row["pair"], row  # the copy-engine path was taken
            assert row["err"] < 1e-2 and row["vs_nccl"] < 1e-2 and row["ranks_equal"], row


def test_the_copy_engines_are_opt_in(monkeypatch):
    """Without MLPFUSE_TP_REDUCE=copy-engine no rank offers the path (the group then agrees on NCCL's chunks)."""
    monkeypatch.delenv(pair_reduce.ENV_VAR, raising=False)
    assert not pair_reduce._can(torch.device("cuda", 0))
    monkeypatch.setenv(pair_reduce.ENV_VAR, "nccl")
    assert not pair_reduce._can(torch.device("cuda", 0))
    monkeypatch.setenv(pair_reduce.ENV_VAR, pair_reduce.CHOICE)
    assert not pair_reduce._can(torch.device("cpu"))
    assert not pair_reduce._can(torch.device("cuda", 0), want=False)  # the caller's choice over the variable
