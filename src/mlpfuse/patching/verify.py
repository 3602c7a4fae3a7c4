"""Whether a fused block computes what the module it would replace computes, on numbers.

Two checks, each on random weights put in for the call (torch.func.functional_call) and not the model's: a
zero-initialised projection would let any reading of the module pass.

1. The math, in float64, whatever the model's dtype: both run on float64 rows whose scales span 1e-3 to 30 (both
   signs; activations that agree near zero part further out, and the reverse), and each output row must equal the
   module's to MATH_TOLERANCE of its own size. Two activations that differ anywhere on those rows (QuickGELU and
   the tanh GELU differ by up to 0.06 at 1) cannot pass, in bf16 as in fp32, so `patch` decides the same for a
   model in any dtype, and `patch --dry-run`'s float32 copy decides what `patch` on the bf16 model does.
2. The rounding, in the model's dtype, on unit-scale rows: the fused block's error against the float64 result of
   the same rounded weights and input must stay within twice the module's own error plus one unit of the dtype's
   rounding (`rounding_bound`). The module's own error is what the dtype and the layer's size cost it (more rounded
   steps, longer sums): the fused block, which rounds fewer intermediates, may not do worse than that.

Eval mode decides the role assignment; the one kept is run again in training mode from the same random state, so a
dropout the module applies without holding a dropout child (F.dropout on a rate it stores) shows as a difference.
Nothing of the caller's changes: the model's weights, modes and random state are as they were.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from mlpfuse.patching import table
from mlpfuse.patching.structure import projection

ROWS = (2, 3)  # batch × tokens: a module that mixes tokens differs from a per-row MLP here
# Row scales of the float64 check: the pre-activations then reach from ~1e-3 (second-order terms decide: silu,
# gelu and quick_gelu share their slope at 0) to ~30 (a clipped GELU, a saturating tail).
SCALES = (1e-3, 0.05, 1.0, 4.0, 30.0, -1.0)
# float64 carries 16 digits; the same math written two ways (gelu_tanh as x·σ(2a)) agrees to ~1e-15 of a row. The
# closest two distinct activations mlpfuse knows (gelu and gelu_tanh) differ by ~1e-4 of a row on these scales.
MATH_TOLERANCE = 1e-9


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def rounding_bound(dtype: torch.dtype, module_error: float) -> float:
    """The largest error against float64 a fused block may have in `dtype`, where the module it replaces has
    `module_error` on the same rows: twice that plus the dtype's machine epsilon."""
    return 2 * module_error + torch.finfo(dtype).eps


def verify_block(source: nn.Module, block: nn.Module, exact: nn.Module, *, training: bool = False) -> Optional[str]:
    """None when `block` computes what `source` computes, else why not: the math in float64 through `exact`, the
    same reading on the torch backend (the kernels take no float64), the rounding in the model's dtype through
    `block` itself; eval mode, and with `training` the math again in training mode from one random state."""
    first = source._modules[block.fused_linears[0]]
    proj = projection(block.fused_linears[0], first)
    weight = first.weight
    gen, where = _generator(weight.device)
    widths = (proj.d_in,) + ((proj.d_out,) if block.fused_layout == table.POST_NORM else ())  # post-norm: residual

    # Random weights rounded to the model's dtype, and the same values in float64 for the two float64 runs: one
    # float64 copy of the weights at a time (4x a bf16 layer's bytes), on the model's device.
    rounded = _random_parameters(source, gen, where, weight.dtype)
    exact_params = {k: _double(v) for k, v in rounded.items()}

    # 1. The math.
    n = ROWS[0] * ROWS[1]
    scale = torch.tensor(SCALES * n, dtype=torch.float64, device=where)[:n].view(*ROWS, 1)
    wide = tuple((torch.randn(*ROWS, w, generator=gen, device=where, dtype=torch.float64) * scale).to(weight.device)
                 for w in widths)
    reason = _compare_math(source, exact, wide, exact_params, False)
    if reason is None and training:
        reason = _compare_math(source, exact, wide, exact_params, True)
        if reason is not None:
            return reason + " in training mode (a dropout it applies without a dropout child?)"
    if reason is not None or (block is exact and weight.dtype == torch.float64):
        return reason

    # 2. The rounding, in the model's dtype: unit-scale rows rounded to it, against float64 on the same values.
    rows = tuple(torch.randn(*ROWS, w, generator=gen, device=where).to(weight.device, weight.dtype) for w in widths)
    pair = (source, block)
    ref = _forward(pair, exact_params, tuple(x.double() for x in rows), False)
    del exact_params
    expected = _forward(pair, rounded, rows, False)
    got = _forward(pair, rounded, rows, False, fused=True)
    reason = next((r for r in (ref, expected, got) if isinstance(r, str)), None) or _shape_problem(expected, got)
    if reason is not None:
        return reason
    own, err = row_error(expected, ref), row_error(got, ref)
    bound = max(rounding_bound(weight.dtype, own), MATH_TOLERANCE)  # float64: the math's own tolerance
    if not err <= bound:
        return (f"the fused block's output differs from the module's own (relative error {err:.2g} against float64, "
                f"over {bound:.2g}: twice the module's own {own:.2g} plus {weight.dtype}'s epsilon)")
    return None


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _generator(device: torch.device) -> tuple[torch.Generator, torch.device]:
    try:
        gen, where = torch.Generator(device=device), device
    except RuntimeError:
        gen, where = torch.Generator(), torch.device("cpu")
    gen.manual_seed(0)
    return gen, where


