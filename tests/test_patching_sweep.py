"""The family sweep: every transformers model type installed, built tiny from its config class's defaults, patched
(fp32, torch backend), its outputs compared with the unpatched model's and restored exactly by unpatch. The table
(family, swapped per layout, left with reasons) is printed at the end of the run (tests/conftest.py)."""

import pytest

transformers = pytest.importorskip("transformers")
import family_sweep as S  # noqa: E402 - needs transformers

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def rows():
    return {r.family: r for r in S.sweep()}


def test_every_family_patched_computes_what_it_did_and_unpatches_exactly(rows):
    mismatches = [r.line() for r in rows.values() if r.status.startswith("MISMATCH")]
    assert mismatches == []
    patched = [r for r in rows.values() if r.status == "patched"]
    assert len(patched) >= 40, "\n".join(S.TABLE)


def test_families_outside_the_name_table_are_read_from_their_structure(rows):
    # The families a name table missed (Granite, OLMo-2, Cohere, StarCoder2, Phi), where they are installed.
    for family, layout in [("granite", "gated"), ("olmo2", "gated"), ("cohere", "gated"),
                           ("starcoder2", "two-layer"), ("phi", "two-layer"), ("gpt_neox", "two-layer"),
                           ("glm", "gated"), ("modernbert", "gated")]:
        if family in rows and not rows[family].status.startswith("skipped"):
            assert rows[family].status == "patched" and rows[family].swapped[f"{layout}/structure"] == 2, \
                rows[family].line()
    # The table's own families still match by name.
    assert rows["llama"].swapped == {"gated/name": 2} and rows["gpt2"].swapped == {"two-layer/name": 2}


def test_post_norm_output_blocks_are_read_by_name_and_from_their_structure(rows):
    # BERT's and RoBERTa's rows name their output blocks; their descendants' are read from the children (a Linear,
    # a LayerNorm over its outputs, a dropout, a forward of two inputs): two per layer, MPNet's one.
    assert rows["bert"].swapped == {"linear-act/name": 2, "post-norm/name": 4}
    for family, blocks in [("electra", 4), ("xlm-roberta", 4), ("camembert", 4), ("layoutlm", 4), ("mpnet", 2)]:
        if family in rows and not rows[family].status.startswith("skipped"):
            assert rows[family].status == "patched" and rows[family].swapped["post-norm/structure"] == blocks, \
                rows[family].line()


def test_mixtures_of_experts_leave_the_experts_and_patch_the_dense_blocks(rows):
    mixtral = rows["mixtral"]
    assert not mixtral.swapped
    assert [k for k in mixtral.left] == [
        k for k in mixtral.left if k.startswith("MixtralSparseMoeBlock: a mixture of experts: grouped expert weights")]
    assert sum(mixtral.left.values()) == 2  # one per layer
    qwen_moe = rows["qwen2_moe"]  # its shared expert is a dense gated MLP
    assert qwen_moe.status == "patched" and qwen_moe.swapped["gated/structure"] == 2
    assert all("grouped expert weights" in k for k in qwen_moe.left)


def test_blocks_that_look_gated_but_compute_otherwise_are_left(rows):
    # Gemma-3n sparsifies the gate's activations in its first layers: no fused reading computes that.
    gemma3n = rows.get("gemma3n_text")
    if gemma3n is not None and not gemma3n.status.startswith("skipped"):
        assert not gemma3n.swapped
        assert all("none of the" in k and "differs from the module's own" in k for k in gemma3n.left)
