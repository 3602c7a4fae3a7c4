"""Kernel-name decoding: families and fields, on names seen in real traces (H200 fixtures, and names of older
cuBLAS / CUTLASS / NCCL builds as they appear in published PyTorch profiles)."""

import gzip
import json
import os

import pytest

from mlpfuse.profiling.kernel_names import FAMILIES, decode, inductor_fused_ops

TRACES = os.path.join(os.path.dirname(__file__), "fixtures", "traces")

CASES = [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "gemm", "nvjet",
     {"arch": "sm90", "tile": "256x128", "stages": "64x4", "cluster": "1x2", "layout": "TNT", "epilogue": ["bias"],
      "schedule": "coopA"}),
    ("nvjet_sm90_tst_128x160_64x5_2x4_h_bz_NTT", "gemm", "nvjet", {"tile": "128x160", "cluster": "2x4", "layout": "NTT"}),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "gemm", "cublas",
     {"arch": "sm80", "dtype": "bf16", "tile": "128x128", "stages": "32x5", "layout": "tn"}),
    ("ampere_h16816gemm_256x128_ldg8_stages_64x3_nn", "gemm", "cublas",
     {"arch": "sm80", "dtype": "fp16", "tile": "256x128", "layout": "nn"}),
    ("volta_sgemm_128x64_tn", "gemm", "cublas", {"arch": "sm70", "dtype": "fp32", "layout": "tn"}),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm", "cublas", {"arch": "sm90", "dtype": "bf16", "tile": "128x128x64", "layout": "tn"}),
    ("cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8", "gemm", "cutlass",
     {"arch": "sm80", "dtype": "bf16", "tile": "32x32", "layout": "tn", "align": 8}),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
     "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "gemm", "cutlass",
     {"arch": "sm80", "epilogue": ["relu"], "tile": "64x64", "stages": "64x4"}),
    ("triton_poi_fused__unsafe_view_gelu_mul_0", "triton_pointwise", "inductor",
     {"fused_ops": ["_unsafe_view", "gelu", "mul"]}),
    ("triton_red_fused_native_layer_norm_3", "triton_reduction", "inductor", {"fused_ops": ["native_layer_norm"]}),
    ("triton_per_fused__softmax_add_1", "triton_persistent", "inductor", {"fused_ops": ["_softmax", "add"]}),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication", "nccl",
     {"collective": "AllReduce", "dtype": "bf16", "algorithm": "RING", "protocol": "LL"}),
    ("mlpfuse_gated_gemm_kernel", "gemm", "mlpfuse", {"kernel": "gated_gemm"}),
    ("mlpfuse_glu_backward_kernel", "gemm", "mlpfuse", {"kernel": "glu_backward"}),
    ("mlpfuse_gemm_act_kernel", "gemm", "mlpfuse", {"kernel": "gemm_act"}),
    ("mlpfuse_decode_mlp_kernel", "gemm", "mlpfuse", {"kernel": "decode_mlp"}),
    ("mlpfuse_glu_backward_pointwise_kernel", "elementwise", "mlpfuse", {"kernel": "glu_backward_pointwise"}),
    ("mlpfuse_decode_reduce_kernel", "reduction", "mlpfuse", {"kernel": "decode_reduce"}),
    ("mlpfuse_decode_down_kernel", "gemm", "mlpfuse", {"kernel": "decode_down"}),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
     "float>, unsigned int, float, 4, 4>)", "reduction", "aten", {"op": "MeanOps", "dtype": "fp32"}),
    ("Memset (Device)", "memset", None, {}),
    ("Memcpy DtoD (Device -> Device)", "copy", None, {}),
]


@pytest.mark.parametrize("name,family,library,fields", CASES, ids=[c[0][:40] for c in CASES])
def test_decode(name, family, library, fields):
    d = decode(name)
    assert d.family == family and d.library == library
    for key, value in fields.items():
        assert d.fields[key] == value, key


