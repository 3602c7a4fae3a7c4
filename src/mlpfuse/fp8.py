"""The FP8 recipe, defined once: e4m3 values with fp32 block scales (DeepSeek-V3, transformers' FineGrainedFP8,
vLLM's block FP8). Every constant, scale shape and group size the FP8 path uses lives here; kernels, modules,
`patch` and the reference path import them rather than restate them.

    values       torch.float8_e4m3fn (largest finite 448, no infinity, unit roundoff 2^-4)
    weight W     [out, in] values + one fp32 `scale_inv` per 128×128 block: [ceil(out/128), ceil(in/128)]
    activation x [..., K] values + one fp32 `scale_inv` per token and 128 consecutive channels: [..., ceil(K/128)]
    dequantized  = values.float() * scale_inv, each scale broadcast over its block

`scale_inv` is the name checkpoints use (dequantized = stored × scale_inv). It is chosen from the group's largest
magnitude so that element lands on 448: scale_inv = amax / 448. Dividing by it, not multiplying by 448/amax,
keeps quantize and dequantize consistent with the one number that is stored.

Edge cases, decided here for every caller:
- A group of zeros gets scale_inv 1 (never 0: 0/0 would make NaN; never inf).
- scale_inv is at least 2^-126, fp32's smallest normal: a subnormal scale keeps few significant bits, and
  amax / (amax/448 rounded down by half) would exceed 448, which torch's cast silently saturates. With the floor,
  groups whose amax is below 448 · 2^-126 ≈ 5e-36 keep an absolute error of 2^-10 · 2^-126 instead.
- Large magnitudes are scaled, never clipped: the amax element maps to 448 (within one fp32 rounding, far from
  464 where e4m3 would round up past its range), so the cast never saturates a finite value.
- Non-finite inputs propagate as float math would: a NaN in a group makes amax, and so scale_inv, NaN, and every
  element of that group dequantizes to NaN. An ±inf makes scale_inv inf; finite elements become 0 and the inf
  becomes inf/inf = NaN, so again every element of that group dequantizes to NaN (0·inf). e4m3fn has no infinity,
  so inf cannot survive as inf; it is never turned into ±448 (which is what a plain cast would do).
- Widths that are not multiples of 128: the last group is partial. Its scale is computed over the real elements
  only (the padding is zeros, which cannot raise an amax), and values keep the tensor's own shape. This is the
  layout of transformers' `FP8Linear` for odd shapes: its `weight_scale_inv` is [ceil(out/128), ceil(in/128)].
- Scales are computed in fp32 whatever the input dtype (the recipe's scale dtype); a float64 input beyond fp32's
  range becomes inf and follows the rule above.

Checkpoint layout (transformers 5.x, `transformers.integrations.finegrained_fp8.FP8Linear` built from
`FineGrainedFP8Config(weight_block_size=(128, 128), activation_scheme="dynamic")`): a projection `p` stores
`p.weight` (float8_e4m3fn, [out, in]) and `p.weight_scale_inv` (float32, [ceil(out/128), ceil(in/128)]), plus
`p.bias` when it has one (kept in the model's dtype, never quantized). Activation scales are not stored: "dynamic"
means they are computed per call, 1×128, as `quantize_activation` does. `Fp8Weight.state_dict` /
`Fp8Weight.from_state_dict` read and write exactly those two keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch import Tensor

from mlpfuse.errors import InputError

DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
UNIT_ROUNDOFF = 2.0**-4  # 3 mantissa bits: round-to-nearest is within 2^-4 relative, for normal values
SUBNORMAL_HALF_SPACING = 2.0**-10  # absolute rounding error below e4m3's smallest normal 2^-6 (spacing 2^-9)
SCALE_DTYPE = torch.float32
MIN_SCALE_INV = 2.0**-126  # fp32's smallest normal: see the module docstring
GROUP = 128  # activations: one scale per token per GROUP consecutive channels (1×128)
BLOCK = (GROUP, GROUP)  # weights: one scale per BLOCK of W [out, in] (128×128)
# Names in a checkpoint (transformers' FP8Linear); the class that holds them there, for `patch` to recognise.
WEIGHT_KEY, SCALE_KEY = "weight", "weight_scale_inv"
TRANSFORMERS_CLASS = "transformers.integrations.finegrained_fp8.FP8Linear"


def _groups(n: int, size: int = GROUP) -> int:
    return -(-n // size)


def _scale_inv(amax: Tensor) -> Tensor:
    """scale_inv = amax / 448, with zeros → 1 and a floor at fp32's smallest normal; NaN and inf pass through
    (NaN < floor is False, so `maximum` would keep NaN anyway, but `where` states it)."""
    # A true division: PyTorch's CUDA kernels turn a division by a Python scalar into a multiplication by its
    # reciprocal, which rounds differently from the correctly rounded amax/448 the kernels and the CPU compute.
    s = torch.clamp_min(amax / torch.full_like(amax, FP8_MAX), MIN_SCALE_INV)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isnan(amax), amax, s)


def _pad_to(t: Tensor, dim: int, size: int) -> Tensor:
    extra = _groups(t.shape[dim], size) * size - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def _expand(scale: Tensor, dim: int, size: int) -> Tensor:
    """Each scale repeated over its group along `dim`, cut to the tensor's real `size` (the last group partial)."""
    return scale.repeat_interleave(GROUP, dim=dim).narrow(dim, 0, size)


