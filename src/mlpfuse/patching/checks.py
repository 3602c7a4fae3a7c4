"""The checks on a module as it is now, before any block is built: each returns why the module cannot be swapped
(one line), or None.

No hooks on it or its projections and no forward replaced on the instance (accelerate's offloading, another
library's patch); projections that are plain nn.Linear (or transformers' Conv1D where the match says so), not
quantized or adapter subclasses; weights that are real floating-point tensors of one dtype and device, not on the
meta device, not int8/fp8, not tensor subclasses; an activation mlpfuse computes; no dropout inside the fusion that
is active now.
"""

from __future__ import annotations

import contextvars
import math
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from mlpfuse import fp8
from mlpfuse.modules import activation_name
from mlpfuse.patching import table
from mlpfuse.patching.structure import NAME, Match

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Set by patch(precision="fp8") while it walks the model: transformers' FineGrainedFP8 projections (FP8Linear) are
# then projections of a block, whose weights patching.quantize adopts as they are.
FP8_CHECKPOINTS = contextvars.ContextVar("mlpfuse_fp8_checkpoints", default=False)


def is_fp8_checkpoint(child) -> bool:
    """transformers' FineGrainedFP8 linear (fp8.TRANSFORMERS_CLASS, by name: transformers need not be imported)."""
    cls = type(child)
    return f"{cls.__module__}.{cls.__qualname__}" == fp8.TRANSFORMERS_CLASS


