"""`patch(model, precision="fp8")`: each swapped gated or two-layer block's projections quantized into the FP8 recipe
(mlpfuse.fp8) once, at patch time, and the high-precision weights dropped. On a model in train mode, each swapped
gated block instead keeps its weights (the optimizer's masters) and trains in FP8: every call quantizes them and runs
every GEMM of its forward and backward in e4m3 (ops.fp8_train), g and u kept in FP8 for the backward.

A block is quantized only after its FP8 output is checked on numbers, on its own weights: random rows in the model's
dtype, at a decode size (the weight-only kernels) and a prefill size (x and h quantized, FP8 GEMMs), against the
float64 MLP of the same weights, elementwise within the recipe's propagated bound
(reference.gated_mlp_fp8_bound: every rounding the recipe makes, the tensor cores' accumulation on a GPU, and the
cast to the model's dtype). A block that cannot run in FP8 here, or does not meet the bound, stays fused in its
dtype, and the report says why. The measured error (‖Δy‖/‖y‖ at the prefill size) is in the report for every block
quantized.

The quantized projections (modules.Fp8Linear, transformers' FP8Linear keys) replace the originals in the block and in
the module it replaced, so nothing holds the old weights; `unpatch` puts back nn.Linear modules holding the
dequantized weights (lossy) — for a two-layer block its own projections (nn.Linear or GPT-2's Conv1D, [in, out])
with the dequantized weight in their layout.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from mlpfuse import reference
from mlpfuse.errors import InputError
from mlpfuse.modules import Fp8Linear, _sharded
from mlpfuse.ops import fp8_mlp
from mlpfuse.patching import blocks, checks
from mlpfuse.patching.report import Left

ROWS = (fp8_mlp.WEIGHT_ONLY_MAX_M // 2, 2 * fp8_mlp.WEIGHT_ONLY_MAX_M + 1)  # one decode size, one prefill size
_OUT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def quantize_blocks(model: nn.Module, report) -> None:
    """Quantize every gated block `report` swapped in `model`; record what was quantized and what was kept, why.
    A block over a FineGrainedFP8 checkpoint's projections (transformers' FP8Linear) adopts their values and scales
    as they are; one that cannot run them is put back, with why, as it cannot run in another dtype."""
    adopted_failed = []
    for i, swapped in enumerate(report.swapped):
        block = model.get_submodule(swapped.path)
        source = block.fused_source
        if any(checks.is_fp8_checkpoint(source._modules.get(n)) for n in getattr(block, "fused_linears", ())):
            error, reason = _adopt(block, _compute_dtype(model))
            if reason is None:
                report.swapped[i] = dataclasses.replace(swapped, precision="fp8", fp8_error=error,
                                                        fp8_checkpoint=True)
            else:
                adopted_failed.append((i, reason))
            continue
        if not isinstance(block, (blocks.GatedBlock, blocks.TwoLayerBlock)):
            report.fp8_kept.append(Left(swapped.path, type(source).__name__,
                                        f"a {block.fused_layout} block: FP8 covers gated and two-layer MLPs"))
            continue
        if block.fused_precision:
            continue
        error, reason = _train_in_fp8(block) if model.training else _quantize(block)
        if reason is not None:
            report.fp8_kept.append(Left(swapped.path, type(source).__name__, reason))
        else:
            report.swapped[i] = dataclasses.replace(swapped, precision=block.fused_precision, fp8_error=error)
    for i, reason in reversed(adopted_failed):
        swapped = report.swapped.pop(i)
        parent, _, name = swapped.path.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        holder._modules[name] = holder._modules[name].fused_source
        report.left.append(Left(swapped.path, swapped.source, reason))


def _compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a FineGrainedFP8 model computes in: its high-precision parameters' (norms, embeddings)."""
    return next((p.dtype for p in model.parameters() if p.dtype in _OUT_ROUNDOFF), torch.bfloat16)


