"""mlpfuse.patch on transformers models of every family in the table (tiny configs, random init, CPU): the patched
model's logits and one training step's gradients equal the unpatched model's; generate (dynamic cache, and the
static cache + torch.compile recipe transformers documents), compiled forwards (fullgraph, no_grad and grad),
gradient checkpointing, autocast and an optimizer loop all run through the fused blocks."""

import collections
import copy

import pytest
import torch
import torch.nn as nn

import mlpfuse
from mlpfuse import kernels
from mlpfuse.patching import PatchedBlock

transformers = pytest.importorskip("transformers")
import hf_models as H  # noqa: E402 - needs transformers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def no_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def blocks_of(model):
    return [m for m in model.modules() if isinstance(m, PatchedBlock)]


def count_calls(model):
    """Calls of the fused blocks (a pre-hook: checkpointing's recompute stops early, before forward hooks run)."""
    calls = []
    for b in blocks_of(model):
        b.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def train_step(model, name, seed=5):
    """Loss and gradients (by parameter name) of one step in training mode, dropout masks drawn from `seed`."""
    model.train()
    model.zero_grad(set_to_none=True)
    batch = H.inputs(name)
    torch.manual_seed(seed)
    loss = model(**batch, labels=H.labels_for(name, batch)).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_grads_equal(got, expected, **tol):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name, **tol)


# fp32 on the torch backend computes what eager does; GPT-2's and T5's gelu_new is transformers' tanh formula op by
# op against one F.gelu(tanh) here, which rounds differently in the last bits.
TOL = {"rtol": 2e-5, "atol": 2e-6}


@pytest.mark.parametrize("name", list(H.FAMILIES))
def test_family_logits_and_training_gradients_equal_the_unpatched_model(name):
    spec = H.FAMILIES[name]
    model = no_dropout(H.build(name)).eval()
    batch = H.inputs(name)
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(**batch).logits
    loss_ref, grads_ref = train_step(model, name)
    model.eval()

    report = mlpfuse.patch(model, backend="torch")
    assert [s.source for s in report.swapped] == spec.swaps, report.summary()
    assert report.left == []
    assert list(model.state_dict()) == keys
    calls = count_calls(model)
    with torch.no_grad():
        got = model(**batch).logits
    assert len(calls) == len(spec.swaps)
    torch.testing.assert_close(got, expected, **TOL)
    loss, grads = train_step(model, name)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    assert_grads_equal(grads, grads_ref, **TOL)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_training_with_live_dropout_draws_the_same_masks(name):
    # GPT-2's dropout after c_proj runs as is, BERT's outside the intermediate: same seed, same step.
    model = H.build(name)
    loss_ref, grads_ref = train_step(model, name)
    assert len(mlpfuse.patch(model, backend="torch").swapped) == 2  # patched in training mode
    loss, grads = train_step(model, name)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    assert_grads_equal(grads, grads_ref, **TOL)


def test_gpt2_second_projection_and_dropout_keep_their_hooks_and_replacements():
    # The block runs c_proj's GEMM itself and skips the inactive dropout after it, but only while calling them would
    # run nothing more: a hook on either, a global module hook, or c_proj replaced by another class is honoured.
    model = no_dropout(H.build("gpt2")).eval()
    batch = H.inputs("gpt2")
    patched = copy.deepcopy(model)
    mlpfuse.patch(patched, backend="torch")
    with torch.no_grad():
        got = patched(**batch).logits
        torch.testing.assert_close(got, model(**batch).logits, **TOL)
    mlps = [(a.mlp, b.mlp) for a, b in zip(model.transformer.h, patched.transformer.h)]

    def shift(module, args, out):  # not a constant shift: the LayerNorms after it would remove that
        return out * 4.0 + torch.linspace(-1.0, 1.0, out.shape[-1])

    for child in ("c_proj", "dropout"):
        handles = [getattr(m, child).register_forward_hook(shift) for pair in mlps for m in pair]
        with torch.no_grad():
            hooked, expected = patched(**batch).logits, model(**batch).logits
        torch.testing.assert_close(hooked, expected, **TOL)
        assert not torch.allclose(hooked, got)  # the hook did act
        for h in handles:
            h.remove()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: seen.append(type(m).__name__) if type(m).__name__ == "Conv1D" else None)
    try:
        with torch.no_grad():
            patched(**batch)
    finally:
        handle.remove()
    assert seen.count("Conv1D") == 3 * len(mlps)  # attention's two Conv1Ds and the MLP's c_proj (c_fc is fused)
    with torch.no_grad():
        plain = patched(**batch).logits

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def weight(self):  # as adapter wrappers expose their base layer's
            return self.inner.weight

        def forward(self, h):
            return 2 * self.inner(h)

    for _, block in mlps:
        block.c_proj = Scaled(block.c_proj)
    with torch.no_grad():
        assert not torch.allclose(patched(**batch).logits, plain)
        for _, block in mlps:
            block.c_proj = block.c_proj.inner
        torch.testing.assert_close(patched(**batch).logits, plain, rtol=0, atol=0)


