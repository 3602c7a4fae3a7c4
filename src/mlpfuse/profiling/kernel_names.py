"""Decode GPU kernel names into a family and the fields the name carries.

Table-driven: `_RULES` maps a name pattern to (family, library, field parser). The first matching rule wins; a
name no rule knows is family `other` with no fields — decoding never fails. Families (DESIGN.md): gemm, attention,
conv, embedding, elementwise, reduction, triton_pointwise, triton_reduction, triton_persistent, memset, copy,
communication, other.

Examples of what the names carry:
  nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT      arch sm90, tile 256x128, k-tile x stages 64x4,
                                                           cluster 1x2, schedule coopA, epilogue bias, layout TNT
  ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn   arch sm80, dtype bf16, tile, stages, layout tn
  cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8
  triton_poi_fused__unsafe_view_gelu_mul_0                 Inductor pointwise kernel fusing _unsafe_view, gelu, mul
  void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl(...)...>   functor GeluCUDAKernelImpl
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable

FAMILIES = (
    "gemm",
    "attention",
    "conv",
    "embedding",
    "elementwise",
    "reduction",
    "triton_pointwise",
    "triton_reduction",
    "triton_persistent",
    "memset",
    "copy",
    "communication",
    "other",
)


@dataclass(frozen=True)
class Decoded:
    family: str
    library: str | None = None
    fields: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {"family": self.family}
        if self.library:
            out["library"] = self.library
        out.update(self.fields)
        return out


# ---------------------------------------------------------------- shared token vocabularies

_ARCH_WORDS = {"maxwell": "sm50", "pascal": "sm60", "volta": "sm70", "turing": "sm75", "ampere": "sm80",
               "ada": "sm89", "hopper": "sm90", "blackwell": "sm100"}
_EPILOGUES = {"bias", "relu", "gelu", "silu", "swish", "bgrad", "bgrada", "bgradb", "drelu", "dgelu", "aux", "alpha",
              "beta", "scale", "amax", "sigmoid", "tanh", "clamp", "swiglu", "geglu"}
_DTYPE_TOKENS = {"bf16": "bf16", "f16": "fp16", "fp16": "fp16", "half": "fp16", "f32": "fp32", "fp32": "fp32",
                 "tf32": "tf32", "f64": "fp64", "fp8": "fp8", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "i8": "int8",
                 "s8": "int8", "int8": "int8"}
# cuBLAS legacy naming: <arch>_<letter>gemm or <letter><mma shape>gemm, e.g. sgemm, h16816gemm, s16816gemm.
_GEMM_LETTER = {"s": "fp32", "d": "fp64", "h": "fp16", "c": "complex64", "z": "complex128", "i": "int8"}
_LAYOUT = re.compile(r"^(?:[tn]{2,3}|[TN]{2,3})$")
_TILE = re.compile(r"^(\d+x\d+(?:x\d+)?)$")


def _gemm_tokens(tokens: list[str]) -> dict:
    """Fields common to cuBLAS / CUTLASS style names: dtype, tile, stages, layout, epilogue, alignment."""
    out: dict = {}
    tiles: list[str] = []
    epilogue: list[str] = []
    for i, tok in enumerate(tokens):
        low = tok.lower()
        if "dtype" not in out:
            prefix = re.match(r"^(bf16|tf32|fp16|f16|fp32|f32|e4m3|e5m2)", low)
            if low in _DTYPE_TOKENS:
                out["dtype"] = _DTYPE_TOKENS[low]
            elif prefix:  # cuBLAS xmma names glue operand types together: bf16bf16_bf16f32
                out["dtype"] = _DTYPE_TOKENS[prefix.group(1)]
            else:
                m = re.match(r"^([sdhczi])(\d{3,6})?gemm", low)
                if m:
                    out["dtype"] = _GEMM_LETTER[m.group(1)]
        if low.startswith("tilesize") and "tile" not in out:
            out["tile"] = low[len("tilesize"):]
        elif low == "stages" and i + 1 < len(tokens) and _TILE.match(tokens[i + 1]):
            out["stages"] = tokens[i + 1]
        elif _TILE.match(tok) and (i == 0 or tokens[i - 1].lower() != "stages"):
            tiles.append(tok)
        elif _LAYOUT.match(tok):
            out["layout"] = tok
        elif low in _EPILOGUES:
            epilogue.append(low)
        elif low.startswith("align") and low[5:].isdigit():
            out["align"] = int(low[5:])
        elif low.startswith("warpgroupsize"):
            out["warpgroups"] = low[len("warpgroupsize"):]
    if tiles:
        out.setdefault("tile", tiles[0])
        if len(tiles) > 1 and "stages" not in out:
            out["stages"] = tiles[1]  # CUTLASS: <tile>_<k-tile>x<stages>
    if epilogue:
        out["epilogue"] = epilogue
    return out


# ---------------------------------------------------------------- per-library parsers


def _parse_nvjet(m: re.Match, name: str) -> dict:
    # nvjet_<arch>_<kind>_<MxN>_<K>x<stages>_<cluster>_<raster>_<flags...>_<layout>
    tokens = name.split("_")[1:]
    out: dict = {}
    if tokens and re.match(r"^sm\d+", tokens[0]):
        out["arch"] = tokens.pop(0)
    if tokens and tokens[0].isalpha() and not _TILE.match(tokens[0]):
        out["variant"] = tokens.pop(0)
    dims = [t for t in tokens if _TILE.match(t)]
    if dims:
        out["tile"] = dims[0]
    if len(dims) > 1:
        out["stages"] = dims[1]  # K-tile x pipeline stages
    if len(dims) > 2:
        out["cluster"] = dims[2]
    flags, epilogue = [], []
    for t in tokens:
        if _TILE.match(t):
            continue
        if _LAYOUT.match(t):
            out["layout"] = t
        elif t.lower() in _EPILOGUES:
            epilogue.append(t.lower())
        elif t.startswith(("coop", "ping", "persist")):
            out["schedule"] = t
        elif t in ("h", "v"):
            out["raster"] = t
        else:
            flags.append(t)
    if epilogue:
        out["epilogue"] = epilogue
    if flags:
        out["flags"] = flags
    return out


def _parse_cublas(m: re.Match, name: str) -> dict:
    word = m.group("arch").lower()
    tokens = name.split("_")
    out = {"arch": _ARCH_WORDS.get(word, word)}
    out.update(_gemm_tokens(tokens[1:]))
    return out


def _parse_cutlass(m: re.Match, name: str) -> dict:
    inner = m.group(0)
    tokens = inner.split("_")
    out: dict = {}
    if len(tokens) > 1 and tokens[1].isdigit():
        out["arch"] = f"sm{tokens[1]}"
    out.update(_gemm_tokens(tokens[2:]))
    return out


# Multi-token aten names that appear inside Inductor kernel names; a plain token is one op.
_INDUCTOR_OPS = sorted(
    (tuple(s.split("_")) for s in (
        "_unsafe_view", "unsafe_view", "_to_copy", "to_copy", "native_layer_norm", "native_layer_norm_backward",
        "native_batch_norm", "native_dropout", "_softmax", "_log_softmax", "_softmax_backward_data",
        "convert_element_type", "gelu_backward", "silu_backward", "threshold_backward", "sigmoid_backward",
        "tanh_backward", "embedding_dense_backward", "new_zeros", "new_empty", "full_like", "zeros_like",
        "ones_like", "clamp_min", "clamp_max", "masked_fill", "index_put", "scatter_add", "var_mean",
        "native_group_norm", "scaled_dot_product", "_scaled_dot_product_flash_attention", "expand_as",
        "reciprocal_mul", "add_mm", "slice_scatter", "select_scatter", "constant_pad_nd",
    )),
    key=len,
    reverse=True,
)


_OPS_BY_FIRST: dict[str, list[tuple[str, ...]]] = {}
for _op in _INDUCTOR_OPS:  # longest first within each list, as in _INDUCTOR_OPS
    _OPS_BY_FIRST.setdefault(_op[0], []).append(_op)


def inductor_fused_ops(text: str) -> list[str]:
    """'_unsafe_view_gelu_mul' -> ['_unsafe_view', 'gelu', 'mul'] (longest known op name first)."""
    tokens = text.split("_")
    ops: list[str] = []
    i = 0
    while i < len(tokens):
        candidates = _OPS_BY_FIRST.get(tokens[i], ())
        if tokens[i] == "" and i + 1 < len(tokens):
            # '' marks a leading underscore of the next op (e.g. '_unsafe_view')
            match = next((op for op in candidates if tuple(tokens[i:i + len(op)]) == op), None)
            if match is None:
                i += 1
                continue
        else:
            match = next((op for op in candidates if tuple(tokens[i:i + len(op)]) == op), (tokens[i],))
        if match != ("",):
            ops.append("_".join(match))
        i += len(match)
    return [op for op in ops if op]


_INDUCTOR_KIND = {"poi": "triton_pointwise", "red": "triton_reduction", "per": "triton_persistent", "tem": "gemm"}


def _parse_inductor(m: re.Match, name: str) -> dict:
    return {"kind": m.group("kind"), "fused_ops": inductor_fused_ops(m.group("ops")), "index": int(m.group("idx"))}


def _inductor_family(m: re.Match) -> str:
    return _INDUCTOR_KIND[m.group("kind")]


_ATEN_WRAPPERS = {"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "gpu_kernel_impl_nocast", "gpu_kernel_impl",
                  "ReduceOp", "TensorIteratorBase", "GeluType", "memory", "LoadWithCast", "StoreWithCast",
                  "OffsetCalculator", "TrivialOffsetCalculator", "func_wrapper_t", "detail", "Array"}
_CTYPES = (("c10::BFloat16", "bf16"), ("c10::Half", "fp16"), ("c10::Float8_e4m3fn", "fp8_e4m3"),
           ("double", "fp64"), ("float", "fp32"), ("long", "int64"), ("bool", "bool"))


# A qualified name after at::native::, matched greedily: linear in the name's length, where a lazy
# `(?:\w+::)*?` before the kernel alternatives backtracks quadratically on names built of many components.
_ATEN_QUALIFIED = re.compile(r"at::native::(?:\(anonymous namespace\)::)?((?:\w+::)*\w+)")


class _Hit:
    """The match-like result of a matcher that is not one regex: `group(name)` of what it found."""

    def __init__(self, **groups: str):
        self._groups = groups

    def group(self, key: str) -> str:
        return self._groups[key]


def _after(comp: str, first: str, then: str) -> bool:
    r"""`\w*first\w*then\w*` matches the whole word `comp` (one scan, no backtracking)."""
    i = comp.find(first)
    return i >= 0 and comp.find(then, i + len(first)) >= 0


def _aten_reduction(comp: str) -> str | None:
    if comp.startswith("reduce_kernel"):
        return "reduce_kernel"
    if re.search(r"[Ss]oft[Mm]ax", comp) or _after(comp, "norm", "_kernel"):
        return comp
    i, j = comp.find("_reduce"), comp.rfind("kernel")
    return comp[: j + 6] if i >= 0 and j >= i + 7 else None


def _aten_elementwise(comp: str) -> str | None:
    if "elementwise_kernel" in comp or any(_after(comp, word, "_kernel") for word in ("index", "copy", "cat")):
        return comp
    return None


class _AtenMatcher:
    """Like a compiled pattern's `search`: the first at::native:: component, left to right, that `kernel_of` names."""

    def __init__(self, kernel_of):
        self.kernel_of = kernel_of

    def search(self, name: str) -> _Hit | None:
        pos = 0
        while m := _ATEN_QUALIFIED.search(name, pos):
            for comp in m.group(1).split("::"):
                if kernel := self.kernel_of(comp):
                    return _Hit(kernel=kernel)
            # An at::native:: inside this chain sees a tail of the same components, already tried; only one that
            # runs past the chain's end (into "::(anonymous namespace)::") can see more.
            pos = m.end() - len("at::native::") + 1
        return None