def _adopt(block, dtype: torch.dtype) -> tuple[Optional[float], Optional[str]]:
    """A FineGrainedFP8 block's projections as modules.Fp8Linear over the same values and scales (nothing quantized,
    nothing copied but e8m0 scales widened), checked against the recipe in float64 on the dequantized weights; the
    module it replaced keeps its FP8Linear children, which `unpatch` gives back."""
    if not isinstance(block, blocks.GatedBlock):
        return None, f"a FineGrainedFP8 {block.fused_layout} block: checkpoints run as they are for gated MLPs"
    if block.fused_in_scale != 1.0 or block.fused_out_scale != 1.0:
        return None, "gate or down multipliers (scaled inputs): not in the FP8 path"
    mods = block._modules
    names = block.fused_linears
    sources = [mods[n] for n in names]
    if not all(checks.is_fp8_checkpoint(m) for m in sources):
        return None, "some of its projections are FineGrainedFP8 and some are not"
    if block.fused_packed and block.fused_hidden % 128:
        return None, (f"a packed gate_up projection whose halves ({block.fused_hidden} rows) are not a whole number "
                      f"of 128-row scale blocks")
    try:
        fp8_mlp.check_device(sources[0].weight.device, block.fused_backend)
        children = [Fp8Linear.from_fp8(m.weight, m.weight_scale_inv, m.bias, dtype, prefix=f"{n}.")
                    for n, m in zip(names, sources)]
    except InputError as exc:
        return None, str(exc)
    with torch.no_grad():
        weights = [c.fp8_weight().dequantize(torch.float64) for c in children]
        biases = [None if c.bias is None else c.bias.detach() for c in children]
        error, reason = _verify(block, weights, biases, dtype, lambda x: block.fp8_call(x, children))
    if reason is not None:
        return None, reason
    for name, child in zip(names, children):
        mods[name] = child
    block.fused_precision = "fp8"
    return error, None


def _unfit(block, weights) -> Optional[str]:
    """Why the block's projections (`weights` in its layout) cannot run in FP8, or None."""
    dtype = weights[0].dtype
    if any(w.dtype != dtype for w in weights):
        return f"projections in different dtypes ({', '.join(str(w.dtype) for w in weights)})"
    if dtype not in _OUT_ROUNDOFF:
        return f"weights in {dtype}"
    if any(_sharded(w) for w in weights):
        return "sharded (DTensor) weights: quantize before tensor parallelism"
    if getattr(block, "fused_in_scale", 1.0) != 1.0 or getattr(block, "fused_out_scale", 1.0) != 1.0:
        return "gate or down multipliers (scaled inputs): not in the FP8 path"
    try:
        fp8_mlp.check_device(weights[0].device, block.fused_backend)
    except InputError as exc:
        return str(exc)
    return None


def _train_in_fp8(block) -> tuple[Optional[float], Optional[str]]:
    """(error, None) when the block now trains in FP8 on its own weights (checked on numbers as a quantized block
    is), (None, why not) when it stays in its dtype."""
    if not isinstance(block, blocks.GatedBlock):
        return None, f"a {block.fused_layout} block: FP8 training covers gated MLPs"
    linears = [block._modules[n] for n in block.fused_linears]
    reason = _unfit(block, [m.weight for m in linears])
    if reason is not None:
        return None, reason
    with torch.no_grad():
        error, reason = _verify(block, [m.weight.detach() for m in linears],
                                [None if m.bias is None else m.bias.detach() for m in linears], linears[0].weight.dtype,
                                block.fp8_train_call)
    if reason is not None:
        return None, reason
    block.fused_precision = "fp8-train"
    return error, None


