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
    "split": (48, 4096, 14336, "auto", dispatch.SPLIT),  # a layer past the H200's split_min_layer (2**25)
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
    if case == "split" and chosen == dispatch.GATED and dispatch.cutovers(xs[0].device).gated_large_min_m <= rows:
        pytest.skip("this card's cut-overs take the gated GEMM, not SPLIT, at this size (kernels/configs.py)")
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


def _replayed_kernels(graph) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _atomic_decode_module():
    """The decode path's one-launch mode (its accumulator must be zero at entry; each launch leaves it so)."""
    torch.manual_seed(1)
    m = mlpfuse.GatedMLP(768, 3072, activation="silu", device="cuda", dtype=torch.bfloat16, backend="triton")
    xs = [torch.randn(2, 768, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    return m, xs


def test_graphs_captured_after_a_warm_up_replay_the_decode_kernel_alone():
    # A graph captured on a stream that never ran the kernels takes a zeroed scratch made before the capture: its
    # replays launch the decode kernels and nothing else (a fresh scratch would add a fill to every replay; captured,
    # the one-launch mode becomes the atomics and their cast launch). Two graphs captured one after the other own
    # different scratch, so each replays right after the other ran.
    torch.use_deterministic_algorithms(False)
    m, xs = _atomic_decode_module()
    graphs = []
    with torch.no_grad():
        want = [m(x) for x in xs]
        side = torch.cuda.Stream()  # one warm-up stream for both captures, as a serving loop would keep
        for _ in range(2):
            static = xs[0].clone()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                m(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = m(static)
            graphs.append((graph, static, out))
        for graph, _, _ in graphs:  # the second capture too: a new spare waited for it
            kernels = _replayed_kernels(graph)
            assert sorted(kernels) == ["mlpfuse_decode_mlp_kernel", "mlpfuse_decode_reduce_kernel"], kernels
        for x, w in zip(xs[1:] + xs[:1], want[1:] + want[:1]):
            for graph, static, out in graphs:
                static.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                torch.testing.assert_close(out, w, rtol=2e-2, atol=2e-2)
        from mlpfuse.kernels import decode_mlp as K

        m(xs[0])  # a call outside any capture releases what the captures took
        taken = [s for s in K._graveyard if s is not None]
        assert len({s[0].data_ptr() for s in taken}) >= 2  # two captures, two accumulators


def test_reduce_overhead_keeps_the_cudagraph_with_the_atomic_decode_kernels():
    # CUDA-graph trees warm up and record inside their own pool; the decode kernels' scratch kept between calls is
    # made outside it, so the tree has no untracked live tensor in its pool and records the graph.
    from torch._dynamo.utils import counters

    torch.use_deterministic_algorithms(False)
    m, xs = _atomic_decode_module()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        want = [m(x) for x in xs]
        for _ in range(3):
            compiled(xs[0])
        got = [compiled(x).clone() for x in xs]
    torch.cuda.synchronize()
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, dict(counters["inductor"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
