"""Hand the RMSNorm in front of a patched gated block to the block (ops.norm): at decode sizes its kernels normalise
x themselves, and the norm's own six to eight small kernels (one, compiled) are gone.

A norm is handed over only when the layer's own forward shows that the block is all that reads its output: two
consecutive statements `h = self.<norm>(h)` then `h = self.<mlp>(h)` (the name overwritten by the block's output,
so nothing after can read the normalised value), as in Llama, Mistral, Qwen, Granite (post_attention_layernorm) and
Gemma 2/3 (pre_feedforward_layernorm). OLMo 2 normalises after its MLP: no match. The norm must be an RMSNorm: one
`weight` of the block's input width, an `eps` or `variance_epsilon`, and a forward equal to one of the two rounding
conventions (ops.norm.KINDS) on random rows with a random weight. The norm module stays where it is (same
parameters, same state_dict); its class becomes a subclass whose forward passes the input through, and the block
calls the original forward wherever its kernels do not take the norm. `unpatch` puts the class back.
"""

from __future__ import annotations

import ast
import math
import functools
import inspect
import textwrap
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from mlpfuse.ops import fp8_mlp
from mlpfuse.ops.norm import KINDS, ONE_PLUS, WEIGHT_AFTER, RMSNormPrologue, rms_norm
from mlpfuse.patching import blocks
from mlpfuse.patching.report import FusedNorm, Left
from mlpfuse.patching.verify import one_line, row_error

# The formula check runs in float64, but transformers' norms compute in float32 inside (~1e-7 of a row); a misplaced
# eps or weight convention is off by O(1) on the rows where it matters.
NORM_MATH_TOLERANCE = 1e-5
# The rounding check in the norm's own dtype: the two conventions round differently, a wrong one errs by O(1).
NORM_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}


def fuse_norms(model: nn.Module, report) -> None:
    """For each gated block `report` swapped in `model`, hand it the norm in front of it where that is exact."""
    for swapped in report.swapped:
        parent_path, _, name = swapped.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        block = parent._modules.get(name)
        if not isinstance(block, blocks.GatedBlock) or block.fused_norm is not None:
            continue
        norm_name = feeding_norm(type(parent), name)
        if norm_name is None:
            continue  # no norm right in front of the block in the layer's forward: nothing to say
        norm_path = f"{parent_path}.{norm_name}" if parent_path else norm_name
        norm = parent._modules.get(norm_name)
        reason = _problem(norm, block)
        if isinstance(reason, str):
            report.norms_kept.append(Left(norm_path, type(norm).__name__, f"not fused into {name}: {reason}"))
            continue
        kind, eps = reason
        original = type(norm).forward
        norm.__class__ = _passthrough(type(norm))
        block.fused_norm = RMSNormPrologue(norm, original, kind, eps)
        if block.fused_precision == "fp8":
            by = _fp8_norm_by()
        elif block.fused_precision == "fp8-train":
            by = "forward, through the norm's own module (FP8 training)"
        else:
            by = "decode kernels"
        report.norms.append(FusedNorm(norm_path, swapped.path, KINDS[kind], by))


def _fp8_norm_by() -> str:
    """Where an FP8 block applies a handed-over norm (ops.fp8_mlp.NORM_IN_WEIGHT_ONLY picks the decode sizes' way)."""
    decode = "the gate+up kernel's prologue" if fp8_mlp.NORM_IN_WEIGHT_ONLY else "its own module"
    return f"FP8 quantization pass ({decode} at decode sizes)"


def restore_norms(model: nn.Module) -> list[str]:
    """Undo `fuse_norms` in `model`: every passed-through norm gets its class back, every block lets go of it."""
    restored = []
    for path, module in model.named_modules():
        source = type(module).__dict__.get("_mlpfuse_norm_of")
        if source is not None:
            module.__class__ = source
            restored.append(path)
        elif isinstance(module, blocks.GatedBlock):
            module.fused_norm = None
    return restored


@functools.lru_cache(maxsize=None)
def feeding_norm(layer_cls: type, block_name: str) -> Optional[str]:
    """The child whose output only `self.<block_name>` reads, from the layer class's forward source, or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(layer_cls.forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    for first, second in statement_pairs(tree):
        a, b = _self_call(first), _self_call(second)
        if a and b and b[1] == block_name and a[1] != block_name and a[0] == b[0] == b[2]:
            return a[1]
    return None


def statement_pairs(tree: ast.AST):
    """Every two consecutive statements of every statement list (bodies, else and finally blocks) in `tree`."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                yield from zip(stmts, stmts[1:])


