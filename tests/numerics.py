"""How far a computed result may sit from its float64 value, derived from the roundings it went through.

Rounding to nearest in a format of machine epsilon eps moves a value y by at most half a unit in its last place,
ulp(y) = eps·2^⌊log2 |y|⌋ (a fixed spacing below the normal range). Over the many values of computed data the error
spreads evenly over that interval: mean square ulp²/12, variance of the square ulp⁴/180. A result that went through
several roundings carries each one's error, propagated to it to first order (h rounded before y = h·Wdᵀ reaches y as
e_h·Wdᵀ; g rounded before the activation reaches h as e_g·act'(g)·u). The expected squared error E, the sum of
those variances, is computed here from the float64 values themselves; a check allows E plus four standard
deviations of the sum (std ≤ E·√(2/n), n = E² / Σ var², the number of values that effectively contribute). So a
correct result fails with a probability under 1e-4, while one more rounding of an [M, N] intermediate than the path
has (fp16 g and u before the activation, say) adds about E again and fails.

On top of the roundings to the dtype, the arithmetic inside the kernels runs in fp32 (fp64 for fp64 tensors): a sum
of K products is off by about eps_acc·√K relative (a random walk of K rounding errors; blocked and pairwise orders
do better), and the activation, a handful of operations each within 2 ulp (the GPU's approximate ex2 and rcp),
adds at most 8·eps_acc. Both are allowed at their full size, relative to the result's norm.
"""

from __future__ import annotations

import math

import torch

from oracle import PLAIN

SIGMAS = 5.0  # standard deviations of the summed squared rounding error a correct result may reach
ACT_ULPS = 8  # an activation's error in the accumulator's precision


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The precision the kernels and PyTorch's own ops compute `dtype` tensors in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rounding_var(ref: torch.Tensor, dtype: torch.dtype, *, chopped: bool = False) -> torch.Tensor:
    """Per element, the mean square error of rounding the float64 value `ref` to `dtype` once: ulp²/12 (0 where
    the value is exactly 0: a zero stays zero). `chopped`: rounding toward zero instead (an error spread over a
    whole ulp, mean square ulp²/3), as Triton's interpreter stores fp32 into bf16."""
    info = torch.finfo(dtype)
    a = ref.detach().double().abs()
    exponent = torch.frexp(a)[1]  # a = m·2^e, m in [0.5, 1): ulp = eps·2^(e-1)
    ulp = torch.ldexp(torch.full_like(a, info.eps), exponent - 1).clamp_min(info.smallest_normal * info.eps)
    return torch.where(a == 0, 0.0, ulp * ulp / (3 if chopped else 12))


def allowed(ref: torch.Tensor, var: torch.Tensor, dtype: torch.dtype, k: int) -> float:
    """The Frobenius norm of the error a correct result may have: the roundings' expected squared error `var`
    (summed, plus SIGMAS standard deviations) and the fp32 arithmetic over sums of `k` terms."""
    e = var.sum().item()
    rounding = 0.0
    if e > 0:
        n = e * e / (var * var).sum().item()
        rounding = math.sqrt(e * (1 + SIGMAS * math.sqrt(2 / n)))
    arithmetic = eps(accumulator(dtype)) * (math.sqrt(max(k, 1)) + ACT_ULPS) * ref.double().norm().item()
    return rounding + arithmetic


def chain_tol(dtype: torch.dtype, *, roundings: int, gain: float = 1.0, k: int = 1) -> float:
    """A relative error bound where no per-element model is kept: `roundings` independent roundings to `dtype`
    (each ≤ eps/√12 relative in root mean square), amplified up to `gain` on their way to the result, and the
    accumulator's arithmetic over sums of `k` terms."""
    return gain * eps(dtype) * math.sqrt(roundings / 12) + eps(accumulator(dtype)) * (math.sqrt(max(k, 1)) + ACT_ULPS)


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, *, k: int = 1,
                 var: torch.Tensor | None = None) -> float:
    """`got` within what its roundings explain of the float64 `ref`; `var` the per-element rounding variance of
    the path (default: one rounding of the result to `dtype`). Returns the relative error."""
    assert got is not None, what
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    assert not torch.isnan(got).any(), f"{what}: NaN in output (unwritten or spurious)"
    ref = ref.detach().double().cpu()
    var = rounding_var(ref, dtype) if var is None else var.cpu()
    err = (got.detach().double().cpu() - ref).norm().item()
    bound = allowed(ref, var, dtype, k)
    norm = ref.norm().item() or 1.0
    assert err <= bound, (f"{what}: relative error {err / norm:.3g} > {bound / norm:.3g} allowed for {dtype} "
                          f"(eps {eps(dtype):.2g}, K {k})")
    return err / norm


# ---- the gated MLP forward: which intermediates a path rounds ---------------------------------------------------

FUSED = ("h", "y")  # the gated GEMM and the decode kernels: g and u stay in fp32 until h is rounded
EAGER = ("g", "u", "a", "h", "y")  # eager PyTorch: every op's output rounded (an upper bound for every path)


def gated_forward(x, wg, wu, wd, bg, bu, bd, activation: str, dtype: torch.dtype, rounded=FUSED):
    """(y, var): the float64 output of down(act(x·Wgᵀ + bg) · (x·Wuᵀ + bu)) + bd on the given (already rounded)
    inputs, and per element of y the mean square error of a path that rounds the intermediates named in `rounded`
    (g, u: the projections; a: act(g); h: act(g)·u; y) to `dtype`."""
    x, wg, wu, wd = (t.detach().double().cpu() for t in (x, wg, wu, wd))
    bg, bu, bd = (t.detach().double().cpu() if t is not None else None for t in (bg, bu, bd))
    g = torch.nn.functional.linear(x, wg, bg).requires_grad_()
    u = torch.nn.functional.linear(x, wu, bu)
    with torch.enable_grad():  # act'(g), also when the caller runs under no_grad
        a = PLAIN[activation](g)
        (da,) = torch.autograd.grad(a.sum(), g)
    g, a = g.detach(), a.detach()
    h = a * u
    y = torch.nn.functional.linear(h, wd, bd)
    var_h = torch.zeros_like(h)
    for name, value, gain in (("g", g, da * u), ("u", u, a), ("a", a, u), ("h", h, None)):
        if name in rounded:
            var_h += rounding_var(value, dtype) * (1 if gain is None else gain * gain)
    var = var_h.reshape(-1, h.shape[-1]) @ (wd * wd).T
    var = var.reshape(y.shape)
    if "y" in rounded:
        var = var + rounding_var(y, dtype)
    return y, var


def assert_same_grads(model, ref, ids, names, tol: float = 1e-4) -> None:
    """The same loss backpropagated through a patched model and its unpatched copy: each named parameter's gradient
    agrees with the copy's within `tol` (relative Frobenius distance)."""
    model(ids).logits.square().mean().backward()
    ref(ids).logits.square().mean().backward()
    for name in names:
        got, want = model.get_parameter(name).grad, ref.get_parameter(name).grad
        assert ((got - want).norm() / want.norm()).item() < tol, name