# ---- activations: 1×128 ----------------------------------------------------------------------------------------

def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor]:
    """(values, scale_inv): values float8_e4m3fn of x's shape; scale_inv fp32 [..., ceil(K/128)], one per token and
    128 consecutive channels of the last dimension (any leading dimensions)."""
    if not x.is_floating_point() or x.dtype == DTYPE or x.dim() == 0:
        raise InputError(f"x: expected a floating-point tensor with at least one dimension, got {x.dtype} "
                         f"of shape {list(x.shape)}")
    k = x.shape[-1]
    xf = x.to(SCALE_DTYPE)
    grouped = _pad_to(xf, -1, GROUP).unflatten(-1, (_groups(k), GROUP))
    scale_inv = _scale_inv(grouped.abs().amax(-1))
    values = (xf / _expand(scale_inv, -1, k)).to(DTYPE)
    return values, scale_inv


def dequantize_activation(values: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """values · scale_inv (each scale over its 1×128 group), computed in fp32, returned in `dtype`."""
    _check_activation_scales(values, scale_inv)
    return (values.to(SCALE_DTYPE) * _expand(scale_inv, -1, values.shape[-1])).to(dtype)


def channel_scales(t: Tensor) -> Tensor:
    """scale_inv fp32 [N] of t [M, N] quantized per channel: one scale per column over all M rows (FP8 training's
    weight gradients: the operand that is not grouped along the tokens)."""
    if not t.is_floating_point() or t.dtype == DTYPE or t.dim() != 2:
        raise InputError(f"t: expected a 2-D floating-point tensor, got {t.dtype} of shape {list(t.shape)}")
    if t.shape[0] == 0:
        return torch.ones(t.shape[1], device=t.device, dtype=SCALE_DTYPE)
    return _scale_inv(t.abs().amax(0).to(SCALE_DTYPE))


def quantize_channels(t: Tensor) -> tuple[Tensor, Tensor]:
    """(values, scale_inv): t [M, N] quantized per channel (channel_scales), the values returned transposed —
    float8_e4m3fn [N, M], row n holding column n over the M rows: a GEMM's operand along M."""
    scale_inv = channel_scales(t)
    return (t.to(SCALE_DTYPE) / scale_inv).to(DTYPE).t().contiguous(), scale_inv


def _check_activation_scales(values: Tensor, scale_inv: Tensor) -> None:
    if values.dtype != DTYPE:
        raise InputError(f"values: expected dtype {DTYPE}, got {values.dtype}")
    if scale_inv.dtype != SCALE_DTYPE:
        raise InputError(f"scale_inv: expected dtype {SCALE_DTYPE}, got {scale_inv.dtype}")
    expected = [*values.shape[:-1], _groups(values.shape[-1])]
    if list(scale_inv.shape) != expected:
        raise InputError(f"scale_inv: shape {list(scale_inv.shape)} does not match activation values "
                         f"{list(values.shape)} in 1×{GROUP} groups (expected {expected})")


# ---- weights: 128×128 ------------------------------------------------------------------------------------------

def weight_scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The shape of a [out, in] weight's `weight_scale_inv`: one per 128×128 block, the last ones partial."""
    return _groups(out_features, BLOCK[0]), _groups(in_features, BLOCK[1])


@dataclass(frozen=True)
class Fp8Weight:
    """A weight W [out, in] in the recipe: `values` (float8_e4m3fn, W's shape), `scale_inv` (fp32, one per 128×128
    block) and `dtype`, the dtype it was quantized from and dequantizes to by default (a checkpoint does not
    record it: the model's dtype). Immutable; `to` returns a new one. The same object serves the module, the
    state_dict, `patch` and the reference path."""

    values: Tensor
    scale_inv: Tensor
    dtype: torch.dtype = torch.bfloat16

    block = BLOCK

    def __post_init__(self):
        _check_weight(self.values, self.scale_inv, "")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """values · scale_inv, each scale over its 128×128 block, computed in fp32, returned in `dtype` (default:
        the dtype it was quantized from)."""
        out, inp = self.values.shape
        scale = _expand(_expand(self.scale_inv, 0, out), 1, inp)
        return (self.values.to(SCALE_DTYPE) * scale).to(dtype or self.dtype)

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.values.to(device), self.scale_inv.to(device), self.dtype)

    def state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """{prefix + "weight": values, prefix + "weight_scale_inv": scale_inv}: transformers' FP8Linear keys."""
        return {prefix + WEIGHT_KEY: self.values, prefix + SCALE_KEY: self.scale_inv}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], prefix: str = "", *,
                        dtype: torch.dtype = torch.bfloat16) -> "Fp8Weight":
        """Read `prefix + "weight"` and `prefix + "weight_scale_inv"`, checked: each wrong dtype, shape or device
        raises one InputError line naming the tensor. Float8_e8m0fnu scales (transformers' scale_fmt="ue8m0",
        powers of two) are widened to fp32, which is exact."""
        tensors = []
        for key in (WEIGHT_KEY, SCALE_KEY):
            name = prefix + key
            if name not in state:
                raise InputError(f"{name}: missing from the state dict")
            t = state[name]
            if not isinstance(t, Tensor):
                raise InputError(f"{name}: expected a tensor, got {type(t).__name__}")
            tensors.append(t)
        values, scale_inv = tensors
        if scale_inv.dtype == getattr(torch, "float8_e8m0fnu", None):
            scale_inv = scale_inv.to(SCALE_DTYPE)
        _check_weight(values, scale_inv, prefix)
        return cls(values, scale_inv, dtype)