def _parse_aten(m: _Hit, name: str) -> dict:
    text = name.replace("(anonymous namespace)::", "")
    out: dict = {"kernel": m.group("kernel")}
    start = text.find(m.group("kernel")) + len(m.group("kernel"))
    rest = text[start:]
    for q in _ATEN_QUALIFIED.finditer(rest):
        ident = q.group(1).rsplit("::", 1)[-1]
        if q.end() < len(rest) and rest[q.end()] not in "<(,> ":
            continue
        if ident not in _ATEN_WRAPPERS and not ident.endswith("_internal"):
            out["op"] = ident
            break
    for ctype, dtype in _CTYPES:
        if re.search(rf"(?<![\w:]){re.escape(ctype)}(?!\w)", rest):
            out["dtype"] = dtype
            break
    return out


def _parse_nccl(m: re.Match, name: str) -> dict:
    # ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...) / ncclKernel_AllGather_RING_LL_Sum_int8_t(...)
    tokens = re.split(r"[_(]", name)
    out: dict = {}
    collectives = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "SendRecv", "Send", "Recv")
    for t in tokens:
        if "collective" not in out and t in collectives:
            out["collective"] = t
        elif t in ("RING", "TREE", "NVLS", "NVLSTree", "CollNetDirect", "CollNetChain", "PAT"):
            out["algorithm"] = t
        elif t in ("LL", "LL128", "SIMPLE", "Simple"):
            out["protocol"] = t
        elif t.lower() in _DTYPE_TOKENS and "dtype" not in out:
            out["dtype"] = _DTYPE_TOKENS[t.lower()]
    return out


