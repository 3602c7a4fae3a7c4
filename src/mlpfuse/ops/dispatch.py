"""Which implementation runs a call: backend names, the `auto` policy, and the switches measured on a GPU.

Backends: "torch" (mlpfuse.reference: cuBLAS GEMMs + PyTorch pointwise, runs anywhere), "triton" (mlpfuse.kernels:
CUDA, or CPU through Triton's interpreter when TRITON_INTERPRET=1), "cuda" (mlpfuse.csrc: a C++/CUDA extension built
on first use; opt-in only, `auto` never picks it), "auto" (the policy below). An empty backend
string means "not given": the environment variable MLPFUSE_BACKEND, else "auto".

`auto` picks a Triton kernel only on CUDA, only where that kernel was measured to beat eager PyTorch; everywhere
else it runs the torch backend. The decode kernels (the whole MLP in one or two launches) never run when a gradient is
needed: they keep no g and u for a backward.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Optional

import torch

from mlpfuse import activations
from mlpfuse.errors import InputError

BACKENDS = ("auto", "triton", "torch", "cuda")
ENV_VAR = "MLPFUSE_BACKEND"

# Under autograd: keep the pre-activations g and u (and h = act(g)·u, the down projection's input, which the forward
# writes anyway and eager autograd saves too) for the backward (True), or recompute them there with a second gated
# GEMM (False). Saving costs 3·M·hidden elements of memory and two extra writes; recomputing costs two of the
# forward's three GEMMs again.
SAVE_PREACT = True

# The `auto` policy, measured on an NVIDIA H200 (bf16, torch 2.11, Triton 3.6) with
#   PYTHONPATH=src python3 benchmarks/tune_kernels.py          (benchmarks/results/kernels-h200.md, crossover sweep)
# Gated GEMM vs cuBLAS gate+up + eager GELU·mul, µs: M=1024 at 768/3072 33.5 → 52.1 (eager wins), M=2048 54.1 →
# 52.9, M=4096 99.8 → 69.9; at 4096/14336: M=1024 397 → 381, M=4096 1643 → 1525. Below that the kernel's host
# cost decides (30.6 µs a call even with the cached launch, vs 9.2 µs for one cuBLAS GEMM, measured with
# benchmarks/host_overhead.py, since retired: benchmarks/README.md), so small problems stay on cuBLAS.
# Those figures are obsolete for inference: with the flattened persistent loop and the held launch plan,
# `benchmarks/tune_mid_m.py` (L2 flushed, each call alone; benchmarks/results/nvidia-h200/auto-sweeps) measured the
# gated GEMM against eager's two GEMMs + GELU·mul, as pure GPU time (the host queued ahead) at 128 / 256 / 512 / 1024
# / 2048 / 4096 × 768×3072: 12.7 / 12.8 / 14.6 / 23.0 / 32.8 / 60.7 µs vs 19.5 / 21.2 / 24.8 / 35.1 / 54.7 / 103.1
# (0.59–0.66×), and 192.4 vs 211.6 / 329.9 vs 359.3 at 512 / 1024 × 4096×14336 (0.91×), the same with the host's
# launch gaps in. Below 128 tokens the whole block was timed (`tune_mid_m.py --compile --shapes ...`,
# benchmarks/results/nvidia-h200/small-m), as pure GPU time against eager's four kernels: at 768×3072 the gated GEMM
# + cuBLAS down ran 0.77 / 0.75 / 0.74× eager at 64 / 96 / 128 tokens (the decode kernels 0.76 / 0.99 / 0.94×,
# torch.compile 0.87×); at 4096×14336 it lost below 96 tokens (1.19 / 1.19 / 1.06 / 0.98× at 32 / 48 / 64 / 80, then
# 0.93 / 0.90× at 96 / 128) and so did the decode kernels from 24 tokens (1.01 / 1.12 / 1.06× at 24 / 48 / 64), where
# torch.compile's kernels — cuBLAS's GEMMs with GELU·mul fused into one pass — ran 0.95–0.96×, and the same GEMMs
# around mlpfuse's GLU pass 0.96–0.97× (within 1.2 % of compile at 16–80 tokens). So inference takes, past the decode
# sizes, the gated GEMM on small layers and from `gated_large_min_m` (96) tokens on large ones (dim·hidden >=
# DECODE_LARGE_LAYER); in between, on large layers, that SPLIT path: cuBLAS's gate and up GEMMs, one Triton GLU pass,
# cuBLAS's down GEMM. (Those small-m figures predate the large layers' wide 128×(2·128) tile row. With it the gated
# GEMM beat SPLIT at 24–80 tokens on 2048×8192 and 4096×14336 on the H100, whose cut-over is therefore 17, and on
# 2048×8192 on the H200, whose SPLIT path now starts at dim·hidden 2**25: kernels/configs.py
# `Cutovers.split_min_layer`, benchmarks/results/{nvidia-h100-x1,nvidia-h200}/cut-over.)
# In eager mode and in graphs alike; training makes the same choice (GATED_TRAINING below).
# The cut-overs' token counts and work sizes are data per card, with the runs that checked them on each card:
# kernels/configs.py `Cutovers` (read through `cutovers` below).
# gemm_act vs addmm + activation at 768→3072: M=2048 27.5 → 45.1 µs (eager wins), M=4096 49.1 → 45.7: `auto` fuses
# from `linear_act_min_work` (9e9 multiply-adds, M·out·in) ...
# ... for the activation it was measured with (gelu_tanh). With the erf GELU (BERT's intermediate layer) the kernel
# lost at every size tune_mid_m.py timed, as pure GPU time at 128 / 1024 / 2048 / 4096 × 768→3072: 43.1 / 44.5 /
# 60.9 / 77.6 µs against addmm + GELU's 11.6 / 19.7 / 30.3 / 51.9 (benchmarks/results/nvidia-h200/auto-sweeps).
LINEAR_ACT_ACTIVATIONS = (activations.GELU_TANH,)  # the activation ids `auto` may fuse
# The GLU backward: "split" = cuBLAS dh = dy·Wd, then one Triton pass writing dg, du and fp32 bias sums;
# "fused" = one Triton GEMM whose epilogue writes dg, du (and h). Same run: split 130.2 / 1694.2 µs, fused 199.6 /
# 2083.5 µs at 8192×768×3072 / 8192×4096×14336 (cuBLAS dh + eager GLU backward: 179.3 / 1982.7). With the cheaper
# activation math the fused form came to 161.1 µs at 8192×768×3072, the split one to 65.2 + 68.5
# (`tune_kernels.py --only blog`, benchmarks/results/tune-h200.md).
GLU_BACKWARD = "split"
# Eager training on the gated path up to this many tokens: g and u in one allocation and the backward's dWg and dWu
# as one batched GEMM over dg and du (written over them): one launch fewer where launches are a visible share of
# the step. A/B in one run on an H200 (benchmarks/results/nvidia-h200/probe-backward), forward+backward at 64 / 256
# / 1024 tokens × 768×3072: 62.2 / 71.1 / 114.7 µs against 64.7 / 73.5 / 118.0 with two GEMMs (GeGLU; SwiGLU the
# same), level at 64 and 256 × 4096×14336 (356.5 / 505.9 against 356.8 / 507.1). The cost: du is freed with dg,
# not before dWg's output is allocated — the step's peak at 1024 × 768×3072 29.0 MiB against 24.5 (compile's 30.5,
# eager's 42.5); past the threshold g and u stay apart and du goes first. The GLU backward fused into the dh GEMM
# lost there (66.0 / 73.9 / 119.0 µs against the split form's 64.5 / 73.5 / 118.1, same folder).
MERGED_DW_MAX_M = 1024
# The decode path (M <= decode_mlp.DECODE_MAX_M, no autograd) on large layers: at 4096×14336 it beat eager at 1–32
# tokens (32: 106.6 vs eager 108.9 µs per call) and lost at 64 (119.1 vs 116.5), benchmarks/results/nvidia-h200/decode;
# against the SPLIT path (pure GPU time, small-m/): 103.0 vs 110.0 µs at 16 tokens, 115.0 vs 109.7 at 24, 113.7 vs
# 111.6 at 32.
DECODE_LARGE_LAYER = 1 << 24  # dim·hidden from which the decode path stops at `decode_large_max_m` tokens (16)
# Under autograd `auto` trains on the path the forward would take without the decode kernels (which keep no g and
# u): the gated GEMM saving g and u, or on large layers below gated_large_min_m tokens the SPLIT path saving the
# cuBLAS GEMMs' g and u; then the same backward (cuBLAS dh = dy·Wd, one Triton GLU-backward pass writing dg and du
# over g and u and h over dh, cuBLAS for dWd, dx, dWu, dWg). Measured as pure GPU time (`mlpfuse bench --mode
# fwd+bwd --variants eager,compile,eager-cudagraph,mlpfuse,mlpfuse-triton`, benchmarks/results/nvidia-h200/
# train-small), µs per step, gated / SPLIT / eager / torch.compile / eager in a CUDA graph:
#   768×3072 at 64 / 512 / 1024 / 4096 / 8192 tokens: 63.1 / 83.5 / 117.3 / 326.7 / 605.9 gated, 64.5 / 88.5 / 120.6
#     / 339.6 / 606.3 SPLIT, against 94.0 / 118.9 / 156.5 / 399.8 / 720.1 eager, 67.4 / 92.9 / 125.1 / 337.8 / 615.9
#     compile, 63.1 / 86.1 / 123.8 / 365.5 / 685.2 eager's graph;
#   4096×14336 at 64 / 512 / 1024 tokens: 365.9 / 821.7 / 1486.9 gated, 350.8 / 825.2 / 1484.5 SPLIT, against
#     371.1 / 852.6 / 1536.8 eager, 345.4 / 822.4 / 1480.2 compile.
# Host time: an earlier version paid ~1.1–1.3× eager's host per step for its Python layers, and `auto` then
# trained on eager's kernels below 1.5e10 multiply-adds outside CUDA graphs. With the module's call plan holding both
# GLU passes' launch plans and the first backward going straight to its kernels, `benchmarks/host_paths.py --only
# train` measured the fused step's host time at 0.75–1.15× eager's (gated) and 0.94–1.12× (SPLIT) at 64–1024
# tokens in two runs, rounds spreading ±20–40 % on those hosts (same folder): level with eager, so the GPU time
# decides. There `mlpfuse bench` measured 0.66–0.85× eager's GPU time at 64–8192 × 768×3072 and 0.92–0.98× at
# 64–8192 × 4096×14336, within 1.5 % of the best peer (torch.compile, eager's CUDA graph) on every row.
# GATED_TRAINING False: training on eager's kernels.
GATED_TRAINING = True
MIN_ARCH = 9  # Hopper: the kernels' fast mainloop (TMA, persistent grid) needs sm90
FAST_DTYPES = (torch.bfloat16, torch.float16)

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Paths a gated MLP call can take. CUDA: the C++ extension's op, which picks its own decode kernel. SPLIT (`auto`
# only): cuBLAS gate and up GEMMs, the Triton GLU pass (kernels/glu.py), cuBLAS down GEMM; under autograd the
# backward's Triton pass is kernels/glu_backward.glu_backward_split.
TORCH, GATED, DECODE, CUDA, SPLIT = "torch", "gated", "decode", "cuda", "split"


def resolve_backend(backend: str) -> str:
    """The backend a call uses: the argument, else MLPFUSE_BACKEND, else auto. Unknown names raise InputError."""
    if backend in BACKENDS:  # the common cases first: this runs on every call
        return backend
    argument = "backend"
    if not backend:
        backend, argument = _env_backend() or "auto", ENV_VAR
        if backend in BACKENDS:
            return backend
    name = backend.strip().lower()
    if name not in BACKENDS:
        raise InputError(f"{argument}: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return name


def _env_backend() -> Optional[str]:
    """MLPFUSE_BACKEND as set now. A module built with backend=None reads it on every call, and os.environ.get of a
    missing variable raises and catches two KeyErrors (~2–5 µs, a tenth of a decode-sized call): where CPython keeps
    the environment's encoded mapping (os.environ._data, what os.environ itself reads), look there directly."""
    data = _ENV_DATA
    if data is None:
        return os.environ.get(ENV_VAR)
    value = data.get(_ENV_KEY)
    return None if value is None else os.environ.decodevalue(value)


