"""`patch(model)` and `unpatch(model)`: swap a model's MLP blocks for fused ones in place, and back.

For every module whose class is in the family table (mlpfuse.patching.table) the swap is decided by checks on the
module as it is now, each with the reason it fails: no hooks on it or its projections and no forward replaced on the
instance (accelerate's offloading, another library's patch); projections that are plain nn.Linear (or transformers'
Conv1D where the table says so), not quantized or adapter subclasses; weights that are real floating-point tensors of
one dtype and device, not on the meta device, not int8/fp8, not tensor subclasses; an activation mlpfuse computes; no
dropout inside the fusion that is active now. Then the block is built and, with `verify`, its output is compared
with the module's own on four random rows (once per class, shape, dtype and device): a class whose forward is not
what the table says is left alone rather than silently changed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from mlpfuse import activations
from mlpfuse.errors import InputError
from mlpfuse.modules import activation_name
from mlpfuse.ops import dispatch
from mlpfuse.patching import blocks, table
from mlpfuse.patching.report import Left, PatchReport, Swapped

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Relative error allowed between a fused block and the module it replaces, on the same input, by weight dtype:
# the two round differently (transformers' NewGELU runs its tanh formula op by op), a wrong layout errs by O(1).
VERIFY_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_STATE_HOOK_DICTS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def patch(model: nn.Module, backend: Optional[str] = "auto", *, verify: bool = True) -> PatchReport:
    """Swap, in place, every MLP block of `model` that mlpfuse recognises for a fused one; return the report.

    backend: "auto" | "triton" | "torch" for the fused blocks, or None to read MLPFUSE_BACKEND at each call.
    verify: compare each new block's output with the replaced module's on random input before keeping it.
    Parameters are reused (same objects), state_dict keys do not change, a second call changes nothing, and
    `unpatch(model)` puts the original modules back.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    backend_name = dispatch.check_backend_name(backend)
    report = PatchReport(type(model).__name__, backend_name or "env")
    if isinstance(model, blocks.PatchedBlock):
        report.already_patched.append("")
    elif table.family_of(model) is not None:
        report.left.append(Left("", type(model).__name__, "the model itself is an MLP block: patch the model "
                                "that holds it, or use mlpfuse.GatedMLP / MLP.from_module"))
    else:
        _walk(model, "", report, backend_name, verify, {})
    return report


