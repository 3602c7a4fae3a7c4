"""mlpfuse's MLP blocks under tensor parallelism (DTensor) and FSDP2, on 2 CPU processes joined by gloo.

Every rank's output, input gradient and (gathered) parameter gradients must equal the single-process block's,
with and without biases, with the torch backend in float64 and the Triton kernels (through Triton's interpreter on
a CPU) in float32. The cases themselves are in tests/dist_cases.py; they run in a group started once per module.
"""

import os

import pytest

import _dist

pytestmark = pytest.mark.skipif(not _dist.AVAILABLE, reason=_dist.WHY_NOT)

WORLD = 2
CASES = "dist_cases"
KINDS = ("gated", "packed", "mlp")


@pytest.fixture(scope="module")
def group():
    g = _dist.Group(WORLD)
    yield g
    g.close()


def _triton_on_cpu() -> str | None:
    """Why the Triton kernels cannot run on the ranks' CPU tensors here, or None: they need Triton's interpreter,
    which conftest turns on only where there is no GPU."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "the ranks' tensors are on CPUs: the Triton kernels run there only through TRITON_INTERPRET=1"
    return None


BACKENDS = [("torch", "float64"),
            pytest.param("triton", "float32", marks=pytest.mark.skipif(_triton_on_cpu() is not None,
                                                                         reason=str(_triton_on_cpu())))]


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_equals_single_process(group, kind, bias, backend, dtype):
    counts = group.run(CASES, "tp_matches_single", kind=kind, bias=bias, backend=backend, dtype=dtype)
    # One all-reduce per block forward (the ranks' partial outputs), one backward (the partial input gradients).
    assert counts == [{"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}] * WORLD


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", ("gated", "packed"))
def test_block_sums_its_output_behind_its_own_gemms(group, kind, bias, backend, dtype):
    """From 2·CHUNK_ROWS tokens a gated block under the all-reduce plan sums the ranks' outputs itself: its down
    projection in row chunks, each chunk's all-reduce started once the chunk is written, and x's gradient
    all-reduced before the weight gradients are computed. Values equal the single process's; the collectives are
    those chunks' and dx's, and DTensor adds none (it would sum the sums again)."""
    from mlpfuse.ops import reduce_overlap

    tokens = (2, reduce_overlap.CHUNK_ROWS + 76)  # 2200 rows: two chunks of 1100
    counts = group.run(CASES, "tp_matches_single", kind=kind, bias=bias, backend=backend, dtype=dtype, tokens=tokens)
    assert counts == [{"forward": {"allreduce_": 2}, "backward": {"allreduce_": 1}}] * WORLD


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_the_overlapped_block_backward_twice(group, backend, dtype):
    from mlpfuse.ops import reduce_overlap

    group.run(CASES, "tp_backward_twice", backend=backend, dtype=dtype, tokens=(2, reduce_overlap.CHUNK_ROWS + 76))


@pytest.mark.parametrize("q", [0.5, 0.571, 0.75])
@pytest.mark.parametrize("m", [2048, 2200, 4100, 8192, 16384, 16385])
def test_chunks_cover_the_rows_each_shorter_than_the_last(m, q):
    from mlpfuse.ops import reduce_overlap

    n = min(reduce_overlap.MAX_CHUNKS, m // reduce_overlap.CHUNK_ROWS)
    bounds = reduce_overlap.bounds(m, n, q)
    assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == m
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert all(a % 8 == 0 for a, _ in bounds), bounds  # chunk starts keep the tensor's alignment
    assert all(later < earlier for earlier, later in zip(sizes, sizes[1:])), sizes  # the tail is the smallest
    for earlier, later in zip(sizes, sizes[1:]):  # q times the one before, up to the 8-row rounding
        assert abs(later - q * earlier) <= 16, (sizes, q)


def test_shrink_follows_the_hidden_width_per_rank_within_its_range():
    from mlpfuse.ops import reduce_overlap as ro

    lo, hi = ro.SHRINK_RANGE
    assert ro.shrink(7168, 2) == pytest.approx(ro.SHRINK_WIDTH / 7168)  # two ranks of a 14336-wide block
    assert ro.shrink(10240, 4) == pytest.approx(1.5 * ro.SHRINK_WIDTH / 10240)  # more data per row for 4 ranks
    assert ro.shrink(10240, 2) == lo  # 0.4: the last chunks would be too short for an efficient GEMM
    assert ro.shrink(10**6, 2) == lo and ro.shrink(64, 2) == hi and ro.shrink(0, 2) == hi


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_pytorch_styles_directly(group, kind, bias):
    """parallelize_module with ColwiseParallel / RowwiseParallel (PackedColwiseParallel for the packed weight)."""
    group.run(CASES, "tp_matches_single", kind=kind, bias=bias, backend="torch", dtype="float64", via="styles")


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_sequence_parallel(group, kind, backend, dtype):
    counts = group.run(CASES, "tp_matches_single", kind=kind, bias=True, backend=backend, dtype=dtype,
                       sequence_dim=1)
    # The sequence shards gathered once at the block's start, the partial outputs reduce-scattered at its end.
    expected = {"forward": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
                "backward": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}}
    assert counts == [expected] * WORLD


@pytest.mark.parametrize("sequence_dim", [None, 1], ids=["replicated", "sequence"])
def test_fewer_collectives_than_eager(group, sequence_dim):
    """Eager nn.Linear projections under the same plan prepare x once per column-parallel projection: gate and
    up each gather a sequence-sharded x, and each sums its share of dx. The fused block does both once."""
    ours = group.run(CASES, "tp_matches_single", kind="gated", bias=True, backend="torch", dtype="float64",
                     sequence_dim=sequence_dim)
    eager = group.run(CASES, "eager_tp_comms", bias=True, sequence_dim=sequence_dim)
    if sequence_dim is None:
        assert eager == [{"forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}}] * WORLD
        assert ours == [{"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}] * WORLD
    else:
        assert eager == [{"forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1},
                          "backward": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}}] * WORLD
        assert ours == [{"forward": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
                         "backward": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}}] * WORLD


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_equals_single_process(group, kind, bias, backend, dtype):
    counts = group.run(CASES, "fsdp_matches_single", kind=kind, bias=bias, backend=backend, dtype=dtype)
    # One all-gather of the parameters before the forward, one reduce-scatter of the gradients after the backward
    # (the backward's re-gather is skipped: the root keeps its parameters gathered after its forward).
    for c in counts:
        assert {k.rstrip("_").lstrip("_") for k in c} == {"allgather_base", "reduce_scatter_base"}, c
        assert all(n == 1 for n in c.values()), c


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fsdp2_trains_an_fp8_block_as_one_process_would(group, bias, backend):
    """GatedMLP(precision="fp8-train") under FSDP2: outputs and input gradients equal the block's own, the averaged
    weight gradients the mean of each rank's single-process FP8 step (the reference path, and the kernels through
    Triton's interpreter)."""
    if backend == "triton" and _triton_on_cpu() is not None:
        pytest.skip(_triton_on_cpu())
    group.run(CASES, "fsdp_fp8_train_matches_single", bias=bias, backend=backend)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_over_tensor_parallel(group, kind, bias):
    group.run(CASES, "fsdp_tp_matches_single", kind=kind, bias=bias)