_ENV_DATA = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_DATA is not None else None


def check_backend_name(backend: Optional[str]) -> str:
    """Validate a backend argument given to a function or module ('' when None, resolved per call)."""
    if backend is None:
        return ""
    if not isinstance(backend, str) or backend.strip().lower() not in BACKENDS:
        raise InputError(f"backend: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)} or None")
    return backend.strip().lower()


@functools.lru_cache(maxsize=None)
def _kernel_module(name: str):
    """mlpfuse.kernels.<name>, or None where Triton cannot run or the module is missing."""
    from mlpfuse import kernels

    if not kernels.available():
        return None
    import importlib

    try:
        return importlib.import_module(f"mlpfuse.kernels.{name}")
    except ImportError:
        return None


def kernel(name: str):
    """The kernel module, which must exist (the caller checked `triton_unavailable`)."""
    mod = _kernel_module(name)
    assert mod is not None, name
    return mod


def decode_max_m() -> int:
    mod = _kernel_module("decode_mlp")
    return int(getattr(mod, "DECODE_MAX_M", 0)) if mod is not None else 0


def triton_unavailable(x: torch.Tensor, module: str) -> Optional[str]:
    """Why the Triton kernels cannot run this call (None when they can)."""
    if x.is_cuda:  # the interpreter's switch matters for CPU tensors only (reading os.environ costs ~2 µs a call)
        return _unavailable("cuda", x.dtype, module, "")
    return _unavailable(x.device.type, x.dtype, module, os.environ.get("TRITON_INTERPRET", "0"))


