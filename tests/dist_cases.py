"""Cases that tests/test_parallel.py runs on every rank of a gloo group (see tests/_dist.py).

Each case builds the same block on every rank from one seed, keeps an untouched copy as the single-process oracle,
shards the block, runs it on the ranks' inputs and checks output and every gradient against the copy run on the
whole input in this process. Numbers go back to the test only where the test itself checks them.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mlpfuse import MLP, GatedMLP, InputError
from mlpfuse.modules import PackedGatedMLP
from mlpfuse.parallel import PackedColwiseParallel, tensor_parallel

DIM, HIDDEN = 16, 24
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _tol(dtype):
    return dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


def make(kind: str, bias: bool, dtype, backend: str, seed: int = 0, hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(seed)
    cls = {"gated": GatedMLP, "packed": PackedGatedMLP, "mlp": MLP}[kind]
    block = cls(DIM, hidden, activation="gelu_tanh", bias=bias, dtype=dtype, backend=backend)
    with torch.no_grad():  # nn.Linear's init leaves biases tiny; make them matter
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return block


def styles(kind: str) -> dict:
    """The plan written with PyTorch's own styles, as a user would write it without mlpfuse.parallel."""
    if kind == "gated":
        return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    if kind == "packed":
        return {"gate_up_proj": PackedColwiseParallel(), "down_proj": RowwiseParallel()}
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _grads(module: nn.Module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def _params(module: nn.Module) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}


class _KernelSpy:
    """Records the shapes the fused gated GEMM kernel is called with (the real kernel runs)."""

    def __init__(self):
        import mlpfuse.kernels.gated_gemm as kernels  # only where Triton is installed: the torch cases spy on nothing

        self.calls = []
        self._kernels = kernels
        self._real = kernels.gated_gemm

    def __enter__(self):
        real = self._real

        @functools.wraps(real)
        def spy(x, wg, wu, *args, **kwargs):
            self.calls.append((tuple(x.shape), tuple(wg.shape), tuple(wu.shape)))
            return real(x, wg, wu, *args, **kwargs)

        self._kernels.gated_gemm = spy
        return self

    def __exit__(self, *exc):
        self._kernels.gated_gemm = self._real


