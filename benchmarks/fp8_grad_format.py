"""Which FP8 format for gradients: e4m3 (3 mantissa bits, largest 448) or e5m2 (2 bits, largest 57344), each with
one fp32 scale per 128 consecutive values (the recipe's 1×128 groups, the scale mapping a group's amax to the
format's largest value). Numerics only — the same on any machine:

    PYTHONPATH=src python3 benchmarks/fp8_grad_format.py

Prints, per gradient-like distribution, the relative Frobenius error of quantize → dequantize and the fraction of
nonzero values flushed to zero, for both formats. Heavy tails and wide spreads inside a group are where e5m2's
range could pay; everywhere else e4m3's extra bit halves the error."""

import torch

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def round_trip(t: torch.Tensor, fmt: str) -> torch.Tensor:
    dtype, top = FORMATS[fmt]
    g = t.reshape(-1, 128)
    s = (g.abs().amax(-1, keepdim=True) / top).clamp_min(2.0**-126)
    return ((g / s).to(dtype).float() * s).reshape(t.shape)


def cases(gen):
    n = 4096 * 128
    yield "gaussian", torch.randn(n, generator=gen)
    yield "student-t, 3 dof", torch.distributions.StudentT(3.0).sample((n,))
    yield "student-t, 1 dof (Cauchy)", torch.distributions.StudentT(1.0).sample((n,))
    for sigma in (1.0, 2.0, 3.0, 4.0):
        mag = torch.exp(torch.randn(n, generator=gen) * sigma)
        yield f"log-normal magnitudes, sigma {sigma:g} (e^±{2 * sigma:g} within ±2σ)", mag * torch.sign(
            torch.randn(n, generator=gen))
    # A backward's dh = dy·Wd and its GLU gradients, from reference.gated_mlp_fp8_train's own shapes
    from mlpfuse import activations

    x = torch.randn(1024, 512, generator=gen)
    wg, wu, wd = (torch.randn(*s, generator=gen) * s[1] ** -0.5 for s in ((1536, 512), (1536, 512), (512, 1536)))
    g, u = x @ wg.T, x @ wu.T
    dy = torch.randn(1024, 512, generator=gen) * 1e-3
    dh = dy @ wd
    act = activations.get("silu")
    yield "dh = dy·Wd", dh
    yield "dg = dh·u·silu'(g)", dh * u * act.grad(g)
    yield "du = dh·silu(g)", dh * act.forward(g)


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    print(f"{'distribution':58s} {'e4m3 rel err':>13s} {'e5m2 rel err':>13s} {'e4m3 flushed':>13s} "
          f"{'e5m2 flushed':>13s}")
    for name, t in cases(gen):
        t = t.float()
        row = [name]
        errs, flushed = [], []
        for fmt in FORMATS:
            r = round_trip(t, fmt)
            errs.append(float((r - t).norm() / t.norm()))
            flushed.append(float(((r == 0) & (t != 0)).float().mean()))
        print(f"{row[0]:58s} {errs[0]:13.2e} {errs[1]:13.2e} {flushed[0]:13.2e} {flushed[1]:13.2e}")


if __name__ == "__main__":
    main()
