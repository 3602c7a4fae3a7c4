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


def tp_matches_single(rank, world, mesh, kind, bias, backend, dtype, via="helper", sequence_dim=None, tokens=(2, 6)):
    """Tensor parallelism: output, dx and every parameter's gradient equal the single-process block's; the fused
    kernel ran on this rank's hidden slice; returns the collectives of the forward and of the backward."""
    dtype = DTYPES[dtype]
    block = make(kind, bias, dtype, backend)
    single = copy.deepcopy(block)
    if via == "helper":
        tensor_parallel(block, mesh, sequence_dim=sequence_dim)
    else:
        parallelize_module(block, mesh, styles(kind))
    torch.manual_seed(1)
    x = torch.randn(*tokens, DIM, dtype=dtype)
    dy = torch.randn(*tokens, DIM, dtype=dtype)

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


def tp_backward_twice(rank, world, mesh, backend, dtype, tokens):
    """A second backward through the same graph (retain_graph=True): the first consumed the block's saved g and u
    (their buffers became dg and du), so the second recomputes them; both give the single process's gradients."""
    dtype = DTYPES[dtype]
    block = make("gated", True, dtype, backend)
    single = copy.deepcopy(block)
    tensor_parallel(block, mesh)
    torch.manual_seed(1)
    x = torch.randn(*tokens, DIM, dtype=dtype)
    dy = torch.randn(*tokens, DIM, dtype=dtype)
    xs = x.clone().requires_grad_()
    (single(xs) * dy).sum().backward()
    xt = x.clone().requires_grad_()
    y = block(xt)
    tol = _tol(dtype)
    for _ in range(2):
        xt.grad = None
        for p in block.parameters():
            p.grad = None
        (y * dy).sum().backward(retain_graph=True)
        torch.testing.assert_close(xt.grad, xs.grad, **tol)
        got, want = _grads(block), _grads(single)
        for name in want:
            torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


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