def _mlpfuse_family(m: re.Match) -> str:
    kind = m.group("kind")
    if kind.endswith("pointwise") or kind == "glu_forward":  # glu_forward: h = act(g)·u, element by element
        return "elementwise"
    if kind.endswith("reduce") or kind.endswith("quantize"):  # quantize: an amax per group, then the cast
        return "reduction"
    return "gemm"


def _parse_mlpfuse(m: re.Match, name: str) -> dict:
    return {"kernel": m.group("kind")}


def _nothing(m: re.Match, name: str) -> dict:
    return {}


_BRACKETS = re.compile(r"[<>()]")
_WRAPPERS = {"device_kernel", "Kernel", "Kernel2", "kentry"}  # launch wrappers whose first template argument is the
# kernel itself (CUTLASS 2 and 3, cudnn's CUTLASS builds, composable_kernel)
MAX_HEAD_CHARS = 300


def kernel_head(name: str) -> str:
    """The kernel's own qualified name, without return type, template arguments or parameters:
    'void at::native::reduce_kernel<512, 1, ...>(...)' -> 'at::native::reduce_kernel'. For a launch wrapper
    ('cutlass::device_kernel<K<...>, ...>') the start of its first template argument is kept, since it names the
    kernel: 'cutlass::device_kernel<flash::FlashAttnFwdSm90<...'. Linear in the name's length."""
    text = name.replace("(anonymous namespace)::", "")
    depth, paren, pieces, last, opened = 0, 0, [], 0, -1
    for m in _BRACKETS.finditer(text):
        ch, i = m.group(), m.start()
        if depth and ch in "()":  # parentheses inside template arguments may hold comparisons: (8)>(0)
            paren = max(paren + (1 if ch == "(" else -1), 0)
        elif paren:
            continue
        elif ch == "<":
            if depth == 0:
                pieces.append(text[last:i])
                opened = i
            depth += 1
        elif ch == ">":
            if depth:
                depth -= 1
                last = i + 1
        elif ch == "(":
            pieces.append(text[last:i])
            break
    else:
        if depth == 0:
            pieces.append(text[last:])
    head = "".join(pieces).strip().rsplit(" ", 1)[-1]
    if head.rsplit("::", 1)[-1] in _WRAPPERS and opened >= 0:
        inner = re.split(r"[,()]", text[opened + 1:opened + 1 + MAX_HEAD_CHARS], maxsplit=1)[0]
        head = f"{head}<{inner.strip()}"
    return head


