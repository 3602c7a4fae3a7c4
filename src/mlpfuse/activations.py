"""Every activation mlpfuse knows, defined once.

Each entry carries its name, aliases, a torch forward, its derivative as a formula (d act / d x: the documented
math, checked against autograd), a vector-Jacobian product `vjp(grad, x) = grad · act'(x)` through PyTorch's own
fused backward kernels where it has one (what the torch backend runs: one kernel, like eager autograd), and an
integer id. Triton kernels take that id as a `tl.constexpr` and call
`act_fwd` / `act_grad` below, so the branch is resolved at compile time and every kernel shares one definition.

Math (x is the pre-activation, in fp32 inside kernels):
    gelu_tanh(x) = 0.5·x·(1 + tanh(a)) = x·σ(2a),  a = √(2/π)·(x + 0.044715·x³)
        d/dx     = 0.5·(1 + t) + 0.5·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²),  t = tanh(a)
    gelu(x)      = 0.5·x·(1 + erf(x/√2)),   d/dx = 0.5·(1 + erf(x/√2)) + x·exp(−x²/2)/√(2π)
    silu(x)      = x·σ(x),                  d/dx = σ(x)·(1 + x·(1 − σ(x)))
    relu(x)      = max(x, 0),               d/dx = [x > 0]
    relu2(x)     = max(x, 0)²,              d/dx = 2·max(x, 0)
    quick_gelu(x) = x·σ(1.702·x),           d/dx = σ(1.702x)·(1 + 1.702·x·(1 − σ(1.702x)))   (CLIP's QuickGELU)
NaN propagates through every forward (relu is written so that NaN stays NaN).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mlpfuse.errors import InputError

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Ids shared by the Python table and the Triton kernels. 0 means "no activation" (identity).
IDENTITY, GELU_TANH, GELU, SILU, RELU, RELU2, QUICK_GELU = 0, 1, 2, 3, 4, 5, 6
QUICK_GELU_SCALE = 1.702  # QuickGELU's slope inside the sigmoid (CLIP, OWL-ViT, X-CLIP, ...)


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x * _INV_SQRT_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(QUICK_GELU_SCALE * x)


def _quick_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(QUICK_GELU_SCALE * x)
    return s * (1 + QUICK_GELU_SCALE * x * (1 - s))


@dataclass(frozen=True)
class Activation:
    name: str
    id: int
    aliases: tuple[str, ...]
    forward: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor], torch.Tensor]
    vjp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


_aten = torch.ops.aten

_TABLE = (
    Activation("identity", IDENTITY, ("none", "linear"), lambda x: x, torch.ones_like, lambda dy, x: dy),
    Activation(
        "gelu_tanh",
        GELU_TANH,
        ("gelu_pytorch_tanh", "gelu_new"),
        lambda x: F.gelu(x, approximate="tanh"),
        _gelu_tanh_grad,
        lambda dy, x: _aten.gelu_backward(dy, x, approximate="tanh"),
    ),
    Activation("gelu", GELU, (), F.gelu, _gelu_grad, lambda dy, x: _aten.gelu_backward(dy, x)),
    Activation("silu", SILU, ("swish",), F.silu, _silu_grad, lambda dy, x: _aten.silu_backward(dy, x)),
    Activation(
        "relu", RELU, (), torch.relu, lambda x: (x > 0).to(x.dtype), lambda dy, x: _aten.threshold_backward(dy, x, 0)
    ),
    Activation(
        "relu2", RELU2, (), lambda x: torch.relu(x).square(), lambda x: 2 * torch.relu(x),
        lambda dy, x: dy * (2 * torch.relu(x)),
    ),
    Activation("quick_gelu", QUICK_GELU, ("quickgelu",), _quick_gelu, _quick_gelu_grad,
               lambda dy, x: dy * _quick_gelu_grad(x)),
)
_BY_NAME = {name: a for a in _TABLE for name in (a.name, *a.aliases)}

NAMES = tuple(a.name for a in _TABLE if a.id != IDENTITY)
IDS = frozenset(a.id for a in _TABLE)


def get(name: str | None, *, argument: str = "activation") -> Activation:
    """Look an activation up by name or alias; None means identity. Unknown names raise InputError."""
    if name is None:
        return _TABLE[0]
    if isinstance(name, Activation):
        return name
    try:
        return _BY_NAME[str(name).lower()]
    except KeyError:
        valid = ", ".join(sorted(n for n in _BY_NAME if n not in ("identity", "none", "linear")))
        raise InputError(f"{argument}: unknown activation {name!r}; expected one of {valid} or None") from None


# Probe points that tell the activations apart: both signs, from 1e-6 (where gelu, silu and quick_gelu share their
# slope and part at second order) to 60 (a clipped GELU, a saturating tail), and 0.
_MAGNITUDES = torch.cat([torch.logspace(-6, 0, 49, dtype=torch.float64), torch.linspace(1.25, 60, 236,
                                                                                         dtype=torch.float64)])
PROBES = torch.cat([-_MAGNITUDES.flip(0), torch.zeros(1, dtype=torch.float64), _MAGNITUDES])
# float64 carries ~16 digits; one activation written two ways (gelu_tanh as x·σ(2a), transformers' FastGELU with
# √(2/π) cut to ten digits) agrees to ~1e-12. The closest two different ones (gelu, gelu_tanh) part by ~1e-4.
IDENTITY_TOLERANCE = 1e-9


def identify(fn: Callable[[torch.Tensor], torch.Tensor]) -> Optional[str]:
    """The name of the activation `fn` computes, decided on numbers: `fn` and each activation here evaluated in
    float64 on PROBES, equal to IDENTITY_TOLERANCE at every point (relative beyond 1), else None. A function that
    raises, returns another shape or leaves float64 equals none. Whoever calls this passes a copy of anything that
    keeps state."""
    x = PROBES.clone()
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - a callable that cannot take a float64 vector computes none of these
        return None
    if not isinstance(y, torch.Tensor) or y.shape != PROBES.shape or y.dtype != torch.float64:
        return None
    for act in _TABLE:
        ref = act.forward(PROBES)
        if bool(((y - ref).abs() <= IDENTITY_TOLERANCE * (1 + ref.abs())).all()):
            return act.name
    return None


try:  # Triton forms: only where Triton is installed (never needed by the profiler or the torch backend).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

if triton is not None:
    # Compiled kernels may only read globals that are constexpr; the interpreter does not enforce it.
    _K_GELU_TANH, _K_GELU, _K_SILU = tl.constexpr(GELU_TANH), tl.constexpr(GELU), tl.constexpr(SILU)
    _K_RELU, _K_RELU2, _K_QUICK_GELU = tl.constexpr(RELU), tl.constexpr(RELU2), tl.constexpr(QUICK_GELU)

    # The interpreter cannot run inline PTX; read once, as triton.jit fixes the mode when a kernel is defined.
    _K_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

    @triton.jit
    def _inv_1p_exp2(w):
        """1 / (1 + 2^w) in two SFU instructions: ex2 and rcp, approximate (≤ 2 ulp), denormals flushed.

        IEEE division and non-flushing exp2 each add range fix-ups (~10 instructions per element); in a GEMM's
        epilogue that is time the next tile's main loop waits for. Saturates cleanly (2^w = inf gives 0) and keeps
        NaN."""
        if _K_INTERPRET:
            return 1.0 / (1.0 + tl.exp2(w))
        else:
            e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [w], dtype=tl.float32, is_pure=True,
                                          pack=1)
            return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32,
                                             is_pure=True, pack=1)

    @triton.jit
    def _sigmoid(z):
        return _inv_1p_exp2(z * -1.4426950408889634)

    @triton.jit
    def _sigmoid_2a(x):
        """σ(2a) for gelu_tanh's a = √(2/π)·(x + 0.044715·x³), folded into one exponent: −2·log2(e)·a."""
        return _inv_1p_exp2(x * (-2.302208198144325 - 0.1029432395800235 * (x * x)))

    @triton.jit
    def act_fwd(x, ACT: tl.constexpr):
        """act(x) for fp32 x; ACT is one of the ids above.

        gelu_tanh uses 0.5·(1 + tanh(a)) = σ(2a), so it costs one sigmoid: exact algebra, not an approximation."""
        if ACT == _K_GELU_TANH:
            return x * _sigmoid_2a(x)
        elif ACT == _K_GELU:
            return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        elif ACT == _K_SILU:
            return x * _sigmoid(x)
        elif ACT == _K_RELU:
            return tl.where(x < 0.0, 0.0, x)
        elif ACT == _K_RELU2:
            r = tl.where(x < 0.0, 0.0, x)
            return r * r
        elif ACT == _K_QUICK_GELU:
            return x * _sigmoid(x * 1.702)
        else:
            return x

    @triton.jit
    def act_grad(x, ACT: tl.constexpr):
        """d act / d x for fp32 x."""
        if ACT == _K_GELU_TANH:
            # With s = σ(2a): 0.5·(1 + t) = s and 0.5·(1 − t²) = 2·s·(1 − s).
            s = _sigmoid_2a(x)
            return s + 2.0 * x * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        elif ACT == _K_GELU:
            return 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        elif ACT == _K_SILU:
            s = _sigmoid(x)
            return s * (1.0 + x * (1.0 - s))
        elif ACT == _K_RELU:
            return tl.where(x > 0.0, 1.0, 0.0)
        elif ACT == _K_RELU2:
            return 2.0 * tl.where(x > 0.0, x, 0.0)
        elif ACT == _K_QUICK_GELU:
            s = _sigmoid(x * 1.702)
            return s * (1.0 + 1.702 * x * (1.0 - s))
        else:
            return x * 0.0 + 1.0