def _check_weight(values: Tensor, scale_inv: Tensor, prefix: str) -> None:
    """Structure only (dtype, shape, device): reading the scales' values would synchronise a GPU."""
    w, s = prefix + WEIGHT_KEY, prefix + SCALE_KEY
    if values.dtype != DTYPE:
        raise InputError(f"{w}: expected dtype {DTYPE}, got {values.dtype}")
    if values.dim() != 2:
        raise InputError(f"{w}: expected a 2-D [out, in] weight, got shape {list(values.shape)}")
    if scale_inv.dtype != SCALE_DTYPE:
        raise InputError(f"{s}: expected dtype {SCALE_DTYPE}, got {scale_inv.dtype}")
    expected = list(weight_scale_shape(*values.shape))
    if list(scale_inv.shape) != expected:
        raise InputError(f"{s}: shape {list(scale_inv.shape)} does not match {w} {list(values.shape)} in "
                         f"{BLOCK[0]}×{BLOCK[1]} blocks (expected {expected})")
    if scale_inv.device != values.device:
        raise InputError(f"{s}: on {scale_inv.device}, its weight on {values.device}")


def check_weight_source(w: Tensor) -> None:
    """What a weight to be quantized must be: a 2-D floating-point [out, in] tensor, not already e4m3."""
    if not w.is_floating_point() or w.dtype == DTYPE or w.dim() != 2:
        raise InputError(f"weight: expected a 2-D floating-point [out, in] tensor, got {w.dtype} "
                         f"of shape {list(w.shape)}")


def quantize_weight(w: Tensor) -> Fp8Weight:
    """W [out, in] → Fp8Weight: one scale per 128×128 block (the last row and column of blocks may be partial)."""
    check_weight_source(w)
    out, inp = w.shape
    wf = w.to(SCALE_DTYPE)
    blocks = _pad_to(_pad_to(wf, 0, BLOCK[0]), 1, BLOCK[1])
    blocks = blocks.unflatten(1, (_groups(inp, BLOCK[1]), BLOCK[1])).unflatten(0, (_groups(out, BLOCK[0]), BLOCK[0]))
    scale_inv = _scale_inv(blocks.abs().amax(dim=(1, 3)))
    values = (wf / _expand(_expand(scale_inv, 0, out), 1, inp)).to(DTYPE)
    return Fp8Weight(values, scale_inv, w.dtype)
