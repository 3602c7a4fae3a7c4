"""Compiled inference takes eager inference's path and kernels: under torch.compile(fullgraph=True) with no_grad or
inference_mode, a module (and a patched model) computes bit for bit what the same call computes eagerly.

A model's Parameters require grad under no_grad too; only the entry of a call, where grad mode is visible, can tell
that no gradient is needed (ops.gated_mlp.gated_mlp_call). The paths each call took are read from the one function
that chooses them (dispatch.gated_mlp_path); the outputs are compared with torch.equal. On CUDA the one-launch
decode kernel sums its partials with fp32 atomics, whose order varies from run to run (eager against eager too), so
the comparisons there run under torch.use_deterministic_algorithms, which selects the decode kernels' fixed-order
reduction.
"""


import pytest
import torch

import mlpfuse
from mlpfuse import kernels
from mlpfuse.modules import PackedGatedMLP
from mlpfuse.ops import dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIM, HIDDEN = 32, 48
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(autouse=True)
def bitwise():
    if DEVICE != "cuda":
        yield
        return
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn_only: cuBLAS asks for a workspace setting
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


@pytest.fixture
def paths(monkeypatch):
    """Every path dispatch.gated_mlp_path returns, in call order."""
    seen = []
    choose = dispatch.gated_mlp_path

    def recording(backend, x, hidden, grad):
        path = choose(backend, x, hidden, grad)
        seen.append((path, grad))
        return path

    monkeypatch.setattr(dispatch, "gated_mlp_path", recording)
    return seen


def _backends():
    return ["torch"] + (["triton"] if kernels.available() else [])


def _rows():
    """A decode-sized and a GEMM-sized call (past every decode path)."""
    return [1, dispatch.decode_max_m() + 5] if kernels.available() else [1, 40]


def _module(kind, backend, bias):
    torch.manual_seed(0)
    if kind == "packed":
        return PackedGatedMLP(DIM, HIDDEN, activation="gelu_tanh", bias=bias, device=DEVICE, backend=backend)
    return mlpfuse.GatedMLP(DIM, HIDDEN, activation="silu", bias=bias, device=DEVICE, backend=backend)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["gated", "packed"])
def test_compiled_inference_is_eager_inference_bit_for_bit(kind, backend, mode, paths):
    torch._dynamo.reset()
    m = _module(kind, backend, bias=kind == "gated")
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for rows in _rows():
        x = torch.randn(rows, DIM, device=DEVICE)
        with MODES[mode]():
            paths.clear()
            want = m(x)
            eager_paths = list(paths)
            paths.clear()
            got = compiled(x)
            compiled_paths = [p for p in paths]
        assert eager_paths and all(not grad for _, grad in eager_paths), eager_paths
        # Compilation may trace more than one call; every one of them chose eager's path, for inference.
        assert compiled_paths and set(compiled_paths) == set(eager_paths), (eager_paths, compiled_paths)
        assert torch.equal(got, want), (rows, (got - want).abs().max().item())
        if backend == "triton" and rows == 1 and dispatch.decode_max_m() > 0:
            assert eager_paths[0][0] == dispatch.DECODE


@pytest.mark.parametrize("backend", _backends())
def test_inductor_compiled_inference_is_eager_inference(backend, paths):
    torch._dynamo.reset()
    m = _module("gated", backend, bias=True)
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(2, 3, DIM, device=DEVICE)
    with torch.no_grad():
        want = m(x)
        got = compiled(x)
    assert torch.equal(got, want)
    assert {grad for _, grad in paths} == {False}


def test_compiled_training_still_takes_the_training_op(paths):
    torch._dynamo.reset()
    m = _module("gated", "torch", bias=False)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, DIM, device=DEVICE, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    assert x.grad is not None and m.gate_proj.weight.grad is not None
    assert paths and all(grad for _, grad in paths), paths


def test_compiled_graph_under_no_grad_records_the_inference_op():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    m = _module("gated", "torch", bias=False)
    with torch.no_grad():
        torch.compile(m, fullgraph=True, backend=backend)(torch.randn(3, DIM, device=DEVICE))
    assert [s.removesuffix(".default") for s in seen] == ["mlpfuse.gated_mlp"], seen
    seen.clear()
    torch._dynamo.reset()
    torch.compile(m, fullgraph=True, backend=backend)(torch.randn(3, DIM, device=DEVICE))
    assert [s.removesuffix(".default") for s in seen[:1]] == ["mlpfuse.gated_mlp_train"], seen


def test_compiled_patched_model_matches_eager_patched_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    backend = "triton" if kernels.available() else "torch"
    report = mlpfuse.patch(model, backend=backend)
    assert len(report.swapped) == 2
    ids = torch.randint(0, 64, (1, 5), device=DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = model(ids).logits
        got = compiled(ids).logits
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # the model's own ops (attention, norms) may take other CUDA kernels once compiled; the blocks do not
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_foreign_weights_take_the_module_math_without_a_graph_break():
    """A weight the kernels cannot read (a wrapper subclass, as quantized weights are) runs nn.Linear's math,
    eagerly and compiled with fullgraph (no break, no error)."""
    from torch.testing._internal.two_tensor import TwoTensor

    m = _module("gated", "triton" if kernels.available() else "torch", bias=False)
    x = torch.randn(3, DIM, device=DEVICE)
    f = torch.nn.functional
    with torch.no_grad():
        want = f.linear(f.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T), m.down_proj.weight)
        for lin in (m.gate_proj, m.up_proj, m.down_proj):
            w = lin.weight.detach()
            lin.weight = torch.nn.Parameter(TwoTensor(w, w.clone()), requires_grad=False)
        eager = m(x)
        assert isinstance(eager, TwoTensor)
        torch.testing.assert_close(eager.a, want)
        torch._dynamo.reset()
        got = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(got.a, want)
        torch.testing.assert_close(got.b, want)


def test_an_unavailable_backend_named_explicitly_is_one_error_also_compiled():
    from mlpfuse import csrc
    from mlpfuse.errors import InputError

    if csrc.environment_problem() is None:
        pytest.skip("the CUDA backend can be built here")
    m = mlpfuse.GatedMLP(DIM, HIDDEN, backend="cuda", device=DEVICE)
    x = torch.randn(2, DIM, device=DEVICE)
    torch._dynamo.reset()
    for call in (m, torch.compile(m, fullgraph=True, backend="aot_eager")):
        with torch.no_grad(), pytest.raises(InputError, match=r"^backend: 'cuda' "):
            call(x)