def test_t5_dropout_inside_the_fusion():
    model = H.build("t5_gated")  # dropout_rate 0.1, between the GLU and wo
    report = mlpfuse.patch(model.train(), backend="torch")
    assert report.swapped == [] and len(report.left) == 4
    assert report.left[0].reason.startswith("dropout (p=0.1) between the activation and wo is active in training")
    # Patched in eval mode, then trained: while the dropout is live the block runs T5's own forward.
    loss_ref, grads_ref = train_step(model, "t5_gated")
    assert len(mlpfuse.patch(model.eval(), backend="torch").swapped) == 4
    loss, grads = train_step(model, "t5_gated")
    torch.testing.assert_close(loss, loss_ref)
    assert_grads_equal(grads, grads_ref)
    loss_other_seed, _ = train_step(model, "t5_gated", seed=6)
    assert not torch.equal(loss_other_seed, loss)  # the dropout did act


def test_t5_wo_kept_in_fp32_is_left_with_the_reason():
    model = H.build("t5_gated", dtype=torch.bfloat16).eval()
    for m in model.modules():
        if type(m).__name__ == "T5DenseGatedActDense":
            m.wo.float()
    report = mlpfuse.patch(model, backend="torch")
    assert report.swapped == [] and len(report.left) == 4
    assert report.left[0].reason == ("wo.weight is float32 on cpu, wi_0.weight bfloat16 on cpu (the fused op runs "
                                     "one dtype on one device)")


def test_falcon_h1_multipliers_with_biases_are_left():
    cfg = H.FAMILIES["falcon_h1"].build().config
    cfg.mlp_bias = True
    model = transformers.FalconH1ForCausalLM(cfg)
    report = mlpfuse.patch(model, backend="torch")
    assert {item.reason for item in report.left} == {"a gate multiplier with biased gate/up projections"}


def test_unknown_activation_in_config_is_left():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   vocab_size=H.VOCAB, hidden_act="mish")
    report = mlpfuse.patch(transformers.LlamaForCausalLM(cfg))
    left = [(i.path, i.reason) for i in report.left]
    assert left == [("model.layers.0.mlp", "unknown activation MishActivation")]


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_auto_patches_an_encoder_layer_as_eager_math_with_fewer_module_calls(name):
    # `auto` never fuses the erf GELU: the intermediate runs eager's own two ops, with one module call in place of
    # nn.Linear's and the activation module's, and no plan to look up; each output block (dense, dropout,
    # LayerNorm(x + residual)) runs its three ops in one call. The same values, bit for bit.
    spec = H.FAMILIES[name]
    model = spec.build().eval()
    batch = H.inputs(name)
    with torch.no_grad():
        expected = model(**batch).logits
    before = _module_forwards(model, batch)
    report = mlpfuse.patch(model)
    assert [s.source for s in report.swapped] == spec.swaps and report.left == []
    assert {s.layout for s in report.swapped} == {"linear-act", "post-norm"}
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, expected)
    assert all(len(b._fused_plan.entries) == 0 for b in blocks_of(model) if b.fused_layout == "linear-act")
    after = _module_forwards(model, batch)
    n = spec.mlps  # layers
    # Per layer, before: the intermediate with its dense and activation (3), each output block with its dense,
    # dropout and norm (2 × 4), the self-attention's query, key and value (3); after: the three blocks' own calls
    # (the attention's three projections are one call of its own forward, mlpfuse.patching.attention).
    assert before.total() - after.total() == n * (3 + 2 * 4 - 3 + 3)
    assert before - after == {"Linear": 6 * n, "LayerNorm": 2 * n, "Dropout": 2 * n, "GELUActivation": n,
                              **{cls: n for cls in spec.layer}}
    assert [p.names for p in report.projections] == ["query+key+value"] * n


