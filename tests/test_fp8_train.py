"""The FP8 training recipe's reference path (reference.gated_mlp_fp8_train): every GEMM of the forward and the
backward in e4m3 with fine-grained scales, g and u kept in FP8 for the backward. Against float64 autograd of the
same MLP: gradients aligned (cosine ≥ 0.99 per tensor, the training target) with FP8's error; the saved tensors
measured by saved-tensor hooks (g and u in half the bytes); NaN and inf reach the gradients; compiles under
aot_eager to the same numbers."""

import pytest
import torch
import torch.nn.functional as F

from mlpfuse import fp8, reference
from mlpfuse.errors import InputError

U = fp8.UNIT_ROUNDOFF


def _case(seed, m=96, d=256, h=384, bias=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    x = r(m, d)
    ws = [r(h, d, scale=d**-0.5), r(h, d, scale=d**-0.5), r(d, h, scale=h**-0.5)]
    bs = [r(h, scale=0.1), r(h, scale=0.1), r(d, scale=0.1)] if bias else [None] * 3
    dy = torch.randn(m, d, generator=gen).to(dtype)
    return x, ws, bs, dy


def _grads(fn, x, ws, bs, dy):
    inputs = [x, *ws, *[b for b in bs if b is not None]]
    y = fn(x, *ws, *bs)
    return y, torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("save", ["fp8", "high"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_training_gradients_align_with_float64(save, dtype):
    x, ws, bs, dy = _case(1, dtype=dtype)
    y, grads = _grads(lambda *a: reference.gated_mlp_fp8_train(*a[:4], "silu", *a[4:], save=save), x, ws, bs, dy)
    y64, grads64 = _grads(lambda *a: reference.gated_mlp(*a[:4], "silu", *a[4:]), x, ws, bs, dy.double())
    assert y.dtype == dtype and all(g.dtype == dtype for g in grads)
    names = ["x", "gate", "up", "down", "gate bias", "up bias", "down bias"]
    for name, g, g64 in zip(names, grads, grads64):
        cos = float(F.cosine_similarity(g.double().flatten(), g64.flatten(), dim=0))
        rel = float((g.double() - g64).norm() / g64.norm())
        assert cos >= 0.99, (name, cos)
        assert rel < 4 * U, (name, rel)  # a few e4m3 roundings on the way, norm-wise
    assert float((y.detach().double() - y64.detach()).norm() / y64.detach().norm()) < 2 * U


def test_fp8_saved_preactivations_take_half_the_bytes_and_change_the_gradients_by_one_rounding():
    """What the step keeps for the backward, measured by saved-tensor hooks: with save='fp8' g and u are e4m3 with
    1×128 scales, x in FP8 either way; the gradients move by about one e4m3 rounding of g and u."""
    x, ws, bs, dy = _case(2, dtype=torch.bfloat16)

    def saved_bytes(save):
        kept = []

        def pack(t):
            kept.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = reference.gated_mlp_fp8_train(x, *ws, "gelu_tanh", *bs, save=save)
        acts = [t for t in kept if t.dim() == 2 and t.shape[0] == x.shape[0]]  # per-token tensors (not weights)
        return sum(t.numel() * t.element_size() for t in acts), y, kept

    fp8_bytes, y8, kept8 = saved_bytes("fp8")
    high_bytes, yh, _ = saved_bytes("high")
    m, h, d = x.shape[0], ws[0].shape[0], x.shape[1]
    x_bytes = m * d + m * (d // 128) * 4  # x: e4m3 values and fp32 scales
    assert high_bytes == x_bytes + 2 * m * h * 2  # g and u in bf16
    assert fp8_bytes == x_bytes + 2 * (m * h + m * (h // 128) * 4)  # g and u in e4m3 with their scales
    assert any(t.dtype == fp8.DTYPE and t.shape == (m, h) for t in kept8)
    assert torch.equal(y8, yh)  # the forward is the same; only what the backward reads differs
    g8 = torch.autograd.grad(y8, ws[0], dy)[0].double()
    gh = torch.autograd.grad(yh, ws[0], dy)[0].double()
    assert 0 < float((g8 - gh).norm() / gh.norm()) < 2 * U


def test_nan_and_inf_reach_the_gradients():
    """A NaN or inf in the output gradient is not zeroed: it spoils the gradients it flows into (the optimizer sees
    it), and the rows it does not touch stay finite in dx."""
    x, ws, bs, dy = _case(3)
    dy[5, 7] = float("nan")
    dy[9, 0] = float("inf")
    y = reference.gated_mlp_fp8_train(x, *ws, "silu", *bs)
    dx, dwg, dwd = torch.autograd.grad(y, [x, ws[0], ws[2]], dy)
    assert bool(dx[5].isnan().all()) and bool(dx[9].isnan().all())
    assert bool(torch.isfinite(dx[torch.arange(dx.shape[0]) > 9]).all())
    assert bool(dwg.isnan().any()) and bool(dwd.isnan().any())


def test_it_compiles_under_aot_eager_to_the_same_numbers():
    torch._dynamo.reset()
    x, ws, bs, dy = _case(4, m=40, d=128, h=256)
    fn = lambda *a: reference.gated_mlp_fp8_train(*a[:4], "silu", *a[4:])  # noqa: E731
    eager = _grads(fn, x, ws, bs, dy)
    compiled = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, ws, bs, dy)
    for a, b in zip([eager[0], *eager[1]], [compiled[0], *compiled[1]]):
        assert torch.equal(a, b)


def test_a_bad_save_is_one_line():
    x, ws, bs, _ = _case(5, m=4, d=128, h=128)
    with pytest.raises(InputError, match="save: expected 'fp8' or 'high', got 'fp4'"):
        reference.gated_mlp_fp8_train(x, *ws, "silu", *bs, save="fp4")
