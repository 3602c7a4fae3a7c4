"""The attention's projections at decode sizes: q, k and v in one launch that reads the layer's input RMSNorm in its
prologue, and the output projection on the same decode kernel (ops.projections, kernels.decode_linear).

A decode step reads every weight once; after the MLP (mlpfuse's blocks), a Llama-like layer's attention holds the
rest of its weights, read by three GEMMs shaped for one weight each (k and v leave most SMs idle) after the input
norm's six to eight small kernels. Three rewrites, each read from the source and checked on numbers:

1. A module whose forward calls two or more of its own `nn.Linear` children on the same input, each once, at the top
   level of the forward, the input a parameter the forward never reassigns:

       q = self.q_proj(hidden_states).view(...)        →   _mlpfuse_p = self._mlpfuse_projections(hidden_states)
       k = self.k_proj(hidden_states).view(...)            q = _mlpfuse_p[0].view(...)
       v = self.v_proj(hidden_states).view(...)            ...

   installed on a subclass of the module's class (its forward compiled again from its source, as
   mlpfuse.patching.residual rebuilds a layer's forward). The helper calls ops.projections (the children's own calls
   where one is no longer a plain `nn.Linear` or something hooks it).
2. The norm in front: where the layer's forward reads `h = self.<norm>(h)` and at once `h, ... = self.<attn>(h, ...)`
   (or `hidden_states=h`), and the attention's forward reads that parameter only through the grouped projections and
   its `.shape`, the norm is handed to the projections as a gated block's norm is (mlpfuse.patching.norms: the module
   passes its input through, the projections' kernel normalises x, every other path calls its own forward first).
3. The module's other plain `nn.Linear` children called once in its forward (the output projection) become the same
   class with a forward that takes the decode kernel at decode sizes.

Parameters, state_dict keys and every path outside decode sizes stay as they were; `unpatch` gives the classes back.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from mlpfuse.ops.norm import KINDS, RMSNormPrologue
from mlpfuse.ops.projections import projections_call
from mlpfuse.patching import norms
from mlpfuse.patching.blocks import _hooked
from mlpfuse.patching.report import FusedNorm, FusedProjections, Left
from mlpfuse.patching.residual import rebuilt, rewritten_class
from mlpfuse.patching.verify import differs, one_line

HELPER = "_mlpfuse_projections"
STATE = "_mlpfuse_projections_state"
RESULT = "_mlpfuse_p"


@dataclass
class _State:
    backend: str
    norm: Optional[RMSNormPrologue] = None


def fuse_projections(model: nn.Module, report, backend: str, fuse_norms: bool = True) -> None:
    """Rewrite every module of `model` whose forward projects one input through several of its own plain
    `nn.Linear` children (module docstring), and hand it the norm in front where its layer shows that."""
    for path, module in list(model.named_modules()):
        cls = type(module)
        if cls.__dict__.get("_mlpfuse_projections_of") is not None or module is model:
            continue
        found = _grouping(cls)
        if found is None:
            continue
        arg, names, others = found
        names = tuple(n for n in names if _plain_linear(module._modules.get(n)))
        if len(names) < 2 or len({module._modules[n].in_features for n in names}) > 1:
            continue
        sub = _subclass(cls, arg, names)
        if isinstance(sub, str):
            report.projections_kept.append(Left(path, cls.__name__, sub))
            continue
        module.__dict__[STATE] = _State(backend)
        module.__class__ = sub
        reason = verify_projections(module)
        if reason is not None:
            _undo(module)
            report.projections_kept.append(Left(path, cls.__name__, reason))
            continue
        outs = [n for n in others if _plain_linear(module._modules.get(n)) and _swap_linear(module._modules[n], backend)]
        report.projections.append(FusedProjections(path, "+".join(names), ", ".join(outs)))
    if fuse_norms:
        _fuse_norms(model, report)


def _plain_linear(child) -> bool:
    return type(child) is nn.Linear and not _hooked(child)


def verify_projections(module: nn.Module) -> Optional[str]:
    """None when the module's fused projections equal its children's own calls (after the norm's own forward, when
    one was handed over) on random rows in the weights' dtype and device (a decode-sized call: the kernel where it
    runs), within a few roundings of the dtype; else why not. Modules on the meta device are taken at their word."""
    names = type(module)._mlpfuse_projection_names
    first = module._modules[names[0]].weight
    if first.device.type == "meta":
        return None
    state = module.__dict__[STATE]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(2, 3, first.shape[1], generator=gen) * 2).to(first.device, first.dtype)
    try:
        with torch.no_grad():
            got = getattr(module, HELPER)(x)
            h = x if state.norm is None else state.norm(x)
            want = [module._modules[n](h) for n in names]
    except Exception as exc:  # noqa: BLE001 - projections that cannot run fused stay as they were, with why
        return f"the fused projections failed: {one_line(exc)}"
    bound = (8 if state.norm is not None else 4) * torch.finfo(first.dtype).eps
    for name, g, w in zip(names, got, want):
        reason = differs(g, w, bound, f"the fused {name}", "its own call")
        if reason is not None:
            return reason
    return None


def restore_projections(model: nn.Module) -> list[str]:
    """Undo `fuse_projections`: every rewritten module and swapped projection gets its class back."""
    restored = []
    for path, module in model.named_modules():
        if type(module).__dict__.get("_mlpfuse_projections_of") is not None:
            _undo(module)
            restored.append(path)
        elif type(module) is DecodeLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_mlpfuse_backend", None)
    return restored


def _undo(module: nn.Module) -> None:
    module.__class__ = type(module)._mlpfuse_projections_of
    module.__dict__.pop(STATE, None)


# ---------------------------------------------------------------------------------------------------------------
# The output projection: nn.Linear with the decode kernel at decode sizes.

class DecodeLinear(nn.Linear):
    """An nn.Linear whose forward takes ops.projections (the decode kernel at decode sizes, F.linear elsewhere)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return projections_call(input, [self.weight], [self.bias], self.__dict__["_mlpfuse_backend"])[0]

    def __reduce_ex__(self, protocol):
        return _rebuild_linear, (self.__getstate__(),)

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, decode kernel (mlpfuse)"


