"""The CUDA backend's alternative kernels (cuda_backend_gpu.py --variants), so that one run decides which to keep.

Each GLU backward variant (glu_variants.cu) and decode kernel-2 variant (decode_variants.cu) is reached through the
extension's private entries (_glu_backward_variant, _decode_variant: variant 0 is the kernel in use) and

0. probed, each in a child process under a time limit (`python3 cuda_variants.py --probe glu|decode N`): a kernel
   that faults or never finishes would take the CUDA context, and every result after it, with it; such a variant
   is reported as failed with the child's last line and left out of what follows;
1. checked: against fp64 (mlpfuse.activations' formulas, mlpfuse.reference.gated_mlp) with the backend tests'
   bounds, bf16/fp16/fp32, on shapes that end in partial tiles and strips, that take the scalar fallback (odd
   columns), that give a persistent block many tiles (its ring wraps), with and without h and bias sums; GLU
   outputs against variant 0 bit for bit (same per-element math: they should match), decode outputs run twice
   (fixed summation order: the same bits every run);
2. timed: GLU backward at 8192×3072 bf16 with bias sums (and without), decode at 1–16 tokens × 4096×14336 bf16,
   all variants of a case in the same interleaved rounds; median and min–max µs, GB/s and % of the measured copy
   bandwidth.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

TOL = {"float32": 2e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _err(got, want) -> float:
    import torch

    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


class Checks:
    """Per-variant verdicts: the worst error / bound seen, failures, and notes (unavailable, bitwise)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.worst = [0.0] * len(names)
        self.failures: list[str] = []
        self.unavailable: dict[int, str] = {}
        self.differs: dict[int, str] = {}  # variant -> first case whose outputs differ from variant 0 / its rerun

    def bound(self, v: int, case: str, e: float, bound: float) -> None:
        self.worst[v] = max(self.worst[v], e / bound)
        if not e < bound:
            self.failures.append(f"v{v} {case}: error {e:.3g} > {bound:.3g}")

    def verdict(self, v: int, same_what: str) -> str:
        if v in self.unavailable:
            return f"n/a: {self.unavailable[v]}"
        bad = any(f.startswith(f"v{v} ") for f in self.failures)
        same = f"{same_what} differ ({self.differs[v]})" if v in self.differs else f"{same_what} identical"
        return f"{'FAIL' if bad else 'ok'} (worst {self.worst[v]:.2g} of bound), {same}"


def glu_numerics(ext, quick: bool, skip=()) -> Checks:
    import torch

    from mlpfuse import activations

    checks = Checks(list(ext._glu_backward_variants()))
    checks.unavailable.update({v: "left out" for v in skip})
    shapes = [(513, 3072), (77, 1000), (64, 1001), (4099, 1536), (20000, 768)]
    if quick:
        shapes = [(77, 1000), (64, 1001), (4099, 1536)]
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tol = TOL[_dname(dtype)]
        for si, (rows, cols) in enumerate(shapes):
            g = torch.randn(rows, cols, device="cuda", dtype=dtype) * 2
            u = torch.randn(rows, cols, device="cuda", dtype=dtype)
            dh = torch.randn(rows, cols, device="cuda", dtype=dtype)
            gd, ud, dhd = g.double(), u.double(), dh.double()
            acts = activations.NAMES if si == 0 else ("gelu_tanh", "silu")
            for name in acts:
                act = activations.get(name)
                want_dg, want_du, want_h = dhd * ud * act.grad(gd), dhd * act.forward(gd), act.forward(gd) * ud
                sums_dg, sums_du = want_dg.sum(0), want_du.sum(0)
                base = ext._glu_backward_variant(dh, g, u, act.id, 0, True, True)
                for v in range(len(checks.names)):
                    if v in checks.unavailable:
                        continue
                    for want_h_out, sums in ((True, True), (False, False)):
                        case = f"{_dname(dtype)} {rows}x{cols} {name} h={want_h_out} sums={sums}"
                        try:
                            dg, du, h, dbg, dbu = ext._glu_backward_variant(dh, g, u, act.id, v, want_h_out, sums)
                        except ValueError as e:  # this device cannot run it
                            checks.unavailable[v] = str(e).splitlines()[0]
                            break
                        checks.bound(v, f"{case} dg", _err(dg, want_dg), 2 * tol)
                        checks.bound(v, f"{case} du", _err(du, want_du), tol)
                        outs = [(dg, base[0]), (du, base[1])]
                        if want_h_out:
                            checks.bound(v, f"{case} h", _err(h, want_h), tol)
                            outs.append((h, base[2]))
                        if sums:
                            checks.bound(v, f"{case} dbg", _err(dbg, sums_dg), 2 * tol)
                            checks.bound(v, f"{case} dbu", _err(dbu, sums_du), 2 * tol)
                        if v not in checks.differs and not all(torch.equal(a, b) for a, b in outs):
                            checks.differs[v] = case
    return checks


