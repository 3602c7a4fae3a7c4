"""The family table: MLP classes whose parts mlpfuse.patch knows by name, and which block replaces them.

One row per MLP layout, as data: the fast path and the documentation of the families mlpfuse was built around.
It is not the gate: a class in no row is read from its structure (mlpfuse.patching.structure), a class in a row
whose forward is not what the row says is read from its structure too, and every reading, a row's included, is
checked against the module's own output on random rows before it is kept. `nn.Sequential(Linear, activation,
Linear)` with an activation mlpfuse knows is a row, its meaning being its structure. transformers is never imported
here: rows name classes.

Fields:
    classes      MLP class names (transformers' modeling files; `Sequential` for torch.nn's)
    layout       the block that replaces it: "gated" (GatedBlock), "two-layer" (TwoLayerBlock), "linear-act"
                 (LinearActBlock), "post-norm" (PostNormBlock: norm(dropout(dense(x)) + residual), two inputs)
    linears      child names of the projections, in order: gate, up, down | gate_up (packed), down | fc, proj | fc
    activation   the attribute holding the activation module (or function); "" for a post-norm row (none)
    dropout      a dropout child between the activation and the last projection (post-norm: after the projection,
                 before the residual add): while it is active (training with p > 0) the block runs the module's own
                 forward instead; a module patched while it is active is left alone
    dropout_after  a dropout child after the last projection: applied as is
    transposed   the projections are transformers' Conv1D, weight stored [in, out]
    multipliers  attributes holding (gate multiplier, down multiplier): act(gate(x)·m_g)·up(x), down(·)·m_d
    norm         post-norm: the nn.LayerNorm child applied to the projection's output plus the residual
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from mlpfuse.modules import activation_name

GATED, TWO_LAYER, LINEAR_ACT, POST_NORM = "gated", "two-layer", "linear-act", "post-norm"


@dataclass(frozen=True)
class Family:
    name: str
    classes: tuple[str, ...]
    layout: str
    linears: tuple[str, ...]
    activation: str
    dropout: str = ""
    dropout_after: str = ""
    transposed: bool = False
    multipliers: tuple[str, str] = ()
    norm: str = ""


FAMILIES: tuple[Family, ...] = (
    Family("swiglu/geglu", ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP"),
           GATED, ("gate_proj", "up_proj", "down_proj"), "act_fn"),
    Family("gated, gate/down multipliers", ("FalconH1MLP",), GATED, ("gate_proj", "up_proj", "down_proj"), "act_fn",
           multipliers=("gate_multiplier", "down_multiplier")),
    Family("packed gate_up", ("Phi3MLP",), GATED, ("gate_up_proj", "down_proj"), "activation_fn"),
    Family("t5 gated", ("T5DenseGatedActDense",), GATED, ("wi_0", "wi_1", "wo"), "act", dropout="dropout"),
    Family("t5", ("T5DenseActDense",), TWO_LAYER, ("wi", "wo"), "act", dropout="dropout"),
    Family("gpt-2", ("GPT2MLP",), TWO_LAYER, ("c_fc", "c_proj"), "act", dropout_after="dropout", transposed=True),
    Family("bert intermediate", ("BertIntermediate", "RobertaIntermediate"), LINEAR_ACT, ("dense",),
           "intermediate_act_fn"),
    Family("bert output", ("BertOutput", "BertSelfOutput", "RobertaOutput", "RobertaSelfOutput"), POST_NORM,
           ("dense",), "", dropout="dropout", norm="LayerNorm"),
    Family("sequential", ("Sequential",), TWO_LAYER, ("0", "2"), "1"),
)

_BY_CLASS = {name: family for family in FAMILIES for name in family.classes}

# Class names that look like an MLP block: reported with why when nothing in them is swapped, and read with every
# activation mlpfuse knows when they hold none.
MLP_SUFFIXES = ("MLP", "Mlp", "FeedForward", "FFN", "Ffn", "DenseActDense", "Intermediate")


def family_of(module: nn.Module) -> Optional[Family]:
    """The row for this module, or None. A Sequential is one only when it is exactly (Linear, activation, Linear);
    any other Sequential is a container to look inside."""
    family = _BY_CLASS.get(type(module).__name__)
    if family is None or family.classes != ("Sequential",):
        return family
    if not isinstance(module, nn.Sequential) or len(module) != 3:
        return None
    first, act, last = module
    linears = isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    return family if linears and activation_name(act) is not None else None


def looks_like_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith(MLP_SUFFIXES)
