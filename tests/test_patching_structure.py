"""mlpfuse.patch reading MLP blocks from their structure: any child names, the layouts' variants, and the forward
deciding. Every module here has a class name outside the family table; each is compared with its own unpatched
output (and gradients), and the ones whose forward no fused block computes must be left, with why."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mlpfuse
from mlpfuse.patching import GatedBlock, PatchedBlock, TwoLayerBlock

DIM, HIDDEN = 16, 40


class Gated(nn.Module):
    """SwiGLU under other names, the activation a function it holds; `kind` spoils it in ways no block computes."""

    def __init__(self, kind="swiglu", sparsity=0.0):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.act = F.silu
        self.kind = kind
        self.sparsity = sparsity

    def forward(self, x):
        g, u = self.w1(x), self.w3(x)
        if self.sparsity > 0:  # Gemma-3n style: keep the gate's top values only
            cutoff = g.mean(-1, keepdim=True) + g.std(-1, keepdim=True) * self.sparsity
            g = torch.relu(g - cutoff)
        if self.kind == "extra-term":
            return self.w2(self.act(g) * u) + 0.5 * x
        if self.kind == "act-after-down":
            return self.act(self.w2(g * u))
        if self.kind == "hidden-dropout":  # a rate it applies with F.dropout, no dropout child
            return F.dropout(self.w2(self.act(g) * u), p=0.3, training=self.training)
        if self.kind == "needs-3d":
            assert x.dim() == 4, "expected [batch, heads, tokens, dim]"
        return self.w2(self.act(g) * u)


class FeedForwardMLP(Gated):
    """Named like an MLP and holding no activation (F.gelu called): every activation mlpfuse knows is tried."""

    def __init__(self):
        super().__init__()
        del self.act

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


class PackedUpGate(nn.Module):
    """Moonshine's decoder MLP: one projection whose halves are (up, gate)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.activation_fn = nn.SiLU()

    def forward(self, x):
        up, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.activation_fn(gate) * up)


class ChunkNoGlu(PackedUpGate):
    """A chunk of one projection that is not a GLU: the halves are added."""

    def forward(self, x):
        a, b = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.activation_fn(a) + b)


class Relu2(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)) ** 2)


