"""The RMSNorm prologue of the decode kernels and the patch that hands a layer's pre-MLP norm to the block after it.

Oracles: a float64 RMSNorm + gated MLP for the kernel; the unpatched model's own logits for the patch (prefill,
and one decode step from a cache: the step that runs the decode kernels)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_models
import mlpfuse
import numerics
from conftest import HAS_CUDA, HAS_TRITON
from mlpfuse.errors import InputError
from mlpfuse.ops import norm as N

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _reference(x, nw, eps, kind, wg, wu, wd):
    xf = x.double()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xn = xf * r * nw.double() if kind == N.WEIGHT_AFTER else xf * r * (1 + nw.double())
    return F.linear(F.silu(xn @ wg.double().T) * (xn @ wu.double().T), wd.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("kind", [N.WEIGHT_AFTER, N.ONE_PLUS])
@pytest.mark.parametrize("mode", [0, 2, 3, 4])
def test_decode_kernel_norm_prologue_matches_float64(dtype, m, kind, mode):
    from mlpfuse import activations
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp

    g = torch.Generator().manual_seed(m * 10 + kind + mode)
    d, h = 40, 72  # neither a multiple of the tiles: partial chunks in the sum of squares and in the K loop
    x = (torch.randn(m, d, generator=g) * 4).to(DEVICE, dtype)
    wg, wu = [(torch.randn(h, d, generator=g) / 6).to(DEVICE, dtype) for _ in range(2)]
    wd = (torch.randn(d, h, generator=g) / 8).to(DEVICE, dtype)
    nw = torch.randn(d, generator=g).to(DEVICE, dtype)
    ref = _reference(x, nw, 1e-5, kind, wg, wu, wd)
    y = decode_gated_mlp(x, wg, wu, wd, activation=activations.SILU, norm_weight=nw, norm_eps=1e-5, norm_kind=kind,
                         allow_tf32=False, _mode=mode)
    plain = decode_gated_mlp(x, wg, wu, wd, activation=activations.SILU, allow_tf32=False, _mode=mode)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 4e-3), err
    # Without the prologue the same call computes the MLP of x itself: the norm changed the answer.
    assert ((plain.double() - ref).norm() / ref.norm()).item() > 0.1


def test_decode_kernel_rejects_bad_norm_arguments():
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp

    x = torch.randn(1, 16, device=DEVICE)
    w, wd = torch.randn(32, 16, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    with pytest.raises(InputError, match="norm_weight: expected a contiguous floating-point \\[16\\]"):
        decode_gated_mlp(x, w, w, wd, activation=3, norm_weight=torch.ones(8, device=DEVICE), norm_kind=1)
    with pytest.raises(InputError, match="norm_kind"):
        decode_gated_mlp(x, w, w, wd, activation=3, norm_weight=torch.ones(16, device=DEVICE), norm_kind=7)
    with pytest.raises(InputError, match="norm_weight: given without a norm_kind"):
        decode_gated_mlp(x, w, w, wd, activation=3, norm_weight=torch.ones(16, device=DEVICE))


def _tiny(family):
    return hf_models.tiny_decoder(family, DEVICE, perturb_norms=True)


_logits = hf_models.prefill_and_step


@pytest.mark.parametrize("family,norm_name,kind", [
    ("llama", "post_attention_layernorm", "weight·norm(x)"),
    ("qwen3", "post_attention_layernorm", "weight·norm(x)"),
    ("gemma2", "pre_feedforward_layernorm", "norm(x)·(1+weight)"),
])
def test_patch_fuses_the_pre_mlp_norm_with_equal_outputs(family, norm_name, kind):
    model = _tiny(family)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = mlpfuse.patch(model, backend="triton")
    mlp_norms = [n for n in report.norms if n.into.endswith(".mlp")]  # the attention's input norms are handed too
    assert [n.path for n in mlp_norms] == [f"model.layers.{i}.{norm_name}" for i in range(2)]
    assert {n.kind for n in report.norms} == {kind}
    assert f"{len(report.norms)} norms fused" in report.summary()
    layer = model.model.layers[0]
    x = torch.randn(3, 32, device=DEVICE)
    assert getattr(layer, norm_name)(x) is x  # the norm passes its input through; the block applies it
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 64, (1, 6), device=DEVICE)
    for got, want in zip(_logits(model, ids), _logits(ref, ids)):
        assert ((got - want).norm() / want.norm()).item() < 1e-5
    mlpfuse.unpatch(model)
    assert type(getattr(model.model.layers[0], norm_name)) is type(getattr(ref.model.layers[0], norm_name))
    assert getattr(model.model.layers[0], norm_name)(x) is not x


def test_decode_step_runs_the_norm_in_the_kernel(monkeypatch):
    """At one token the fused block hands the norm to the decode kernels: the norm's own forward is not called."""
    model = _tiny("llama")
    mlpfuse.patch(model, backend="triton")
    calls = []
    from mlpfuse.kernels import decode_mlp

    real = decode_mlp.decode_gated_mlp
    monkeypatch.setattr(decode_mlp, "decode_gated_mlp",
                        lambda *a, **k: calls.append(k.get("norm_kind", 0)) or real(*a, **k))
    block = model.model.layers[0].mlp
    norm_forward = block.fused_norm.forward
    seen = []
    block.fused_norm.forward = lambda module, x: seen.append(x.shape) or norm_forward(module, x)
    x = torch.randn(1, 1, 32, device=DEVICE)
    with torch.no_grad():
        block(x)  # decode size: the kernels normalise
        block(torch.randn(1, 80, 32, device=DEVICE))  # past the decode sizes: the norm's own forward first
    assert calls[0] == N.WEIGHT_AFTER and seen == [torch.Size([1, 80, 32])]


