"""Which tile rows a card gets (kernels.configs): measured cards by name and SM count, others the safe default."""

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from mlpfuse.kernels import configs  # noqa: E402

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"  # as torch.cuda.get_device_name() reports them


def _gated(name, sms, m, n, k, dtype=torch.bfloat16):
    return configs.pick("gated", dtype, m, n, device=CUDA, num_sms=sms, arch=9, k=k, name=name)


def test_measured_cards_get_their_gated_rows_by_layer_size():
    for name in (H100, H200):
        large = _gated(name, 132, 8192, 14336, 4096)
        assert (large.block_n, large.num_warps, large.programs_per_sm) == (128, 8, 1)
        # The rows split by layer size, not by tile count: the blog shape keeps the paired 128×64 tiles.
        small = _gated(name, 132, 8192, 3072, 768)
        assert (small.block_n, small.group_m, small.programs_per_sm) == (64, 4, 2)
        assert _gated(name, 132, 16, 14336, 4096) == large
    assert _gated(H100, 132, 8192, 14336, 4096, torch.float32).block_k == 32


def test_gated_rows_by_activation_and_tokens():
    """Measured per card (tune-gated-tma-store, then the layer sweeps): GeGLU on large layers from 4096 tokens and
    small layers from 16384 store h through TMA with three stages (the small layers' GROUP_M: 4 on the H100, 8 on
    the H200); SwiGLU on large layers and shorter calls keep the shared rows."""
    from mlpfuse.activations import GELU_TANH, SILU

    def on(name, m, n, k, act, dtype=torch.bfloat16):
        return configs.pick("gated", dtype, m, n, device=CUDA, num_sms=132, arch=9, k=k, name=name, activation=act)

    shared_large = configs._SM90_MEASURED[("gated", "large")]
    shared_small = configs._SM90_MEASURED[("gated", "small")]
    for name, group in ((H100, 4), (H200, 8)):
        for m in (4096, 8192, 16384):
            geglu_large = on(name, m, 14336, 4096, GELU_TANH)
            assert (geglu_large.block_n, geglu_large.num_stages, geglu_large.tma_store) == (128, 3, True)
            assert on(name, m, 14336, 4096, SILU) == shared_large
        for m in (1, 64, 256, 1024, 4095):  # shorter calls: the four-stage row
            assert on(name, m, 14336, 4096, GELU_TANH) == on(name, m, 8192, 2048, GELU_TANH) == shared_large
        for act in (GELU_TANH, SILU):
            long = on(name, 16384, 3072, 768, act)
            assert (long.block_n, long.programs_per_sm, long.tma_store, long.group_m) == (128, 1, True, group)
            # the paired tiles below 16384 tokens, either activation
            assert on(name, 16383, 3072, 768, act) == on(name, 4096, 3072, 768, act) == shared_small
            assert on(name, 16384, 3072, 768, act, torch.float32).block_k == 32  # fp32: half the K depth
        assert on(name, 8192, 14336, 4096, GELU_TANH, torch.float32).block_k == 32
    # A card without rows by activation or tokens (the first H200 table, classed by tile count) gets its size row.
    assert on("NVIDIA GH200 480GB", 16384, 3072, 768, GELU_TANH) == configs._SM90_16[("gated", "large")]


def test_cards_are_told_apart_by_name_and_sm_count():
    assert configs.card(H100, 132)[0] == "h100-sxm"
    assert configs.card("NVIDIA H100 PCIe", 114) is None  # fewer SMs, other clocks: not measured
    assert configs.card("NVIDIA H800", 132) is None
    assert configs.card("NVIDIA H100 NVL", 132) is None and configs.card("NVIDIA GH200 480GB", 132) is None
    assert configs.card(H200, 132)[0] == "h200"
    # An unmeasured Hopper card still gets valid rows (the first H200 table's) for kernels a caller forces.
    assert _gated("NVIDIA GH200 480GB", 132, 8192, 14336, 4096) == configs._SM90_16[("gated", "large")]


class Props(NamedTuple):
    """The fields of torch.cuda.get_device_properties() that tell cards apart, for cards this machine lacks."""

    name: str
    multi_processor_count: int


@pytest.mark.parametrize("name", [H100, H200])
@pytest.mark.parametrize("sms", [114, 131, 133, 144])
def test_a_measured_name_with_another_sm_count_is_an_untuned_card(name, sms):
    """Same name, other SM count (a cut-down or differently fused part, a MIG-like slice): its clocks and tile
    counts differ, so the card's measured rows and cut-overs do not apply; it gets the generic Hopper rows."""
    assert configs.card_of(Props(name, 132)) is configs.card(name, 132) is not None
    assert configs.card_of(Props(name, sms)) is None and configs.card(name, sms) is None
    generic = configs._SM90_16
    assert _gated(name, sms, 8192, 14336, 4096) == generic[("gated", "large")] != _gated(name, 132, 8192, 14336, 4096)
    assert _gated(name, sms, 16384, 3072, 768) == generic[("gated", "large")]  # no long-call row either


def test_measured_cards_carry_their_cut_overs():
    for name in (H100, H200):
        cut = configs.card(name, 132).cutovers
        assert isinstance(cut, configs.Cutovers)
        # the decode kernels, then (where the gap is more than one token) cuBLAS around the GLU pass, then the
        # gated GEMM, in that order of tokens
        assert 0 < cut.decode_large_max_m < cut.gated_large_min_m and cut.linear_act_min_work > 0
    # the H100 goes from the decode kernels straight to the gated GEMM (cut-over/); the H200 keeps SPLIT in between
    # on layers from its split_min_layer
    h100, h200 = configs.card(H100, 132).cutovers, configs.card(H200, 132).cutovers
    assert h100.gated_large_min_m == h100.decode_large_max_m + 1
    assert h200.gated_large_min_m > h200.decode_large_max_m + 1 and h200.split_min_layer > 1 << 24


def test_cpu_and_older_gpus_get_their_rows():
    assert configs.pick("gated", torch.float32, 64, 64, device=torch.device("cpu"), num_sms=1, arch=0) is \
        configs._INTERPRET
    ampere = configs.pick("gated", torch.bfloat16, 4096, 4096, device=CUDA, num_sms=108, arch=8, name="NVIDIA A100")
    assert ampere.tma is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs the card itself")
def test_the_test_machine_is_a_measured_card():
    from mlpfuse.ops import dispatch

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    if name in (H100, H200):
        assert dispatch.tuned_card(dev) and dispatch.untuned_note(dev) is None