def _random_parameters(source: nn.Module, gen: torch.Generator, where: torch.device, dtype: torch.dtype) -> dict:
    """Weights of the source's shapes with unit-scale outputs (std 1/√fan-in), biases small, rounded to `dtype`;
    its buffers as they are."""
    out = {}
    for name, p in source.named_parameters():
        owner, _, kind = name.rpartition(".")
        proj = projection(owner, source.get_submodule(owner)) if owner else None
        std = 0.1 if p.dim() < 2 else (proj.d_in if proj is not None else p.shape[-1]) ** -0.5
        value = torch.randn(p.shape, generator=gen, device=where, dtype=torch.float64) * std
        out[name] = value.to(p.device, dtype if p.is_floating_point() else p.dtype)
    out.update(source.named_buffers())
    return out


def _forward(pair: tuple, params: dict, inputs: tuple, training: bool, fused: bool = False):
    """The output of the pair's source (or, `fused`, its block) with `params` put in, both in the given mode (the
    block may call the source's forward), from a fixed random state; a string saying why when it raised or returned
    something other than one tensor."""
    module = pair[1] if fused else pair[0]
    states = [(m, m.training) for m in {id(m): m for p in pair for m in p.modules()}.values()]
    device = inputs[0].device
    try:
        for m, _ in states:
            m.training = training
        with torch.no_grad(), _random_state_kept(device):
            _reseed(device)
            out = functional_call(module, params, inputs)
    except Exception as exc:  # noqa: BLE001 - a module that cannot run alone is left, with why
        if fused:
            return f"the fused forward failed: {one_line(exc)}"
        return f"its forward raised on random rows: {one_line(exc)}"
    finally:
        for m, state in states:
            m.training = state
    if not fused and not isinstance(out, torch.Tensor):
        return f"its forward returns a {type(out).__name__}, not one tensor"
    return out


def _shape_problem(expected: torch.Tensor, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = list(getattr(got, "shape", []))
        return f"the fused block's output has shape {shape}, the module's {list(expected.shape)}"
    return None


def differs(got, want: torch.Tensor, bound: float, what: str, oracle: str) -> Optional[str]:
    """None when `got` is a tensor of `want`'s shape within `bound` of it row by row (row_error; NaN never passes),
    else why not, naming `what` and its `oracle`."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"{what} returned another shape"
    err = row_error(got, want)
    if not err <= bound:
        return f"{what} differs from {oracle} (relative error {err:.2g})"
    return None


def row_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest error of a row of `got` against the same row of `ref`, relative to that row's size (float64).
    NaN stays NaN, and no bound passes it."""
    ref = ref.double().reshape(-1, ref.shape[-1]) if ref.dim() else ref.double().view(1, 1)
    diff = got.double().reshape(ref.shape) - ref
    size = torch.linalg.vector_norm(ref, dim=-1)
    err = torch.linalg.vector_norm(diff, dim=-1) / torch.where(size > 0, size, 1.0)
    return float(err.max()) if err.numel() else 0.0


def _compare_math(source, block, inputs: tuple, params, training: bool) -> Optional[str]:
    expected = _forward((source, block), params, inputs, training)
    got = _forward((source, block), params, inputs, training, fused=True)
    reason = next((r for r in (expected, got) if isinstance(r, str)), None) or _shape_problem(expected, got)
    if reason is not None:
        return reason
    if expected.dtype != torch.float64:
        return f"its forward returns {expected.dtype} on float64 rows: its math cannot be checked exactly"
    err = row_error(got, expected)
    if not err <= MATH_TOLERANCE:
        return (f"the fused block's output differs from the module's own in float64 (relative error {err:.2g} > "
                f"{MATH_TOLERANCE:g}): another function")
    return None


@contextlib.contextmanager
def _random_state_kept(device: torch.device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def _reseed(device: torch.device) -> None:
    torch.default_generator.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()] \
            .manual_seed(0)