class Scaled(nn.Module):
    """Falcon-H1's multipliers under another class: act(gate(x)·m_g)·up(x), then ·m_d."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.act_fn = nn.SiLU()
        self.gate_multiplier, self.down_multiplier = 0.75, 1.5

    def forward(self, x):
        return self.down(self.act_fn(self.gate(x) * self.gate_multiplier) * self.up(x)) * self.down_multiplier


class Masked(Gated):
    def forward(self, x, mask=None):
        y = super().forward(x)
        return y if mask is None else y * mask


class Net(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def run(model, x):
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make, layout, roles", [
    (lambda: Gated(), "gated", "gate=w1 up=w3 down=w2"),
    (lambda: FeedForwardMLP(), "gated", "gate=w1 up=w3 down=w2"),
    (lambda: PackedUpGate(), "gated", "gate_up=fc1 (up, gate) down=fc2"),
    (lambda: Relu2(), "two-layer", "fc=up_proj proj=down_proj"),
    (lambda: Scaled(), "gated", "gate=gate up=up down=down multipliers 0.75, 1.5"),
])
def test_blocks_under_any_names_are_read_and_compute_what_they_did(make, layout, roles):
    model = Net(make(), make())
    x = torch.randn(2, 5, DIM)
    y_ref, g_ref = run(model, x)
    originals = list(model.blocks)
    report = mlpfuse.patch(model, backend="torch")
    assert [(s.path, s.layout, s.matched, s.roles) for s in report.swapped] == [
        (f"blocks.{i}", layout, "structure", roles) for i in range(2)]
    assert report.left == []
    assert all(isinstance(b, PatchedBlock) for b in model.blocks)
    y, g = run(model, x)
    torch.testing.assert_close(y, y_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], msg=name)
    assert mlpfuse.unpatch(model) == ["blocks.0", "blocks.1"] and list(model.blocks) == originals
    assert torch.equal(model(x), y_ref)


def test_the_activation_found_is_the_one_the_forward_applies():
    model = Net(FeedForwardMLP())  # F.gelu (erf) in the forward, nothing held: tried until one computes it
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped[0].activation == "gelu"


@pytest.mark.parametrize("kind, reason", [
    ("extra-term", "its forward is none of the"),
    ("act-after-down", "its forward is none of the"),
    ("hidden-dropout", "in training mode (a dropout it applies without a dropout child?)"),
    ("needs-3d", "its forward raised on random rows: AssertionError: expected [batch, heads, tokens, dim]"),
])
def test_a_forward_no_block_computes_is_left_with_the_reason(kind, reason):
    model = Net(Gated(kind)).eval()  # patched in eval mode: the training-mode check runs all the same
    x = torch.randn(2, 5, DIM)
    before = model(x) if kind != "needs-3d" else None
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [] and len(report.left) == 1, report.summary()
    assert reason in report.left[0].reason
    assert type(model.blocks[0]) is Gated
    if before is not None:
        assert torch.equal(model(x), before)


def test_sparsified_activations_are_told_apart_per_instance():
    # One class, one shape: the verdict is cached per what may change the forward, so the sparsified instance is
    # left and the plain one swapped, in either order.
    model = Net(Gated(sparsity=0.5), Gated(), Gated(sparsity=0.5))
    x = torch.randn(3, DIM)
    before = model(x)
    report = mlpfuse.patch(model, backend="torch")
    assert [s.path for s in report.swapped] == ["blocks.1"]
    assert [i.path for i in report.left] == ["blocks.0", "blocks.2"]
    torch.testing.assert_close(model(x), before)


def test_other_layouts_that_look_fused_are_left():
    model = Net(ChunkNoGlu(), Masked())
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == []
    reasons = {i.source: i.reason for i in report.left}
    assert reasons["ChunkNoGlu"].startswith("its forward is none of the")
    assert reasons["Masked"] == "its forward takes (x, mask), the fused block only the input"


def test_zero_weights_do_not_vouch_for_a_reading():
    # With the model's own weights (a zero-initialised last projection) every reading would agree; the check puts in
    # random weights, so the wrong readings still differ and the module is left.
    block = Gated("act-after-down")
    nn.init.zeros_(block.w2.weight)
    model = Net(block)
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [] and "none of the" in report.left[0].reason
    assert torch.count_nonzero(block.w2.weight) == 0  # the model's weights were not touched


def test_structure_alone_is_not_trusted_without_verification():
    report = mlpfuse.patch(Net(Gated()), backend="torch", verify=False)
    assert report.swapped == []
    assert report.left[0].reason.startswith("read from its structure, which is trusted only once verified")


def test_patching_changes_no_random_state_and_no_mode():
    model = Net(Gated(), PackedUpGate())
    model.train()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    mlpfuse.patch(model, backend="torch")
    torch.testing.assert_close(torch.rand(3), expected)
    assert all(m.training for m in model.modules())


def test_a_copy_of_a_patched_model_and_a_second_patch():
    model = Net(Gated(), Relu2())
    mlpfuse.patch(model, backend="torch")
    twin = copy.deepcopy(model)
    x = torch.randn(4, DIM)
    torch.testing.assert_close(twin(x), model(x))
    again = mlpfuse.patch(model, backend="torch")
    assert again.swapped == [] and again.already_patched == ["blocks.0", "blocks.1"]
    assert isinstance(model.blocks[0], GatedBlock) and isinstance(model.blocks[1], TwoLayerBlock)


def test_a_structural_mlp_as_the_model_itself_is_left_with_advice():
    report = mlpfuse.patch(Gated())
    assert report.left[0].path == "" and "the model itself is an MLP block" in report.left[0].reason


def test_the_model_lab_runs_olmo2_patched_by_structure(tmp_path):
    # OLMo-2 has no row in mlpfuse's family table: the lab's mlpfuse variant is there because its MLP's structure
    # is read (the GPU rows of `mlpfuse bench --model olmo2-7b` run the same code at the real size).
    pytest.importorskip("transformers")
    import json

    from mlpfuse.cli import main

    out = tmp_path / "lab"
    code = main(["bench", "--model", "olmo2-7b", "--tiny", "--device", "cpu", "--rounds", "1", "--target-ms", "1",
                 "--mode", "prefill", "--variants", "eager,mlpfuse", "--out", str(out)])
    assert code == 0
    rows = {r["variant"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["mlpfuse"]["status"] == "ok" and rows["mlpfuse"]["patched"] == 2


class PostLN(nn.Module):
    """A post-norm projection under other names, norm(drop(proj(x)) + residual); `kind` spoils it."""

    def __init__(self, kind="post-norm"):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, DIM)
        self.drop = nn.Dropout(0.25)
        self.norm = nn.LayerNorm(DIM)
        self.kind = kind

    def forward(self, x, residual):
        y = self.drop(self.proj(x))
        if self.kind == "norm-then-add":
            return self.norm(y) + residual
        if self.kind == "scaled-residual":
            return self.norm(y + 0.5 * residual)
        return self.norm(y + residual)


class ProjectNorm(nn.Module):
    """A projection and a norm with one input: no residual, so no post-norm block."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(self.proj(x))


class Encoder(nn.Module):
    def __init__(self, *blocks):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.ModuleList(nn.Linear(DIM, HIDDEN) for _ in blocks)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for up, b in zip(self.up, self.blocks):
            x = b(torch.relu(up(x)), x)
        return self.head(x)


