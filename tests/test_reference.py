"""mlpfuse.reference (the torch backend's math) against autograd of the plain, unfused PyTorch MLP in float64."""

import pytest
import torch
import torch.nn.functional as F

from mlpfuse import activations, reference
from oracle import PLAIN

ACTS = ["identity", *activations.NAMES]



def _params(m, d, h, bias, seed):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    ps = [r(m, d), r(h, d) / d**0.5, r(h, d) / d**0.5, r(d, h) / h**0.5]
    ps += [r(h), r(h), r(d)] if bias else [None, None, None]
    return ps


def _plain_gated(act, x, wg, wu, wd, bg, bu, bd):
    return F.linear(PLAIN[act](F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_forward_and_backward_match_autograd(act, bias):
    m, d, h = 7, 5, 11
    ps = _params(m, d, h, bias, seed=ACTS.index(act) * 2 + bias)
    leaves = [p.clone().requires_grad_() if p is not None else None for p in ps]
    y_ref = _plain_gated(act, *leaves)
    dy = torch.randn(m, d, dtype=torch.float64)
    y_ref.backward(dy)

    y, h, g, u = reference.gated_mlp_forward(*ps, act, save_preact=True)
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-12, atol=1e-12)
    grads = reference.gated_mlp_backward(dy, ps[0], ps[1], ps[2], ps[3], g, u, act, bias_grads=(bias,) * 3)
    for name, got, leaf in zip(grads._fields, grads, leaves):
        if leaf is None:
            assert got is None, name
        else:
            torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_gated_backward_skips_what_is_not_asked_for():
    ps = _params(4, 3, 6, True, seed=1)
    _, _, g, u = reference.gated_mlp_forward(*ps, "silu", save_preact=True)
    grads = reference.gated_mlp_backward(torch.ones(4, 3, dtype=torch.float64), *ps[:4], g, u, "silu",
                                         need_dx=False, need_dw=False)
    assert all(t is None for t in grads)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_act_matches_autograd(act, bias):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 9, generator=gen, dtype=torch.float64), torch.randn(4, 9, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64) if bias else None
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    bl = b.clone().requires_grad_() if bias else None
    y_ref = PLAIN[act](F.linear(xl, wl, bl))
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y, z = reference.linear_act_forward(x, w, b, act, save_preact=True)
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-12, atol=1e-12)
    dx, dw, db = reference.linear_act_backward(dy, x, w, z, act, need_db=bias)
    torch.testing.assert_close(dx, xl.grad)
    torch.testing.assert_close(dw, wl.grad)
    if bias:
        torch.testing.assert_close(db, bl.grad)
    else:
        assert db is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_stays_within_the_dtype_bound(dtype):
    # Computed the way eager PyTorch does (a rounding per kernel): within the bounds the kernels are held to.
    ps = _params(33, 24, 40, True, seed=5)
    y64 = reference.gated_mlp(ps[0], *ps[1:4], "gelu_tanh", *ps[4:])
    low = [p.to(dtype) for p in ps]
    y = reference.gated_mlp_forward(*low, "gelu_tanh")
    assert y.dtype == dtype
    rel = ((y.double() - y64).norm() / y64.norm()).item()
    assert rel < {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


def test_oracle_keeps_leading_dimensions_and_accepts_aliases():
    ps = _params(6, 4, 8, False, seed=2)
    x = ps[0].reshape(2, 3, 4)
    y = reference.gated_mlp(x, *ps[1:4], "gelu_pytorch_tanh")
    assert y.shape == (2, 3, 4)
    torch.testing.assert_close(y.reshape(6, 4), _plain_gated("gelu_tanh", *ps))
    z = reference.linear_act(x.float(), ps[1].float(), None, "swish")
    assert z.dtype == torch.float64 and z.shape == (2, 3, 8)
    torch.testing.assert_close(z, F.silu(F.linear(x, ps[1])), rtol=1e-6, atol=1e-6)


def test_nan_propagates():
    ps = _params(3, 4, 5, True, seed=4)
    ps[0][1, 2] = float("nan")
    for act in ACTS:
        y = reference.gated_mlp_forward(*ps, act)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any(), act
