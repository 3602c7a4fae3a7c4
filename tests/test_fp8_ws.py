"""The warp-specialized FP8 GEMM (kernels/fp8_gemm_ws.py, Gluon, Hopper only).

On any machine: each form the wrappers launch compiles for sm_90a (Triton's own ptxas, no GPU needed) into a
kernel whose partitions do what the design says — wgmma and TMA in it, the consumers' registers raised by setmaxnreg —
and which spills nothing (a spilled accumulator would put local-memory traffic in the K loop): tests/sm90_compile.py.

On a Hopper GPU: fp8_gemm taking this kernel gives the Triton kernel's outputs bit for bit (same K-block sums, same
promotion, same epilogue), over ragged shapes, biases, every output form, the paired and one-tile forms."""

import json

import pytest
import torch

import sm90_compile
from conftest import HAS_CUDA, HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9

_COMPILE = r"""
from mlpfuse.kernels import fp8_gemm_ws as W

results = []
for gated, quant, pair, bias, save, trans, col in json.loads(sys.argv[1]):
    m, n, k = 4096, 2048, 1024
    f8 = torch.float8_e4m3fn
    a, w = torch.empty(m, k, dtype=f8), torch.empty(n, k, dtype=f8)
    sa, b = torch.empty(m, k // 128), torch.empty(n)
    out = torch.empty(m, n, dtype=f8 if quant else torch.bfloat16)
    ad, wd1, wd2 = W.descriptors(a, w, w, 128)
    args = dict(a_desc=ad, sa=sa, w1_desc=wd1, s1=sa, w2_desc=wd2, s2=sa, b1=b, b2=b, out=out, sout=sa, gq=out, gs=sa,
                uq=out, us=sa, cs=b, M=m, N=n, K=k, s_sam=8, s_s1=8, s_s2=8, s_om=n, s_som=n // 128)
    consts = dict(ACT=3 if gated else 0, GATED=gated, HAS_B1=bias, HAS_B2=bias, QUANT_OUT=quant, SAVE_GU=save,
                  TRANS_OUT=trans, BN=128, GROUP_M=16, STAGES=W.stages(gated, pair, save), I64=False, PAIR=pair,
                  COL_SCALE=col)
    r = compile_sm90(W.mlpfuse_fp8_gemm_ws_kernel, args, consts, num_warps=4, maxnreg=168)
    ptx = r.pop("ptx")
    r.update(wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
             setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx))),
             consumer_regs=W.CONSUMER_REGS.value)
    results.append(r)
print(json.dumps(results))
"""

# (gated, quantized output, paired weight tiles, biases, save_gu, output transposed, column scales): the forms
# fp8_gemm and FP8 training launch
FORMS = [(True, True, True, False, False, False, False), (True, True, True, True, False, False, False),
         (False, False, True, False, False, False, False), (False, False, False, True, False, False, False),
         (True, True, False, False, False, False, False), (True, True, True, False, True, False, False),
         (True, True, True, True, True, False, False), (False, False, True, False, False, True, True),
         (False, False, True, False, False, False, True)]


@pytest.fixture(scope="module")
def compiled():
    return sm90_compile.run(_COMPILE, json.dumps(FORMS))


@pytest.mark.parametrize("i", range(len(FORMS)), ids=[str(f) for f in FORMS])
def test_each_form_compiles_for_hopper_without_spilling(compiled, i):
    r = compiled[i]
    _, _, pair, _, save, _, _ = FORMS[i]
    # save_gu quantizes g, h and u in the epilogue (u parked in shared memory): a few registers spill there (32 and 64
    # bytes of spill stores a thread without and with biases, when measured); in the K loop a spill would be a tile's
    # worth (the two-accumulator form that was dropped spilled 0.2–2.5 KB, 8 KB with save_gu)
    assert r["spills"] <= (512 if save else 0), r
    # per K block: one wgmma of 4 k32 steps a weight tile, in each of the two consumers' code
    assert r["wgmma"] > 0 and r["tma"] > 0, r
    assert r["consumer_regs"] > 168 and r["consumer_regs"] in r["setmaxnreg"], r  # raised above the launch's 168
    stage = 128 * 128 * (3 if pair else 2)
    assert r["smem"] >= 3 * stage, r


