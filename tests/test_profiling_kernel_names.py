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
    ("mlpfuse_fp8_gemm_kernel", "gemm", "mlpfuse", {"kernel": "fp8_gemm"}),
    ("mlpfuse_fp8_weight_gemm_kernel", "gemm", "mlpfuse", {"kernel": "fp8_weight_gemm"}),
    ("mlpfuse_fp8_quantize_kernel", "reduction", "mlpfuse", {"kernel": "fp8_quantize"}),
    ("mlpfuse_fp8_norm_quantize_kernel", "reduction", "mlpfuse", {"kernel": "fp8_norm_quantize"}),
    ("mlpfuse_fp8_split_reduce_kernel", "reduction", "mlpfuse", {"kernel": "fp8_split_reduce"}),
    ("mlpfuse_glu_forward_kernel", "elementwise", "mlpfuse", {"kernel": "glu_forward"}),
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


# Vendor and library names, one row per rule, each from a published trace (source and what it shows). A name that
# no rule knows stays `other`.
VENDOR_CASES = [
    ('Cijk_Ailk_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1_SN_1LDSB0_APM1_AF0EM1_AF1EM1_AMAS3_ASE_ASGT_ASLT_ASM_ASAE'
     '01_ASCE01_ASEM1_BL1_BS1_CLR1_DTVA1_DTVB0_ETSP_EPS1_ELFLR0_EMLL0_FSSC10_FL0_GLVWA2_GLVWB4_GRCGA1_GRCGB1_GR'
     'PM1_GRVWn1_GSU1_GSUASB_GLS0_ISA942_IU1_K1_KLA_LBSPPA0_LBSPPB1024_LPA0_LPB4_LRVW4_LWPMn1_MIAV0_MKFGSU256_N'
     'TA0_NTB0_NTC1_NTD1_NEPBS0_NLCA1_NLCB1_ONLL1_PK0_PGR2_PLR5_PKA0_SIA3_SLW1_SS1_SU0_SUM0_SUS0_SPO1_SRVW0_SSO'
     '0_SVW2_TSGRA0_TSGRB0_TT2_128_TLDS0_UMLDSA0_UMLDSB0_U64SL1_USFGROn1_VAW1_VSn1_VW2_VWB4_VFLRP1_WSGRA0_WSGRB'
     '0_WG64_4_1_WGMn2',
     'gemm', 'rocblas', {'layout': 'NN', 'dtype': 'bf16', 'tile': '128x128', 'depth_u': 64, 'arch': 'gfx942'},
     'TraceLens tests/traces/inference/xdit_flux.1_aiter_sage (MI300X)', 'Tensile GEMM from rocBLAS'),
    ('Cijk_Ailk_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT64x128x64_MI16x16x1_SN_LDSB1_AFC1_AG0_AFEM1_AFEM1_ASEM1_CB'
     '0_CD1_1_CLR1_CADS0_DTLA0_DTLB0_DTLM0_DTVA0_DTVB0_DTVMXSA0_DTVMXSB0_DTVSM0_DPLB0_EPS0_ELFLR0_EMLLn1_FDSI0_'
     'GRPM1_GRVWA8_GRVWB8_GSUAMB_GLS0_HPLR0_ISA942_ICIW0_IU1_K1_LDSTI0_LBSPPA1024_LBSPPB512_LBSPPMXSA0_LBSPPMXS'
     'B0_LBSPPM0_LPA32_LPB16_LPMXSA0_LPMXSB0_LPM0_LRVW8_LWPMn1_MIAV0_MIWT2_4_MXLIBL_MXSFNS_MO40_MGRIPM1_NTn1_NT'
     'A0_NTB4_NTC0_NTD4_NTE0_NTMXSA0_NTMXSB0_NTM0_NTWS0_NVn1_NVA0_NVB0_NVC0_NVD0_NVE0_NVMXSA0_NVMXSB0_NVM0_NVWS'
     '0_NEPBS16_NLCA1_NLCB1_ONLL1_PGR2_PLR1_PKA1_SGROB0_SIA3_SS1_SPO0_SRVW0_SSO0_SVW2_SK0_SKFTR0_SKXCCM0_SIP1_S'
     'GRO0_TDMI0_TDMS0_TIN0_THn1_THA0_THB0_THC0_THD0_THE0_THMXSA0_THMXSB0_THM0_THWS0_TLDS1_TLDSM1_ULSGRO0_USL1_'
     'USLMX0_UIOFGRO0_UPLRP0_USFGROn1_USI0_VSn1_VWA2_VWB4_WSGRA0_WSGRB0_WS64_WG32_8_1',
     'gemm', 'hipblaslt', {'layout': 'NN', 'dtype': 'bf16', 'tile': '64x128', 'arch': 'gfx942', 'epilogue': ['bias']},
     'TraceLens tests/traces/inference/xdit_flux.1_aiter_sage (MI300X)', 'Tensile GEMM from hipBLASLt'),
    ('Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0_AFC1_AFEM1_AFEM1_ASEM1_CLR1_CADS0_EP'
     'S0_GRVWA2_GRVWB2_GSUAMB_ISA90a_IU1_K1_LBSPPA128_LBSPPB128_LBSPPM0_LPA8_LPB8_LPM0_LRVW4_LWPMn1_MIAV0_MIWT1'
     '_1_MO40_NTn1_NTA0_NTB0_NTC0_NTD0_NTM0_NEPBS2_NLCA1_NLCB1_ONLL1_PGR2_PLR1_PKA1_SIA3_SS1_SPO1_SRVW0_SSO0_SV'
     'W1_TLDS1_USFGROn1_VSn1_VWA1_VWB1_WSGRA1_WSGRB1_WS64_WG64_4_1',
     'gemm', 'hipblaslt', {'layout': 'TN', 'dtype': 'fp32', 'tile': '64x16', 'arch': 'gfx90a'},
     'HolisticTraceAnalysis tests/data/amd_trace/mi250_minitoy_train_ROCm6_2_kineto', 'Tensile GEMM on MI250'),
    ('igemm_fwd_gtcx2_nhwc_bf16_bx0_ex1_bt64x64x64_wt16x16x16_ws1x1_wr2x2_ta1x8x2x1_1x8x1x32_tb1x8x2x1_1x8x1x32',
     'conv', 'miopen', {},
     'TraceLens tests/traces/mi210/gpu_only_trace', 'MIOpen implicit-GEMM convolution'),
    ('Im2d2Col_v2',
     'conv', 'miopen', {},
     'TraceLens tests/traces/inference/xdit_flux.1_aiter_sage (MI300X)', 'MIOpen im2col'),
    ('MIOpenBatchNormFwdTrainSpatialMeanVariance',
     'reduction', None, {},
     'TraceLens tests/traces/perf_model/normalization (MI300X)', 'MIOpen batch norm'),
    ('SubTensorOpWithScalar1d',
     'elementwise', None, {},
     'TraceLens tests/traces/inference/xdit_flux.1_aiter_sage (MI300X)', 'MIOpen tensor op'),
    ('batched_transpose_64x64_pack_4x4_ediv_4x4_half',
     'elementwise', None, {},
     'TraceLens tests/traces/mi210/gpu_only_trace', 'layout transpose'),
    ('cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1',
     'conv', 'cudnn', {},
     'HolisticTraceAnalysis tests/data/ns_resolution_trace', 'cuDNN convolution engine'),
    ('sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4_warpsiz'
     'e2x2x1_g1_tensor16x8x8_alignc4_execute_kernel_cudnn',
     'conv', 'cudnn', {},
     'HolisticTraceAnalysis tests/data/critical_path/alexnet',
     'cuDNN implicit-GEMM fprop engine (not a cuBLAS GEMM)'),
    ('void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, float const*, in'
     't, float*, float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)',
     'conv', 'cudnn', {},
     'kineto tb_plugin/samples/resnet50_num_workers_0', 'cuDNN weight-gradient engine'),
    ('void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused::WinogradDat'
     'aParams<float, float>)',
     'conv', 'cudnn', {},
     'HolisticTraceAnalysis tests/data/ns_resolution_trace', 'cuDNN Winograd convolution'),
    ('void cutlass_cudnn_infer::Kernel<cutlass_tensorop_s1688dgrad_optimized_tf32_64x256_32x4_nhwc_align4>(cutl'
     'ass_tensorop_s1688dgrad_optimized_tf32_64x256_32x4_nhwc_align4::Params)',
     'conv', 'cudnn', {},
     'HolisticTraceAnalysis tests/data/nccl_parser_config/nccl_data', "cuDNN's CUTLASS dgrad kernel (not a GEMM)"),
    ('void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, 512, true, 1>(cudnnTensorStruct, float const*, cudnnT'
     'ensorStruct, float*, float const*, float const*, float, float, float*, float*, float*, float*, float, flo'
     'at)',
     'reduction', None, {},
     'kineto tb_plugin/samples/resnet50_num_workers_0', 'cuDNN batch norm'),
    ('void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true>(float*, float const*, int'
     ', int, int)',
     'reduction', None, {},
     'kineto tb_plugin/samples/resnet50_num_workers_0', 'softmax outside at::native'),
    ('nvjet_tst_144x128_64x6_2x1_v_bz_bias_TNN',
     'gemm', 'nvjet', {'tile': '144x128', 'layout': 'TNN', 'epilogue': ['bias']},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'cuBLAS on Blackwell, no arch in the name'),
    ('nvjet_sm100_tst_128x256_64x6_2x1_2cta_v_bz_TNT',
     'gemm', 'nvjet', {'arch': 'sm100', 'tile': '128x256', 'stages': '64x6', 'cluster': '2x1', 'layout': 'TNT'},
     'a B200 PyTorch profile table published with its trace-derived kernel list', 'cuBLAS on Blackwell, arch named'),
    ('bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_16dp256b_rM_TN_transOut_sche'
     'dP2x1x2x3_biasM_bN_tmaOpt_clmp_dynBatch_sm100f',
     'gemm', 'trtllm', {'arch': 'sm100', 'tile': '128x16x256', 'layout': 'TN'},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'TRT-LLM batched GEMM (MoE experts)'),
    ('_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu',
     'gemm', None, {},
     'TraceLens tests/traces/inference/vllm_decode_full', 'Triton matmul kernel'),
    ('void cutlass::device_kernel<enable_sm120_family<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int'
     ', int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::Mainl',
     'gemm', 'cutlass', {},
     'an nsys kernel table of a FlashInfer run (name as printed there, cut short)', 'CUTLASS 3.x GEMM'),
    ('cutlass3x_sm90_tensorop_gemm_f16_f16_f16_f16_f16_128x256x64_1x2x1_0_tnn_align8_warpspecialized_pingpong_e'
     'pi_tma',
     'gemm', 'cutlass', {'arch': 'sm90', 'tile': '128x256x64', 'layout': 'tnn', 'align': 8},
     "the CUTLASS profiler's kernel name as quoted in a public write-up", 'CUTLASS 3.x library kernel'),
    ('fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext',
     'attention', None, {},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'TRT-LLM / FlashInfer fmha on Blackwell'),
    ('void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128, 128, 4, false, false'
     ', cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false,'
     ' false, false, false, false, true, false>(pytorch_flash::Flash_fwd_params)',
     'attention', None, {},
     'TraceLens tests/traces/h100/Falconsai_nsfw_image_detection', "PyTorch's FlashAttention 2"),
    ('void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloop'
     'FwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<80>, cute:'
     ':C<256> >, 256, cutlass::bfloat16_t, float, cutlass::arch::Sm90, false, false, false, true, true, false, '
     'false, true, true, true, true, false, cutlass::bfloat16_t, 1>, flash::CollectiveEpilogueFwd<cute::tuple<c'
     'ute::C<128>, cute::C<256>, cute::C<80> >, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bflo'
     'at16_t, cutlass::arch::Sm90, 256, true, true, true, false, 1>, flash::VarlenDynamicPersistentTileSchedule'
     'r<128, 80, 256, 128, true, true, true, false, false, true> > > >(flash::enable_sm90_or_later<flash::Flash'
     'AttnFwdSm90<...> >::Params)',
     'attention', None, {},
     "a vLLM H100 profile's kernel table (FlashAttention 3 through CUTLASS 3's device_kernel)", 'FlashAttention 3'),
    ('fmha_cutlassF_f16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, cutlass'
     '::arch::Sm80, true, 64, 128, 128, true, true>::Params)',
     'attention', None, {},
     'a published list of the kernels each SDPA backend launches', 'PyTorch memory-efficient attention'),
    ('cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_kernel0_0',
     'attention', None, {},
     'a published list of the kernels each SDPA backend launches', 'cuDNN SDPA (not a cuDNN convolution)'),
    ('attn_fwd',
     'attention', None, {},
     'TraceLens tests/traces/inference/xdit_flux.1_aiter_sage (MI300X)', 'AMD Triton attention'),
    ('kernel_unified_attention_2d',
     'attention', None, {},
     'TraceLens tests/traces/inference/vllm_prefilldecode_piecewise', 'vLLM unified attention'),
    ('void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16, __hip_bfloat16, (vllm::Fp8KVCacheDataType'
     ')0, 1, 128, 256, false, 4, 1, ck_tile::ComposedAttention<0u, false> >(__hip_bfloat16 const*, __hip_bfloat'
     '16 const*, __hip_bfloat16 const*, float, int const*, int const*, int const*, float const*, int, int, int,'
     ' int, float*, float*, __hip_bfloat16*, float, float, float const*, float const*, float const*, ck_tile::C'
     'omposedAttention<0u, false> const*)',
     'attention', None, {},
     'TraceLens tests/traces/inference/sglang_decode', 'vLLM/ROCm paged attention'),
    ('_ZN7ck_tile6kentryILi2ENS_38FmhaBatchPrefillWithPagedKVCacheKernelINS_40BlockFmhaBatchPrefillPipelineQRKS'
     'VSAsyncINS_36BlockFmhaBatchPrefillPipelineProblemIDF16bDF16bDF16bffDF16bhfDF16bfDF16bNS_13TileFmhaShapeIN'
     'S_8sequenceIJLi128ELi128ELi32ELi128ELi32ELi128EEEENS5_IJLi4ELi1ELi1EEEENS5_IJLi32ELi32ELi16EEEES7_S8_Lb1E'
     'EELb1ENS_17ComposedAttentionILj0ELb1EEENS_30SimplifiedGenericAttentionMaskILb1EEELb0ELi1ENS_26TileFmhaBat'
     'chPrefillTraitsILb1ELb1ELb1ELb1ELb0ELNS_22BlockAttentionBiasEnumE0ELb0ELb0ELb0ELNS_28BlockAttentionQuantS'
     'caleEnumE0ELin1ELb0ELb0ELi1ELNS_37BlockAttentionKVCacheMemoryLayoutEnumE1ELNS_36BlockAttentionKVCacheLook'
     'upTableEnumE1ELNS_33BlockAttentionKVCacheLoadModeEnumE0EEEEENS_53BlockFmhaBatchPrefillPipelineQRKSVSAsync'
     'DefaultPolicyEEENS_17Default2DEpilogueINS_24Default2DEpilogueProblemIfDF16bLb1ELb1ELb1EEEvEEEEJNSS_21Fmha'
     'FwdGroupModeKargsEEEEvDpT1_',
     'attention', None, {},
     'TraceLens tests/traces/inference/sglang_prefilldecode', 'composable_kernel fmha, mangled'),
    ('void split_embedding_codegen_forward_unweighted_kernel<c10::Half, c10::Half, float, false, long, 2ul, 32u'
     'l>(at::GenericPackedTensorAccessor<c10::Half, 1ul, at::RestrictPtrTraits, long>, at::GenericPackedTensorA'
     'ccessor<c10::Half, 1ul, at::RestrictPtrTraits, long>, at::GenericPackedTensorAccessor<c10::Half, 2ul, at:'
     ':RestrictPtrTraits, long>, at::GenericPackedTensorAccessor<int, 1ul, at::RestrictPtrTraits, int>, at::Gen'
     'ericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>, at::GenericPackedTensorAccessor<int, 1ul'
     ', at::RestrictPtrTraits, int>, fbgemm_gpu::FixedDivisor, at::GenericPackedTensorAccessor<long, 1ul, at::R'
     'estrictPtrTraits, int>, at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>, long, at:'
     ':GenericPackedTensorAccessor<int, 1ul, at::RestrictPtrTraits, int>, at::GenericPackedTensorAccessor<float'
     ', 2ul, at::RestrictPtrTraits, long>)',
     'embedding', 'fbgemm_gpu', {},
     'HolisticTraceAnalysis tests/data/timeline_analysis/sampled_rank-0',
     'fbgemm table-batched embedding lookup (fbgemm in its arguments)'),
    ('void bounds_check_indices_kernel<long, false>(at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrT'
     'raits, int>, at::GenericPackedTensorAccessor<long, 1ul, at::RestrictPtrTraits, int>, at::GenericPackedTen'
     'sorAccessor<long, 1ul, at::RestrictPtrTraits, int>, int const*, long, at::GenericPackedTensorAccessor<lon'
     'g, 1ul, at::RestrictPtrTraits, int>, fbgemm_gpu::FixedDivisor)',
     'embedding', 'fbgemm_gpu', {},
     'HolisticTraceAnalysis tests/data/timeline_analysis/sampled_rank-0', 'fbgemm embedding index check'),
    ('void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, int*)',
     'other', 'fbgemm_gpu', {},
     'HolisticTraceAnalysis tests/data/timeline_analysis/sampled_rank-0', 'fbgemm_gpu but no GEMM'),
    ('ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)',
     'communication', 'nccl', {'collective': 'SendRecv', 'algorithm': 'RING'},
     'HolisticTraceAnalysis tests/data/timeline_analysis/sampled_rank-0', 'NCCL'),
    ('ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)',
     'communication', 'nccl', {},
     'TraceLens tests/traces/mi300/resnet_act_checkpoint (MI300X)', "RCCL keeps NCCL's kernel names"),
    ('void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long, '
     'unsigned int**, unsigned long, unsigned long)',
     'communication', 'custom', {},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'PyTorch symmetric-memory all-reduce'),
    ('void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<c'
     'har*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)',
     'elementwise', 'aten', {'op': 'CUDAFunctor_add', 'dtype': 'fp32'},
     'HolisticTraceAnalysis tests/data/amd_trace/mi250_minitoy_train_ROCm6_2_kineto', 'ATen elementwise on ROCm'),
    ('void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, true, true, false>(cublasLt::'
     'cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*, float const*, '
     'float const*, float*, void*, long, float*, int*)',
     'reduction', None, {},
     'HolisticTraceAnalysis tests/data/ns_resolution_trace', 'cuBLASLt split-K reduction'),
    ('void reduce_1Block_kernel<float, 128, 7, cublasGemvTensorStridedBatched<float>, cublasGemvTensorStridedBa'
     'tched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16> >(float const*, float, cublasGe'
     'mvTensorStridedBatched<float>, int, float const*, float, cublasGemvTensorStridedBatched<__nv_bfloat16 con'
     'st>, cublasGemvTensorStridedBatched<__nv_bfloat16>, cublasPointerMode_t, cublasLtEpilogue_t, cublasGemvTe'
     'nsorStridedBatched<biasType<cublasGemvTensorStridedBatched<__nv_bfloat16>::value_type, float>::type const'
     '>)',
     'gemm', 'cublas', {},
     'TraceLens tests/traces/h100/google_owlv2-large-patch14-ensemble',
     'cuBLAS GEMV helper, cuBLAS only in its arguments'),
    ('void vllm::rms_norm_kernel<c10::BFloat16, 8, 2>(c10::BFloat16*, c10::BFloat16 const*, long, long, long, l'
     'ong, long, c10::BFloat16 const*, float, int, int)',
     'reduction', None, {},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'vLLM RMSNorm'),
    ('std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type vllm::fused_add_rms_no'
     'rm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, c10::BFloat16*, c10::BFloat16 const*, float, int, int)',
     'reduction', None, {},
     'TraceLens tests/traces/b200/eager_trace (B200)', 'return type with a comparison inside its template arguments'),
    ('void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*, c10:'
     ':BFloat16 const*, int, long, long, long, int, int, int)',
     'elementwise', None, {},
     'TraceLens tests/traces/inference/vllm_prefilldecode_piecewise', 'rotary embedding, not an embedding lookup'),
    ('void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType'
     '<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*, at::native::(anonymous'
     ' namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 6'
     '4, 64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)',
     'elementwise', None, {},
     'TraceLens tests/traces/h100/Qwen_Qwen1.5-0.5B-Chat', 'torch.cat copy'),
]


@pytest.mark.parametrize("name,family,library,fields,source,why", VENDOR_CASES,
                         ids=[c[5] for c in VENDOR_CASES])
def test_vendor_names(name, family, library, fields, source, why):
    d = decode(name)
    assert (d.family, d.library) == (family, library), (why, source)
    for key, value in fields.items():
        assert d.fields[key] == value, key


def test_every_rule_has_a_row():
    """Each rule of the table decides at least one name above or in CASES (an unused rule is untested)."""
    from mlpfuse.profiling import kernel_names

    hits = set()
    for name in [c[0] for c in CASES] + [c[0] for c in VENDOR_CASES]:
        head = kernel_names.kernel_head(name)
        for i, (pattern, _, _, _, on_head) in enumerate(kernel_names._RULES):
            if pattern.search(head if on_head else name):
                hits.add(i)
                break
    assert hits == set(range(len(kernel_names._RULES)))