def decode_numerics(ext, quick: bool, skip=()) -> Checks:
    import torch

    from mlpfuse import activations, reference

    checks = Checks(list(ext._decode_variants()))
    checks.unavailable.update({v: "left out" for v in skip})
    dims = [(264, 712)] + ([] if quick else [(4096, 14336)])
    tokens = (1, 3, 8, 9, 16) if not quick else (1, 9, 16)
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tol = TOL[_dname(dtype)]
        for dim, hidden in dims:
            for bias in (False, True):
                def t(*shape, scale=0.5):
                    return (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale).to(dtype)

                wg, wu = t(hidden, dim) / dim**0.5, t(hidden, dim) / dim**0.5
                wd = t(dim, hidden) / hidden**0.5
                bg, bu, bd = (t(hidden), t(hidden), t(dim)) if bias else (None, None, None)
                for m in tokens:
                    x = torch.randn(m, dim + 8, device="cuda", dtype=dtype)[:, :dim]  # a row stride past the width
                    for name in ("silu", "gelu_tanh"):
                        act = activations.get(name)
                        want = reference.gated_mlp(x, wg, wu, wd, name, bg, bu, bd)
                        for v in range(len(checks.names)):
                            if v in checks.unavailable:
                                continue
                            case = f"{_dname(dtype)} {m}x{dim}x{hidden} bias={bias} {name}"
                            try:
                                y = ext._decode_variant(x, wg, wu, wd, bg, bu, bd, act.id, v)
                            except ValueError as e:
                                checks.unavailable[v] = str(e).splitlines()[0]
                                continue
                            checks.bound(v, case, _err(y, want), tol)
                            again = ext._decode_variant(x, wg, wu, wd, bg, bu, bd, act.id, v)
                            if v not in checks.differs and not torch.equal(y, again):
                                checks.differs[v] = case
    return checks


PROBE_SECONDS = 120


def _probe_calls(ext, kind: str, v: int):
    """Every shape and dtype the checks and timings use, once, then a synchronize (in the child)."""
    import torch

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if kind == "glu":
            for rows, cols in ((77, 1000), (64, 1001), (20000, 768), (8192, 3072)):
                g, u, dh = (torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(3))
                for want_h, sums in ((True, True), (False, False)):
                    ext._glu_backward_variant(dh, g, u, 1, v, want_h, sums)
        else:
            for dim, hidden in ((264, 712), (4096, 14336)):
                w = [torch.randn(*s, device="cuda", dtype=dtype) / 64 for s in ((hidden, dim), (hidden, dim),
                                                                               (dim, hidden), (hidden,), (hidden,),
                                                                               (dim,))]
                for m in (1, 8, 9, 16):
                    x = torch.randn(m, dim, device="cuda", dtype=dtype)
                    ext._decode_variant(x, *w, 3, v)
        torch.cuda.synchronize()


UNAVAILABLE = 3  # the child's exit status when the device cannot run the variant (not a failure)


