"""What a bench run measures: cases (one shape, dtype, workload, mode) built from presets and sweep flags.

A case is one row group of the result table; every variant runs on every case. Presets name shapes the README and
DESIGN.md talk about; sweep flags (tokens, dim, hidden, dtype, activation, workload, mode) override a preset's
fields, and their cross product is the list of cases. All user-facing names are validated here, so a typo is one
InputError line before anything is allocated.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from mlpfuse import activations
from mlpfuse.errors import InputError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# geglu/swiglu fix their activation (they are the two gated MLPs real models use); gated, mlp and linear take it
# from --activation.
WORKLOADS = {
    "geglu": ("gated", "gelu_tanh"),
    "swiglu": ("gated", "silu"),
    "gated": ("gated", None),
    "mlp": ("mlp", None),
    "linear": ("linear", None),
}
WORKLOAD_HELP = {
    "geglu": "down(gelu_tanh(gate(x)) * up(x)), no bias (Gemma)",
    "swiglu": "down(silu(gate(x)) * up(x)), no bias (Llama)",
    "gated": "gated MLP with --activation",
    "mlp": "fc2(act(fc1(x))), both with bias (GPT-2/BERT)",
    "linear": "act(x @ W^T + b): one Linear(dim -> hidden) with bias (+ activation)",
}
MODES = ("fwd", "fwd+bwd")
_MODE_ALIASES = {"forward": "fwd", "fwdbwd": "fwd+bwd", "train": "fwd+bwd", "fwd_bwd": "fwd+bwd"}


@dataclass(frozen=True)
class Preset:
    tokens: tuple[int, ...]
    dim: int
    hidden: int
    about: str


PRESETS = {
    "blog": Preset((8192,), 768, 3072, "the walkthrough's GeGLU block (GPT-2 small sizes, 8192 tokens)"),
    "llama-8b": Preset((8192,), 4096, 14336, "Llama-3 8B MLP, 8192 tokens"),
    "gemma-2b": Preset((8192,), 2048, 16384, "Gemma 2B MLP, 8192 tokens"),
    "decode": Preset((1, 4, 16, 32, 64), 4096, 14336, "decode-sized batches on Llama-3 8B weights"),
    "small": Preset((64,), 768, 3072, "64 tokens of the blog block: launch and dispatch bound"),
}

# On a CPU, 8192-token GEMMs take seconds per call; presets keep their dim/hidden but cap the tokens (said aloud).
CPU_MAX_TOKENS = 128


@dataclass(frozen=True)
class Case:
    workload: str  # a key of WORKLOADS
    activation: str  # canonical activation name ("identity" for a bare linear)
    tokens: int
    dim: int
    hidden: int
    dtype: str  # a key of DTYPES
    mode: str  # "fwd" | "fwd+bwd"

    @property
    def kind(self) -> str:
        return WORKLOADS[self.workload][0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def label(self) -> str:
        act = "" if WORKLOADS[self.workload][1] else f"[{self.activation}]"
        return f"{self.workload}{act} {self.tokens}x{self.dim}x{self.hidden} {self.dtype} {self.mode}"

    @property
    def group(self) -> tuple:
        """Everything but the token count: the key of one line in the time-ratio vs tokens plot."""
        return (self.workload, self.activation, self.dim, self.hidden, self.dtype, self.mode)

    def to_dict(self) -> dict:
        return asdict(self)


def _split(value: str | None) -> list[str]:
    if value is None:
        return []
    return [v.strip() for v in str(value).split(",") if v.strip()]


def _choose(values: list[str], valid, argument: str, aliases: dict | None = None) -> list[str]:
    out = []
    for v in values:
        key = (aliases or {}).get(v.lower(), v.lower())
        if key not in valid:
            raise InputError(f"{argument}: unknown value {v!r}; expected one of {', '.join(valid)}")
        if key not in out:
            out.append(key)
    return out


def _parse_int(text: str, argument: str) -> int:
    """An integer >= 1; for --tokens, `AxB` means A*B (batch x sequence)."""
    # Only token counts come as batch x sequence: a width like 4x2048 would be a wrong suggestion for --dim.
    like = "512 or 4x2048" if argument == "--tokens" else "768 or 768,4096"
    parts = text.lower().split("x") if argument == "--tokens" else [text]
    try:
        n = 1
        for part in parts:
            n *= int(part)
    except ValueError:
        raise InputError(f"{argument}: expected positive integers like {like}, got {text!r}") from None
    if n < 1 or any(int(part) < 1 for part in parts):
        raise InputError(f"{argument}: expected positive integers like {like}, got {text!r}")
    return n


def parse_ints(value: str | None, argument: str) -> list[int]:
    return [_parse_int(v, argument) for v in _split(value)]


def parse_dtypes(value: str | None) -> list[str]:
    return _choose(_split(value), tuple(DTYPES), "--dtype", _DTYPE_ALIASES)


def parse_modes(value: str | None) -> list[str]:
    return _choose(_split(value), MODES, "--mode", _MODE_ALIASES)


def parse_workloads(value: str | None) -> list[str]:
    return _choose(_split(value), tuple(WORKLOADS), "--workload")


def parse_activations(value: str | None) -> list[str]:
    out = []
    for v in _split(value):
        name = activations.get(v, argument="--activation").name
        if name not in out:
            out.append(name)
    return out


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise InputError(f"--preset: unknown preset {name!r}; expected one of {', '.join(PRESETS)}") from None


def build_cases(
    *,
    preset: str | None = None,
    tokens: str | None = None,
    dim: str | None = None,
    hidden: str | None = None,
    dtype: str | None = None,
    activation: str | None = None,
    workload: str | None = None,
    mode: str | None = None,
    on_cpu: bool = False,
    notes: list[str] | None = None,
) -> list[Case]:
    """For each preset (a comma list), the cross product of its fields and the sweep flags (flags win)."""
    notes = notes if notes is not None else []
    names = _split(preset)
    if not names and not (tokens or dim or hidden):
        names = ["small" if on_cpu else "blog"]
        notes.append(f"no shape given: preset {names[0]!r}")
    chosen = [get_preset(n) for n in names] or [PRESETS["blog"]]

    dtypes = parse_dtypes(dtype)
    if not dtypes:
        # CPUs have no fast bf16 GEMM in general; fp32 is what a CPU user runs.
        dtypes = ["fp32"] if on_cpu else ["bf16"]
        if on_cpu:
            notes.append("on CPU the default dtype is fp32 (pass --dtype to override)")
    acts = parse_activations(activation) or ["gelu_tanh"]
    workloads = parse_workloads(workload) or ["geglu"]
    modes = parse_modes(mode) or ["fwd"]
    token_flag = parse_ints(tokens, "--tokens")
    dims_flag = parse_ints(dim, "--dim")
    hiddens_flag = parse_ints(hidden, "--hidden")

    cases: list[Case] = []
    for p in chosen:
        token_list = token_flag or list(p.tokens)
        if on_cpu and not token_flag and any(t > CPU_MAX_TOKENS for t in token_list):
            token_list = sorted({min(t, CPU_MAX_TOKENS) for t in token_list})
            note = f"on CPU the preset's tokens are capped at {CPU_MAX_TOKENS} (pass --tokens to override)"
            if note not in notes:
                notes.append(note)
        for wl, act, d, h, dt, md, t in itertools.product(
            workloads, acts, dims_flag or [p.dim], hiddens_flag or [p.hidden], dtypes, modes, token_list
        ):
            case = Case(wl, WORKLOADS[wl][1] or act, t, d, h, dt, md)
            if case not in cases:
                cases.append(case)
    return cases
