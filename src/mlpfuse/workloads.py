"""Built-in workloads that mirror the nn.Linear -> fused MLP walkthrough.

A workload is a module plus an input; a variant says how the module runs (eager, `torch.compile`, mlpfuse's fused
modules, ...). Variants are a registry so that fused implementations plug in without touching the profiler: each
entry knows how to wrap a module and whether it can run on this machine (and if not, why).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from mlpfuse.errors import InputError

# ---------------------------------------------------------------- modules


class GeGLUMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with Llama/Gemma parameter names (no biases, as in those models)."""

    def __init__(self, dim: int, hidden: int, *, device=None, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    # size name -> (default on CUDA, default on CPU, help)
    sizes: dict[str, tuple[int, int, str]]
    build: Callable[..., tuple[nn.Module, torch.Tensor]]
    # elements alive at the peak of one forward (input, parameters, intermediates, output), from the sizes
    peak_elements: Callable[..., int]
    # the block in FP8: eager and compile run the rowwise FP8 chain the peers run, mlpfuse its FP8 recipe
    fp8: bool = False


def _build_linear(*, batch, in_dim, out_dim, bias=True, device, dtype):
    module = nn.Linear(in_dim, out_dim, bias=bias, device=device, dtype=dtype)
    return module, torch.randn(batch, in_dim, device=device, dtype=dtype)


def _build_geglu(*, batch, seq, dim, hidden, bias=False, device, dtype):
    module = GeGLUMLP(dim, hidden, device=device, dtype=dtype)
    return module, torch.randn(batch, seq, dim, device=device, dtype=dtype)


# CUDA defaults are the walkthrough's shapes (8192 tokens, 768 -> 3072); CPU defaults finish in well under a second.
_GEGLU_SIZES = {
    "batch": (8, 2, "sequences"),
    "seq": (1024, 64, "tokens per sequence"),
    "dim": (768, 128, "model width"),
    "hidden": (3072, 512, "MLP hidden width"),
}
WORKLOADS: dict[str, WorkloadSpec] = {
    "linear": WorkloadSpec(
        "linear",
        "nn.Linear(in_dim, out_dim, bias) on x[batch, in_dim]",
        {
            "batch": (8192, 256, "rows of x"),
            "in_dim": (768, 128, "input features"),
            "out_dim": (3072, 512, "output features"),
        },
        _build_linear,
        lambda batch, in_dim, out_dim: batch * in_dim + in_dim * out_dim + out_dim + batch * out_dim,
    ),
    "geglu-mlp": WorkloadSpec(
        "geglu-mlp",
        "down(gelu_tanh(gate(x)) * up(x)) on x[batch, seq, dim]",
        _GEGLU_SIZES,
        _build_geglu,
        # x and the output, three weights, and eager's [tokens, hidden] gate, up, gelu(gate) and product
        lambda batch, seq, dim, hidden: 2 * batch * seq * dim + 3 * dim * hidden + 4 * batch * seq * hidden,
    ),
    "geglu-mlp-fp8": WorkloadSpec(
        "geglu-mlp-fp8",
        "the same GeGLU MLP in FP8 (e4m3): eager and compile run the rowwise chain, x and h quantized by ops of "
        "their own around torch._scaled_mm; mlpfuse runs GatedMLP(precision='fp8'), its quantization inside its "
        "kernels (needs a CUDA GPU with FP8 tensor cores, compute capability 8.9+; widths multiples of 16)",
        _GEGLU_SIZES,
        _build_geglu,
        # the bf16 block's peak, plus the quantized weight copies, bounds the FP8 one's
        lambda batch, seq, dim, hidden: 2 * batch * seq * dim + 4 * dim * hidden + 4 * batch * seq * hidden,
        fp8=True,
    ),
}


def fp8_unavailable(device: str) -> str | None:
    """Why `device` cannot run the FP8 workloads (None when it can): FP8 tensor cores, compute capability 8.9+."""
    if not device.startswith("cuda"):
        return f"needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+); this run is on {device}"
    from mlpfuse.ops.fp8_mlp import MIN_CAPABILITY

    cap = torch.cuda.get_device_capability(torch.device(device))
    if cap < MIN_CAPABILITY:
        return f"needs FP8 tensor cores (compute capability 8.9+); {device} has {cap[0]}.{cap[1]}"
    return None


def unavailable(workload: str, device: str) -> str | None:
    """Why `workload` cannot run on `device` (None when it can)."""
    return fp8_unavailable(device) if WORKLOADS[workload].fp8 else None

# ---------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    description: str
    wrap: Callable[[str, nn.Module], Callable[[torch.Tensor], torch.Tensor]]
    available: Callable[[], tuple[bool, str]]


def _always() -> tuple[bool, str]:
    return True, ""


# ---------------------------------------------------------------- the peers' rowwise FP8 (the FP8 workload's eager
# and compile variants; the bench's FP8 peer rows)


def rowwise_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale per row): the rowwise FP8 the peers run."""
    s = (t.float().abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (t.float() / s).to(torch.float8_e4m3fn), s


def scaled_mm(xq, xs, wq, ws, dtype):
    """xq·wqᵀ with the rows' scales xs and ws, by cuBLAS's rowwise FP8 GEMM, out in `dtype`."""
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=dtype)


def rowwise_fp8_chain(gate_weight, up_weight, down_weight, act, dtype, gemm=scaled_mm):
    """The gated block in rowwise FP8 as the peers run it: the weights quantized once here; per call x and h each
    quantized by ops of their own (amax, scale, cast) around cuBLAS's FP8 GEMMs (`gemm`, scaled_mm's signature: another
    form of the same product, e.g. on a CPU). Returns chain(x), x [..., dim]."""
    g, u, d = (rowwise_fp8(w.detach()) for w in (gate_weight, up_weight, down_weight))

    def chain(x):
        xq, xs = rowwise_fp8(x.reshape(-1, x.shape[-1]))
        h = act(gemm(xq, xs, *g, dtype)) * gemm(xq, xs, *u, dtype)
        hq, hs = rowwise_fp8(h)
        return gemm(hq, hs, *d, dtype).reshape(*x.shape[:-1], -1)

    return chain


def _as_peers_run(workload: str, module: nn.Module):
    """What eager and compile run: the module itself, or for an FP8 workload the rowwise FP8 chain over its
    weights (quantized once here)."""
    if not WORKLOADS[workload].fp8:
        return module
    return rowwise_fp8_chain(module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight,
                             lambda t: F.gelu(t, approximate="tanh"), module.gate_proj.weight.dtype)


def _wrap_eager(workload: str, module: nn.Module):
    return _as_peers_run(workload, module)


def _wrap_compile(workload: str, module: nn.Module):
    return torch.compile(_as_peers_run(workload, module))


def _mlpfuse_available() -> tuple[bool, str]:
    try:
        import mlpfuse.modules  # noqa: F401
    except Exception as exc:  # the fused modules are optional for the profiler: report, never fail
        return False, f"mlpfuse.modules cannot be imported ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return True, ""


def _wrap_mlpfuse(workload: str, module: nn.Module):
    import mlpfuse.modules as fused

    if workload == "linear":
        return fused.FusedLinear.from_module(module)
    block = fused.GatedMLP.from_module(module, activation="gelu_tanh")
    return block.to_fp8() if WORKLOADS[workload].fp8 else block


VARIANTS: dict[str, Variant] = {
    "eager": Variant("eager", "the PyTorch module as is", _wrap_eager, _always),
    "compile": Variant("compile", "torch.compile(module), default mode", _wrap_compile, _always),
    "mlpfuse": Variant("mlpfuse", "mlpfuse's fused modules (FusedLinear / GatedMLP)", _wrap_mlpfuse, _mlpfuse_available),
}


def register_variant(variant: Variant) -> None:
    """Add a variant (e.g. a third-party fused implementation) so `profile --variant NAME` can run it."""
    VARIANTS[variant.name] = variant


def variant_status() -> dict[str, tuple[bool, str]]:
    """name -> (available, reason when not)."""
    return {name: v.available() for name, v in VARIANTS.items()}


# ---------------------------------------------------------------- building a runnable workload

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise InputError(f"--dtype: expected one of bf16, fp16, fp32, got {name!r}") from None


def resolve_device(name: str | None) -> str:
    device = name or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device: {device!r} requested but no CUDA device is available here")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError(f"--device: expected 'cpu' or 'cuda[:N]', got {device!r}")
    return device


MAX_SIZE = 2**31 - 1  # one dimension; the memory check below bounds their product


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")


def available_memory(device: str) -> int | None:
    """Bytes that can be allocated on `device` now (None when unknown): free GPU memory, or MemAvailable."""
    if device.startswith("cuda"):
        try:
            return torch.cuda.mem_get_info(torch.device(device))[0]
        except (RuntimeError, ValueError, AssertionError):  # e.g. cuda:7 on a one-GPU machine: torch says so later
            return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(spec: WorkloadSpec, sizes: dict[str, int], device: str, dtype: torch.dtype) -> None:
    """Refuse sizes that cannot fit before allocating anything (an absurd --batch would otherwise end in an
    allocator error, or in the machine swapping)."""
    need = spec.peak_elements(**sizes) * torch.empty((), dtype=dtype).element_size()
    have = available_memory(device)
    if have is not None and need > have:
        given = " ".join(f"{_option(k)} {v}" for k, v in sizes.items())
        raise InputError(f"{given}: {spec.name} needs about {need / 2**30:,.1f} GiB on {device}, more than the "
                         f"{have / 2**30:,.1f} GiB available; choose smaller sizes")


@dataclasses.dataclass
class Built:
    """A ready-to-profile workload: call `fn(x)` once per step."""

    workload: str
    variant: str
    fn: Callable[[torch.Tensor], Any]
    x: torch.Tensor
    sizes: dict[str, int]
    bias: bool
    device: str
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.workload}-{self.variant}"

    def describe(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.sizes.items())
        bias = f" bias={self.bias}" if self.workload == "linear" else ""
        recipe = ""
        if WORKLOADS[self.workload].fp8 and self.variant in _FP8_RECIPES:
            recipe = f" fp8={_FP8_RECIPES[self.variant]}"
        return (f"{self.workload} [{self.variant}] {dims}{bias}{recipe} dtype={str(self.dtype).replace('torch.', '')} "
                f"device={self.device}")


# What each built-in variant runs of an FP8 workload (Built.describe says it)
_FP8_RECIPES = {"eager": "rowwise(torch._scaled_mm,separate-quantization)",
                "compile": "rowwise(torch._scaled_mm,quantization-compiled)",
                "mlpfuse": "1x128/128x128-blocks(quantization-in-kernels)"}


def build(
    workload: str,
    *,
    variant: str = "eager",
    device: str | None = None,
    dtype: str | None = None,
    bias: bool | None = None,
    seed: int = 0,
    **sizes: int | None,
) -> Built:
    """Build `workload` for `variant`; sizes left None take the device's defaults."""
    spec = WORKLOADS.get(workload)
    if spec is None:
        raise InputError(f"WORKLOAD: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    if variant not in VARIANTS:
        raise InputError(f"--variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    ok, reason = VARIANTS[variant].available()
    if not ok:
        raise InputError(f"--variant {variant}: unavailable: {reason}")
    device = resolve_device(device)
    reason = unavailable(workload, device)
    if reason:
        raise InputError(f"{workload}: {reason}")
    torch_dtype = resolve_dtype(dtype, device)
    on_cuda = device.startswith("cuda")
    unknown = set(sizes) - set(spec.sizes)
    if unknown:
        raise InputError(f"{workload}: unknown size option(s) {sorted(unknown)}; expected {sorted(spec.sizes)}")
    chosen = {}
    for key, (cuda_default, cpu_default, _) in spec.sizes.items():
        value = sizes.get(key)
        value = (cuda_default if on_cuda else cpu_default) if value is None else value
        try:
            value = operator.index(value) if not isinstance(value, bool) else None
        except TypeError:
            value = None
        if value is None or not 1 <= value <= MAX_SIZE:
            raise InputError(f"{_option(key)}: expected an integer from 1 to {MAX_SIZE}, got {sizes.get(key)!r}")
        chosen[key] = value
    if spec.fp8:  # the rowwise peers' GEMM (torch._scaled_mm) takes widths in multiples of 16
        for key in ("dim", "hidden"):
            if chosen[key] % 16:
                raise InputError(f"{_option(key)}: {workload} takes multiples of 16 (torch._scaled_mm's rule), "
                                 f"got {chosen[key]}")
    _check_memory(spec, chosen, device, torch_dtype)
    use_bias = (workload == "linear") if bias is None else bool(bias)
    torch.manual_seed(seed)
    module, x = spec.build(**chosen, bias=use_bias, device=device, dtype=torch_dtype)
    module.requires_grad_(False)  # the walkthrough profiles the forward pass
    fn = VARIANTS[variant].wrap(workload, module)
    return Built(workload, variant, fn, x, chosen, use_bias, device, torch_dtype)