def _rebuild_linear(state: dict) -> nn.Module:
    module = nn.Linear.__new__(nn.Linear)
    module.__setstate__(state)
    module.__class__ = DecodeLinear
    return module


def _swap_linear(linear: nn.Linear, backend: str) -> bool:
    """Make `linear` a DecodeLinear when its decode call equals F.linear on random rows; whether it did."""
    w = linear.weight
    linear.__dict__["_mlpfuse_backend"] = backend
    linear.__class__ = DecodeLinear
    if w.device.type == "meta":
        return True
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(2, 3, w.shape[1], generator=gen).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            reason = differs(linear(x), torch.nn.functional.linear(x, w, linear.bias), 4 * torch.finfo(w.dtype).eps,
                             "", "")
    except Exception:  # noqa: BLE001 - a projection that cannot take the kernel stays nn.Linear
        reason = "failed"
    if reason is None:
        return True
    linear.__class__ = nn.Linear
    linear.__dict__.pop("_mlpfuse_backend", None)
    return False


# ---------------------------------------------------------------------------------------------------------------
# Reading and rewriting the forward.

def _forward_tree(cls: type):
    raw = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, None, None
    func = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return (raw, tree, func) if func is not None else (None, None, None)


def _self_calls(node) -> list[ast.Call]:
    """The `self.<attr>(...)` calls under `node`, in source order (q before k before v, however deep each sits)."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _self_uses(func) -> dict[str, int]:
    """How often the forward names each `self.<attr>`."""
    counts: dict[str, int] = {}
    for n in ast.walk(func):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            counts[n.attr] = counts.get(n.attr, 0) + 1
    return counts


def _stored(func) -> set[str]:
    return {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


@functools.lru_cache(maxsize=None)
def _grouping(cls: type):
    """(input name, children called on it, other children called once) from the class's forward: the children
    `self.<c>(arg)` called once each with one plain-name argument, the argument a parameter never reassigned, the
    calls in statements at the forward's top level; None when no argument has two such children."""
    raw, tree, func = _forward_tree(cls)
    if func is None:
        return None
    params = {a.arg for a in func.args.args[1:] + func.args.kwonlyargs}
    stored = _stored(func)
    uses = _self_uses(func)
    by_arg: dict[str, list[str]] = {}
    others = []
    for call in _self_calls(func):
        name = call.func.attr
        if uses.get(name) != 1 or call.keywords or len(call.args) != 1:
            continue
        arg = call.args[0]
        if isinstance(arg, ast.Name) and arg.id in params and arg.id not in stored and not _nested(func, call):
            by_arg.setdefault(arg.id, []).append(name)
        else:
            others.append(name)
    groups = [(arg, names) for arg, names in by_arg.items() if len(names) >= 2]
    if len(groups) != 1:
        return None
    arg, names = groups[0]
    return arg, tuple(names), tuple(others)


