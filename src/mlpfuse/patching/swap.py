"""`patch(model)` and `unpatch(model)`: swap a model's MLP blocks for fused ones in place, and back.

A module is a candidate when its class is in the family table (mlpfuse.patching.table: the fast path, and the
documentation of what the known families are) or when its children fit a fused layout under any names
(mlpfuse.patching.structure). Each candidate passes the checks on the module as it is now (mlpfuse.patching.checks),
then its block is built and its output compared with the module's own on random rows (mlpfuse.patching.verify):
the first reading of the module that computes what it computes is kept, and a module none does is left, with why.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from mlpfuse.errors import InputError
from mlpfuse.ops import _checks, dispatch
from mlpfuse.modules import _check_precision, check_save
from mlpfuse.patching import attention, blocks, checks, norms, quantize, residual, structure, table
from mlpfuse.patching.report import Left, PatchReport, Swapped
from mlpfuse.patching.verify import one_line, verify_block


def patch(model: nn.Module, backend: Optional[str] = "auto", *, verify: bool = True,
          fuse_norms: bool = True, recompute: bool = False, precision: Optional[str] = None,
          fuse_residuals: bool = True, save: str = "high", fuse_attention: bool = True) -> PatchReport:
    """Swap, in place, every MLP block of `model` that mlpfuse recognises (by class name or by structure) for a
    fused one; return the report.

    backend: "auto" | "triton" | "torch" for the fused blocks, or None to read MLPFUSE_BACKEND at each call.
    verify: compare each new block's output with the replaced module's on random input before keeping it (False:
    the family table's rows are taken at their word, and nothing is swapped on its structure alone).
    fuse_norms: hand the RMSNorm in front of each swapped gated block to it where the layer's forward shows
    that only the block reads the norm's output (mlpfuse.patching.norms): its decode kernels then normalise x.
    fuse_residuals: hand the residual add right after each swapped gated block to it where the layer's forward
    shows exactly `h = residual + mlp(h)` (mlpfuse.patching.residual): its down projection adds it in its epilogue.
    recompute: the swapped gated blocks keep only their input for the backward and recompute g and u there
    (training memory: three [tokens, hidden] tensors less per block, for two GEMMs more).
    precision: None (the weights' own dtype) or "fp8": each swapped gated block's projections are then quantized
    once into the FP8 recipe (mlpfuse.fp8; inference) and their high-precision weights dropped, each after
    its FP8 output met the recipe's error bound on its own weights (mlpfuse.patching.quantize); the report gives
    the measured error of each and says which blocks stayed in their dtype, and why. Their state_dict keys gain
    `weight_scale_inv` beside `weight` (transformers' FP8Linear layout); `unpatch` dequantizes (lossy). On a model
    in train mode the swapped gated blocks instead train in FP8: their weights stay as they are (the optimizer's
    masters, state_dict unchanged), each call quantizes them and runs every GEMM of its forward and backward in
    e4m3, keeping g and u in FP8 for the backward (ops.fp8_train; checked on numbers the same way; report precision
    "fp8-train"); `unpatch` gives the untouched modules back.
    save: "high" or "fp8": the swapped gated blocks' training keeps g and u in the FP8 recipe (written by the
    gated GEMM's epilogue; half their memory), as GatedMLP(save="fp8").
    fuse_attention: a module whose forward projects one input through several of its own nn.Linear children (an
    attention's q, k and v) computes them in one call, one decode kernel launch at decode sizes, with the RMSNorm
    in front of it in that kernel's prologue where the layer shows that only those projections read it (with
    fuse_norms); its other nn.Linear children called once (the output projection) take the decode kernel too
    (mlpfuse.patching.attention). Checked on numbers like every swap; elsewhere the same GEMMs run as before.
    Parameters are reused (same objects), state_dict keys do not change, a second call changes nothing, and
    `unpatch(model)` puts the original modules back.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    backend_name = dispatch.check_backend_name(backend)
    _checks.flag("fuse_norms", fuse_norms)
    _checks.flag("fuse_residuals", fuse_residuals)
    _checks.flag("fuse_attention", fuse_attention)
    _checks.flag("recompute", recompute)
    precision = _check_precision(precision, allowed=("fp8",))  # train or eval mode decides which FP8
    save = check_save(save, recompute, precision)
    if precision == "fp8" and recompute:
        raise InputError("recompute: not with precision='fp8' (its training keeps g and u in FP8 instead)")
    report = PatchReport(type(model).__name__, backend_name or "env")
    if isinstance(model, blocks.PatchedBlock):
        report.already_patched.append("")
    elif table.family_of(model) is not None or structure.read(model, getattr(model, "config", None)).matches:
        report.left.append(Left("", type(model).__name__, "the model itself is an MLP block: patch the model "
                                "that holds it, or use mlpfuse.GatedMLP / MLP.from_module"))
    else:
        token = checks.FP8_CHECKPOINTS.set(precision == "fp8")
        try:
            _walk(model, "", report, backend_name, verify, {}, getattr(model, "config", None), recompute=recompute)
        finally:
            checks.FP8_CHECKPOINTS.reset(token)
        if precision == "fp8":
            quantize.quantize_blocks(model, report)
        for swapped in report.swapped:
            block = model.get_submodule(swapped.path)
            if isinstance(block, blocks.GatedBlock):
                block.fused_save = save
        if fuse_norms:
            norms.fuse_norms(model, report)
        if fuse_residuals:
            residual.fuse_residuals(model, report)
        if fuse_attention:
            attention.fuse_projections(model, report, backend_name, fuse_norms)
    return report


def unpatch(model: nn.Module) -> list[str]:
    """Put back every module `patch` replaced in `model` (and the norms it handed to them their own forward);
    returns the replaced modules' paths."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    norms.restore_norms(model)
    residual.restore_residuals(model)
    attention.restore_projections(model)
    restored: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, blocks.PatchedBlock):
                if child.fused_precision == "fp8":
                    quantize.restore(child)
                source = child.fused_source
                source.training = child.training
                parent._modules[name] = source
                restored.append(path)
            else:
                walk(child, path)

    walk(model, "")
    return restored


def _walk(parent: nn.Module, prefix: str, report: PatchReport, backend: str, verify: bool, verdicts: dict,
          config, skip: frozenset = frozenset(), recompute: bool = False) -> None:
    for name, child in list(parent._modules.items()):
        if child is None or name in skip:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, blocks.PatchedBlock):
            report.already_patched.append(path)
            continue
        match, reason, reading = decide(child, backend, verify, verdicts, config)
        if match is not None:
            block = build(child, match, backend, recompute)
            parent._modules[name] = block
            report.swapped.append(Swapped(path, type(child).__name__, match.layout, match.family,
                                          block.fused_activation, match.how, match.roles))
        elif reason is not None:
            report.left.append(Left(path, type(child).__name__, reason))
        elif structure.owns_grouped(child):
            report.left.append(Left(path, type(child).__name__, reading.why_not))
        else:
            # A mixture of experts is listed once, with its grouped weights; its dense parts (a shared expert, an
            # MLP in a dense layer) are looked at on their own.
            experts = frozenset(n for n, c in child.named_children() if c is not None and structure.owns_grouped(c))
            if experts:
                report.left.append(Left(path, type(child).__name__, f"a mixture of experts: {reading.why_not}"))
            before = (len(report.swapped), len(report.left))
            _walk(child, path, report, backend, verify, verdicts, config, experts, recompute)
            plausible = table.looks_like_mlp(child) or reading.shaped
            if not experts and plausible and (len(report.swapped), len(report.left)) == before:
                report.left.append(Left(path, type(child).__name__, f"no layout mlpfuse fuses: {reading.why_not}"))


def decide(module: nn.Module, backend: str, verify: bool, verdicts: dict, config):
    """(match, None, reading) when `module` is to be swapped; (None, reason, reading) when it is a candidate left
    alone; (None, None, reading) when it is no candidate (reading.why_not says why).

    The family table's row, where the class has one, is tried first, then every reading of the module's structure;
    the first whose block verifies wins. Verdicts are cached by what may change the module's forward
    (structure.fingerprint), its weights' dtype and device, and the reading.
    """
    family = table.family_of(module)
    named, named_reason = checks.from_family(module, family) if family is not None else (None, None)
    reading = structure.read(module, config)
    if family is None and not reading.matches:
        return None, None, reading
    if named is not None and named_reason is None and not verify:
        return named, None, reading  # the table's word, unchecked, as asked
    if family is not None and any(checks.is_fp8_checkpoint(module._modules.get(n)) for n in family.linears):
        # A FineGrainedFP8 block: its own forward needs transformers' FP8 kernels, so it is checked against the
        # recipe in float64 once its weights are adopted (patching.quantize), on the table's reading alone.
        return (named, None, reading) if named_reason is None else (None, named_reason, reading)
    reason = checks.module_problem(module)
    if reason is not None:
        return None, reason, reading
    matches = [named] if named is not None and named_reason is None else []
    structural = [m for m in reading.matches if named is None or m.reading != named.reading]
    if structural and named is None and structural[0].layout != table.POST_NORM:  # post-norm: `read` checked it
        reason = structure.forward_problem(module)
        if reason is not None:
            return None, reason, reading
    matches += structural
    first_failure, tried = None, 0
    for match in matches:
        reason = checks.match_problem(module, match)
        if reason is None and not verify:
            reason = "read from its structure, which is trusted only once verified (patch(verify=False))"
        if reason is None:
            tried += 1
            weight = module._modules[match.linears[0]].weight
            key = (structure.fingerprint(module), weight.dtype, weight.device, backend, match.reading, match.how)
            if key not in verdicts:
                try:
                    block = build(module, match, backend)
                    exact = block if backend == "torch" else build(module, match, "torch")
                except Exception as exc:  # noqa: BLE001 - a module the block cannot adopt is left, with why
                    verdicts[key] = f"the fused forward failed: the block cannot be built ({one_line(exc)})"
                else:
                    verdicts[key] = verify_block(module, block, exact, training=match.how == structure.STRUCTURE)
            reason = verdicts[key]
            if reason is None:
                return match, None, reading
        first_failure = first_failure or reason
        if not reason.startswith(_READING_FAILURES):
            break  # a problem of the module, not of the reading: every other reading has it too
    if named_reason is not None:
        return None, named_reason, reading
    if tried > 1 and first_failure.startswith(_READING_FAILURES[0]):
        if reading.unknown and not reading.held:
            return None, f"unknown activation {reading.unknown[0]}", reading
        return None, f"its forward is none of the {tried} fused readings tried (the first: {first_failure})", reading
    return None, first_failure, reading


_READING_FAILURES = ("the fused block's output differs", "the fused block's output has shape", "the fused forward")


def build(module: nn.Module, match: structure.Match, backend: str, recompute: bool = False) -> blocks.PatchedBlock:
    """The fused block for a module as `match` reads it."""
    if match.layout == table.GATED:
        return blocks.GatedBlock(module, match.family, match.linears, match.activation, backend,
                                 dropout=match.dropout, gate_multiplier=match.gate_multiplier,
                                 down_multiplier=match.down_multiplier, gate_second=match.gate_second,
                                 recompute=recompute)
    if match.layout == table.TWO_LAYER:
        return blocks.TwoLayerBlock(module, match.family, match.linears, match.activation, backend,
                                    dropout=match.dropout, transposed=match.transposed,
                                    dropout_after=match.dropout_after)
    if match.layout == table.POST_NORM:
        return blocks.PostNormBlock(module, match.family, match.linears, backend, dropout=match.dropout,
                                    norm=match.norm)
    return blocks.LinearActBlock(module, match.family, match.linears, match.activation, backend)