def _operands(m, n, k, gated, seed):
    from mlpfuse.kernels import fp8_gemm as K

    g = torch.Generator(device="cuda").manual_seed(seed)
    xq, xs = K.quantize(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
    ws = []
    for _ in range(2 if gated else 1):
        ws.extend(K.quantize_weight(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02))
    return xq, xs, ws


def _same(a, b):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return len(a) == len(b) and all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                                                y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y)
                                    for x, y in zip(a, b))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("m,n,k,gated,quant,bias,out_dtype", [
    (1024, 384, 512, True, True, False, torch.bfloat16),
    (1300, 640, 1040, True, True, True, torch.bfloat16),
    (2048, 640, 1536, False, False, True, torch.bfloat16),  # 2.5 paired tiles across
    (1100, 1024, 2048, False, False, False, torch.float32),
    (1030, 512, 256, False, True, False, torch.bfloat16),
])
def test_fp8_gemm_on_the_warp_specialized_kernel_is_the_triton_kernel_bit_for_bit(m, n, k, gated, quant, bias,
                                                                                  out_dtype, monkeypatch):
    from mlpfuse import activations
    from mlpfuse.kernels import fp8_gemm as K
    from mlpfuse.kernels import fp8_gemm_ws as W

    xq, xs, ws = _operands(m, n, k, gated, seed=m)
    b = (torch.randn(n, device="cuda") * 0.1, torch.randn(n, device="cuda", dtype=torch.bfloat16)) if bias else \
        (None, None)
    kw = dict(activation=activations.get("silu").id if gated else activations.IDENTITY, quant_out=quant,
              out_dtype=out_dtype)
    w2 = (ws[2], ws[3]) if gated else (None, None)
    assert K._ws(xq.device) is W and m >= K.WS_MIN_ROWS
    got = K.fp8_gemm(xq, xs, ws[0], ws[1], *w2, *b, **kw)
    one_tile = W.gemm(xq, xs, ws[0], ws[1], *w2, *b, pair=False, **kw)
    monkeypatch.setattr(K, "WS", False)
    K._plans.clear()
    ref = K.fp8_gemm(xq, xs, ws[0], ws[1], *w2, *b, **kw)
    assert _same(got, ref)
    assert _same(one_tile, ref)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("transposed", [False, True])
def test_column_scales_are_the_triton_kernels_bit_for_bit(transposed, monkeypatch):
    """FP8 training's weight-gradient form: a per-row-quantized second operand (block scales of ones), its scales
    applied per output column in the epilogue; 640 columns are 2.5 paired tiles."""
    from mlpfuse import activations
    from mlpfuse.kernels import fp8_gemm as K

    xq, xs, ws = _operands(1100, 640, 1024, False, seed=5)
    cs = torch.rand(640, device="cuda") * 4.0 + 0.25
    ones = torch.ones_like(ws[1])
    kw = dict(activation=activations.IDENTITY, quant_out=False, out_transposed=transposed, col_scale=cs)
    got = K.fp8_gemm(xq, xs, ws[0], ones, **kw)
    monkeypatch.setattr(K, "WS", False)
    ref = K.fp8_gemm(xq, xs, ws[0], ones, **kw)
    assert _same(got, ref)
    plain = K.fp8_gemm(xq, xs, ws[0], ones, activation=activations.IDENTITY, quant_out=False, out_dtype=torch.float32)
    assert torch.allclose(ref.float(), ((plain * cs).t() if transposed else plain * cs).bfloat16().float(), rtol=0,
                          atol=0)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_the_gated_gemm_keeps_g_and_u_as_the_triton_kernel_does(monkeypatch):
    from mlpfuse import activations
    from mlpfuse.kernels import fp8_gemm as K

    xq, xs, ws = _operands(1200, 384, 640, True, seed=3)
    act = activations.get("silu").id
    got = K.fp8_gemm(xq, xs, *ws, activation=act, quant_out=True, save_gu=True)  # paired, u parked in shared memory
    monkeypatch.setattr(K, "WS", False)
    assert _same(got, K.fp8_gemm(xq, xs, *ws, activation=act, quant_out=True, save_gu=True))