@pytest.mark.parametrize("case,kwargs", [("fsdp_tp_matches_single", {"kind": "gated", "bias": True}),
                                         ("patched_matches_single", {"family": "llama", "bias": False,
                                                                     "backend": "torch", "dtype": "float64"})],
                         ids=["fsdp2-over-tp", "patched-llama"])
def test_the_overlapped_all_reduce_under_fsdp2_and_in_patched_models(group, case, kwargs):
    """The block's own all-reduce (from 2048 tokens) where FSDP2 gathers the tensor-parallel shards, and in the
    blocks mlpfuse.patch puts in a model: the same values as the single process."""
    from mlpfuse.ops import reduce_overlap

    counts = group.run(CASES, case, tokens=(2, reduce_overlap.CHUNK_ROWS + 76), **kwargs)
    blocks = 2 if case == "patched_matches_single" else 1  # the patched model has two layers
    # per block: two chunks' all-reduces in the forward, dx's in the backward, and none by DTensor
    assert all(c.get("allreduce_") == 3 * blocks and "all_reduce" not in c for c in counts), counts


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("family,bias", [("llama", False), ("llama", True), ("phi3", True), ("falcon-h1", False),
                                         ("t5", False), ("sequential", True)])
def test_patched_models(group, family, bias, backend, dtype):
    """Models patched by mlpfuse.patch (blocks named like transformers' MLPs), then tensor_parallel."""
    counts = group.run(CASES, "patched_matches_single", family=family, bias=bias, backend=backend, dtype=dtype)
    # Two blocks: each one all-reduce forward and one backward. (Eager projections would all-reduce dx once per
    # column-parallel projection: 2 per gated block.)
    assert counts == [{"all_reduce": 4}] * WORLD


