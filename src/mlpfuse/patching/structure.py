"""Which fused layouts a module could be, read from its children: the candidate role assignments `mlpfuse.patch`
then proves or refutes on numbers (mlpfuse.patching.verify).

A module is a structural candidate when its children are 1 to 3 projections (nn.Linear, or transformers' Conv1D
with its [in, out] weight), dropouts and parameter-free activation modules, and nothing else holds parameters.
The projections' shapes say which layouts fit, with every name:
    3 projections  dim→h, dim→h, h→dim        gated: down is the h→dim one; gate/up in either order
    2 projections  dim→2h, h→dim              packed gate_up: gate half first or second
                   dim→h, h→dim               two-layer: fc then proj (either order when h = dim)
    1 projection   dim→h, a known activation  linear-act
                   dim→d, an nn.LayerNorm(d)  post-norm: norm(dense(x) + residual), a forward of two inputs
                                              (BERT's output blocks), no activation
A module that holds no activation is a candidate when its forward calls one as a function (F.gelu, torch.sigmoid,
x.relu(): read from its source), or when its class is named like an MLP. Activations tried: those the module holds
(children, functions, names) that mlpfuse knows, then those its forward calls, then the config's hidden_act, then
every other one mlpfuse computes. Gate and down multipliers: (1, 1), then the module's float attributes named like
multipliers. Names never decide; the verification does, and the first assignment whose output equals the module's
is kept. A module whose projections fit a layout but which is no candidate is reported as left, with why.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import math
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from mlpfuse import activations
from mlpfuse.modules import activation_name
from mlpfuse.patching import table

NAME, STRUCTURE = "name", "structure"
_CONFIG_ACTS = ("hidden_act", "hidden_activation", "activation_function", "act_fn", "hidden_activation_fn")


@dataclass(frozen=True)
class Match:
    """One way to read a module as a fused layout: the block mlpfuse would build from it."""

    how: str  # NAME (a row of the family table) | STRUCTURE (its children)
    family: str  # the table row's name, or the layout's description
    layout: str  # table.GATED | table.TWO_LAYER | table.LINEAR_ACT
    linears: tuple[str, ...]  # gate, up, down | gate_up, down | fc, proj | fc
    activation: str  # mlpfuse's name
    dropout: str = ""
    dropout_after: str = ""
    transposed: bool = False
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0
    gate_second: bool = False  # packed halves in (up, gate) order
    norm: str = ""  # post-norm: the nn.LayerNorm child

    @property
    def reading(self) -> tuple:
        """What the block computes, whatever the match is called: two matches with one reading verify alike."""
        return (self.layout, self.linears, self.activation, self.transposed, self.gate_multiplier,
                self.down_multiplier, self.gate_second, self.norm)

    @property
    def roles(self) -> str:
        names = self.linears
        if self.layout == table.GATED and len(names) == 3:
            text = f"gate={names[0]} up={names[1]} down={names[2]}"
        elif self.layout == table.GATED:
            text = f"gate_up={names[0]} ({'up, gate' if self.gate_second else 'gate, up'}) down={names[1]}"
        elif self.layout == table.TWO_LAYER:
            text = f"fc={names[0]} proj={names[1]}"
        elif self.layout == table.POST_NORM:
            text = f"dense={names[0]} norm={self.norm}"
        else:
            text = f"fc={names[0]}"
        if self.transposed:
            text += " (Conv1D)"
        if (self.gate_multiplier, self.down_multiplier) != (1.0, 1.0):
            text += f" multipliers {self.gate_multiplier:g}, {self.down_multiplier:g}"
        return text


@dataclass(frozen=True)
class Projection:
    name: str
    module: nn.Module
    d_in: int
    d_out: int
    transposed: bool


@dataclass
class Reading:
    """What a module's children say: the candidate matches, or why it is none (`why_not`); the activations it holds
    that mlpfuse knows, and the names of those it does not, for the reason when no candidate verifies."""

    matches: list[Match]
    why_not: str = ""
    held: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    shaped: bool = False  # its projections fit a fused layout: a module worth naming in the report when left


def projection(name: str, child) -> Optional[Projection]:
    """The child as a projection (nn.Linear or a subclass, or transformers' Conv1D), else None."""
    w = getattr(child, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    if isinstance(child, nn.Linear):
        return Projection(name, child, w.shape[1], w.shape[0], False)
    if type(child).__name__ == "Conv1D" and tuple(w.shape) == (getattr(child, "nx", None), getattr(child, "nf", None)):
        return Projection(name, child, w.shape[0], w.shape[1], True)
    return None


def read(module: nn.Module, config=None) -> Reading:
    """The structural candidates of `module`, in the order to try them."""
    grouped = grouped_parameters(module)
    if grouped:
        return Reading([], grouped)
    projs, drops, acts, unknown, norms = [], [], [], [], []
    for name, child in module.named_children():
        if child is None:
            continue
        p = projection(name, child)
        if p is not None:
            projs.append(p)
        elif isinstance(child, nn.Dropout):
            drops.append(name)
        elif isinstance(child, nn.LayerNorm):
            norms.append((name, child))
        elif any(True for _ in child.parameters()):
            return Reading([], f"{name} ({type(child).__name__}) holds parameters besides the projections")
        elif (act := activation_name(child)) not in (None, "identity"):
            acts.append(act)
        elif not isinstance(child, (nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            unknown.append(type(child).__name__)
    for value in _plain_attributes(module).values():  # functions (F.silu) and names ("gelu") held as attributes
        name = activation_name(value) if callable(value) or isinstance(value, str) else None
        if name not in (None, "identity"):
            acts.append(name)
    if norms:
        return _post_norm(module, projs, drops, acts, norms)
    if not projs or len(projs) > 3:
        return Reading([], f"{len(projs)} projections ({', '.join(p.name for p in projs) or 'none'}): no fused "
                           f"layout has that many")
    if len({p.transposed for p in projs}) > 1:
        return Reading([], "nn.Linear and Conv1D projections mixed")
    calls = forward_activations(type(module))
    called = [mlp_name for _, mlp_name in calls if mlp_name]
    unknown += [f"{call} (called in its forward)" for call, mlp_name in calls if not mlp_name]
    layouts = _layouts(projs)
    if len(projs) == 1 and not acts and not calls:
        return Reading([], "one projection and no activation mlpfuse knows on the module")
    if not acts and not called and not unknown and not table.looks_like_mlp(module):
        # Two or three projections that chain like an MLP's, in a module whose forward takes the input alone (not a
        # container, not an attention taking masks and positions) and applies nothing between them that mlpfuse
        # can see: worth a line in the report, unlike a lone projection.
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
        shaped = len(projs) > 1 and bool(layouts) and not container and forward_problem(module) is None
        return Reading([], "no activation in its children or its forward", shaped=shaped)
    if not layouts:
        shapes = ", ".join(f"{p.name} {p.d_in}→{p.d_out}" for p in projs)
        return Reading([], f"projection shapes match no fused layout ({shapes})")
    # Held first, then those its forward calls, then the config's, then every other one mlpfuse computes: a module
    # may call F.gelu without holding it, square what its ReLU gives, or hold an activation mlpfuse does not name
    # that computes one it knows (Bloom's gelu is tanh's). Only a module no reading verifies pays for the later ones.
    tried = list(dict.fromkeys([*acts, *called, *_config_activations(module, config),
                                *activations.NAMES]))
    tried = [a for a in tried if a != "identity"]
    dropout = drops[0] if len(drops) == 1 else ""
    if len(drops) > 1:
        return Reading([], f"{len(drops)} dropouts ({', '.join(drops)}): the fused block can stand aside for one")
    matches = []
    for layout, names, extra in layouts:
        if layout == table.LINEAR_ACT and dropout:
            continue
        mults = _multiplier_pairs(module) if layout == table.GATED else [(1.0, 1.0)]
        for act, (m_g, m_d) in itertools.product(tried, mults):
            matches.append(Match(STRUCTURE, f"{layout} by structure", layout, names, act, dropout=dropout,
                                 transposed=projs[0].transposed, gate_multiplier=m_g, down_multiplier=m_d,
                                 gate_second=extra))
    if not matches:
        return Reading([], f"a dropout ({dropout}) beside one projection: no fused layout keeps it")
    return Reading(matches, held=tuple(acts), unknown=tuple(unknown))


def _post_norm(module: nn.Module, projs: list[Projection], drops: list[str], acts: list[str],
               norms: list[tuple[str, nn.LayerNorm]]) -> Reading:
    """The post-norm reading of a module holding a LayerNorm: one projection whose output, plus a residual, the
    norm normalises (an optional dropout after the projection), or why it is none."""
    name, norm = norms[0]
    if len(norms) > 1 or len(projs) != 1:
        return Reading([], f"{name} ({type(norm).__name__}) holds parameters besides the projections")
    proj = projs[0]
    if acts:
        return Reading([], f"an activation ({acts[0]}) beside a projection and a norm: no fused layout has both")
    if proj.transposed or tuple(norm.normalized_shape) != (proj.d_out,):
        return Reading([], f"{name} normalises {list(norm.normalized_shape)}, not {proj.name}'s {proj.d_out} outputs")
    if len(drops) > 1:
        return Reading([], f"{len(drops)} dropouts ({', '.join(drops)}): the fused block can stand aside for one")
    signature = forward_problem(module, 2)
    if signature is not None:
        return Reading([], signature)
    match = Match(STRUCTURE, f"{table.POST_NORM} by structure", table.POST_NORM, (proj.name,), "",
                  dropout=drops[0] if drops else "", norm=name)
    return Reading([match])


def _layouts(projs: list[Projection]) -> list[tuple[str, tuple[str, ...], bool]]:
    """(layout, projection names in role order, gate_second) for each assignment the shapes allow."""
    out = []
    if len(projs) == 3:
        for down in projs:
            pair = [p for p in projs if p is not down]
            if all((p.d_in, p.d_out) == (down.d_out, down.d_in) for p in pair):
                for gate, up in (pair, pair[::-1]):
                    out.append((table.GATED, (gate.name, up.name, down.name), False))
    elif len(projs) == 2:
        for a, b in (projs, projs[::-1]):
            if a.d_in == b.d_out and a.d_out == 2 * b.d_in:
                out += [(table.GATED, (a.name, b.name), False), (table.GATED, (a.name, b.name), True)]
            elif a.d_in == b.d_out and a.d_out == b.d_in:
                out.append((table.TWO_LAYER, (a.name, b.name), False))
    else:
        out.append((table.LINEAR_ACT, (projs[0].name,), False))
    return out


# Functions a forward may call to apply an activation, by the name it calls them by (F.gelu, torch.sigmoid, x.relu(),
# nn.functional.silu): what each suggests trying first. "" marks a call that makes the module a candidate without
# naming one mlpfuse computes (x·sigmoid(1.702x) is quick_gelu, x·sigmoid(x) silu: the numbers decide).
_CALLED = {"gelu": "gelu", "silu": "silu", "swish": "silu", "relu": "relu", "sigmoid": "silu", "quick_gelu":
           "quick_gelu", "gelu_new": "gelu_tanh", "relu_squared": "relu2", "mish": "", "tanh": "", "softplus": "",
           "relu6": "", "leaky_relu": "", "hardswish": "", "elu": "", "selu": "", "celu": "", "gelu_pytorch_tanh":
           "gelu_tanh"}


@functools.lru_cache(maxsize=None)
def forward_activations(cls: type) -> tuple[tuple[str, str], ...]:
    """(function called, mlpfuse's activation to try first) for each activation a class's forward calls as a
    function (F.gelu(x, approximate="tanh") → ("gelu", "gelu_tanh")), read from its source; the second is "" for
    one mlpfuse computes nothing like. Empty when there is no source to read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in _CALLED:
            continue
        tanh = any(k.arg == "approximate" and isinstance(k.value, ast.Constant) and k.value.value == "tanh"
                   for k in node.keywords)
        found.append((name, "gelu_tanh" if name == "gelu" and tanh else _CALLED[name]))
    return tuple(dict.fromkeys(found))


def _config_activations(module: nn.Module, config) -> list[str]:
    found = []
    for cfg in (getattr(module, "config", None), config):
        for key in _CONFIG_ACTS:
            name = activation_name(getattr(cfg, key, None)) if cfg is not None else None
            if name is not None:
                found.append(name)
    return list(dict.fromkeys(found))


def _multiplier_pairs(module: nn.Module) -> list[tuple[float, float]]:
    """(gate, down) multipliers to try: none, then the module's finite float attributes named like multipliers."""
    values = [float(v) for k, v in _plain_attributes(module).items()
              if "multiplier" in k and isinstance(v, float) and math.isfinite(v) and v != 0]
    pairs = [(1.0, 1.0)]
    for g, d in itertools.product([1.0, *values], repeat=2):
        if (g, d) not in pairs:
            pairs.append((g, d))
    return pairs[:9]


def _plain_attributes(module: nn.Module) -> dict:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def owns_grouped(module: nn.Module) -> bool:
    """The module itself holds a mixture of experts' grouped weights: [experts, out, in]-like parameters, a matrix
    per expert (not a convolution's kernels, a [1, tokens, dim] position table or a [dim, 1, 1] scale)."""
    return bool(_grouped(module))


def _grouped(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    return [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() == 3
            and p.is_floating_point() and min(p.shape) > 1]


def grouped_parameters(module: nn.Module) -> str:
    """Why a module holding grouped expert weights (itself or below it) is left; '' when it holds none."""
    grouped = [(f"{prefix}.{n}" if prefix else n, p) for prefix, m in module.named_modules() for n, p in _grouped(m)]
    if not grouped:
        return ""
    shown = ", ".join(f"{n} {list(p.shape)}" for n, p in grouped[:2]) + (", ..." if len(grouped) > 2 else "")
    return (f"grouped expert weights ({shown}): mlpfuse fuses dense MLP blocks, and each expert is a slice the "
            f"model's router indexes")


def forward_problem(module: nn.Module, inputs: int = 1) -> Optional[str]:
    """Why a structural candidate's forward cannot be replaced by a block that takes `inputs` positional inputs
    (the input; post-norm: the input and the residual), else None: a caller that passes more (a mask, a padding
    flag) would reach a block that drops it."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward has no signature to read"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != inputs or any(p.kind not in positional for p in params):
        shown = ", ".join(p.name for p in params)
        return f"its forward takes ({shown}), the fused block only {'the input' if inputs == 1 else 'two inputs'}"
    return None


def fingerprint(module: nn.Module) -> tuple:
    """What, besides the weights' shapes, may change a module's forward: its class, its plain attributes (numbers,
    names: Gemma-3n's per-layer activation sparsity) and those of its children. Verdicts are cached under it."""
    def plain(m: nn.Module) -> tuple:
        return tuple(sorted((k, v) for k, v in _plain_attributes(m).items()
                            if isinstance(v, (int, float, str, bool, type(None)))))

    children = tuple((n, type(c).__qualname__, plain(c)) for n, c in module.named_children() if c is not None)
    shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return type(module).__module__, type(module).__qualname__, plain(module), children, shapes