@functools.lru_cache(maxsize=None)
def _unavailable(device_type: str, dtype: torch.dtype, module: str, interpret: str) -> Optional[str]:
    # Cached per device type, dtype, kernel and interpreter setting: asking Triton and the driver each call cost
    # ~20 µs of host time, twice per training step.
    from mlpfuse import kernels

    if not kernels.triton_importable():
        return ("Triton is not installed (pip install triton; without CUDA its interpreter runs the kernels, "
                "TRITON_INTERPRET=1, with numpy<2.4)")
    if not kernels.available():
        return "there is no CUDA device (TRITON_INTERPRET=1 runs the kernels on the CPU through Triton's interpreter)"
    if device_type == "cpu" and interpret in ("", "0"):
        return "x is on the CPU; the kernels need CUDA (or TRITON_INTERPRET=1)"
    if device_type not in ("cuda", "cpu"):
        return f"x is on {device_type}; the kernels need CUDA"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not supported by the kernels (bfloat16, float16, float32)"
    if _kernel_module(module) is None:
        return f"kernel module mlpfuse.kernels.{module} is not available"
    return None


_triton_note_taken = False


def take_triton_note() -> Optional[str]:
    """Where Triton does not import, one line saying what `auto` does instead — returned once per process (None
    after that, and None where Triton imports). `auto` gives it as a warning on its first call; a command prints it
    first as a line of its own, so that its output does not carry a warning's file and line number."""
    global _triton_note_taken
    from mlpfuse import kernels

    if _triton_note_taken or kernels.triton_importable():
        return None
    _triton_note_taken = True
    return ("Triton is not installed, so backend='auto' runs mlpfuse's PyTorch path (the same math in ATen ops); "
            "the fused kernels need Triton and a CUDA GPU")