@pytest.mark.parametrize("family", ["llama", "phi3", "sequential"])
def test_patched_models_sequence_parallel(group, family):
    counts = group.run(CASES, "patched_matches_single", family=family, bias=True, backend="torch", dtype="float64",
                       sequence_dim=1)
    assert counts == [{"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}] * WORLD


def test_patched_blocks_without_a_plan(group):
    messages = group.run(CASES, "patched_refusals")[0]
    assert "bert" in messages and "one projection whose row-parallel partner lies outside it" in messages["bert"]
    assert "Conv1D projections" in messages["gpt2"]


def test_patched_one_projection_block_paired_by_hand(group):
    group.run(CASES, "bert_pair_matches_single")


def test_whole_model(group):
    counts = group.run(CASES, "model_matches_single")
    assert counts == [{"all_reduce": 6}] * WORLD  # 3 blocks, forward and backward


def test_refusals(group):
    messages = group.run(CASES, "refusals")[0]
    expected = {
        "hidden": "2 ranks do not divide the hidden size 7",
        "packed_hidden": "2 ranks do not divide the 5 gate (and up) rows",
        "packed_plain_shard": "PackedColwiseParallel",
        "partial_plan": "gate_proj.weight: a plain tensor among DTensor parameters",
        "twice": "already has DTensor parameters",
        "mesh_2d": "expected a 1-D mesh",
        "no_blocks": "no mlpfuse GatedMLP, PackedGatedMLP, MLP or patched MLP block",
        "row_activation": "weight: a row-parallel projection would apply gelu_tanh",
        "fsdp_child": "gate_proj: fully_shard was applied to the projection",
    }
    for key, text in expected.items():
        assert messages[key] is not None and text in messages[key], (key, messages[key])
        assert "\n" not in messages[key]


def test_refusals_without_a_group():
    from torch import nn

    from mlpfuse import InputError
    from mlpfuse.parallel import tensor_parallel

    with pytest.raises(InputError, match="device_mesh: expected a torch.distributed DeviceMesh, got str"):
        tensor_parallel(nn.Linear(2, 2), "cuda")
    with pytest.raises(InputError, match="module: expected an nn.Module, got int"):
        tensor_parallel(3, None)


def test_per_rank_traces_of_a_real_run(group, tmp_path):
    from mlpfuse.profiling.ranks import analyze_ranks

    paths = group.run(CASES, "profile_steps", folder=str(tmp_path))
    data = analyze_ranks(tmp_path).to_dict()
    assert data["world_size"] == WORLD and data["ranks_found"] == list(range(WORLD))
    assert [row["trace"] for row in data["per_rank"]] == paths
    for row in data["per_rank"]:
        assert row["steps"] == 3 and row["comm_kernels"] == 0  # gloo on CPUs: no GPU kernels to count
    assert data["skew"]["matched_by"] == "step name" and len(data["skew"]["steps"]) == 3


def test_the_group_waits_for_a_rank_still_working(group):
    """Waiting is on progress, not on a clock: a rank that answers after several of the group's polls is waited for."""
    assert group.run(CASES, "slow_rank", seconds=4 * _dist._POLL_S) == list(range(WORLD))


@pytest.mark.parametrize("how,message", [("raise", "ValueError: rank 1 gave up"),
                                         ("exit", "rank(s) exited without answering (exit codes {1: 3})")])
def test_a_failed_or_dead_rank_fails_the_case_and_the_group_starts_afresh(group, how, message):
    # rank 0 is left in a barrier: the case must fail on the other rank's traceback or exit, not wait out a clock
    with pytest.raises(AssertionError) as failed:
        group.run(CASES, "rank_fails", how=how)
    assert message in str(failed.value)
    assert group.run(CASES, "slow_rank", seconds=0.0) == list(range(WORLD))  # a fresh group runs the next case