def test_a_post_norm_projection_is_read_from_its_structure_and_computes_what_it_did():
    model = Encoder(PostLN(), PostLN()).eval()
    x = torch.randn(2, 5, DIM)
    y_ref, g_ref = run(model, x)
    originals = list(model.blocks)
    report = mlpfuse.patch(model)
    assert [(s.path, s.layout, s.matched, s.roles, s.activation) for s in report.swapped] == [
        (f"blocks.{i}", "post-norm", "structure", "dense=proj norm=norm", "") for i in range(2)]
    assert report.left == []
    assert "PostLN -> post-norm (by structure: dense=proj norm=norm)" in report.summary()
    y, g = run(model, x)
    assert torch.equal(y, y_ref)  # the module's own ops: the same values, bit for bit
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], msg=name)
    block = model.blocks[0]
    h, r = torch.randn(3, HIDDEN), torch.randn(3, DIM)
    with torch.no_grad():  # called with the residual by keyword: the module's own forward runs
        assert torch.equal(block(h, residual=r), originals[0](h, r))
    assert mlpfuse.unpatch(model) == ["blocks.0", "blocks.1"] and list(model.blocks) == originals


@pytest.mark.parametrize("kind", ["norm-then-add", "scaled-residual"])
def test_a_projection_and_norm_computing_otherwise_are_left(kind):
    model = Encoder(PostLN(kind)).eval()
    x = torch.randn(2, 5, DIM)
    before = model(x)
    report = mlpfuse.patch(model)
    assert report.swapped == [] and len(report.left) == 1, report.summary()
    assert report.left[0].reason.startswith("the fused block's output differs from the module's own")
    assert type(model.blocks[0]) is PostLN and torch.equal(model(x), before)


def test_a_projection_and_norm_without_a_residual_input_are_no_candidate():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.pn = ProjectNorm()

        def forward(self, x):
            return self.pn(x)

    report = mlpfuse.patch(Holder())
    assert report.swapped == [] and report.left == []


def test_a_post_norm_block_runs_the_module_s_own_forward_while_its_dropout_or_norm_does_more():
    model = Encoder(PostLN()).eval()
    reference = copy.deepcopy(model)
    mlpfuse.patch(model)
    x = torch.randn(2, 5, DIM)
    model.train(), reference.train()  # live dropout: the same masks from the same seed
    torch.manual_seed(3)
    y_ref = reference(x)
    torch.manual_seed(3)
    y = model(x)
    assert torch.equal(y, y_ref) and not torch.equal(y, model.eval()(x))
    reference.eval()

    def shift(module, args, out):
        return out * 2.0 + 1.0

    unhooked = model(x)
    for m in (model, reference):
        m.blocks[0].norm.register_forward_hook(shift)
    hooked = model(x)
    assert torch.equal(hooked, reference(x)) and not torch.equal(hooked, unhooked)


# A hand-written block whose activation is a function its forward calls: read from its structure whatever the class
# is called (no MLP-like name, no activation child), and the modules looked at and left are named with why.
class GeGLU(nn.Module):
    def __init__(self, dim=DIM, hidden=2 * DIM):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class SquaredReLU(nn.Module):
    def __init__(self, dim=DIM, hidden=2 * DIM):
        super().__init__()
        self.w_in, self.w_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w_out(torch.relu(self.w_in(x)).square())


class Bottleneck(nn.Module):  # two projections, nothing between them
    def __init__(self, dim=DIM, hidden=2 * DIM):
        super().__init__()
        self.a, self.b = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.b(self.a(x))


class MishBlock(Bottleneck):
    def forward(self, x):
        return self.b(F.mish(self.a(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff, self.sq, self.bn, self.mi = GeGLU(), SquaredReLU(), Bottleneck(), MishBlock()

    def forward(self, x):
        return self.mi(self.bn(self.sq(self.ff(x))))


def test_functional_activations_in_a_forward_are_read_whatever_the_class_is_called():
    model = Stack().double()
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    expected = model(x)
    report = mlpfuse.patch(model, backend="torch")
    assert [(s.path, s.layout, s.activation, s.matched) for s in report.swapped] == [
        ("ff", "gated", "gelu_tanh", "structure"), ("sq", "two-layer", "relu2", "structure")], report.summary()
    assert [(item.path, item.reason) for item in report.left] == [
        ("bn", "no layout mlpfuse fuses: no activation in its children or its forward"),
        ("mi", "unknown activation mish (called in its forward)")]
    torch.testing.assert_close(model(x), expected, rtol=1e-12, atol=1e-12)


def test_the_calls_read_from_a_forward():
    from mlpfuse.patching.structure import forward_activations

    assert forward_activations(GeGLU) == (("gelu", "gelu_tanh"),)
    assert forward_activations(SquaredReLU) == (("relu", "relu"),)
    assert forward_activations(MishBlock) == (("mish", ""),)
    assert forward_activations(Bottleneck) == ()