def _module_forwards(model, batch) -> collections.Counter:
    """Module forwards one no-grad call of `model` runs, by class name (counted inside forward: a hook would make
    the fused blocks stand aside)."""
    seen = collections.Counter()
    classes = {type(m) for m in model.modules()}
    originals = {cls: cls.__dict__["forward"] for cls in classes if "forward" in cls.__dict__}

    def counting(cls, forward):
        def wrapper(self, *args, **kwargs):
            seen[cls.__name__] += 1
            return forward(self, *args, **kwargs)
        return wrapper

    try:
        for cls, forward in originals.items():
            cls.forward = counting(cls, forward)
        with torch.no_grad():
            model(**batch)
    finally:
        for cls, forward in originals.items():
            cls.forward = forward
    return seen


def test_model_on_the_meta_device_is_left_unchanged():
    cfg = H.FAMILIES["llama"].build().config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    report = mlpfuse.patch(model)
    assert report.swapped == [] and {i.reason for i in report.left} == {
        "gate_proj.weight is on the meta device (weights not loaded yet)"}


def test_save_pretrained_round_trip(tmp_path):
    model = H.build("llama").eval()
    batch = H.inputs("llama")
    with torch.no_grad():
        expected = model(**batch).logits
    mlpfuse.patch(model, backend="torch")
    model.save_pretrained(tmp_path / "patched")
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "patched").eval()  # an unpatched model
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, expected)
    assert mlpfuse.patch(plain, backend="torch").changed
    mlpfuse.unpatch(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


@pytest.mark.parametrize("name", ["llama", "gemma2", "phi3", "gpt2", "falcon_h1", "t5_gated"])
def test_generate_with_the_dynamic_cache(name):
    model = H.build(name).eval()
    batch = H.inputs(name, batch=2, seq=6)
    batch.pop("decoder_input_ids", None)
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(**batch, **args)
    mlpfuse.patch(model, backend="torch")
    calls = count_calls(model)
    got = model.generate(**batch, **args)
    assert torch.equal(got, expected)
    assert len(calls) >= 6 * len(blocks_of(model)) // (2 if name == "t5_gated" else 1)  # every step went through


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_with_static_cache_and_compile(name):
    # The recipe transformers 5 documents (CompileConfig with a static cache: generate compiles the decode step);
    # fullgraph=True, so a graph break in a block would fail here. aot_eager keeps the CPU test short;
    # _compile_all_devices is transformers' switch to compile off CUDA.
    torch._dynamo.reset()
    model = H.build(name).eval()
    batch = H.inputs(name, batch=1, seq=6)
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(**batch, **args)
    mlpfuse.patch(model, backend="torch")
    config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    got = model.generate(**batch, **args, cache_implementation="static", compile_config=config)
    assert torch.equal(got, expected)
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled


@pytest.mark.parametrize("name", ["llama", "phi3", "falcon_h1", "gpt2", "bert"])
def test_compiled_forward_fullgraph_under_no_grad_and_grad(name):
    torch._dynamo.reset()
    model = no_dropout(H.build(name)).eval()
    batch = H.inputs(name)
    with torch.no_grad():
        expected = model(**batch).logits
    _, grads_ref = train_step(model, name)
    mlpfuse.patch(model, backend="torch")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, expected, **TOL)
    model.train()
    model.zero_grad(set_to_none=True)
    logits = compiled(**batch).logits
    # The loss outside the compiled region: transformers' loss functions log through a logger Dynamo refuses.
    labels = H.labels_for(name, batch)
    loss = model.loss_function(logits, labels, vocab_size=model.config.vocab_size)
    loss.backward()
    assert_grads_equal({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, grads_ref, **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5_gated"])
def test_gradient_checkpointing(name):
    model = no_dropout(H.build(name))
    loss_ref, grads_ref = train_step(model, name)
    mlpfuse.patch(model, backend="torch")
    model.gradient_checkpointing_enable()
    calls = count_calls(model)
    loss, grads = train_step(model, name)
    assert len(calls) == 2 * len(blocks_of(model))  # each block ran again in the backward
    torch.testing.assert_close(loss, loss_ref, **TOL)
    assert_grads_equal(grads, grads_ref, **TOL)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_autocast(name):
    model = no_dropout(H.build(name))
    batch = H.inputs(name)
    labels = H.labels_for(name, batch)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**batch, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    logits_ref, grads_ref = step()
    mlpfuse.patch(model, backend="torch")
    logits, grads = step()
    assert logits.dtype == logits_ref.dtype
    torch.testing.assert_close(logits, logits_ref, rtol=2e-2, atol=2e-2)
    assert grads.keys() == grads_ref.keys()
    for n in grads_ref:  # fp32 master weights; bf16 compute rounds the same operations
        assert grads[n].dtype == torch.float32
        err = (grads[n] - grads_ref[n]).norm() / grads_ref[n].norm().clamp_min(1e-12)
        assert err < 2e-2, (n, err.item())


def test_t5_block_under_autocast_casts_as_t5_does():
    # T5 casts the GLU output to wo's dtype before wo; under autocast wo then runs in bf16 again. The fused op's
    # inputs are cast to bf16 once: it rounds other intermediates than T5 does, and ends no further from the float64
    # result than T5's own forward. (The whole T5 model is compared above in fp32: under CPU autocast two identical
    # eager steps of it already differ.)
    model = H.build("t5_gated").eval()
    source = model.encoder.block[0].layer[1].DenseReluDense
    x = torch.randn(2, 5, 32, requires_grad=True)
    with torch.no_grad():
        exact = copy.deepcopy(source).double()(x.detach().double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = source(x)
        expected.float().square().sum().backward()
        grads_ref = [x.grad.clone()] + [p.grad.clone() for p in source.parameters()]
        # Decided as outside autocast (the math in float64); the norm stays the layer's, so the block reads x as is.
        assert len(mlpfuse.patch(model, backend="torch", fuse_norms=False).swapped) == 4
        block = model.encoder.block[0].layer[1].DenseReluDense
        assert block is not source
        x.grad = None
        source.zero_grad(set_to_none=True)
        got = block(x)
        got.float().square().sum().backward()
    assert got.dtype == expected.dtype == torch.bfloat16

    def error(t):
        return (torch.linalg.vector_norm(t.double() - exact) / torch.linalg.vector_norm(exact)).item()

    assert error(got) <= 2 * error(expected) + torch.finfo(torch.bfloat16).eps
    for a, b in zip([x.grad] + [p.grad for p in source.parameters()], grads_ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_optimizer_loop_tracks_the_unpatched_model():
    reference = no_dropout(H.build("llama"))
    model = copy.deepcopy(reference)
    mlpfuse.patch(model, backend="torch")
    batches = [H.inputs("llama", seed=s) for s in range(3)]
    for m in (reference, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m.train()
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            m(**batch, labels=batch["input_ids"]).loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
    for (n, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b, a, msg=n, **TOL)


def _triton_fp32():
    if not kernels.available():
        pytest.skip("Triton kernels cannot run here")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    return tf32


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_triton_backend_through_the_interpreter(name):
    # fp32 through Triton's interpreter on CPU (the GPU runs the same kernels): the gated GEMM for Llama, the
    # GEMM+bias+activation over GPT-2's Conv1D weight read through its transposed view (no copy).
    tf32 = _triton_fp32()
    try:
        model = no_dropout(H.build(name)).eval()
        batch = H.inputs(name, batch=1, seq=5)
        with torch.no_grad():
            expected = model(**batch).logits
        _, grads_ref = train_step(model, name)
        mlpfuse.patch(model, backend="triton")
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, expected, rtol=1e-4, atol=1e-5)
        _, grads = train_step(model, name)
        assert_grads_equal(grads, grads_ref, rtol=1e-4, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