@functools.lru_cache(maxsize=None)
def _auto_may_use(device: torch.device, dtype: torch.dtype, module: str) -> bool:
    """Whether `auto` may consider kernel `module` for tensors of this device and dtype: a Hopper-class CUDA device, a
    16-bit dtype, the kernel importable. Cached: asking the driver for the capability costs several µs a call, which
    showed up in the benchmark sweep at 512 tokens (auto 72.7 µs vs the torch backend 61.0 µs, same kernels)."""
    note = take_triton_note()
    if note is not None:
        warnings.warn(f"mlpfuse: {note}", stacklevel=2)
    if device.type != "cuda" or dtype not in FAST_DTYPES:
        return False
    if torch.cuda.get_device_capability(device)[0] < MIN_ARCH:
        return False
    return _kernel_module(module) is not None


@functools.lru_cache(maxsize=None)
def _card(device: torch.device):
    """The device's kernels.configs.CARDS entry (tile rows and cut-overs measured on that card), or None."""
    from mlpfuse import kernels

    if device.type != "cuda" or not kernels.triton_importable():
        return None  # no card to look up; or no Triton, which kernels._common imports (and `auto` then runs torch)
    from mlpfuse.kernels import configs

    return configs.card_of(torch.cuda.get_device_properties(device))


@functools.lru_cache(maxsize=None)
def cutovers(device: torch.device):
    """The cut-overs `auto` uses on this device (kernels.configs.Cutovers): its card's where it has a CARDS entry,
    else configs.DEFAULT_CUTOVERS (the CPU through Triton's interpreter; an untuned card, which runs only the
    decode kernels)."""
    from mlpfuse.kernels import configs

    measured = _card(device)
    return measured.cutovers if measured else configs.DEFAULT_CUTOVERS


