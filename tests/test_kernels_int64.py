"""Offsets past 2**31 elements: every kernel reads and writes the right place.

The tensors are views with rows 2**30 elements apart into sparse memory-mapped files (private mappings: the pages a
kernel never touches are never allocated), so `row * stride` passes 2**31 at the third row while the data is a few
KB. With 32-bit index math the kernels read and write the wrong place -- wrong rows, or a crash when the wrapped
address is unmapped -- so the kernels run in a child process and the test reads its report.

Runs through Triton's interpreter on CPU (fp32). The same check at real sizes on a GPU (160k tokens × 14336, bf16,
forward and backward) is `benchmarks/numerics_gpu.py --int64`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cli_run import HANG_S
from conftest import HAS_CUDA
from mlpfuse.kernels import available

# A CUDA machine runs the suite's kernels on the GPU and keeps its own numpy, which Triton 3.6's interpreter may not
# accept (numpy >= 2.4); there `benchmarks/numerics_gpu.py --int64` checks the same at real sizes.
pytestmark = pytest.mark.skipif(not available() or HAS_CUDA,
                                reason="interpreter check: runs where the suite runs the kernels on CPU")

_CHILD = textwrap.dedent(r"""
    import json, os, sys, tempfile, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.nn.functional as F
    from mlpfuse import activations as A
    from mlpfuse.kernels import _common as C
    from mlpfuse.kernels.configs import KernelConfig
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp
    from mlpfuse.kernels.gated_gemm import gated_gemm
    from mlpfuse.kernels.gemm_act import gemm_act
    from mlpfuse.kernels.glu_backward import glu_backward_split, matmul_glu_backward

    ROW = 2**30
    tmp = tempfile.mkdtemp()
    gen = torch.Generator().manual_seed(0)
    count = [0]

    def far(rows, cols, fill=None, row=ROW):
        # [rows, cols] fp32, rows `row` elements apart, in a sparse file mapped copy-on-write (each mapping stays
        # under the machine's memory size: the kernel refuses larger private mappings outright).
        count[0] += 1
        path = os.path.join(tmp, str(count[0]))
        n = (rows - 1) * row + cols
        with open(path, "wb") as f:
            f.truncate(n * 4)
        t = torch.from_file(path, shared=False, size=n, dtype=torch.float32).as_strided((rows, cols), (row, 1))
        os.unlink(path)
        if fill is None:
            t.copy_(torch.randn(rows, cols, generator=gen))
        else:
            t.fill_(fill)
        return t

    def err(out, ref):
        out = out.double()
        if torch.isnan(out).any():
            return float("inf")
        return ((out - ref).norm() / ref.norm()).item()

    nan = float("nan")
    act = A.get("silu")
    cfg = KernelConfig(16, 16, 16, group_m=2, num_stages=1, num_warps=4, tma=False)
    M, K, N = 5, 24, 40
    report = {"reach": C.span(far(M, K)), "small_uses_i64": C.needs_i64(torch.empty(4096, 4096))}

    x = far(M, K)
    wg, wu = torch.randn(N, K, generator=gen), torch.randn(N, K, generator=gen)
    h, g, u = far(M, N, nan), far(M, N, nan), far(M, N, nan)
    gated_gemm(x, wg, wu, activation=act.id, save_preact=True, out=(h, g, u), config=cfg, allow_tf32=False)
    xd = x.double()
    gd, ud = xd @ wg.double().T, xd @ wu.double().T
    report["gated_gemm"] = max(err(h, act.forward(gd) * ud), err(g, gd), err(u, ud))

    y, z = far(M, N, nan), far(M, N, nan)
    gemm_act(x, wg, activation=act.id, save_preact=True, out=(y, z), config=cfg, allow_tf32=False)
    report["gemm_act"] = max(err(y, act.forward(gd)), err(z, gd))

    dy = far(M, K)
    wd = torch.randn(K, N, generator=gen)
    dh = dy.double() @ wd.double()
    dg_ref = dh * ud * act.grad(gd)
    du_ref = dh * act.forward(gd)
    for name, tile in (("matmul_glu_backward", cfg), ("matmul_glu_backward_prefetch",
                                                      KernelConfig(16, 16, 16, group_m=2, num_stages=1,
                                                                   num_warps=4, tma=False, prefetch=True))):
        dg, du, hh = far(M, N, nan), far(M, N, nan), far(M, N, nan)
        matmul_glu_backward(dy, wd, g, u, activation=act.id, out=(dg, du, hh), config=tile, allow_tf32=False)
        report[name] = max(err(dg, dg_ref), err(du, du_ref), err(hh, act.forward(gd) * ud))

    dhf = far(M, N)
    dh = dhf.double()
    dg, du = far(M, N, nan), far(M, N, nan)
    _, _, hh, dbg, dbu = glu_backward_split(dhf, g, u, activation=act.id, want_h=True, bias_sums=True, out=(dg, du))
    dg_ref, du_ref = dh * ud * act.grad(gd), dh * act.forward(gd)
    report["glu_backward_split"] = max(err(dg, dg_ref), err(du, du_ref), err(hh, act.forward(gd) * ud),
                                       err(dbg, dg_ref.sum(0)), err(dbu, du_ref.sum(0)))

    del x, h, g, u, y, z, dy, dhf, dg, du, hh  # unmap before the next ones
    D, H = 24, 16
    xs = far(3, D)
    w_gate, w_up, w_down = far(H, D, row=2**28), far(H, D, row=2**28), far(D, H, row=2**27)
    ref = (act.forward(xs.double() @ w_gate.double().T) * (xs.double() @ w_up.double().T)) @ w_down.double().T
    for mode in (0, 2, 3, 4):
        out = decode_gated_mlp(xs, w_gate, w_up, w_down, activation=act.id, allow_tf32=False, _mode=mode)
        report[f"decode_mode{mode}"] = err(out, ref)
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, f"kernels crashed on offsets past 2**31 (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_views_reach_past_int32(report):
    assert report["reach"] > 2**31  # the test exercises what it claims to
    assert report["small_uses_i64"] is False  # a 4096×4096 tensor keeps 32-bit index math


@pytest.mark.parametrize("kernel", ["gated_gemm", "gemm_act", "matmul_glu_backward", "matmul_glu_backward_prefetch",
                                    "glu_backward_split", "decode_mode0", "decode_mode2", "decode_mode3",
                                    "decode_mode4"])
def test_kernel_right_past_int32(report, kernel):
    assert report[kernel] < 1e-5, f"{kernel}: relative error {report[kernel]:.3g} against float64 with far rows"


def test_span_matches_largest_index():
    from mlpfuse.kernels._common import span

    base = torch.empty(7, 11)
    for view in (base, base.t(), base[::2, 3:], base[1:, :5], base.as_strided((3, 4), (0, 2))):
        # Brute force: the offset of every element, from its index.
        idx = torch.cartesian_prod(*[torch.arange(n) for n in view.shape])
        assert span(view) == int((idx * torch.tensor(view.stride())).sum(1).max())
    assert span(base.new_empty(0, 3)) == 0