def test_real_aten_elementwise_names_from_the_h200_traces():
    with gzip.open(os.path.join(TRACES, "geglu_eager_train.json.gz"), "rt") as fh:
        names = {e["name"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel"}
    aten = {n for n in names if "at::native" in n}
    assert aten  # the trace has them
    decoded = {n: decode(n) for n in aten}
    ops = {d.fields.get("op") for d in decoded.values()}
    assert {"GeluCUDAKernelImpl", "GeluBackwardCUDAKernelImpl", "MulFunctor", "CUDAFunctor_add", "FillFunctor"} <= ops
    for n, d in decoded.items():
        # the dtype comes from the template arguments the name spells out
        expected = "bf16" if "c10::BFloat16" in n else "fp32"
        if d.family == "elementwise" and "copy" not in d.fields["op"]:
            assert d.fields["dtype"] == expected, n
    assert all(d.family in ("elementwise", "reduction") for d in decoded.values())


@pytest.mark.parametrize("name", ["", "flash_fwd_kernel", "my_custom_kernel<int>", "???", "x" * 5000,
                                  "triton_poi_fused_", "nvjet_", "cutlass_", "ampere_"])
def test_unknown_or_odd_names_never_fail(name):
    d = decode(name)
    assert d.family in FAMILIES


def test_inductor_fused_ops_split():
    assert inductor_fused_ops("_to_copy_add_mul_native_layer_norm") == ["_to_copy", "add", "mul", "native_layer_norm"]
    assert inductor_fused_ops("gelu") == ["gelu"]


# The ATen rules as regular expressions: the specification the linear-time matcher implements. Their lazy
# `(?:\w+::)*?` backtracks quadratically on long names, so they serve only as the oracle, on short ones.
import re  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

_REFERENCE = {
    "reduction": re.compile(r"at::native::(?:\(anonymous namespace\)::)?(?:\w+::)*?(?P<kernel>reduce_kernel|"
                            r"\w*[Ss]oft[Mm]ax\w*|\w*norm\w*_kernel\w*|\w*_reduce\w*kernel)"),
    "elementwise": re.compile(r"at::native::(?:\(anonymous namespace\)::)?(?:\w+::)*?(?P<kernel>"
                              r"\w*elementwise_kernel\w*|\w*index\w*_kernel\w*|\w*copy\w*_kernel\w*|"
                              r"\w*cat\w*_kernel\w*)"),
}
_OP = re.compile(r"at::native::(?:\w+::)*?(\w+)(?=[<(,> ]|$)")
_PIECES = ["at::native::", "at::native::", "at::native::(anonymous namespace)::", "::", "(anonymous namespace)::", "norm", "_kernel", "kernel", "_reduce", "reduce_kernel",
           "Softmax", "softmax", "index", "copy", "cat", "elementwise_kernel", "vectorized_", "<", ">", "(", ")", ",",
           " ", "a", "b_", "c10::Half", "float", "BinaryFunctor", "_internal", "MulFunctor", "void ", "x", "_"]


@settings(max_examples=500, derandomize=True, database=None, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=16).map("".join))
def test_aten_matching_agrees_with_the_reference_patterns(name):
    from mlpfuse.profiling.kernel_names import _ATEN_WRAPPERS

    decoded = decode(name)
    want = next(((family, m) for family, p in _REFERENCE.items() if (m := p.search(name))), None)
    if want is None:
        assert decoded.library != "aten"
        return
    if any(p.search(name) for p in (re.compile(r"^(?:Memset|memset|Memcpy|memcpy|mlpfuse_|nvjet_|triton_)"),
                                    re.compile(r"nccl", re.I), re.compile(r"cutlass_\d+_"))):
        return  # an earlier rule owns the name
    family, m = want
    assert (decoded.family, decoded.library, decoded.fields["kernel"]) == (family, "aten", m.group("kernel"))
    text = name.replace("(anonymous namespace)::", "")
    rest = text[text.find(m.group("kernel")) + len(m.group("kernel")):]
    op = next((i for i in _OP.findall(rest) if i not in _ATEN_WRAPPERS and not i.endswith("_internal")), None)
    assert decoded.fields.get("op") == op