def _self_call(stmt) -> Optional[tuple[str, str, Optional[str]]]:
    """(target, child, argument name) for `target = self.child(argument)`; None for anything else."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" and len(call.args) == 1
            and not call.keywords):
        return None
    arg = call.args[0]
    return stmt.targets[0].id, call.func.attr, arg.id if isinstance(arg, ast.Name) else None


def _problem(norm: Optional[nn.Module], block: "blocks.GatedBlock"):
    """(kind, eps) when `norm` is an RMSNorm the block's kernels can apply; else why not."""
    if norm is None:
        return "the layer holds no module under that name"
    if block.fused_in_scale != 1.0:
        return "the block scales its input (a gate multiplier)"
    return rms_kind(norm, block._modules[block.fused_linears[0]].weight.shape[1])


def rms_kind(norm: nn.Module, width: int):
    """(kind, eps) when `norm` is an RMSNorm of one [width] weight in one of the two conventions (ops.norm.KINDS),
    checked on random rows; else why not."""
    params = dict(norm.named_parameters(recurse=False))
    weight = params.get("weight")
    if set(params) != {"weight"} or list(norm.children()) or weight.shape != (width,):
        return f"not an RMSNorm with one [{width}] weight"
    eps = next((getattr(norm, n) for n in ("variance_epsilon", "eps") if isinstance(getattr(norm, n, None), float)),
               None)
    if eps is None:
        return "no float eps or variance_epsilon attribute"
    if not weight.is_floating_point():
        return f"weight of dtype {weight.dtype}"
    gen = torch.Generator().manual_seed(0)
    # The formula in float64, on unit-scale rows and on rows at the scale of √eps, where mean(x²) and eps are
    # alike and an eps added anywhere else than under the root shows.
    x64 = torch.randn(4, width, generator=gen, dtype=torch.float64)
    x64[2:] *= math.sqrt(eps) if eps > 0 else 1e-3
    w64 = 1 + torch.randn(width, generator=gen, dtype=torch.float64) / 4
    x64, w64 = x64.to(weight.device), w64.to(weight.device)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    exact = {WEIGHT_AFTER: w64 * normed, ONE_PLUS: normed * (1 + w64)}
    x = (torch.randn(3, width, generator=gen) * 3).to(weight.device, weight.dtype)
    w = (1 + torch.randn(width, generator=gen) / 4).to(weight.device, weight.dtype)
    tol = NORM_TOLERANCE.get(weight.dtype, 1e-4)
    try:
        with torch.no_grad():
            out64 = functional_call(norm, {"weight": w64}, (x64,))
            out = functional_call(norm, {"weight": w}, (x,))
            for kind in KINDS:
                if not row_error(out64, exact[kind]) <= NORM_MATH_TOLERANCE:
                    continue
                ref = rms_norm(x, w, eps, kind)
                if out.shape == ref.shape and out.dtype == ref.dtype:
                    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
                    if err <= tol:
                        return kind, eps
    except Exception as exc:  # noqa: BLE001 - a norm that cannot run on its own (or on meta) is kept, with why
        return f"its forward failed on random rows ({one_line(exc)})"
    return "its forward is neither RMSNorm convention on random rows"


@functools.lru_cache(maxsize=None)
def _passthrough(cls: type) -> type:
    """A subclass of the norm's class whose forward returns its input: the block after it normalises."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save, deepcopy) as the original class plus the swap: this class exists only in memory.
        return _rebuild, (cls, self.__getstate__())

    def extra_repr(self) -> str:
        return ", ".join(part for part in (cls.extra_repr(self), "applied by the module after it (mlpfuse)") if part)

    return type(cls.__name__, (cls,), {"forward": forward, "__reduce_ex__": __reduce_ex__, "extra_repr": extra_repr,
                                       "_mlpfuse_norm_of": cls, "__module__": cls.__module__})


def _rebuild(cls: type, state: dict) -> nn.Module:
    """A passed-through norm back from its pickled state: the original class's module, then the swap again."""
    module = cls.__new__(cls)
    module.__setstate__(state)
    module.__class__ = _passthrough(cls)
    return module