def _quantize(block) -> tuple[Optional[float], Optional[str]]:
    """(error, None) when the block was quantized, (None, why not) when it stays in its dtype."""
    mods = block._modules
    names = block.fused_linears
    linears = [mods[n] for n in names]
    transposed = getattr(block, "fused_transposed", False)  # GPT-2's Conv1D keeps its weight [in, out]
    weights = [m.weight.t() if transposed else m.weight for m in linears]
    dtype = weights[0].dtype
    reason = _unfit(block, weights)
    if reason is not None:
        return None, reason
    if getattr(block, "fused_packed", False) and block.fused_hidden % 128:
        return None, (f"a packed gate_up projection whose halves ({block.fused_hidden} rows) are not a whole number "
                      f"of 128-row scale blocks")
    with torch.no_grad():
        fp8_children = [Fp8Linear.from_weight(w.contiguous(), m.bias) if transposed else Fp8Linear.from_linear(m)
                        for w, m in zip(weights, linears)]
        error, reason = _verify(block, [w.detach() for w in weights],
                                [None if m.bias is None else m.bias.detach() for m in linears], dtype,
                                lambda x: block.fp8_call(x, fp8_children))
    if reason is not None:
        return None, reason
    source = block.fused_source
    two_layer = isinstance(block, blocks.TwoLayerBlock)
    for name, child, original in zip(names, fp8_children, linears):
        mods[name] = child
        if source._modules.get(name) is not None:
            source._modules[name] = child  # the original projection (and its weight) is no longer held
        if two_layer:  # kept for unpatch, its weight dropped: it comes back in the projection's own layout
            original._parameters["weight"] = None
            block.fused_fp8_originals[name] = original
    block.fused_precision = "fp8"
    return error, None


def _verify(block, w: list, b: list, dtype: torch.dtype, call) -> tuple[Optional[float], Optional[str]]:
    """`call` (the block's FP8 computation) against the float64 MLP of the high-precision weights `w` and biases `b`
    (in the block's layout), inputs in `dtype`: (error, None), or (None, why) where it exceeds the recipe's bound."""
    if isinstance(block, blocks.TwoLayerBlock):  # y = proj(act(fc(x))): no up projection
        (wg, wd), (bg, bd), wu, bu = w, b, None, None
    elif block.fused_packed:
        (wg, wu), (bg, bu) = block.fused_halves(w[0], block.fused_hidden), block.fused_halves(b[0], block.fused_hidden)
        wd, bd = w[1], b[1]
    else:
        (wg, wu, wd), (bg, bu, bd) = w, b
    device = wg.device
    gen = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
    gen.manual_seed(0)
    accumulation = reference.FP8_MMA_ACCUMULATION if device.type == "cuda" else reference.FP32_ACCUMULATION
    error = 0.0
    for rows in ROWS:
        x = torch.randn(rows, wg.shape[1], generator=gen, device=device).to(dtype)
        try:
            y = call(x)
        except Exception as exc:  # noqa: BLE001 - a block the FP8 path cannot run stays in its dtype, with why
            return None, f"the FP8 forward failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        d = [None if t is None else t.double() for t in (wg, wu, wd, bg, bu, bd)]
        y64, bound = reference.gated_mlp_fp8_bound(x.double(), *d[:3], block.fused_activation, *d[3:],
                                                   out_roundoff=_OUT_ROUNDOFF[dtype], accumulation=accumulation)
        diff = (y.double() - y64).abs()
        if not bool((diff <= bound).all()):
            worst = float((diff / bound).nan_to_num(float("inf")).max())
            return None, (f"its FP8 output at {rows} rows exceeds the recipe's error bound ({worst:.3g}× the bound "
                          f"against float64)")
        error = float((y.double() - y64).norm() / y64.norm().clamp_min(1e-300))
    return error, None


def restore(block) -> None:
    """For `unpatch`: the replaced module's FP8 projections back as nn.Linear modules (dequantized, lossy); a
    two-layer block's as the projections it replaced (nn.Linear, or Conv1D's [in, out]), holding the dequantized
    weight."""
    source = block.fused_source
    originals = getattr(block, "fused_fp8_originals", {})
    for name in block.fused_linears:
        child = source._modules.get(name)
        if not isinstance(child, Fp8Linear):
            continue
        original = originals.get(name)
        if original is None:
            source._modules[name] = child.to_linear()
            continue
        w = child.fp8_weight().dequantize(child.dtype)
        original.weight = nn.Parameter(w.t().contiguous() if block.fused_transposed else w)
        source._modules[name] = original
    originals.clear()