def fsdp_fp8_train_matches_single(rank, world, mesh, bias, backend):
    """FSDP2 over GatedMLP(precision="fp8-train"): each rank's FP8 step on its own batch with the gathered masters;
    the reduce-scattered gradients equal the mean of the single-process block's gradients on each rank's batch (FP8
    quantizes per batch — the weight gradients' token groups — so that is the oracle, not one step on both)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    dim, hidden = 128, 256  # whole FP8 blocks
    block = GatedMLP(dim, hidden, "silu", bias=bias, precision="fp8-train", backend=backend)
    single = copy.deepcopy(block)
    fully_shard(block, mesh=mesh)
    torch.manual_seed(1)
    x = torch.randn(world, 40, dim)
    dy = torch.randn(world, 40, dim)
    want_y, want = None, {}
    for r in range(world):
        single.zero_grad(set_to_none=True)
        xs = x[r].clone().requires_grad_()
        ys = single(xs)
        (ys * dy[r]).sum().backward()
        if r == rank:
            want_y, want_dx = ys.detach(), xs.grad
        for name, g in _grads(single).items():
            want[name] = want.get(name, 0) + g / world  # FSDP2 averages the ranks' gradients
    xt = x[rank].clone().requires_grad_()
    y = block(xt)
    (y * dy[rank]).sum().backward()
    assert torch.equal(y, want_y)  # the same FP8 forward on the gathered masters
    torch.testing.assert_close(xt.grad, want_dx, rtol=0, atol=0)
    got = _grads(block)
    for name in want:
        assert isinstance(dict(block.named_parameters())[name], DTensor), name
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


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


def fsdp_tp_matches_single(rank, world, mesh, kind, bias, tokens=(2, 5), dp=1):
    """FSDP2 over tensor parallelism on a 2-D mesh dp × (world / dp) (with 2 processes 1 × 2: the data-parallel
    dimension has one rank; with 4, 2 × 2): FSDP gathers each rank's tensor-parallel shards, the block runs on them,
    and the gradients equal the single-process block's. Every rank sees the same input, so FSDP's average of the
    data-parallel ranks' gradients is the single process's gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh2 = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    block = make(kind, bias, torch.float64, "torch")
    single = copy.deepcopy(block)
    tensor_parallel(block, mesh2["tp"])
    fully_shard(block, mesh=mesh2["dp"])
    torch.manual_seed(1)
    x = torch.randn(*tokens, DIM, dtype=torch.float64)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys = single(xs)
    ys.square().sum().backward()
    with CommDebugMode() as comms:
        y = block(xt)
        y.square().sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(y, ys.detach(), **tol)
    torch.testing.assert_close(xt.grad, xs.grad, **tol)
    params, want_params = _params(block), _params(single)
    for name in want_params:  # the gathered parameters are the single block's, in its layout
        torch.testing.assert_close(params[name], want_params[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    got, want = _grads(block), _grads(single)
    for name in want:
        param = dict(block.named_parameters())[name]
        assert isinstance(param, DTensor) and param.device_mesh.ndim == 2, name
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    return _counts(comms)


def packed_state_dict_on_2d_mesh(rank, world, mesh, dp):
    """A packed block under FSDP2 over tensor parallelism: its state_dict refused with one InputError when the
    data-parallel dimension has more than one rank (the global view PyTorch would save is permuted), saved as the
    single block's otherwise. Returns the refusal's message or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh2 = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    block = make("packed", True, torch.float64, "torch")
    single = copy.deepcopy(block)
    tensor_parallel(block, mesh2["tp"])
    fully_shard(block, mesh=mesh2["dp"])
    try:
        saved = block.state_dict()
    except InputError as exc:
        return str(exc)
    for name, want in single.state_dict().items():
        got = saved[name].full_tensor() if isinstance(saved[name], DTensor) else saved[name]
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return None


# ---------------------------------------------------------------- models patched with mlpfuse.patch


class LlamaMLP(nn.Module):  # named like transformers' classes: mlpfuse.patch's table matches class names
    def __init__(self, bias):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=bias)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=bias)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Phi3MLP(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 2 * HIDDEN, bias=bias)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=bias)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class FalconH1MLP(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.act_fn = nn.SiLU()
        self.gate_multiplier, self.down_multiplier = 0.75, 1.5

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x) * self.gate_multiplier)) \
            * self.down_multiplier


class T5DenseActDense(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.wi = nn.Linear(DIM, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, DIM, bias=False)
        self.dropout = nn.Dropout(0.1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.wo(self.dropout(self.act(self.wi(x))))


class BertIntermediate(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.dense = nn.Linear(DIM, HIDDEN)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x):
        return self.intermediate_act_fn(self.dense(x))


class Conv1D(nn.Module):  # transformers' GPT-2 projection: weight [in, out]
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx ** 0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class GPT2MLP(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(HIDDEN, DIM), Conv1D(DIM, HIDDEN)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


def _sequential(bias):
    return nn.Sequential(nn.Linear(DIM, HIDDEN, bias=bias), nn.GELU(approximate="tanh"), nn.Linear(HIDDEN, DIM, bias=bias))


FAMILIES = {"llama": LlamaMLP, "phi3": Phi3MLP, "falcon-h1": FalconH1MLP, "t5": T5DenseActDense,
            "sequential": _sequential, "bert": BertIntermediate, "gpt2": GPT2MLP}


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def patched_model(family: str, bias: bool, dtype, backend: str):
    """(patched model, the same model unpatched): two layers of one family's MLP, patched by mlpfuse.patch."""
    import mlpfuse

    torch.manual_seed(0)
    model = nn.Sequential(Layer(FAMILIES[family](bias)), Layer(FAMILIES[family](bias))).to(dtype).eval()
    single = copy.deepcopy(model)
    report = mlpfuse.patch(model, backend=backend)
    assert len(report.swapped) == 2, report
    return model, single


class _SpyOps:
    """Records the weight shapes the sharded forwards hand to the fused ops (the real ops run)."""

    def __init__(self):
        import mlpfuse.ops.sharded as sharded

        self.sharded, self.calls = sharded, []

    def __enter__(self):
        overlap = self.sharded.reduce_overlap
        self.real = (self.sharded.gated_mlp_call, self.sharded.linear_act_call, overlap.gated)
        real_gated, real_linear, real_overlapped = self.real

        def gated(x, wg, *args):
            self.calls.append(("gated", tuple(wg.shape)))
            return real_gated(x, wg, *args)

        def overlapped(x, wg, *args):  # the block that all-reduces its own output (from 2048 tokens)
            self.calls.append(("gated", tuple(wg.shape)))
            return real_overlapped(x, wg, *args)

        def linear(x, w, *args):
            self.calls.append(("linear", tuple(w.shape)))
            return real_linear(x, w, *args)

        self.sharded.gated_mlp_call, self.sharded.linear_act_call, overlap.gated = gated, linear, overlapped
        return self

    def __exit__(self, *exc):
        self.sharded.gated_mlp_call, self.sharded.linear_act_call, self.sharded.reduce_overlap.gated = self.real


def patched_matches_single(rank, world, mesh, family, bias, backend, dtype, sequence_dim=None, tokens=(2, 6)):
    """A model patched by mlpfuse.patch, then tensor_parallel: output, dx and gradients equal the unpatched model's
    on one process, and each block ran the fused op on its local shards."""
    dtype = DTYPES[dtype]
    model, single = patched_model(family, bias, dtype, backend)
    tensor_parallel(model, mesh, sequence_dim=sequence_dim)
    torch.manual_seed(1)
    x = torch.randn(*tokens, DIM, dtype=dtype)
    xs = x.clone().requires_grad_()
    ys = single(xs)
    ys.square().sum().backward()
    pick = (lambda t: t) if sequence_dim is None else (lambda t: t.chunk(world, dim=sequence_dim)[rank])
    xt = pick(x).clone().requires_grad_()
    with _SpyOps() as spy, CommDebugMode() as comms:
        y = model(xt)
        y.square().sum().backward()
    tol = _tol(dtype)
    torch.testing.assert_close(y, pick(ys).detach(), **tol)
    torch.testing.assert_close(xt.grad, pick(xs.grad), **tol)
    got, want = _grads(model), _grads(single)
    assert got.keys() == want.keys()
    for name, param in model.named_parameters():
        if sequence_dim is not None and not isinstance(param, DTensor):
            # The norms saw this rank's tokens only: their gradients add up over ranks (PyTorch's SequenceParallel
            # style would do this sum for them).
            torch.distributed.all_reduce(got[name])
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    kind = "gated" if family in ("llama", "phi3", "falcon-h1") else "linear"
    local = (HIDDEN // world, DIM)
    assert spy.calls == [(kind, local)] * 2, spy.calls  # both layers, fused, on this rank's rows
    return _counts(comms)


def patched_refusals(rank, world, mesh):
    out = {}
    for family in ("bert", "gpt2"):
        model, _ = patched_model(family, True, torch.float64, "torch")
        try:
            tensor_parallel(model, mesh)
            out[family] = None
        except InputError as exc:
            out[family] = str(exc)
    return out


class BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.intermediate = BertIntermediate(True)
        self.output_dense = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.output_dense(self.intermediate(x))


def bert_pair_matches_single(rank, world, mesh):
    """BERT's intermediate block (one projection) patched, then paired by hand with the projection after it:
    ColwiseParallel on its dense, RowwiseParallel on the next one."""
    import mlpfuse

    torch.manual_seed(0)
    model = nn.Sequential(BertLayer(), BertLayer()).double()
    single = copy.deepcopy(model)
    assert len(mlpfuse.patch(model, backend="torch").swapped) == 2
    plan = {}
    for i in range(2):
        plan[f"{i}.intermediate.dense"] = ColwiseParallel()
        plan[f"{i}.output_dense"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    x = torch.randn(3, DIM, dtype=torch.float64)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    single(xs).square().sum().backward()
    with _SpyOps() as spy:
        model(xt).square().sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(xt.grad, xs.grad, **tol)
    got, want = _grads(model), _grads(single)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")
    assert spy.calls == [("linear", (HIDDEN // world, DIM))] * 2, spy.calls


# The group's own behaviour (tests/_dist.py): a slow rank, a failing one, one that dies.

def slow_rank(rank, world, mesh, seconds: float):
    """Rank 1 answers after `seconds` (several of the group's polls): a rank still working is waited for."""
    import time

    if rank == 1:
        time.sleep(seconds)
    return rank


def rank_fails(rank, world, mesh, how: str):
    """Rank 1 raises (how="raise") or exits on the spot (how="exit") while rank 0 waits for it in a barrier."""
    import os

    import torch.distributed as dist

    if rank == 1:
        if how == "exit":
            os._exit(3)
        raise ValueError("rank 1 gave up")
    dist.barrier()
    return rank