def fp8_checkpoint_problem(child) -> Optional[str]:
    """None when a FineGrainedFP8 linear is in mlpfuse's recipe (e4m3 values, one scale per 128×128 block, dynamic
    activation scales): its values and scales then run as they are; else why not."""
    if tuple(getattr(child, "block_size", None) or ()) != (128, 128):
        return f"FP8 with block size {getattr(child, 'block_size', None)}, mlpfuse runs 128×128 blocks"
    if getattr(child, "activation_scheme", "dynamic") != "dynamic":
        return f"FP8 with {child.activation_scheme} activation scales, mlpfuse computes them per call"
    w = child._parameters.get("weight")
    if w is None or type(w) not in (nn.Parameter, torch.Tensor) or w.is_meta:
        return "its FP8 weight is missing, not loaded yet or a tensor subclass"
    return None
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_STATE_HOOK_DICTS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def module_problem(module: nn.Module) -> Optional[str]:
    """Why no block may stand in for `module` whatever its layout, or None."""
    hooked = _hooks(module)
    if hooked:
        return f"hooks on the MLP ({hooked})"
    if "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return "its forward is replaced on the instance (accelerate offloading or another library's patch)"
    own = [n for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
    if own:
        return f"tensors of its own ({', '.join(own)}) that the fused block would not use"
    return None


def from_family(module: nn.Module, family: table.Family) -> tuple[Optional[Match], Optional[str]]:
    """The match a row of the family table gives `module` (None when the module is not what the row says), and
    why it cannot be swapped now (None when it can)."""
    reason = module_problem(module)
    if reason:
        return None, reason
    linears = []
    for name in family.linears:
        child = module._modules.get(name)
        reason = _projection_problem(name, child, family.transposed)
        if reason:
            return None, reason
        linears.append(child)
    for name, child in module.named_children():
        if name not in (*family.linears, family.norm) and child is not None and any(True for _ in child.parameters()):
            return None, f"{name} holds parameters the fused block would not use"
    reason = _weights_problem(family.linears, linears) or _shapes_problem(family, linears)
    if reason:
        return None, reason
    if family.layout == table.POST_NORM:
        act_name = ""
        reason = _norm_problem(module, family.norm, linears[0])
        if reason:
            return None, reason
    else:
        act = _activation_object(module, family)
        act_name = activation_name(act)
        if act_name is None:
            return None, f"unknown activation {type(act).__name__}"
    for name in (family.dropout, family.dropout_after):
        drop = module._modules.get(name) if name else None
        if name and not isinstance(drop, nn.Dropout):
            return None, f"{name} is {type(drop).__name__}, not an nn.Dropout"
    multipliers = [1.0, 1.0]
    for i, attr in enumerate(family.multipliers):
        m = getattr(module, attr, None)
        if isinstance(m, torch.Tensor) and m.numel() == 1 and not m.is_meta:
            m = m.item()
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
            return None, f"{attr} is not a finite number ({type(m).__name__})"
        multipliers[i] = float(m)
    match = Match(NAME, family.name, family.layout, family.linears, act_name, dropout=family.dropout,
                  dropout_after=family.dropout_after, transposed=family.transposed,
                  gate_multiplier=multipliers[0], down_multiplier=multipliers[1], norm=family.norm)
    return match, _dropout_active(module, match) or _multipliers_problem(module, match)


def match_problem(module: nn.Module, match: Match) -> Optional[str]:
    """Why `module` cannot be swapped as a structural `match` reads it (its children passed `structure.read`)."""
    linears = [module._modules[n] for n in match.linears]
    for name, child in zip(match.linears, linears):
        reason = _projection_problem(name, child, match.transposed)
        if reason:
            return reason
    norm = _norm_problem(module, match.norm, linears[0]) if match.layout == table.POST_NORM else None
    return (norm or _weights_problem(match.linears, linears) or _dropout_active(module, match)
            or _multipliers_problem(module, match))


def _dropout_active(module: nn.Module, match: Match) -> Optional[str]:
    drop = module._modules.get(match.dropout) if match.dropout else None
    if drop is None or not drop.training or drop.p <= 0:
        return None
    # Read from structure, where the dropout sits is not known: the block runs the module's own forward whenever
    # it is live, so patching now would gain nothing.
    if match.how != NAME:
        where = f"({match.dropout}), which the fused block leaves to the module's own forward,"
    elif match.layout == table.POST_NORM:
        where = f"after {match.linears[0]}"
    else:
        where = f"between the activation and {match.linears[-1]}"
    return f"dropout (p={drop.p:g}) {where} is active in training mode; call model.eval() (or set its p to 0) " \
           f"before patching"


def _multipliers_problem(module: nn.Module, match: Match) -> Optional[str]:
    if match.gate_multiplier == 0:
        return "gate multiplier 0 (the block scales the input by it and the output by its inverse)"
    linears = [module._modules[n] for n in match.linears[:-1]]
    if match.gate_multiplier != 1 and any(getattr(lin, "bias", None) is not None for lin in linears):
        return "a gate multiplier with biased gate/up projections"
    return None


def _norm_problem(module: nn.Module, name: str, dense: nn.Module) -> Optional[str]:
    """Why a post-norm match's norm child is not what the block applies (an nn.LayerNorm over the projection's
    outputs, with no hooks), or None."""
    norm = module._modules.get(name)
    if not isinstance(norm, nn.LayerNorm):
        return f"{name} is {type(norm).__name__}, not an nn.LayerNorm"
    if tuple(norm.normalized_shape) != (dense.weight.shape[0],):
        return f"{name} normalises {list(norm.normalized_shape)}, not the projection's {dense.weight.shape[0]} outputs"
    hooked = _hooks(norm)
    if hooked:
        return f"hooks on {name} ({hooked})"
    return None


def _activation_object(module: nn.Module, family: table.Family):
    # A Sequential's children are named "0", "1", ...: read them from the module dict, not as attributes.
    if family.activation.isdigit():
        return module._modules.get(family.activation)
    return getattr(module, family.activation, None)


def _hooks(module: nn.Module) -> str:
    kinds = [d.lstrip("_").replace("_", " ") for d in _HOOK_DICTS if getattr(module, d, None)]
    if any(getattr(module, d, None) for d in _STATE_HOOK_DICTS):
        kinds.append("state_dict hooks")
    return ", ".join(kinds)


def _projection_problem(name: str, child, transposed: bool) -> Optional[str]:
    if child is None:
        return f"no {name} child"
    if parametrize.is_parametrized(child):  # before the class test: parametrizing swaps the class for a subclass
        return f"{name} is parametrized"
    if transposed:
        if type(child).__name__ != "Conv1D" or not isinstance(getattr(child, "weight", None), torch.Tensor):
            return f"{name} is {type(child).__name__}, not transformers' Conv1D"
        if tuple(child.weight.shape) != (getattr(child, "nx", None), getattr(child, "nf", None)):
            return f"{name}'s weight is not the Conv1D [nx, nf] layout"
    elif is_fp8_checkpoint(child) and FP8_CHECKPOINTS.get():
        reason = fp8_checkpoint_problem(child)
        if reason:
            return f"{name}: {reason}"
    elif type(child) is not nn.Linear:
        hint = (" (a FineGrainedFP8 checkpoint: patch(model, precision='fp8') runs its FP8 weights as they are)"
                if is_fp8_checkpoint(child) else " (quantized and adapter layers keep their forward)")
        return f"{name} is {type(child).__name__}, not a plain nn.Linear{hint}"
    hooked = _hooks(child)
    if hooked:
        return f"hooks on {name} ({hooked})"
    if "forward" in child.__dict__ or hasattr(child, "_hf_hook"):
        return f"{name}'s forward is replaced on the instance"
    return None


def _weights_problem(names: tuple[str, ...], linears: list[nn.Module]) -> Optional[str]:
    first = None
    for name, lin in zip(names, linears):
        adopted = is_fp8_checkpoint(lin) and FP8_CHECKPOINTS.get()  # its weight checked by fp8_checkpoint_problem
        for kind in ("weight", "bias")[adopted:]:
            t = lin._parameters.get(kind)
            if t is None:
                if kind == "weight":
                    return f"{name} has no weight parameter"
                continue
            label = f"{name}.{kind}"
            if type(t) not in (nn.Parameter, torch.Tensor):
                return f"{label} is a {type(t).__name__} (a tensor subclass: quantized or sharded weights)"
            if t.is_meta:
                return f"{label} is on the meta device (weights not loaded yet)"
            if t.dtype not in _FLOATS:
                what = "fp8" if "float8" in str(t.dtype) else "unsupported" if t.is_floating_point() else "quantized"
                return f"{label} is {str(t.dtype).replace('torch.', '')} ({what} weights)"
            if first is None:
                first = (label, t)
            elif t.dtype != first[1].dtype or t.device != first[1].device:
                return (f"{label} is {str(t.dtype).replace('torch.', '')} on {t.device}, {first[0]} "
                        f"{str(first[1].dtype).replace('torch.', '')} on {first[1].device} (the fused op runs one "
                        f"dtype on one device)")
    return None


def _shapes_problem(family: table.Family, linears: list[nn.Module]) -> Optional[str]:
    shapes = [tuple(lin.weight.shape) for lin in linears]
    if family.transposed:  # Conv1D: [in, out]
        shapes = [(s[1], s[0]) for s in shapes]
    if family.layout == table.GATED:
        if len(linears) == 2:
            two_h, dim = shapes[0]
            ok = two_h % 2 == 0 and shapes == [(two_h, dim), (dim, two_h // 2)]
        else:
            hidden, dim = shapes[0]
            ok = shapes == [(hidden, dim), (hidden, dim), (dim, hidden)]
    elif family.layout == table.TWO_LAYER:
        ok = shapes[1][1] == shapes[0][0]  # proj's inputs are fc's outputs
    else:
        ok = True
    if not ok:
        return "projection shapes do not chain: " + ", ".join(f"{n} {list(s)}" for n, s in zip(family.linears, shapes))
    return None


