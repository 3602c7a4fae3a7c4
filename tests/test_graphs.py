"""CUDA graphs: every gated-MLP path (decode, split, gated GEMM, the CUDA backend) captured by hand and under
torch.compile(mode="reduce-overhead") replays what eager computes, with no cudagraph skipped and no graph break.

The skip and break counts are read from torch._dynamo's own counters (what Inductor logs as "skipping cudagraphs
due to ..."); outputs are compared with eager's under torch.use_deterministic_algorithms (the decode kernels' fixed
order reduction), bit for bit.
"""

import pytest
import torch

import mlpfuse
from mlpfuse.ops import dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (rows, dim, hidden, backend, the path `auto` or the backend takes there)
CASES = {
    "decode": (4, 768, 3072, "triton", dispatch.DECODE),
    "gated": (256, 768, 3072, "triton", dispatch.GATED),
    "split": (48, 4096, 4096, "auto", dispatch.SPLIT),
    "cuda": (4, 768, 3072, "cuda", dispatch.CUDA),
}


@pytest.fixture(autouse=True)
def deterministic():
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _module(case):
    rows, dim, hidden, backend, path = CASES[case]
    if case == "split" and torch.cuda.get_device_capability()[0] < dispatch.MIN_ARCH:
        pytest.skip("the split path is auto's on Hopper-class GPUs only")
    if backend == "cuda":
        from mlpfuse import csrc

        reason = csrc.environment_problem()
        if reason:
            pytest.skip(reason)
    torch.manual_seed(0)
    m = mlpfuse.GatedMLP(dim, hidden, activation="silu", device="cuda", dtype=torch.bfloat16, backend=backend)
    xs = [torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        chosen = dispatch.gated_mlp_path(backend, xs[0], hidden, False)
    assert chosen == path, chosen
    return m, xs


@pytest.mark.parametrize("case", list(CASES))
def test_captured_by_hand_replays_eager(case):
    m, xs = _module(case)
    with torch.no_grad():
        want = [m(x) for x in xs]
        static = xs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                m(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(static)
        for x, w in zip(xs[1:] + xs[:1], want[1:] + want[:1]):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, w)


@pytest.mark.parametrize("case", list(CASES))
def test_reduce_overhead_keeps_every_cudagraph(case):
    from torch._dynamo.utils import counters

    m, xs = _module(case)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = [m(x) for x in xs]
        for _ in range(3):  # warm-up, record, replay
            compiled(xs[0])
        got = [compiled(x).clone() for x in xs]
    torch.cuda.synchronize()
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, dict(counters["inductor"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
