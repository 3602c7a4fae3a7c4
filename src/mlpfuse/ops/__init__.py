"""Functional fused MLP ops, registered as torch.library custom ops in the `mlpfuse` namespace.

    gated_mlp(x, gate_weight, up_weight, down_weight, activation="gelu_tanh", gate_bias=None, up_bias=None,
              down_bias=None, *, backend=None)
    linear_act(x, weight, bias=None, activation=None, *, backend=None)

Importing this package registers torch.ops.mlpfuse.{gated_mlp, gated_mlp_train, gated_mlp_backward, linear_act,
linear_act_train, linear_act_backward}. Backend choice and its measured policy: mlpfuse.ops.dispatch.
"""

from mlpfuse.ops.gated_mlp import gated_mlp
from mlpfuse.ops.linear_act import linear_act

__all__ = ["gated_mlp", "linear_act"]
