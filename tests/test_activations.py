"""The activation table: each formula derivative and each fused vjp against autograd of the forward, in fp64."""

import pytest
import torch

from mlpfuse import activations as A
from mlpfuse.errors import InputError


@pytest.mark.parametrize("name", [*A.NAMES, "identity"])
def test_grad_and_vjp_match_autograd(name):
    act = A.get(name)
    gen = torch.Generator().manual_seed(act.id)
    # Wide range (saturation of tanh/sigmoid) plus the kink at 0 avoided by the random draw.
    x = (torch.randn(4096, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    dy = torch.randn(4096, generator=gen, dtype=torch.float64)
    (want,) = torch.autograd.grad(act.forward(x), x, dy)
    x = x.detach()
    torch.testing.assert_close(dy * act.grad(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(act.vjp(dy, x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alias,name", [("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"),
                                        ("swish", "silu"), ("SiLU", "silu"), (None, "identity")])
def test_aliases(alias, name):
    assert A.get(alias).name == name


def test_unknown_name_is_one_line_naming_the_argument():
    with pytest.raises(InputError, match=r"^activation: unknown activation 'mish'; expected one of .*gelu_tanh") as e:
        A.get("mish")
    assert "\n" not in str(e.value)


def test_nan_propagates_through_every_forward():
    x = torch.tensor([float("nan"), -1.0, 2.0], dtype=torch.float64)
    for name in A.NAMES:
        assert torch.isnan(A.get(name).forward(x)[0]), name