def _parse_tensile(m: re.Match, name: str) -> dict:
    # Cijk_<A index>_<B index>_<types>_..._MT<M>x<N>x<depth U>_MI<matrix instruction>_..._ISA<gfx>_...
    tokens = name.split("_")
    out: dict = {}
    layout = {"Ailk": "N", "Alik": "T"}.get(tokens[1] if len(tokens) > 1 else "", "")
    layout += {"Bljk": "N", "Bjlk": "T"}.get(tokens[2] if len(tokens) > 2 else "", "")
    if len(layout) == 2:
        out["layout"] = layout
    if len(tokens) > 3 and tokens[3][:1] in _TENSILE_TYPES:
        out["dtype"] = _TENSILE_TYPES[tokens[3][:1]]
    for tok in tokens:
        if tok.startswith("MT") and re.match(r"^MT\d+x\d+x\d+$", tok):
            mt = tok[2:].split("x")
            out["tile"], out["depth_u"] = f"{mt[0]}x{mt[1]}", int(mt[2])
        elif tok.startswith("MI") and re.match(r"^MI\d+(?:x\d+)+$", tok):
            out["matrix_instruction"] = tok[2:]
        elif tok.startswith("ISA") and tok[3:].isalnum() and len(tok) <= 8:
            out["arch"] = "gfx" + tok[3:]
        elif tok == "Bias":
            out["epilogue"] = ["bias"]
    return out


