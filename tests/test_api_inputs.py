"""The ops' argument checks on inputs the shape/dtype table in test_ops.py does not cover: missing tensors, sparse and
nested layouts, empty dimensions (which work, as in torch), and where those checks run (once per call)."""

import pytest
import torch
import torch.nn.functional as F

from mlpfuse import ops
from mlpfuse.errors import InputError
from mlpfuse.ops import _checks

F64 = torch.float64


def _gated(m=4, d=6, h=8, dtype=F64, bias=False):
    g = torch.Generator().manual_seed(m * 100 + d * 10 + h)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return [r(m, d), r(h, d), r(h, d), r(d, h)] + ([r(h), r(h), r(d)] if bias else [None, None, None])


def _bad_calls():
    x, wg, wu, wd, bg, bu, bd = _gated(bias=True)
    nested = torch.nested.nested_tensor([torch.randn(2, 6, dtype=F64), torch.randn(3, 6, dtype=F64)])
    return [
        ("x", lambda: ops.gated_mlp(None, wg, wu, wd)),
        ("gate_weight", lambda: ops.gated_mlp(x, None, wu, wd)),
        ("down_weight", lambda: ops.gated_mlp(x, wg, wu, None)),
        ("x", lambda: ops.linear_act(None, wg)),
        ("weight", lambda: ops.linear_act(x, None)),
        ("x", lambda: ops.gated_mlp(x.to_sparse(), wg, wu, wd)),
        ("x", lambda: ops.gated_mlp(nested, wg, wu, wd)),
        ("gate_weight", lambda: ops.gated_mlp(x, wg.to_sparse(), wu, wd)),
        ("up_weight", lambda: ops.gated_mlp(x, wg, wu.to_sparse_csr(), wd)),
        ("down_bias", lambda: ops.gated_mlp(x, wg, wu, wd, down_bias=bd.to_sparse())),
        ("x", lambda: ops.linear_act(x.to_sparse_csr(), wg)),
        ("x", lambda: ops.linear_act(nested, wg)),
        ("weight", lambda: ops.linear_act(x, wg.to_sparse())),
        ("bias", lambda: ops.linear_act(x, wg, bg.to_sparse())),
        ("bias", lambda: ops.linear_act(x, wg, "bias")),
        # Through the registered op too (torch.compile and export see these).
        ("x", lambda: torch.ops.mlpfuse.gated_mlp(x.to_sparse(), wg, wu, wd, None, None, None, "silu", "torch")),
        ("weight", lambda: torch.ops.mlpfuse.linear_act(x, wg.to_sparse(), None, "relu", "torch")),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_names_the_argument(case):
    argument, call = _bad_calls()[case]
    with pytest.raises(InputError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{argument}: ") and "\n" not in message, message


@pytest.mark.parametrize("m, d, h", [(0, 6, 8), (4, 0, 8), (4, 6, 0), (0, 0, 0)])
def test_empty_dimensions_give_torchs_answer(m, d, h):
    """Zero tokens, features or hidden units: the result torch's own layers give (empty, or exact zeros)."""
    x, wg, wu, wd, *_ = _gated(m, d, h)
    bg, bu, bd = torch.randn(h, dtype=F64), torch.randn(h, dtype=F64), torch.randn(d, dtype=F64)
    y = ops.gated_mlp(x, wg, wu, wd, "silu", bg, bu, bd, backend="torch")
    want = F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)
    assert y.shape == want.shape == (m, d)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    z = ops.linear_act(x, wg, bg, "gelu", backend="torch")
    torch.testing.assert_close(z, F.gelu(F.linear(x, wg, bg)), rtol=0, atol=1e-12)
    assert z.shape == (m, h)


def test_each_call_checks_its_arguments_once(monkeypatch):
    """Inference and training through the public functions run the argument check once per call."""
    counts = {"gated": 0, "linear": 0}
    real_gated, real_linear = _checks.gated_mlp_args, _checks.linear_act_args

    def gated(*args):
        counts["gated"] += 1
        return real_gated(*args)

    def linear(*args):
        counts["linear"] += 1
        return real_linear(*args)

    monkeypatch.setattr(_checks, "gated_mlp_args", gated)
    monkeypatch.setattr(_checks, "linear_act_args", linear)
    x, wg, wu, wd, *_ = _gated()
    for grad in (False, True):
        leaves = [t.clone().requires_grad_(grad) for t in (x, wg, wu, wd)]
        counts.update(gated=0, linear=0)
        ops.gated_mlp(*leaves, "silu", backend="torch")
        ops.linear_act(leaves[0], leaves[1], None, "relu", backend="torch")
        assert counts == {"gated": 1, "linear": 1}, (grad, counts)