def probe(kind: str, v: int) -> tuple[str, str]:
    """("ok", ""), ("n/a", why) or ("failed", why): variant v of kind run to completion in a child process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--probe", kind, str(v)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        return "failed", f"probe did not finish in {PROBE_SECONDS} s (a hang?)"
    last = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
    why = last[-1][:160] if last else ""
    if run.returncode == 0:
        return "ok", ""
    if run.returncode == UNAVAILABLE:
        return "n/a", why
    return "failed", f"probe failed (exit {run.returncode}): {why}"


def _cell(samples: list[float]) -> str:
    return f"{statistics.median(samples):.1f} µs [{min(samples):.1f}–{max(samples):.1f}]"


def run(ext, copy_gbs: float, samples_us, rounds: int, quick: bool) -> tuple[list[str], list[str]]:
    """Markdown table lines and failures. samples_us(fns, rounds, reps): per-call µs of each fn, one per round."""
    probed, failures = {}, []
    for kind, count in (("glu", len(ext._glu_backward_variants())), ("decode", len(ext._decode_variants()))):
        for v in range(1, count):
            status, why = probe(kind, v)
            print(f"probe {kind} variant {v}: {status} {why}".rstrip(), flush=True)
            if status != "ok":
                probed[(kind, v)] = why
            if status == "failed":
                failures.append(f"{kind} variant {v}: {why}")
    glu_checks = glu_numerics(ext, quick, [v for (k, v) in probed if k == "glu"])
    dec_checks = decode_numerics(ext, quick, [v for (k, v) in probed if k == "decode"])
    for (kind, v), why in probed.items():
        (glu_checks if kind == "glu" else dec_checks).unavailable[v] = why
    failures += glu_checks.failures + dec_checks.failures
    _spin_clocks()  # the probes and checks leave the GPU idle at times: clocks up again before timing
    lines = _glu_table(ext, glu_checks, copy_gbs, samples_us, rounds)
    lines += [""] + _decode_table(ext, dec_checks, copy_gbs, samples_us, rounds)
    return lines, failures


def _spin_clocks() -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(100):
        a @ a
    torch.cuda.synchronize()


def _glu_table(ext, checks: Checks, copy_gbs: float, samples_us, rounds: int) -> list[str]:
    import torch

    from mlpfuse import activations

    gelu = activations.get("gelu_tanh").id
    m, n = 8192, 3072
    g, u, dh = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    usable = [v for v in range(len(checks.names)) if v not in checks.unavailable]
    fns = {}
    for v in usable:
        fns[(v, True)] = lambda v=v: ext._glu_backward_variant(dh, g, u, gelu, v, False, True)
        fns[(v, False)] = lambda v=v: ext._glu_backward_variant(dh, g, u, gelu, v, False, False)
    times = samples_us(fns, rounds, 20)
    lines = [f"| GLU backward variant ({m}×{n} bf16) | with bias sums: median [min–max] | GB/s | of copy | "
             "no bias sums | numerics |", "|---|---|---|---|---|---|"]
    for v, name in enumerate(checks.names):
        verdict = checks.verdict(v, "dg/du/h vs v0")
        if v not in usable:
            lines.append(f"| {v}: {name} | | | | | {verdict} |")
            continue
        gbs = 5 * m * n * 2 / statistics.median(times[(v, True)]) / 1e3  # dh, g, u read; dg, du written
        lines.append(f"| {v}: {name} | {_cell(times[(v, True)])} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f} % | "
                     f"{_cell(times[(v, False)])} | {verdict} |")
    return lines


def _decode_table(ext, checks: Checks, copy_gbs: float, samples_us, rounds: int) -> list[str]:
    import torch

    from mlpfuse import activations

    gelu = activations.get("gelu_tanh").id
    dim, hidden = 4096, 14336
    token_counts = (1, 2, 4, 8, 12, 16)
    w = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) / 64
         for s in ((hidden, dim), (hidden, dim), (dim, hidden))]
    usable = [v for v in range(len(checks.names)) if v not in checks.unavailable]
    cells = {v: [""] * len(token_counts) for v in range(len(checks.names))}
    for i, tokens in enumerate(token_counts):
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
        fns = {v: (lambda v=v, x=x: ext._decode_variant(x, *w, None, None, None, gelu, v)) for v in usable}
        times = samples_us(fns, rounds, 20)
        for v in usable:
            gbs = 3 * hidden * dim * 2 / statistics.median(times[v]) / 1e3  # the weights, streamed once
            cells[v][i] = f"{_cell(times[v])} {100 * gbs / copy_gbs:.1f} %"
    lines = [f"| decode variant ({dim}×{hidden} bf16; µs, % of copy) | "
             + " | ".join(f"{t} tok" for t in token_counts) + " | numerics |",
             "|---|" + "---|" * (len(token_counts) + 1)]
    for v, name in enumerate(checks.names):
        lines.append(f"| {v}: {name} | " + " | ".join(cells[v]) + f" | {checks.verdict(v, 'reruns')} |")
    return lines


if __name__ == "__main__":  # the probe child: --probe glu|decode N
    if len(sys.argv) != 4 or sys.argv[1] != "--probe" or sys.argv[2] not in ("glu", "decode"):
        print("usage: cuda_variants.py --probe glu|decode N", file=sys.stderr)
        sys.exit(2)
    from mlpfuse import csrc

    try:
        _probe_calls(csrc.extension(), sys.argv[2], int(sys.argv[3]))
    except ValueError as e:  # "variant: ... cannot run on this device"
        print(str(e).splitlines()[0])
        sys.exit(UNAVAILABLE)
    print("ok")