def test_training_and_grad_run_the_norm_under_autograd():
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    mlpfuse.patch(model, backend="triton")
    ids = torch.randint(0, 64, (2, 5), device=DEVICE)
    numerics.assert_same_grads(model, ref, ids, ("model.layers.0.post_attention_layernorm.weight",
                                                 "model.layers.1.mlp.gate_proj.weight"))


def test_post_norm_layers_keep_their_norm():
    """OLMo 2 normalises after its MLP: nothing reads a norm's output only through the block."""
    model = _tiny("olmo2")
    report = mlpfuse.patch(model, backend="triton")
    assert len(report.swapped) == 2 and report.norms == []


class _Layer(nn.Module):
    def __init__(self, norm, reuse=False):
        super().__init__()
        self.norm = norm
        self.mlp = _Mlp()
        self.reuse = reuse

    def forward(self, h):
        h = self.norm(h)
        h = self.mlp(h)
        return h


class _ReusingLayer(_Layer):
    def forward(self, h):
        n = self.norm(h)
        h = self.mlp(n)
        return h + n  # the normalised value is read again: the norm must stay


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _LayerNormish(nn.Module):  # one weight and an eps, but it centres the rows: not an RMSNorm
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.eps = 1e-6

    def forward(self, x):
        return F.layer_norm(x, (16,), self.weight, None, self.eps)


class _RMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return N.rms_norm(x, self.weight, self.variance_epsilon, N.WEIGHT_AFTER)


def test_only_rms_norms_read_by_the_block_alone_are_fused():
    fused = nn.Sequential(_Layer(_RMS()))
    assert [n.path for n in mlpfuse.patch(fused, backend="torch").norms] == ["0.norm"]
    reused = nn.Sequential(_ReusingLayer(_RMS()))
    report = mlpfuse.patch(reused, backend="torch")
    assert len(report.swapped) == 1 and report.norms == []
    layer_norm = nn.Sequential(_Layer(_LayerNormish()))
    report = mlpfuse.patch(layer_norm, backend="torch")
    assert report.norms == []
    assert report.left == [] and [item.reason for item in report.norms_kept] == [
        "not fused into mlp: its forward is neither RMSNorm convention on random rows"]
    off = nn.Sequential(_Layer(_RMS()))
    assert mlpfuse.patch(off, backend="torch", fuse_norms=False).norms == []


def test_compiled_inference_records_one_node_and_matches_eager():
    """Under torch.compile(fullgraph=True) and no_grad, at decode sizes the block and its norm are one
    `mlpfuse::norm_gated_mlp` node (the kernels normalise); past them the norm's own ops stay in the graph, where a
    compiler can fuse them, before one `mlpfuse::gated_mlp`. Either way the output is eager's, bit for bit."""
    model = _tiny("llama")
    mlpfuse.patch(model, backend="triton")
    block = model.model.layers[0].mlp
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    for shape in ((1, 1, 32), (2, 70, 32)):
        x = torch.randn(*shape, device=DEVICE)
        with torch.no_grad():
            assert torch.equal(compiled(x), block(x))
    assert len(graphs) == 2 and graphs[0] == [torch.ops.mlpfuse.norm_gated_mlp]
    assert graphs[1][-1] == torch.ops.mlpfuse.gated_mlp and torch.rsqrt in graphs[1], graphs[1]
    assert torch.ops.mlpfuse.norm_gated_mlp not in graphs[1]
    with torch.inference_mode():
        x = torch.randn(1, 1, 32, device=DEVICE)
        assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_blocks_second_decode_call_goes_straight_to_the_kernels_plan(monkeypatch, fuse):
    """The module's call plan holds the decode kernels' plan after the first call: later calls build no kernel key,
    and compute what the first did; a change of the deterministic flag is honoured."""
    from mlpfuse.kernels import decode_mlp

    model = _tiny("llama")
    mlpfuse.patch(model, backend="triton", fuse_norms=fuse)
    block = model.model.layers[0].mlp
    keys = []
    real = decode_mlp._key
    monkeypatch.setattr(decode_mlp, "_key", lambda *a: keys.append(1) or real(*a))
    x = torch.randn(1, 1, 32, device=DEVICE)
    with torch.no_grad():
        first = block(x)
        built = len(keys)
        assert built >= 1 and torch.equal(block(x), first) and len(keys) == built
        torch.use_deterministic_algorithms(True)
        try:
            det = block(x)
        finally:
            torch.use_deterministic_algorithms(False)
    assert len(keys) > built  # another mode: the general route, its own plan
    assert ((det - first).norm() / first.norm()).item() < 1e-5


