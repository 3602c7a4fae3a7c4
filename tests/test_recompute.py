"""`recompute=True`: training keeps only the block's input, and the backward recomputes the pre-activations.

Oracle: the same module with recompute off (gradients), autograd's own record of what is saved (saved-tensor hooks,
the custom Function's context), and the op a compiled graph records."""

import copy

import pytest
import torch

import mlpfuse
import numerics
from conftest import HAS_TRITON
from mlpfuse.errors import InputError

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _pair(backend, packed=False):
    torch.manual_seed(0)
    cls = mlpfuse.modules.PackedGatedMLP if packed else mlpfuse.GatedMLP
    base = cls(24, 40, "silu", bias=True, backend=backend)
    lazy = copy.deepcopy(base)
    lazy.recompute = True
    return base, lazy


def _grads(module, x):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    params = list(module.parameters())
    return list(torch.autograd.grad(y.square().sum(), [x, *params])), y


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("packed", [False, True])
def test_recompute_gives_the_same_gradients(backend, packed):
    base, lazy = _pair(backend, packed)
    x = torch.randn(2, 70, 24)  # past the decode sizes: the gated (or torch) training path
    want, y0 = _grads(base, x)
    got, y1 = _grads(lazy, x)
    assert torch.allclose(y1, y0, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5)


def test_eager_training_keeps_no_preactivations_with_recompute():
    base, lazy = _pair("triton")
    x = torch.randn(70, 24, requires_grad=True)
    assert [tuple(t.shape) for t in base(x).grad_fn.held] == [(70, 40), (70, 40)]  # g and u kept
    assert lazy(x).grad_fn.held is None  # nothing but x (and the weights) kept


def _saved_bytes(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def test_torch_path_saves_less_with_recompute():
    base, lazy = _pair("torch")
    x = torch.randn(70, 24, requires_grad=True)
    params = sum(p.numel() * p.element_size() for p in base.parameters())
    kept, lean = _saved_bytes(lambda: base(x)), _saved_bytes(lambda: lazy(x))
    assert lean <= x.numel() * 4 + params < kept


def test_compiled_training_records_the_train_op_without_saving():
    base, lazy = _pair("triton")
    calls = []

    def backend(gm, example_inputs):
        calls.extend(n.args for n in gm.graph.nodes if n.op == "call_function"
                     and "gated_mlp_train" in str(n.target))
        return gm

    for module, save in ((base, True), (lazy, False)):
        calls.clear()
        torch._dynamo.reset()
        compiled = torch.compile(module, backend=backend, fullgraph=True)
        x = torch.randn(70, 24)
        got, _ = _grads(compiled, x)
        want, _ = _grads(module, x)
        assert len(calls) == 1 and calls[0][-1] is save
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-5)


def test_patch_recompute_reaches_every_block():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    mlpfuse.patch(model, backend="triton", recompute=True)
    assert all(layer.mlp.fused_recompute for layer in model.model.layers)
    ids = torch.randint(0, 64, (2, 70))
    numerics.assert_same_grads(model, ref, ids, ("model.layers.0.mlp.up_proj.weight",
                                                 "model.layers.1.post_attention_layernorm.weight"))


def test_recompute_must_be_a_bool():
    with pytest.raises(InputError, match="recompute: expected True or False, got 'yes'"):
        mlpfuse.GatedMLP(8, 16, recompute="yes")
    with pytest.raises(InputError, match="recompute: expected True or False"):
        mlpfuse.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)), recompute=1)
    with pytest.raises(InputError, match="fuse_norms: expected True or False, got 'no'"):
        mlpfuse.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)), fuse_norms="no")
    with pytest.raises(InputError, match="recompute: expected True or False"):
        mlpfuse.ops.gated_mlp(torch.randn(2, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16),
                              recompute=None)
