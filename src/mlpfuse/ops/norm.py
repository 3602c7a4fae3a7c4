"""An RMSNorm that a gated MLP reads its input through: the norm in front of a decoder layer's MLP, fused into the
decode kernels' prologue.

A pre-norm decoder layer computes `mlp(norm(h))` and uses `norm(h)` nowhere else. At decode sizes the norm is six to
eight small kernels in eager PyTorch (casts, square, mean, rsqrt, two products) and one in torch.compile, each a
launch and a round trip of a vector through HBM; the decode kernels read x anyway, so they can normalise it on chip.
`mlpfuse.patch` hands such a norm to the block after it (`RMSNormPrologue`) and makes the norm module itself pass
its input through (mlpfuse.patching.norms); wherever the fused kernels do not run (prefill, training, other backends)
the block calls the norm's own forward first, so those paths compute exactly what they did (compiled, one
`mlpfuse::norm_gated_mlp` node runs `rms_norm` below, the same ops as the norm's forward).

Kinds (the rounding of the two RMSNorm conventions in transformers, r = 1/sqrt(mean(x²) + eps) in fp32):
    WEIGHT_AFTER   weight · round(x·r), rounded again          Llama, Mistral, Qwen, OLMo, Granite, ...
    ONE_PLUS       round(x·r·(1 + weight))                     Gemma
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

WEIGHT_AFTER, ONE_PLUS = 1, 2  # the decode kernel's NORM values (kernels.decode_mlp.NORM_*)
KINDS = {WEIGHT_AFTER: "weight·norm(x)", ONE_PLUS: "norm(x)·(1+weight)"}


def rms_norm(x: Tensor, weight: Tensor, eps: float, kind: int) -> Tensor:
    """The kind's RMSNorm in PyTorch, rounded as transformers' modules round (the oracle that recognises a norm, and
    the compiled op's norm off the decode path)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if kind == WEIGHT_AFTER:
        return weight * normed.to(x.dtype)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class RMSNormPrologue:
    """The norm module a block reads its input through: its weight, eps and kind for the fused kernels, and its own
    forward (`forward(module, x)`, the class's, from before the module was made to pass its input through) for
    every other path. Not a module: the norm stays where the model keeps it (same parameters, same state_dict)."""

    __slots__ = ("module", "forward", "kind", "eps")

    def __init__(self, module: nn.Module, forward: Callable, kind: int, eps: float):
        self.module, self.forward, self.kind, self.eps = module, forward, kind, float(eps)

    @property
    def weight(self) -> Tensor:
        return self.module._parameters["weight"]

    def __call__(self, x: Tensor) -> Tensor:
        return self.forward(self.module, x)

    def key(self, x: Tensor):
        """What the fused path's choice depends on, for a call plan's key; None when the kernels cannot take it
        (the weight in another dtype than x, whose product PyTorch would promote)."""
        w = self.weight
        if type(w) is not nn.Parameter and type(w) is not Tensor or w.dtype != x.dtype:
            return None
        return (w.data_ptr(), w.shape, w.stride(), w.dtype, self.kind, self.eps)
