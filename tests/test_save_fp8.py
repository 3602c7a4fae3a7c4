"""Training with the pre-activations g and u kept in FP8 (save="fp8"): the gated GEMM's epilogue writes them in the
FP8 recipe, the backward's GLU pass dequantizes them as it reads them.

Oracles: float64 g and u (and mlpfuse.fp8's own quantizer, which the epilogue must match group by group), the GLU
backward on the dequantized values, and float64 gradients of the whole block."""

import pytest
import torch
import torch.nn.functional as F

import mlpfuse
from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse import activations, fp8
from mlpfuse.errors import InputError

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]  # the interpreter: no bf16 tl.dot


def _cos(a, b) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n", [(37, 200), (16, 128), (130, 384)])
def test_epilogue_writes_g_and_u_in_the_recipe(dtype, m, n):
    from mlpfuse.kernels.gated_gemm import gated_gemm

    g0 = torch.Generator().manual_seed(m + n)
    k = 48
    x = torch.randn(m, k, generator=g0).to(DEVICE, dtype)
    wg, wu = [(torch.randn(n, k, generator=g0) / 7).to(DEVICE, dtype) for _ in range(2)]
    x[3] *= 1e3  # one row far larger than the rest: its groups get their own scales
    h, (gq, gs), (uq, us) = gated_gemm(x, wg, wu, activation=activations.SILU, save_preact="fp8", allow_tf32=False)
    h_ref = gated_gemm(x, wg, wu, activation=activations.SILU, allow_tf32=False)
    # h comes from the same unquantized accumulators (a 128-wide tile here: summed in another order than h_ref's).
    h64 = F.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)
    err, err_ref = ((t.double() - h64).norm() / h64.norm() for t in (h, h_ref))
    assert err <= 2 * err_ref + torch.finfo(dtype).eps
    assert gq.dtype == uq.dtype == fp8.DTYPE and gs.dtype == fp8.SCALE_DTYPE
    assert gs.shape == us.shape == (m, -(-n // 128))
    for q, s, w in ((gq, gs, wg), (uq, us, wu)):
        exact = x.double() @ w.double().T
        # The scales: the float64 group amax / 448, to the accumulator's (fp32) rounding.
        _, s_ref = fp8.quantize_activation(exact)
        torch.testing.assert_close(s.double(), s_ref.double(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)
        # The values: within e4m3's half spacing of the exact pre-activation, group by group.
        back = fp8.dequantize_activation(q, s, torch.float64)
        spread = fp8._expand(s.double(), -1, n)
        bound = exact.abs() * fp8.UNIT_ROUNDOFF + spread * fp8.SUBNORMAL_HALF_SPACING
        slack = exact.abs() * (1e-6 if dtype == torch.float32 else 2e-2)  # the accumulator vs float64
        assert ((back - exact).abs() <= bound + slack).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_backward_reads_fp8_g_and_u_as_their_dequantized_values(dtype):
    from mlpfuse.kernels.glu_backward import glu_backward_split

    gen = torch.Generator().manual_seed(5)
    m, n = 33, 300
    g = (torch.randn(m, n, generator=gen) * 3).to(DEVICE)
    u = torch.randn(m, n, generator=gen).to(DEVICE)
    (gq, gs), (uq, us) = fp8.quantize_activation(g), fp8.quantize_activation(u)
    dh = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    dg, du, h, dbg, dbu = glu_backward_split(dh, gq, uq, activation=activations.SILU, want_h=True, bias_sums=True,
                                             g_scale=gs, u_scale=us)
    g64, u64 = fp8.dequantize_activation(gq, gs, torch.float64), fp8.dequantize_activation(uq, us, torch.float64)
    g64.requires_grad_(True)
    u64.requires_grad_(True)
    (F.silu(g64) * u64).backward(dh.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for got, ref in ((dg, g64.grad), (du, u64.grad), (h, F.silu(g64) * u64), (dbg, g64.grad.sum(0)),
                     (dbu, u64.grad.sum(0))):
        assert got.dtype == (torch.float32 if got.dim() == 1 else dtype)
        assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    with pytest.raises(InputError, match="g, g_scale: expected"):
        glu_backward_split(dh, gq, uq, activation=activations.SILU, g_scale=gs[:, :1], u_scale=us)
    with pytest.raises(InputError, match="out: FP8 g and u cannot receive"):
        glu_backward_split(dh, gq, uq, activation=activations.SILU, g_scale=gs, u_scale=us, out=(gq, uq))


def _pair(dtype, **kw):
    torch.manual_seed(0)
    high = mlpfuse.GatedMLP(64, 384, activation="silu", backend="triton", device=DEVICE, dtype=dtype)
    low = mlpfuse.GatedMLP(64, 384, activation="silu", backend="triton", device=DEVICE, dtype=dtype, save="fp8", **kw)
    low.load_state_dict(high.state_dict())
    return high, low


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_keeps_fp8_g_and_u_and_its_gradients_stay_close(dtype):
    high, low = _pair(dtype)
    x = torch.randn(300, 64, device=DEVICE).to(dtype)
    dy = torch.randn(300, 64, device=DEVICE).to(dtype)
    saved = {}
    for name, module in (("high", high), ("fp8", low)):
        xi = x.clone().requires_grad_(True)
        kept = []

        def pack(t):
            kept.append((t.dtype, t.numel() * t.element_size()))
            return t

        # Under saved-tensor hooks g and u are saved like everything else: the hooks see what the block keeps.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = module(xi)
        y.backward(dy)
        saved[name] = (kept, y.detach(), xi.grad)
    kept_high, y_high, dx_high = saved["high"]
    kept_low, y_low, dx_low = saved["fp8"]
    assert [d for d, _ in kept_low].count(fp8.DTYPE) == 2
    assert [d for d, _ in kept_low].count(fp8.SCALE_DTYPE) >= 2
    pre = 2 * 300 * 384
    bytes_high = sum(b for _, b in kept_high)
    bytes_low = sum(b for _, b in kept_low)
    assert bytes_high - bytes_low >= pre * (x.element_size() - 1) - 2 * 300 * 3 * 4  # g and u at one byte + scales
    torch.testing.assert_close(y_low, y_high, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    # Gradients against float64: the e4m3 rounding of g and u (unit roundoff 2^-4) costs a few percent.
    x64 = x.double().requires_grad_(True)
    w = [p.detach().double().requires_grad_(True) for p in (high.gate_proj.weight, high.up_proj.weight,
                                                            high.down_proj.weight)]
    (F.silu(x64 @ w[0].T) * (x64 @ w[1].T) @ w[2].T).backward(dy.double())
    assert _cos(dx_low, x64.grad) >= 0.999
    for p, ref in zip((low.gate_proj.weight, low.up_proj.weight, low.down_proj.weight), w):
        assert _cos(p.grad, ref.grad) >= 0.998
    assert ((dx_low.double() - x64.grad).norm() / x64.grad.norm()).item() < 0.06


def test_nan_in_the_input_reaches_the_gradients():
    _, low = _pair(DTYPES[0])
    x = torch.randn(40, 64, device=DEVICE).to(DTYPES[0])
    x[7, 3] = float("nan")
    x.requires_grad_(True)
    low(x).sum().backward()
    assert torch.isnan(low.gate_proj.weight.grad).any() and torch.isnan(x.grad[7]).all()


def test_bad_save_arguments_are_one_line():
    with pytest.raises(InputError, match="^save: expected 'high'"):
        mlpfuse.GatedMLP(8, 16, save="int8")
    with pytest.raises(InputError, match="^save: 'fp8' keeps g and u"):
        mlpfuse.GatedMLP(8, 16, save="fp8", recompute=True)
    with pytest.raises(InputError, match="^save: expected"):
        mlpfuse.patch(torch.nn.Linear(2, 2), save=3)


def test_patch_save_fp8_reaches_the_blocks():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model = T.LlamaForCausalLM(cfg).to(DEVICE, DTYPES[0])
    ref = T.LlamaForCausalLM(cfg).to(DEVICE, DTYPES[0])
    ref.load_state_dict(model.state_dict())
    mlpfuse.patch(model, backend="triton", save="fp8")
    assert all(b.fused_save == "fp8" for b in model.modules() if isinstance(b, mlpfuse.patching.GatedBlock))
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for m in (model, ref):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is not None and p.grad.norm() > 0:
            assert _cos(p.grad, q.grad) >= 0.99, name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_records_the_fp8_op_and_equals_eager(backend):
    """Compiled: one `mlpfuse::gated_mlp_train_fp8` node whose FP8 outputs are what the graph saves, with outputs and
    gradients equal to the eager step's."""
    torch._dynamo.reset()
    _, low = _pair(DTYPES[0])
    compiled = torch.compile(low, backend=backend, fullgraph=True)
    x = torch.randn(300, 64, device=DEVICE).to(DTYPES[0])
    grads = []
    for fn in (low, compiled):
        xi = x.clone().requires_grad_(True)
        low.zero_grad(set_to_none=True)
        y = fn(xi)
        y.square().sum().backward()
        grads.append((y.detach(), xi.grad, low.up_proj.weight.grad))
    for eager, comp in zip(*grads):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        compiled(x.clone().requires_grad_(True))
    assert kept.count((fp8.DTYPE, (300, 384))) == 2 and kept.count((fp8.SCALE_DTYPE, (300, 3))) == 2


def test_activation_checkpointing_of_a_save_fp8_block_gives_the_same_gradients():
    """Under torch.utils.checkpoint the block's FP8 g and u go through the saved-tensor hooks (recomputed in the
    backward): the same gradients as the plain save="fp8" step."""
    from torch.utils.checkpoint import checkpoint

    _, low = _pair(DTYPES[0])
    x = torch.randn(200, 64, device=DEVICE).to(DTYPES[0])
    grads = []
    for wrap in (False, True):
        xi = x.clone().requires_grad_(True)
        low.zero_grad(set_to_none=True)
        y = checkpoint(low, xi, use_reentrant=False) if wrap else low(xi)
        y.square().sum().backward()
        grads.append((xi.grad, low.gate_proj.weight.grad, low.down_proj.weight.grad))
    for plain, ckpt in zip(*grads):
        torch.testing.assert_close(ckpt, plain, rtol=0, atol=0)