def test_a_norm_that_cannot_run_is_kept_with_its_reason():
    class Broken(_RMS):
        def forward(self, x):
            raise RuntimeError("no kernel for this device")

    report = mlpfuse.patch(nn.Sequential(_Layer(Broken())), backend="torch")
    assert len(report.swapped) == 1 and report.norms == []
    assert report.norms_kept[0].reason == ("not fused into mlp: its forward failed on random rows "
                                           "(RuntimeError: no kernel for this device)")


def test_a_patched_model_pickles_and_deep_copies_with_its_norms_handed_over():
    import io

    model = _tiny("llama")
    mlpfuse.patch(model, backend="triton")
    ids = torch.randint(0, 64, (1, 5), device=DEVICE)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        layer = other.model.layers[0]
        assert layer.mlp.fused_norm.module is layer.post_attention_layernorm
        x = torch.randn(2, 32, device=DEVICE)
        assert layer.post_attention_layernorm(x) is x
        for got, want in zip(_logits(other, ids), _logits(model, ids)):
            assert torch.equal(got, want)


# --- RMSNorm's eps, on every path that normalises ---------------------------------------------------------------

def _rms64(x, weight, eps, kind):
    """RMSNorm from its definition, in float64: each row divided by sqrt(mean(x²) + eps), then the weight."""
    xd = x.double()
    normed = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
    return normed * weight.double() if kind == N.WEIGHT_AFTER else normed * (1.0 + weight.double())


def _eps_rows(m, d, generator):
    """Rows whose mean square lies far below eps, near it and far above it (eps from 1e-6 to 0.25): on the small rows
    eps decides the scale, so adding it after the square root, or leaving it out, is off by orders of magnitude."""
    scales = torch.tensor([1e-4, 3e-3, 0.05, 0.5, 4.0])[torch.arange(m) % 5]
    return torch.randn(m, d, generator=generator, dtype=torch.float64) * scales[:, None]


def _row_err(got, want):
    """Worst relative error of one row: a bug confined to the small rows must not hide behind the large ones."""
    got, want = got.double().flatten(0, -2), want.flatten(0, -2)
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 0.25])
@pytest.mark.parametrize("kind", [N.WEIGHT_AFTER, N.ONE_PLUS])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-6), (torch.float16, 2e-3)],
                         ids=["fp32", "fp64", "fp16"])
def test_rms_norm_adds_eps_under_the_root(dtype, tol, kind, eps):
    g = torch.Generator().manual_seed(3)
    x = _eps_rows(10, 48, g).to(dtype)
    w = (torch.randn(48, generator=g, dtype=torch.float64) / 2 + 1).to(dtype)
    want = _rms64(x, w, eps, kind)
    got = N.rms_norm(x, w, eps, kind)
    assert got.dtype == dtype and got.shape == x.shape
    assert _row_err(got, want) < tol


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
@pytest.mark.parametrize("kind", [N.WEIGHT_AFTER, N.ONE_PLUS])
def test_decode_kernel_norm_prologue_adds_eps_under_the_root(kind, mode):
    """The decode kernels' own norm (fp32 through the interpreter on a CPU) with a large eps and tiny rows."""
    from mlpfuse import activations
    from mlpfuse.kernels.decode_mlp import decode_gated_mlp

    g = torch.Generator().manual_seed(kind * 7 + mode)
    d, h, eps = 40, 72, 0.25
    x = _eps_rows(5, d, g).to(DEVICE, torch.float32)
    wg, wu = [(torch.randn(h, d, generator=g) / 2).to(DEVICE) for _ in range(2)]
    wd = (torch.randn(d, h, generator=g) / 8).to(DEVICE)
    nw = (torch.randn(d, generator=g) / 2 + 1).to(DEVICE)
    xn = _rms64(x, nw, eps, kind)
    want = F.linear(F.silu(xn @ wg.double().T) * (xn @ wu.double().T), wd.double())
    got = decode_gated_mlp(x, wg, wu, wd, activation=activations.SILU, norm_weight=nw, norm_eps=eps, norm_kind=kind,
                           allow_tf32=False, _mode=mode)
    assert _row_err(got, want) < 1e-5