def _nested(func, call) -> bool:
    """Whether `call` sits inside a compound statement (if/for/with/try...) or a nested function of the forward."""
    for stmt in func.body:
        if any(n is call for n in ast.walk(stmt)):
            return isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef,
                                     ast.AsyncFunctionDef, ast.ClassDef, ast.AsyncFor, ast.AsyncWith))
    return True


@functools.lru_cache(maxsize=None)
def _subclass(cls: type, arg: str, names: tuple):
    """The subclass whose forward computes `names`' projections of `arg` in one helper call; a string why not."""
    raw, tree, func = _forward_tree(cls)
    if func is None:
        return "its forward's source cannot be read"
    calls = {id(c): names.index(c.func.attr) for c in _self_calls(func) if c.func.attr in names
             and len(c.args) == 1 and isinstance(c.args[0], ast.Name) and c.args[0].id == arg}

    class Swap(ast.NodeTransformer):
        def visit_Call(self, node):
            if id(node) in calls:
                return ast.copy_location(ast.Subscript(ast.Name(RESULT, ast.Load()), ast.Constant(calls[id(node)]),
                                                       ast.Load()), node)
            return self.generic_visit(node)

    first = next(i for i, stmt in enumerate(func.body) if any(id(n) in calls for n in ast.walk(stmt)))
    Swap().visit(func)
    helper = ast.Assign([ast.Name(RESULT, ast.Store())],
                        ast.Call(ast.Attribute(ast.Name("self", ast.Load()), HELPER, ast.Load()),
                                 [ast.Name(arg, ast.Load())], []))
    func.body.insert(first, ast.copy_location(helper, func.body[first]))
    forward = rebuilt(raw, tree, func)
    if isinstance(forward, str):
        return forward

    def projections(self, x):
        state = self.__dict__.get(STATE)
        children = [self._modules[n] for n in names]
        if state is None or not all(_plain_linear(c) for c in children):
            h = x if state is None or state.norm is None else state.norm(x)
            return [c(h) for c in children]
        return projections_call(x, [c.weight for c in children], [c.bias for c in children], state.backend,
                                state.norm)

    return rewritten_class(cls, forward, {HELPER: projections}, f"{'+'.join(names)} in one decode call", _rebuild,
                           (cls, arg, names), {"_mlpfuse_projections_of": cls, "_mlpfuse_projection_names": names,
                                               "_mlpfuse_projection_input": arg})


def _rebuild(cls: type, arg: str, names: tuple, state: dict) -> nn.Module:
    module = cls.__new__(cls)
    module.__setstate__(state)
    swapped = _subclass(cls, arg, names)
    if isinstance(swapped, type):
        module.__class__ = swapped
    return module


# ---------------------------------------------------------------------------------------------------------------
# The norm in front of the attention.

