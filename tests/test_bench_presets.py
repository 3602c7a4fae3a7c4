"""Cases from presets and sweep flags; every bad name is one InputError that lists the valid ones."""

import pytest

from mlpfuse.bench import presets
from mlpfuse.bench.variants import DEFAULT_VARIANTS, VARIANTS, parse_variants
from mlpfuse.errors import InputError


def test_preset_shapes():
    (blog,) = presets.build_cases(preset="blog")
    assert (blog.tokens, blog.dim, blog.hidden, blog.dtype, blog.mode) == (8192, 768, 3072, "bf16", "fwd")
    assert (blog.workload, blog.activation) == ("geglu", "gelu_tanh")
    decode = presets.build_cases(preset="decode")
    assert [c.tokens for c in decode] == [1, 4, 16, 32, 64]
    assert {(c.dim, c.hidden) for c in decode} == {(4096, 14336)}


def test_several_presets_are_a_union():
    cases = presets.build_cases(preset="blog,gemma-2b", mode="fwd,fwd+bwd")
    assert [(c.tokens, c.dim, c.hidden, c.mode) for c in cases] == [
        (8192, 768, 3072, "fwd"), (8192, 768, 3072, "fwd+bwd"), (8192, 2048, 16384, "fwd"), (8192, 2048, 16384, "fwd+bwd")
    ]


def test_sweep_is_the_cross_product_and_flags_override_the_preset():
    cases = presets.build_cases(
        preset="blog", tokens="1,4x16", dtype="bf16,fp16", activation="gelu_tanh,silu", workload="gated,swiglu",
        mode="fwd,fwd+bwd",
    )
    assert {c.tokens for c in cases} == {1, 64}
    assert {c.dim for c in cases} == {768}
    # gated: 2 activations; swiglu: its own activation only (the flag does not multiply it)
    assert len(cases) == (2 + 1) * 2 * 2 * 2
    assert {c.activation for c in cases if c.workload == "swiglu"} == {"silu"}
    assert len(set(cases)) == len(cases)


def test_cpu_defaults_are_small_and_said():
    notes = []
    cases = presets.build_cases(preset="llama-8b", on_cpu=True, notes=notes)
    assert [c.tokens for c in cases] == [presets.CPU_MAX_TOKENS]
    assert cases[0].dtype == "fp32"
    assert any("capped" in n for n in notes) and any("fp32" in n for n in notes)
    # explicit flags are obeyed as given
    (case,) = presets.build_cases(preset="llama-8b", tokens="8192", dtype="bf16", on_cpu=True)
    assert (case.tokens, case.dtype) == (8192, "bf16")
    assert presets.build_cases(on_cpu=True)[0].tokens == 64  # no shape: the small preset


@pytest.mark.parametrize(
    "kwargs, argument, valid",
    [
        ({"preset": "gpt5"}, "--preset", "blog, llama-8b, gemma-2b, decode, small"),
        ({"workload": "geglu,moe"}, "--workload", "geglu, swiglu, gated, mlp, linear"),
        ({"dtype": "fp8"}, "--dtype", "bf16, fp16, fp32"),
        ({"mode": "bwd"}, "--mode", "fwd, fwd+bwd"),
        ({"activation": "tanhh"}, "--activation", "gelu_tanh"),
        ({"tokens": "12,abc"}, "--tokens", "positive integers"),
        ({"tokens": "0"}, "--tokens", "positive integers"),
        ({"dim": "-4"}, "--dim", "positive integers"),
    ],
)
def test_bad_input_names_the_argument_and_the_valid_values(kwargs, argument, valid):
    with pytest.raises(InputError) as info:
        presets.build_cases(**kwargs)
    msg = str(info.value)
    assert msg.startswith(argument) and valid in msg and "\n" not in msg


def test_variants_parsing():
    assert [v.name for v in parse_variants(None)] == list(DEFAULT_VARIANTS)
    assert [v.name for v in parse_variants("all")] == list(VARIANTS)
    names = [v.name for v in parse_variants("eager,compile,compile", compile_mode="max-autotune")]
    assert names == ["eager", "compile-max-autotune"]
    with pytest.raises(InputError, match=r"--variants: unknown variant 'triton'; expected one of eager, compile"):
        parse_variants("eager,triton")
    with pytest.raises(InputError, match="--compile-mode"):
        parse_variants("compile", compile_mode="fastest")