@pytest.mark.parametrize("backend,m", [("torch", 5), ("triton", 5), ("triton", 70)],
                         ids=["torch", "triton-decode", "triton-past-decode"])
@pytest.mark.parametrize("kind", [N.WEIGHT_AFTER, N.ONE_PLUS])
def test_norm_gated_mlp_op_adds_eps_under_the_root(kind, backend, m):
    """The op a compiled block records: the decode kernels normalise at decode sizes, ops.norm.rms_norm elsewhere."""
    g = torch.Generator().manual_seed(kind + m)
    d, h, eps = 32, 48, 0.25
    dtype = torch.float64 if backend == "torch" else torch.float32
    x = _eps_rows(m, d, g).to(DEVICE, dtype)
    wg, wu = [(torch.randn(h, d, generator=g, dtype=torch.float64) / 2).to(DEVICE, dtype) for _ in range(2)]
    wd = (torch.randn(d, h, generator=g, dtype=torch.float64) / 8).to(DEVICE, dtype)
    nw = (torch.randn(d, generator=g, dtype=torch.float64) / 2 + 1).to(DEVICE, dtype)
    xn = _rms64(x, nw, eps, kind)
    want = F.linear(F.silu(xn @ wg.double().T) * (xn @ wu.double().T), wd.double())
    with torch.no_grad():
        got = torch.ops.mlpfuse.norm_gated_mlp(x, nw, eps, kind, wg, wu, wd, None, None, None, "silu", backend)
    # rms_norm computes in fp32 (as transformers' norms do), so float64 inputs keep fp32's rounding
    assert _row_err(got, want) < 1e-5


# --- which norm a layer's forward hands to the block ------------------------------------------------------------

class _RawInputLayer(_Layer):
    def forward(self, h):
        n = self.norm(h)
        h = self.mlp(h)  # the block reads the raw input; the normalised value is used below
        return h + n


class _DiscardedNormLayer(_Layer):
    def forward(self, h):
        n = self.norm(h)  # noqa: F841 - computed and dropped: the block still reads the raw input
        h = self.mlp(h)
        return h


class _OtherNameLayer(_Layer):
    def forward(self, x):
        h = self.norm(x)
        x = self.mlp(x)  # the norm's argument, not its output, goes into the block
        return x + h


class _RenamedLayer(_Layer):
    def forward(self, x):
        h = self.norm(x)
        y = self.mlp(h)  # the block reads the norm's output, but `h` lives on and is read again
        return y + h


def _rms_layer_model(layer_cls, eps=0.25):
    torch.manual_seed(0)
    model = nn.Sequential(layer_cls(_RMS()), layer_cls(_RMS())).double()
    with torch.no_grad():
        for layer in model:
            layer.norm.variance_epsilon = eps  # large enough that a wrongly applied norm shows on any row
            layer.norm.weight.normal_(1.0, 0.3)
    return model


@pytest.mark.parametrize("layer_cls", [_RawInputLayer, _DiscardedNormLayer, _OtherNameLayer, _RenamedLayer])
def test_a_norm_whose_output_the_block_does_not_alone_read_stays(layer_cls):
    model = _rms_layer_model(layer_cls)
    ref = copy.deepcopy(model)
    report = mlpfuse.patch(model, backend="torch")
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 0.1  # small rows: eps matters to the norm
    with torch.no_grad():
        got, want = model(x), ref(x)
        normed = model[0].norm(x)
    assert ((got - want).norm() / want.norm()).item() < 1e-12
    assert [s.path for s in report.swapped] == ["0.mlp", "1.mlp"]
    assert report.norms == [] and report.norms_kept == []
    assert not torch.equal(normed, x)  # the norm still computes its output: not made to pass its input through


def test_a_norm_whose_output_only_the_block_reads_is_fused_with_equal_outputs():
    """The positive case beside the ones above: same classes, `h = self.norm(h); h = self.mlp(h)`."""
    model = _rms_layer_model(_Layer)
    ref = copy.deepcopy(model)
    report = mlpfuse.patch(model, backend="torch")
    assert [n.path for n in report.norms] == ["0.norm", "1.norm"]
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 0.1
    with torch.no_grad():
        assert model[0].norm(x) is x
        got, want = model(x), ref(x)
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # the norm's fp32 rounding, as the model's own