@functools.lru_cache(maxsize=None)
def tuned_card(device: torch.device) -> bool:
    """Whether the GEMM kernels have tile rows measured on this card (kernels.configs.CARDS). Elsewhere `auto` keeps
    cuBLAS for every GEMM (the SPLIT path; addmm for linear+activation) and runs only the decode kernels."""
    return _card(device) is not None


def untuned_note(device: torch.device) -> Optional[str]:
    """One line for `mlpfuse bench` and the walkthrough when `auto` runs on a card with no tuned rows, else None."""
    if device.type != "cuda" or not _auto_may_use(device, torch.bfloat16, "gated_gemm") or tuned_card(device):
        return None
    from mlpfuse.kernels import _common as C

    return (f"{C.device_name(device)} ({C.num_sms(device)} SMs) has no tuned kernel configs in mlpfuse: `auto` "
            "keeps cuBLAS's GEMMs (the gated MLP's GLU fused between them) and the decode kernels; "
            "kernels/configs.py says how to add the card")


def _require_triton(x: torch.Tensor, module: str) -> None:
    reason = triton_unavailable(x, module)
    if reason is not None:
        raise InputError(f"backend: 'triton' cannot run this call: {reason}")


def cuda_extension(x: torch.Tensor):
    """The CUDA backend's built module for a call on x, or InputError: no CUDA, no nvcc, a failed build (with its
    log's path), or a tensor it cannot take."""
    from mlpfuse import csrc

    ext = csrc.extension()
    if x.device.type != "cuda":
        raise InputError(f"backend: 'cuda' cannot run this call: x is on {x.device.type}; it needs CUDA tensors")
    if x.dtype not in KERNEL_DTYPES:
        raise InputError(f"backend: 'cuda' cannot run this call: dtype {x.dtype} is not supported "
                         "(bfloat16, float16, float32)")
    return ext