def _counts(mode: CommDebugMode) -> dict:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def tp_matches_single(rank, world, mesh, kind, bias, backend, dtype, via="helper", sequence_dim=None):
    """Tensor parallelism: output, dx and every parameter's gradient equal the single-process block's; the fused
    kernel ran on this rank's hidden slice; the collectives per block are those of eager TP under the same plan."""
    dtype = DTYPES[dtype]
    block = make(kind, bias, dtype, backend)
    single = copy.deepcopy(block)
    if via == "helper":
        tensor_parallel(block, mesh, sequence_dim=sequence_dim)
    else:
        parallelize_module(block, mesh, styles(kind))
    torch.manual_seed(1)
    x = torch.randn(2, 6, DIM, dtype=dtype)
    dy = torch.randn(2, 6, DIM, dtype=dtype)

    xs = x.clone().requires_grad_()
    ys = single(xs)
    (ys * dy).sum().backward()

    if sequence_dim is None:
        x_mine, dy_mine, ys_mine, dxs_mine = x, dy, ys, xs.grad
    else:
        pick = lambda t: t.chunk(world, dim=sequence_dim)[rank]  # noqa: E731
        x_mine, dy_mine, ys_mine, dxs_mine = pick(x), pick(dy), pick(ys), pick(xs.grad)
    xt = x_mine.clone().requires_grad_()
    spy = _KernelSpy() if backend == "triton" else contextlib.nullcontext()
    with spy, CommDebugMode() as fwd_comms:
        y = block(xt)
    with CommDebugMode() as bwd_comms:
        (y * dy_mine).sum().backward()
    assert type(y) is not DTensor, type(y)
    tol = _tol(dtype)
    torch.testing.assert_close(y, ys_mine.detach(), **tol)
    torch.testing.assert_close(xt.grad, dxs_mine, **tol)
    got, want = _grads(block), _grads(single)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    # Sharding kept every parameter's value and name: the full tensors are the single-process ones.
    for name, p in _params(block).items():
        torch.testing.assert_close(p, _params(single)[name], rtol=0, atol=0)
    if backend == "triton" and kind != "mlp":
        tokens = x.shape[0] * x.shape[1]
        # forward, and the backward's recompute if any: all on the local slice of hidden
        assert spy.calls and all(c == ((tokens, DIM), (HIDDEN // world, DIM), (HIDDEN // world, DIM))
                                 for c in spy.calls), spy.calls
    return {"forward": _counts(fwd_comms), "backward": _counts(bwd_comms)}


class _EagerGated(nn.Module):
    def __init__(self, block: GatedMLP):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (copy.deepcopy(block.gate_proj), copy.deepcopy(block.up_proj),
                                                        copy.deepcopy(block.down_proj))

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def eager_tp_comms(rank, world, mesh, bias, sequence_dim=None):
    """The collectives eager PyTorch issues for the same gated block under the same plan (nn.Linear children)."""
    from torch.distributed.tensor import Replicate, Shard

    eager = _EagerGated(make("gated", bias, torch.float64, "torch"))
    act = Replicate() if sequence_dim is None else Shard(sequence_dim)
    parallelize_module(eager, mesh, {"gate_proj": ColwiseParallel(input_layouts=act),
                                     "up_proj": ColwiseParallel(input_layouts=act),
                                     "down_proj": RowwiseParallel(output_layouts=act)})
    x = torch.randn(2, 6 if sequence_dim is None else 6 // world, DIM, dtype=torch.float64, requires_grad=True)
    with CommDebugMode() as fwd:
        y = eager(x)
    with CommDebugMode() as bwd:
        y.sum().backward()
    return {"forward": _counts(fwd), "backward": _counts(bwd)}


def fsdp_matches_single(rank, world, mesh, kind, bias, backend, dtype):
    """FSDP2: each rank runs its own batch through the block with gathered weights; the reduce-scattered gradients
    equal the single-process block's gradients of the mean of the ranks' losses."""
    from torch.distributed.fsdp import fully_shard

    dtype = DTYPES[dtype]
    block = make(kind, bias, dtype, backend)
    single = copy.deepcopy(block)
    fully_shard(block, mesh=mesh)
    torch.manual_seed(1)
    x = torch.randn(world, 5, DIM, dtype=dtype)
    dy = torch.randn(world, 5, DIM, dtype=dtype)

    xs = x.clone().requires_grad_()
    ys = single(xs)
    ((ys * dy).sum() / world).backward()  # FSDP2 averages the ranks' gradients

    xt = x[rank].clone().requires_grad_()
    spy = _KernelSpy() if backend == "triton" else contextlib.nullcontext()
    with spy, CommDebugMode() as comms:
        y = block(xt)
        (y * dy[rank]).sum().backward()
    tol = _tol(dtype)
    torch.testing.assert_close(y, ys[rank].detach(), **tol)
    torch.testing.assert_close(xt.grad, xs.grad[rank] * world, **tol)
    got, want = _grads(block), _grads(single)
    for name in want:
        assert isinstance(dict(block.named_parameters())[name], DTensor), name  # resharded after the step
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    if backend == "triton" and kind != "mlp":
        assert spy.calls and all(c[1] == (HIDDEN, DIM) for c in spy.calls), spy.calls  # unsharded weights
    return _counts(comms)


def model_matches_single(rank, world, mesh):
    """tensor_parallel on a model holding every kind of block between plain layers."""
    torch.manual_seed(0)
    blocks = [make(k, b, torch.float64, "torch", seed=i) for i, (k, b) in
              enumerate((("gated", False), ("packed", True), ("mlp", True)))]
    model = nn.Sequential(blocks[0], nn.LayerNorm(DIM, dtype=torch.float64), nn.Sequential(blocks[1], blocks[2]))
    single = copy.deepcopy(model)
    tensor_parallel(model, mesh)
    x = torch.randn(3, DIM, dtype=torch.float64)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    single(xs).square().sum().backward()
    with CommDebugMode() as comms:
        model(xt).square().sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(xt.grad, xs.grad, **tol)
    got, want = _grads(model), _grads(single)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    return _counts(comms)


def refusals(rank, world, mesh):
    """Bad plans and meshes: one InputError naming the cause each (returned for the test to check)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def message(fn):
        try:
            fn()
        except InputError as exc:
            return str(exc)
        return None

    out = {}
    x = torch.randn(4, DIM, dtype=torch.float64)
    out["hidden"] = message(lambda: tensor_parallel(make("gated", False, torch.float64, "torch", hidden=7), mesh))
    out["packed_hidden"] = message(
        lambda: parallelize_module(make("packed", False, torch.float64, "torch", hidden=5), mesh, styles("packed")))

    packed = make("packed", False, torch.float64, "torch")
    parallelize_module(packed, mesh, {"gate_up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    out["packed_plain_shard"] = message(lambda: packed(x))

    half = make("gated", False, torch.float64, "torch")
    parallelize_module(half, mesh, {"down_proj": RowwiseParallel()})
    out["partial_plan"] = message(lambda: half(x))

    twice = tensor_parallel(make("mlp", True, torch.float64, "torch"), mesh)
    out["twice"] = message(lambda: tensor_parallel(twice, mesh))

    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    out["mesh_2d"] = message(lambda: tensor_parallel(make("gated", False, torch.float64, "torch"), mesh2d))
    out["no_blocks"] = message(lambda: tensor_parallel(nn.Sequential(nn.Linear(4, 4)), mesh))

    row_act = make("mlp", True, torch.float64, "torch")
    parallelize_module(row_act, mesh, {"fc1": RowwiseParallel()})
    out["row_activation"] = message(lambda: row_act.fc1(x))

    child = make("gated", False, torch.float64, "torch")
    fully_shard(child.gate_proj, mesh=mesh)
    out["fsdp_child"] = message(lambda: child(x))
    return out


def profile_steps(rank, world, mesh, folder):
    """Three profiled training steps of a tensor-parallel block, one trace per rank, named without the rank: the
    trace's own distributedInfo must tell which rank wrote it."""
    import os

    from torch.profiler import ProfilerActivity, profile, schedule

    block = tensor_parallel(make("gated", True, torch.float32, "torch"), mesh)
    x = torch.randn(4, DIM, requires_grad=True)
    path = os.path.join(folder, f"trace-{os.getpid()}.json")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(5):
            block(x).sum().backward()
            prof.step()
    return path


def fsdp_tp_matches_single(rank, world, mesh, kind, bias):
    """FSDP2 over tensor parallelism (a 2-D mesh, here 1 × world: with 2 processes the data-parallel dimension has
    one rank): FSDP gathers each rank's tensor-parallel shards, the block runs on them, and the gradients equal
    the single-process block's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    block = make(kind, bias, torch.float64, "torch")
    single = copy.deepcopy(block)
    tensor_parallel(block, mesh2["tp"])
    fully_shard(block, mesh=mesh2["dp"])
    torch.manual_seed(1)
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = single(xs)
    ys.square().sum().backward()
    y = block(xt)
    y.square().sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(y, ys.detach(), **tol)
    torch.testing.assert_close(xt.grad, xs.grad, **tol)
    got, want = _grads(block), _grads(single)
    for name in want:
        param = dict(block.named_parameters())[name]
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, name
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
