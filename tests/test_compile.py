"""Compiler citizenship: the ops are torch.library custom ops, so torch.compile(fullgraph=True), torch.export and
torch.jit.script all see them as single nodes and agree with eager."""

import pytest
import torch

from mlpfuse import FusedLinear, GatedMLP, MLP, kernels
from mlpfuse.modules import PackedGatedMLP

MODULES = {
    "gated": lambda: GatedMLP(16, 24, activation="silu", bias=True, backend="torch"),
    "packed": lambda: PackedGatedMLP(16, 24, activation="gelu", backend="torch"),
    "fused_linear": lambda: FusedLinear(16, 24, activation="gelu_tanh", backend="torch"),
    "mlp": lambda: MLP(16, 24, activation="relu2", backend="torch"),
}


def fresh(name):
    torch.manual_seed(0)
    return MODULES[name]()


def eager_reference(module, x):
    x = x.clone().requires_grad_()
    y = module(x)
    y.sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach(), grads


def assert_matches_eager(module, run, x):
    y_ref, g_ref = eager_reference(module, x)
    xx = x.clone().requires_grad_()
    y = run(xx)
    y.sum().backward()
    torch.testing.assert_close(y, y_ref)
    for a, b in zip([xx.grad] + [p.grad for p in module.parameters()], g_ref):
        torch.testing.assert_close(a, b)
    module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(MODULES))
def test_compile_fullgraph_aot_eager(name):
    torch._dynamo.reset()
    m = fresh(name)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    assert_matches_eager(m, compiled, torch.randn(3, 5, 16))
    with torch.no_grad():
        torch.testing.assert_close(compiled(torch.randn(7, 16) * 0 + 1), m(torch.ones(7, 16)))


@pytest.mark.parametrize("name", ["gated", "mlp"])
def test_compile_fullgraph_inductor(name):
    torch._dynamo.reset()
    m = fresh(name)
    compiled = torch.compile(m, fullgraph=True)
    assert_matches_eager(m, compiled, torch.randn(2, 9, 16))


def test_compiled_graph_is_one_custom_op():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m = fresh("gated")
    counter = CompileCounterWithBackend("eager")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return counter(gm, example_inputs)

    with torch.no_grad():
        torch.compile(m, fullgraph=True, backend=backend)(torch.randn(4, 16))
    assert counter.frame_count == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets in ([torch.ops.mlpfuse.gated_mlp], [torch.ops.mlpfuse.gated_mlp.default])


@pytest.mark.parametrize("name", list(MODULES))
def test_export(name):
    m = fresh(name)
    x = torch.randn(4, 16)
    with torch.no_grad():
        ep = torch.export.export(m, (x,))
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert any(o.startswith("mlpfuse.") for o in ops), ops
        torch.testing.assert_close(ep.module()(x), m(x))
    # Exported under autograd, the graph carries the training op and still runs.
    ep = torch.export.export(m, (x,))
    torch.testing.assert_close(ep.module()(x), m(x))


def test_export_with_dynamic_batch():
    m = fresh("gated")
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        ep = torch.export.export(m, (torch.randn(4, 16),), dynamic_shapes={"x": {0: batch}})
        x = torch.randn(11, 16)
        torch.testing.assert_close(ep.module()(x), m(x))


@pytest.mark.parametrize("name", list(MODULES))
def test_torchscript(name):
    m = fresh(name)
    scripted = torch.jit.script(m)
    assert_matches_eager(m, scripted, torch.randn(2, 3, 16))
    with torch.no_grad():
        x = torch.randn(5, 16)
        torch.testing.assert_close(scripted(x), m(x))


@pytest.mark.parametrize("name", ["gated", "fused_linear"])
def test_jit_trace_records_the_op(name):
    m = fresh(name)
    x = torch.randn(3, 16)
    with torch.no_grad():
        traced = torch.jit.trace(m, (x,))
        assert "mlpfuse::" in str(traced.graph)
        x2 = torch.randn(7, 16)
        torch.testing.assert_close(traced(x2), m(x2))


def test_opcheck_of_every_op():
    from torch.library import opcheck

    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    wg, wu = (torch.randn(12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    wd = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    opcheck(torch.ops.mlpfuse.gated_mlp.default, (x, wg, wu, wd, b, None, None, "gelu_tanh", "torch"))
    opcheck(torch.ops.mlpfuse.gated_mlp_train.default, (x, wg, wu, wd, None, b, None, "silu", "torch", True))
    opcheck(torch.ops.mlpfuse.gated_mlp_train.default, (x, wg, wu, wd, None, None, None, "relu", "torch", False))
    opcheck(torch.ops.mlpfuse.linear_act.default, (x, wg, b, "gelu", "torch"))
    opcheck(torch.ops.mlpfuse.linear_act_train.default, (x, wg, b, "relu2", "torch", True))
    dy = torch.randn(5, 8, dtype=torch.float64)
    x, wg, wu, wd = (t.detach() for t in (x, wg, wu, wd))  # the backward ops have no double backward
    _, h, g, u = torch.ops.mlpfuse.gated_mlp_train(x, wg, wu, wd, None, None, None, "silu", "torch", True)
    opcheck(
        torch.ops.mlpfuse.gated_mlp_backward.default,
        (dy, x, wg, wu, wd, None, None, g, u, h, "silu", "torch", False, True, True, False, False, True),
    )
    opcheck(
        torch.ops.mlpfuse.linear_act_backward.default,
        (torch.randn(5, 12, dtype=torch.float64), x, wg, b.detach(), x.new_empty(0), "gelu", True, True, True, True),
    )


@pytest.mark.skipif(not kernels.available(), reason="Triton kernels cannot run here")
def test_compile_with_the_triton_backend():
    torch._dynamo.reset()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
    m = GatedMLP(16, 24, activation="gelu_tanh", backend="triton", device=device)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 16, device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y_ref, g_ref = eager_reference(m, x)
        xx = x.clone().requires_grad_()
        y = compiled(xx)
        y.sum().backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xx.grad, g_ref[0], rtol=1e-5, atol=1e-5)



def _on_fake_cuda(module, dim):
    """`module` with its Linear weights replaced by fake CUDA tensors, and a fake CUDA input [3, dim]: Dynamo then
    traces the forward down the branches a GPU takes (the call plan's `x.is_cuda` holds) on a machine
    without one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for lin in (m for m in module.modules() if isinstance(m, torch.nn.Linear)):
            lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape, device="cuda"))
        return torch.empty(3, dim, device="cuda")


def test_gated_module_traces_fullgraph_on_cuda_inputs_under_no_grad():
    # Under no_grad a CUDA input reaches the module's call plan, which once asked torch._C._is_tracing() first:
    # Dynamo cannot trace that call ("torch.* op returned non-Tensor"), so a model holding the module failed to
    # compile. (Compiling with grad is tested on CPU models in test_patching_models.)
    m = GatedMLP(16, 24, activation="silu", device="meta")
    x = _on_fake_cuda(m, 16)
    with torch.no_grad():
        ep = torch.export.export(m, (x,), strict=True)
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert ops == ["mlpfuse.gated_mlp.default"], ops