def unpatch(model: nn.Module) -> list[str]:
    """Put back every module `patch` replaced in `model`; returns their paths."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    restored: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, blocks.PatchedBlock):
                source = child.fused_source
                source.training = child.training
                parent._modules[name] = source
                restored.append(path)
            else:
                walk(child, path)

    walk(model, "")
    return restored


def _walk(parent: nn.Module, prefix: str, report: PatchReport, backend: str, verify: bool, verdicts: dict) -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, blocks.PatchedBlock):
            report.already_patched.append(path)
            continue
        family = table.family_of(child)
        if family is None:
            before = len(report.swapped)
            _walk(child, path, report, backend, verify, verdicts)
            if table.looks_like_mlp(child) and len(report.swapped) == before:
                report.left.append(Left(path, type(child).__name__, "class not in mlpfuse's family table"))
            continue
        reason = check(child, family) or _nothing_to_gain(child, family, backend)
        block = None
        if reason is None:
            block = build(child, family, backend)
            if verify:
                key = _verify_key(child, family)
                if key not in verdicts:
                    verdicts[key] = verify_block(child, block)
                reason = verdicts[key]
        if reason is not None:
            report.left.append(Left(path, type(child).__name__, reason))
            continue
        parent._modules[name] = block
        report.swapped.append(Swapped(path, type(child).__name__, family.layout, family.name, block.fused_activation))


# --- the checks ----------------------------------------------------------------------------------------------


def check(module: nn.Module, family: table.Family) -> Optional[str]:
    """Why `module` cannot be swapped as `family` says, or None when it can."""
    hooked = _hooks(module)
    if hooked:
        return f"hooks on the MLP ({hooked})"
    if "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return "its forward is replaced on the instance (accelerate offloading or another library's patch)"
    own = [n for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None]
    if own:
        return f"tensors of its own ({', '.join(own)}) that the fused block would not use"
    linears = []
    for name in family.linears:
        child = module._modules.get(name)
        reason = _projection_problem(name, child, family.transposed)
        if reason:
            return reason
        linears.append(child)
    for name, child in module.named_children():
        if name not in family.linears and child is not None and any(True for _ in child.parameters()):
            return f"{name} holds parameters the fused block would not use"
    reason = _weights_problem(family.linears, linears)
    if reason:
        return reason
    reason = _shapes_problem(family, linears)
    if reason:
        return reason
    act = _activation_object(module, family)
    if activation_name(act) is None:
        return f"unknown activation {type(act).__name__}"
    if family.dropout or family.dropout_after:
        for name in (family.dropout, family.dropout_after):
            drop = module._modules.get(name) if name else None
            if name and not isinstance(drop, nn.Dropout):
                return f"{name} is {type(drop).__name__}, not an nn.Dropout"
        drop = module._modules.get(family.dropout) if family.dropout else None
        if drop is not None and drop.training and drop.p > 0:
            return (f"dropout (p={drop.p:g}) between the activation and {family.linears[-1]} is active in training "
                    f"mode; call model.eval() (or set its p to 0) before patching")
    if family.multipliers:
        return _multipliers_problem(module, family, linears)
    return None


def _nothing_to_gain(module: nn.Module, family: table.Family, backend: str) -> Optional[str]:
    """Why a lone linear + activation is left as it is on backend="auto": where `auto` never fuses the activation,
    the block would run eager's own two kernels behind more Python per call than nn.Linear + the activation module
    (BERT-base measured 1.04-1.09x eager's prefill time patched so, benchmarks/results/nvidia-h200/model-lab-families).
    """
    if family.layout != table.LINEAR_ACT or backend != "auto":
        return None
    act = activations.get(activation_name(_activation_object(module, family)))
    if act.id in dispatch.LINEAR_ACT_ACTIVATIONS:
        return None
    return (f"backend 'auto' keeps {family.linears[0]} + {act.name} as eager runs them (the fused kernel measured "
            f"slower for {act.name}): the block would only add host time; patch with backend='triton' to fuse anyway")


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
    elif type(child) is not nn.Linear:
        return (f"{name} is {type(child).__name__}, not a plain nn.Linear (quantized and adapter layers keep their "
                f"forward)")
    hooked = _hooks(child)
    if hooked:
        return f"hooks on {name} ({hooked})"
    if "forward" in child.__dict__ or hasattr(child, "_hf_hook"):
        return f"{name}'s forward is replaced on the instance"
    return None


def _weights_problem(names: tuple[str, ...], linears: list[nn.Module]) -> Optional[str]:
    first = None
    for name, lin in zip(names, linears):
        for kind in ("weight", "bias"):
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


def _multipliers_problem(module: nn.Module, family: table.Family, linears: list[nn.Module]) -> Optional[str]:
    values = []
    for attr in family.multipliers:
        m = getattr(module, attr, None)
        if isinstance(m, torch.Tensor) and m.numel() == 1 and not m.is_meta:
            m = m.item()
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
            return f"{attr} is not a finite number ({type(m).__name__})"
        values.append(float(m))
    if values[0] == 0:
        return "gate multiplier 0 (the block scales the input by it and the output by its inverse)"
    if values[0] != 1 and any(lin.bias is not None for lin in linears[:2]):
        return "a gate multiplier with biased gate/up projections"
    return None


# --- building and verifying ----------------------------------------------------------------------------------


def _multipliers(module: nn.Module, family: table.Family) -> tuple[float, float]:
    if not family.multipliers:
        return 1.0, 1.0
    values = [getattr(module, a) for a in family.multipliers]
    return tuple(float(v.item() if isinstance(v, torch.Tensor) else v) for v in values)


def build(module: nn.Module, family: table.Family, backend: str) -> blocks.PatchedBlock:
    """The fused block for a module that passed `check`."""
    act = activation_name(_activation_object(module, family))
    if family.layout == table.GATED:
        gate_m, down_m = _multipliers(module, family)
        return blocks.GatedBlock(module, family.name, family.linears, act, backend, dropout=family.dropout,
                                 gate_multiplier=gate_m, down_multiplier=down_m)
    if family.layout == table.TWO_LAYER:
        return blocks.TwoLayerBlock(module, family.name, family.linears, act, backend, dropout=family.dropout,
                                    transposed=family.transposed, dropout_after=family.dropout_after)
    return blocks.LinearActBlock(module, family.name, family.linears, act, backend)


def _verify_key(module: nn.Module, family: table.Family) -> tuple:
    weights = [module._modules[n].weight for n in family.linears]
    return (type(module).__name__, family.name, tuple(tuple(w.shape) for w in weights), weights[0].dtype,
            weights[0].device, _multipliers(module, family))


def verify_block(source: nn.Module, block: blocks.PatchedBlock) -> Optional[str]:
    """None when the block computes what `source` computes on four random rows (eval mode, no grad), else why not.
    Draws from its own generator: the caller's random state is left as it was."""
    first = source._modules[block.fused_linears[0]]
    weight = first.weight
    dim = weight.shape[0] if getattr(block, "fused_transposed", False) else weight.shape[1]
    try:
        gen = torch.Generator(device=weight.device)
        where = weight.device
    except RuntimeError:
        gen, where = torch.Generator(), torch.device("cpu")
    gen.manual_seed(0)
    x = torch.randn(4, dim, generator=gen, device=where).to(weight.device, weight.dtype)
    modules = {id(m): m for m in (*source.modules(), *block.modules())}.values()
    states = [(m, m.training) for m in modules]
    try:
        for m, _ in states:
            m.training = False
        with torch.no_grad():
            expected = source(x)
            got = block(x)
    except Exception as exc:  # noqa: BLE001 - whatever fails here is a reason to leave the module alone
        text = str(exc).strip().splitlines()
        return f"the fused forward failed: {type(exc).__name__}: {text[0][:160] if text else ''}"
    finally:
        for m, training in states:
            m.training = training
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = list(getattr(got, "shape", []))
        return f"the fused block's output has shape {shape}, the module's {list(expected.shape)}"
    ref = expected.double()
    err = torch.linalg.vector_norm(got.double() - ref).item() / (torch.linalg.vector_norm(ref).item() or 1.0)
    tol = VERIFY_TOLERANCE[weight.dtype]
    if not err <= tol:
        return f"the fused block's output differs from the module's own (relative error {err:.2g} > {tol:g})"
    return None
