"""Whether a fused block computes what the module it would replace computes, on numbers.

Both run on the same random rows with the same random weights, put in for the call (torch.func.functional_call)
and not the model's: a zero-initialised projection would let any reading of the module pass. Eval mode decides the
role assignment; the one kept is run again in training mode from the same random state, so a dropout the module
applies without holding a dropout child (F.dropout on a rate it stores) shows as a difference. Nothing of the
caller's changes: the model's weights, modes and random state are as they were.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from mlpfuse.patching import table
from mlpfuse.patching.structure import projection

# Relative error allowed between a fused block and the module it replaces, on the same input, by weight dtype:
# the two round differently (transformers' NewGELU runs its tanh formula op by op), a wrong layout errs by O(1).
VERIFY_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}
ROWS = (2, 3)  # batch × tokens: a module that mixes tokens differs from a per-row MLP here


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def verify_block(source: nn.Module, block: nn.Module, *, training: bool = False) -> Optional[str]:
    """None when `block` computes what `source` computes on random rows and weights (eval mode, and with
    `training` also training mode from one random state), else why not."""
    first = source._modules[block.fused_linears[0]]
    proj = projection(block.fused_linears[0], first)
    weight = first.weight
    gen, where = _generator(weight.device)
    x = torch.randn(*ROWS, proj.d_in, generator=gen, device=where).to(weight.device, weight.dtype)
    inputs = (x,)
    if block.fused_layout == table.POST_NORM:  # and the residual the projection's output is added to
        inputs += (torch.randn(*ROWS, proj.d_out, generator=gen, device=where).to(weight.device, weight.dtype),)
    params = _random_parameters(source, gen, where)
    reason = _compare(source, block, inputs, params, False, weight.dtype)
    if reason is None and training:
        reason = _compare(source, block, inputs, params, True, weight.dtype)
        if reason is not None:
            reason += " in training mode (a dropout it applies without a dropout child?)"
    return reason


def _generator(device: torch.device) -> tuple[torch.Generator, torch.device]:
    try:
        gen, where = torch.Generator(device=device), device
    except RuntimeError:
        gen, where = torch.Generator(), torch.device("cpu")
    gen.manual_seed(0)
    return gen, where


def _random_parameters(source: nn.Module, gen: torch.Generator, where: torch.device) -> dict:
    """Weights of the source's shapes and dtypes with unit-scale outputs (std 1/√fan-in); biases small."""
    out = {}
    for name, p in source.named_parameters():
        owner, _, kind = name.rpartition(".")
        proj = projection(owner, source.get_submodule(owner)) if owner else None
        std = 0.1 if p.dim() < 2 else (proj.d_in if proj is not None else p.shape[-1]) ** -0.5
        value = torch.randn(p.shape, generator=gen, device=where) * std
        out[name] = value.to(p.device, p.dtype)
    return out


def _compare(source, block, inputs: tuple, params, training: bool, dtype) -> Optional[str]:
    modules = {id(m): m for m in (*source.modules(), *block.modules())}.values()
    states = [(m, m.training) for m in modules]
    try:
        for m, _ in states:
            m.training = training
        device = inputs[0].device
        with torch.no_grad(), _random_state_kept(device):
            _reseed(device)
            try:
                expected = functional_call(source, params, inputs)
            except Exception as exc:  # noqa: BLE001 - a module that cannot run alone is left, with why
                return f"its forward raised on random rows: {one_line(exc)}"
            _reseed(device)
            try:
                got = functional_call(block, params, inputs)
            except Exception as exc:  # noqa: BLE001
                return f"the fused forward failed: {one_line(exc)}"
    finally:
        for m, state in states:
            m.training = state
    if not isinstance(expected, torch.Tensor):
        return f"its forward returns a {type(expected).__name__}, not one tensor"
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = list(getattr(got, "shape", []))
        return f"the fused block's output has shape {shape}, the module's {list(expected.shape)}"
    ref = expected.double()
    err = torch.linalg.vector_norm(got.double() - ref).item() / (torch.linalg.vector_norm(ref).item() or 1.0)
    tol = VERIFY_TOLERANCE[dtype]
    if not err <= tol:
        return f"the fused block's output differs from the module's own (relative error {err:.2g} > {tol:g})"
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