def _fuse_norms(model: nn.Module, report) -> None:
    for path, layer in list(model.named_modules()):
        for child_name, child in list(layer._modules.items()):
            ccls = type(child)
            if ccls.__dict__.get("_mlpfuse_projections_of") is None or child.__dict__[STATE].norm is not None:
                continue
            norm_name = _feeding_norm(type(layer), child_name, ccls._mlpfuse_projections_of,
                                      ccls._mlpfuse_projection_input, ccls._mlpfuse_projection_names)
            if norm_name is None:
                continue
            norm = layer._modules.get(norm_name)
            norm_path = f"{path}.{norm_name}" if path else norm_name
            child_path = f"{path}.{child_name}" if path else child_name
            names = ccls._mlpfuse_projection_names
            found = norms.rms_kind(norm, child._modules[names[0]].in_features) if norm is not None else \
                "the layer holds no module under that name"
            if isinstance(found, str):
                report.norms_kept.append(Left(norm_path, type(norm).__name__, f"not fused into {child_name}: {found}"))
                continue
            kind, eps = found
            original = type(norm).forward
            state = child.__dict__[STATE]
            state.norm = RMSNormPrologue(norm, original, kind, eps)
            reason = verify_projections(child)
            if reason is not None:
                state.norm = None
                report.norms_kept.append(Left(norm_path, type(norm).__name__, f"not fused into {child_name}: "
                                              f"{reason}"))
                continue
            norm.__class__ = norms._passthrough(type(norm))
            report.norms.append(FusedNorm(norm_path, child_path, KINDS[kind], "decode projections"))


@functools.lru_cache(maxsize=None)
def _feeding_norm(layer_cls: type, attn_name: str, attn_cls: type, param: str, names: tuple) -> Optional[str]:
    """The norm child of `layer_cls` whose output only `self.<attn_name>` reads, bound to the attention's `param`,
    which the attention reads only through `names`' projections and its shape; None otherwise."""
    if not _only_projected(attn_cls, param, names):
        return None
    raw, tree, func = _forward_tree(layer_cls)
    if func is None:
        return None
    positional = _positional_index(attn_cls, param)
    for first, second in norms.statement_pairs(func):
        a = norms._self_call(first)
        if a and a[0] == a[2] and a[1] != attn_name and _reads_into(second, attn_name, a[0], param, positional):
            return a[1]
    return None


def _positional_index(cls: type, param: str) -> Optional[int]:
    raw, tree, func = _forward_tree(cls)
    names = [a.arg for a in func.args.args[1:]] if func is not None else []
    return names.index(param) if param in names else None


def _reads_into(stmt, attn_name: str, h: str, param: str, positional: Optional[int]) -> bool:
    """Whether `stmt` is `<targets> = self.<attn_name>(...)` passing `h` once, as `param`, with `h` among the targets
    (so nothing after reads the normalised value)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return False
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == attn_name
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"):
        return False
    target = stmt.targets[0]
    targets = [target] if isinstance(target, ast.Name) else list(target.elts) if isinstance(target, ast.Tuple) else []
    if not any(isinstance(t, ast.Name) and t.id == h for t in targets):
        return False
    passed = [i for i, a in enumerate(call.args) if isinstance(a, ast.Name) and a.id == h]
    by_name = [k for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == h]
    mentions = sum(1 for n in ast.walk(call) if isinstance(n, ast.Name) and n.id == h)
    if mentions != 1 or any(isinstance(a, ast.Starred) for a in call.args):
        return False
    return (passed == [positional] if passed else len(by_name) == 1 and by_name[0].arg == param)


def _only_projected(attn_cls: type, param: str, names: tuple) -> bool:
    """Whether the attention's forward reads `param` only as the grouped projections' argument or through
    `.shape` / `.size()` / `.dtype` / `.device` (what a passed-through norm leaves the same)."""
    raw, tree, func = _forward_tree(attn_cls)
    if func is None:
        return False
    allowed = set()
    for call in _self_calls(func):
        if call.func.attr in names and len(call.args) == 1:
            allowed.add(id(call.args[0]))
    for node in ast.walk(func):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == param:
            if node.attr in ("shape", "size", "dtype", "device", "ndim", "dim"):
                allowed.add(id(node.value))
    return all(id(n) in allowed for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == param)