_TENSILE_TYPES = {"B": "bf16", "H": "fp16", "S": "fp32", "D": "fp64", "I": "int8", "F": "fp8"}


def _tensile_library(m: re.Match, name: str) -> str:
    return "hipblaslt" if "_UserArgs_" in name else "rocblas"


def _parse_trtllm_bmm(m: re.Match, name: str) -> dict:
    # bmm_<A type>_<B types>_<acc>_t<tile>u2_s<stages>_..._<layout>_..._sm100f
    out: dict = {}
    for tok in name.split("_"):
        if "tile" not in out and (t := re.match(r"^t(\d+x\d+x\d+)", tok)):
            out["tile"] = t.group(1)
        elif re.match(r"^s\d+$", tok):
            out["stages"] = tok[1:]
        elif tok in ("TN", "NT", "NN", "TT"):
            out["layout"] = tok
        elif re.match(r"^sm\d+\w?$", tok):
            out["arch"] = re.match(r"^sm\d+", tok).group(0)
        elif tok.lower() in ("swiglu", "geglu", "relu", "gelu") or tok.startswith("bias"):
            out.setdefault("epilogue", []).append("bias" if tok.startswith("bias") else tok.lower())
    return out


def _parse_cutlass3(m: re.Match, name: str) -> dict:
    # cutlass3x_sm90_tensorop_gemm_f16_f16_f32_f16_f16_128x128x64_2x1x1_0_tnt_align8_warpspecialized_...
    tokens = m.group(0).split("_")
    out: dict = {"arch": tokens[1]} if len(tokens) > 1 else {}
    out.update(_gemm_tokens(tokens[2:]))
    return out


def _device_kernel_family(m: re.Match) -> str:
    inner = m.string.lower()
    if "conv" in inner or "fprop" in inner or "dgrad" in inner or "wgrad" in inner:
        return "conv"
    return "gemm" if "gemm" in inner or "mma" in inner else "other"