def cuda_call(fn, *args):
    """fn(*args) on the extension, its argument errors as one InputError line. The C++ side raises them as c10
    ValueErrors whose text starts with the argument's name ("down_weight: expected shape ..."); torch maps those to
    ValueError (RuntimeError where its translator is not in reach). Anything else, a CUDA error included, propagates."""
    try:
        return fn(*args)
    except (ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not _ARG_ERROR.match(first):
            raise
        raise InputError(first) from None


_ARG_ERROR = re.compile(r"^[a-z_]+: ")


def gated_mlp_path(backend: str, x: torch.Tensor, hidden: int, training: bool) -> str:
    """The path (TORCH, GATED, DECODE, SPLIT or CUDA) of a gated MLP call on 2-D x [M, dim] with `hidden` units.
    `backend` is an argument as given ('' = default)."""
    name = resolve_backend(backend)
    m = x.shape[0]
    if name == "torch":
        return TORCH
    if name == "cuda":
        cuda_extension(x)
        return CUDA
    use_decode = not training and 0 < m <= decode_max_m()
    layer = x.shape[1] * hidden
    large = layer >= DECODE_LARGE_LAYER
    cut = cutovers(x.device)
    if use_decode and name == "auto" and m > cut.decode_large_max_m and large:
        use_decode = False
    if name == "triton":
        _require_triton(x, "gated_gemm")
        if use_decode and triton_unavailable(x, "decode_mlp") is None:
            return DECODE
        return GATED
    if training and not GATED_TRAINING:
        return TORCH
    if use_decode and _auto_may_use(x.device, x.dtype, "decode_mlp"):
        return DECODE
    if not _auto_may_use(x.device, x.dtype, "gated_gemm"):
        return TORCH
    if training and not _auto_may_use(x.device, x.dtype, "glu_backward"):
        return TORCH
    split = large and m < cut.gated_large_min_m and layer >= cut.split_min_layer
    if split or not tuned_card(x.device):
        # An untuned card keeps cuBLAS's GEMMs around the GLU pass: eager's projections, one pass fewer.
        return SPLIT if _auto_may_use(x.device, x.dtype, "glu") else TORCH
    return GATED


def eager_math(backend: str, activation_id: int) -> bool:
    """Whether every linear+activation call runs eager's own ops whatever its input: backend "torch", or `auto` with
    an activation `auto` never fuses (linear_act_path below makes the same choice for each call)."""
    name = resolve_backend(backend)
    return name == "torch" or (name == "auto" and activation_id not in LINEAR_ACT_ACTIVATIONS)


def linear_act_path(backend: str, x: torch.Tensor, out_features: int, activation_id: int) -> str:
    """"torch", "triton" or "cuda" for a linear+activation call on 2-D x."""
    name = resolve_backend(backend)
    if name == "torch":
        return "torch"
    if name == "cuda":
        cuda_extension(x)
        return "cuda"
    if name == "triton":
        _require_triton(x, "gemm_act")
        return "triton"
    # Without an activation, cuBLAS's addmm already is one kernel with the bias in its epilogue.
    if (eager_math(name, activation_id) or not _auto_may_use(x.device, x.dtype, "gemm_act")
            or not tuned_card(x.device)):
        return "torch"
    return "triton" if x.shape[0] * x.shape[1] * out_features >= cutovers(x.device).linear_act_min_work else "torch"


def allow_tf32() -> bool:
    """The flag fp32 kernels follow, as torch's own fp32 matmuls do."""
    return _cublas_allow_tf32()


# torch.backends.cuda.matmul.allow_tf32 reads this C flag through a module __getattr__ that costs ~2 µs a call.
_cublas_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", None) or (
    lambda: bool(torch.backends.cuda.matmul.allow_tf32))