def _conv_library(m: re.Match, name: str) -> str:
    head = m.string
    if head.startswith(("igemm_", "MIOpen", "miopen")) or re.match(r"^Im\dd2Col", head):
        return "miopen"
    return "composable_kernel" if head.startswith("_ZN2ck") else "cudnn"


def _communication_library(m: re.Match, name: str) -> str:
    low = name.lower()
    return "rccl" if "rccl" in low else "nccl" if "nccl" in low else "custom"


# A rule: (pattern with `search(text)`, family or family(match), library or library(match, name), field parser,
# whether the pattern looks at the kernel's head (`kernel_head`) rather than the whole name). The head keeps a
# rule from firing on a word that only appears in a kernel's template arguments (an embedding kernel templated on
# an fbgemm type is no GEMM; a quantize kernel taking a flashinfer type is no attention).
Rule = tuple[Any, "str | Callable[[re.Match], str]", "str | Callable[[re.Match, str], str] | None",
             Callable[[re.Match, str], dict], bool]
NAME, HEAD = False, True

# Every matcher and parser is linear in the name's length; past this many characters (real kernel names run to a
# few KB) a name is decoded from its start only, which bounds the fields it yields too.
MAX_DECODE_CHARS = 32768

# Order matters: specific before generic. Patterns are `search`ed; anchor where a name must start with them. Each
# rule has a test row in tests/test_profiling_kernel_names.py with a name from a published trace.
_RULES: list[Rule] = [
    (re.compile(r"^(?:Memset|memset)"), "memset", None, _nothing, NAME),
    (re.compile(r"^(?:Memcpy|memcpy)"), "copy", None, _nothing, NAME),
    (re.compile(r"^mlpfuse_(?P<kind>\w+?)(?:_kernel)?$"), _mlpfuse_family, "mlpfuse", _parse_mlpfuse, NAME),
    # cuBLAS (CUDA 12.8+): nvjet_sm90_tst_..., nvjet_sm100_tst_..., and nvjet_tst_... without the arch
    (re.compile(r"^nvjet_"), "gemm", "nvjet", _parse_nvjet, HEAD),
    (re.compile(r"^triton_(?P<kind>poi|red|per|tem)_fused_?(?P<ops>.*?)_(?P<idx>\d+)$"), _inductor_family,
     "inductor", _parse_inductor, NAME),
    # NCCL and RCCL (ROCm keeps NCCL's kernel names), and all-reduce kernels outside them (symmetric memory, vLLM)
    (re.compile(r"nccl|rccl|msccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce",
                re.I), "communication", _communication_library, _parse_nccl, HEAD),
    # FlashAttention 2/3, PyTorch's flash and memory-efficient (fmha_cutlass*) kernels, cuDNN SDPA, FlashInfer,
    # TRT-LLM / Blackwell fmha, AMD CK and Triton attention, vLLM paged and unified attention
    (re.compile(r"flash_?attn|flash_(?:fwd|bwd)|fmha|(?:^|_)mha_(?:fwd|bwd|varlen)|attn_(?:fwd|bwd)|attention|sdpa|"
                r"(?:Batch|Single)(?:Prefill|Decode)With|sage_fwd", re.I), "attention", None, _nothing, HEAD),
    (_AtenMatcher(_aten_reduction), "reduction", "aten", _parse_aten, NAME),
    (_AtenMatcher(_aten_elementwise), "elementwise", "aten", _parse_aten, NAME),
    # normalizations and softmax outside at::native: cuDNN batch norm, MIOpen, vLLM / AITER / CK RMSNorm
    (re.compile(r"(?:rms|layer|group|batch|instance)_?norm|\bbn_(?:fw|bw)|softmax", re.I), "reduction", None,
     _nothing, HEAD),
    # pointwise work outside at::native: rotary embeddings, layout transposes, MIOpen tensor ops, cuDNN scaling
    (re.compile(r"elementwise|rotary|transpose|nchw_?to_?nhwc|nhwc_?to_?nchw|^(?:Sub)?TensorOp|^Op(?:\dd)?Tensor|"
                r"scalePackedTensor|CatArrayBatchedCopy|multi_tensor_apply|dropout|reshape_and_cache|store_kvcache",
                re.I), "elementwise", None, _nothing, HEAD),
    # fbgemm_gpu's table-batched embeddings (TorchRec): lookups and their fused optimizer backward, not GEMMs
    (re.compile(r"split_embedding|embedding_?bag|embedding_backward|embedding_dense|permute_pooled_embs|"
                r"bounds_check_indices|linearize_index", re.I), "embedding", "fbgemm_gpu", _nothing, HEAD),
    (re.compile(r"^fbgemm_gpu::"), "other", "fbgemm_gpu", _nothing, HEAD),
    # convolutions: cuDNN engines (scudnn, implicit GEMM fprop / dgrad / wgrad, winograd, FFT), MIOpen igemm
    (re.compile(r"scudnn|conv(?!ert)|fprop|dgrad|wgrad|winograd|fft2d|im2col|col2im|im\dd2col|cask_cudnn|cutlass_cudnn|"
                r"_cudnn::|cudnn::cnn::|igemm_(?:fwd|bwd|wrw)|implicit_?gemm", re.I),
     "conv", _conv_library, _nothing, HEAD),
    # AMD: Tensile GEMMs from rocBLAS and hipBLASLt (hipBLASLt's carry UserArgs)
    (re.compile(r"^(?:Custom_)?Cijk_"), "gemm", _tensile_library, _parse_tensile, HEAD),
    # TRT-LLM's batched GEMMs on Blackwell (FlashInfer MoE): bmm_<types>_t<tile>..._sm100f
    (re.compile(r"^bmm_\w+_sm\d+"), "gemm", "trtllm", _parse_trtllm_bmm, HEAD),
    (re.compile(r"cutlass3x_sm\d+_\w+"), "gemm", "cutlass", _parse_cutlass3, HEAD),
    (re.compile(r"^cutlass::device_kernel<"), _device_kernel_family, "cutlass", _nothing, HEAD),
    (re.compile(r"cutlass_\d+_[A-Za-z0-9_]+"), "gemm", "cutlass", _parse_cutlass, HEAD),
    (re.compile(r"^(?P<arch>maxwell|pascal|volta|turing|ampere|ada|hopper|blackwell|sm\d{2,3})_\w*?(?:gemm|xmma|gemv)",
                re.I), "gemm", "cublas", _parse_cublas, HEAD),
    (re.compile(r"splitKreduce|cub::\w*Reduce|DeviceReduce"), "reduction", None, _nothing, HEAD),
    (re.compile(r"gemm|gemv|xmma|matmul", re.I), "gemm", None, _nothing, HEAD),
    (re.compile(r"cublas", re.I), "gemm", "cublas", _nothing, NAME),
]


@functools.lru_cache(maxsize=4096)
def decode(name: str) -> Decoded:
    """Family, library and fields of a kernel name; unknown names are family 'other'."""
    name = name[:MAX_DECODE_CHARS]
    head = kernel_head(name)
    for pattern, family, library, parse, on_head in _RULES:
        m = pattern.search(head if on_head else name)
        if m is None:
            continue
        try:
            fields = parse(m, name)
        except Exception:  # a name that half-matches keeps its family; decoding must never fail on odd names
            fields = {}
        fam = family(m) if callable(family) else family
        lib = library(m, name) if callable(library) else library
        if lib == "cublas" and head.startswith("sm") and "cutlass" in head.lower():
            lib = "cutlass"
        return Decoded(fam, lib, fields)
    return Decoded("other")


def family_of(name: str, category: str = "kernel") -> str:
    """Family with the GPU activity's category taken into account (memset/memcpy activities have fixed names)."""
    if category == "memset":
        return "memset"
    if category == "memcpy":
        return "copy"
    return decode(name).family
