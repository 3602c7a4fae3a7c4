"""The contestants: eager PyTorch, torch.compile, Liger, eager in a CUDA graph, and mlpfuse's backends.

Every variant gets the same `Problem` (one case's weights, input and output gradient) and returns a `step()`
closure: the forward under no_grad, or the forward plus `torch.autograd.grad` of the input and every weight. The
closures take no arguments, so a CUDA graph can replay one as is; the runner times, checks and profiles `step`
and nothing else. The fp64 reference below is written from the math, not from any variant.

A variant is data (`Variant`): name, whether it is a peer (peers set the bar mlpfuse is judged against), what it
needs, and `build(problem) -> step`. Tests add their own (a deliberately wrong one, say) through `variants=`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from mlpfuse import activations
from mlpfuse.bench.presets import Case
from mlpfuse.workloads import fp8_unavailable, rowwise_fp8, rowwise_fp8_chain, scaled_mm
from mlpfuse.errors import InputError

Step = Callable[[], "torch.Tensor | tuple[torch.Tensor, ...]"]

# Relative Frobenius error ‖out − ref‖ / ‖ref‖ allowed against the fp64 reference, per dtype: rounding the
# inputs and every stored intermediate to bf16 costs a few 1e-3; a real bug (wrong activation, swapped operands,
# a missed tile) costs 1e-1 or more.
TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 5e-3}
# FP8 variants round x, the weights and h to e4m3 (unit roundoff 2^-4): measured 6.3–6.6e-2 for every FP8 form at
# 4096×14336 (mlpfuse's recipe and the rowwise peers alike, docs/fp8.md); a wrong activation or operand costs more
# than twice that.
FP8_TOLERANCE = 0.12


@dataclass
class Problem:
    """One case's tensors, shared by every variant: same weights, same input, same output gradient."""

    case: Case
    device: torch.device
    x: torch.Tensor
    params: dict[str, nn.Parameter]
    dy: torch.Tensor | None = None

    @property
    def train(self) -> bool:
        return self.case.mode == "fwd+bwd"

    @property
    def output_names(self) -> list[str]:
        return ["y"] + (["dx"] + [f"d{k}" for k in self.params] if self.train else [])


def make_problem(case: Case, device: torch.device, seed: int = 0) -> Problem:
    """Random (never zero) inputs scaled so activations stay O(1): weights ~ N(0, 1/fan_in)."""
    # Drawn on the device itself: Llama-sized weights take seconds to draw on a host.
    g = torch.Generator(device=device).manual_seed(seed)
    m, d, h, dt = case.tokens, case.dim, case.hidden, case.torch_dtype

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    train = case.mode == "fwd+bwd"
    if case.kind == "gated":
        shapes = {"gate_weight": ((h, d), d**-0.5), "up_weight": ((h, d), d**-0.5), "down_weight": ((d, h), h**-0.5)}
    elif case.kind == "mlp":
        shapes = {
            "fc1_weight": ((h, d), d**-0.5),
            "fc1_bias": ((h,), 0.1),
            "fc2_weight": ((d, h), h**-0.5),
            "fc2_bias": ((d,), 0.1),
        }
    else:
        shapes = {"weight": ((h, d), d**-0.5), "bias": ((h,), 0.1)}
    params = {k: nn.Parameter(rand(*shape, scale=s), requires_grad=train) for k, (shape, s) in shapes.items()}
    x = rand(m, d).requires_grad_(train)
    out_dim = h if case.kind == "linear" else d
    dy = rand(m, out_dim) if train else None
    return Problem(case, device, x, params, dy)


def _formula(kind: str, act, x, p):
    """The workload's math on whatever dtype it is handed (the reference calls it in fp64)."""
    if kind == "gated":
        return (act(x @ p["gate_weight"].T) * (x @ p["up_weight"].T)) @ p["down_weight"].T
    if kind == "mlp":
        return act(x @ p["fc1_weight"].T + p["fc1_bias"]) @ p["fc2_weight"].T + p["fc2_bias"]
    return act(x @ p["weight"].T + p["bias"])


def reference(problem: Problem) -> list[torch.Tensor]:
    """fp64 outputs (y, then dx and each weight's gradient in fwd+bwd), on the problem's device."""
    train = problem.train
    act = activations.get(problem.case.activation).forward
    x = problem.x.detach().double().requires_grad_(train)
    p = {k: v.detach().double().requires_grad_(train) for k, v in problem.params.items()}
    with torch.enable_grad() if train else torch.no_grad():
        y = _formula(problem.case.kind, act, x, p)
        if not train:
            return [y]
        grads = torch.autograd.grad(y, [x, *p.values()], problem.dy.double())
    return [y.detach(), *grads]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN or Inf anywhere (or a wrong shape) is an infinite error."""
    if out is None or tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    out = out.detach().to(ref.device, torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    denom = torch.linalg.vector_norm(ref).item() or 1.0
    return torch.linalg.vector_norm(out - ref).item() / denom


def check(problem: Problem, outputs, ref: list[torch.Tensor]) -> dict[str, float]:
    """Error of each output against the reference, by name (y, dx, dgate_weight, ...)."""
    outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    if len(outs) != len(ref):
        return {name: float("inf") for name in problem.output_names}
    return {name: rel_error(o, r) for name, o, r in zip(problem.output_names, outs, ref)}


# --- turning a forward into a step ---------------------------------------------------------------------------


def as_step(forward: Callable[[torch.Tensor], torch.Tensor], problem: Problem, before: Callable | None = None) -> Step:
    """Wrap `forward(x) -> y` into the case's step: no_grad forward, or forward + grads of x and all weights."""
    x, dy = problem.x, problem.dy
    wrt = [x, *problem.params.values()]
    if not problem.train:

        def step():
            if before:
                before()
            with torch.no_grad():
                return forward(x)

        return step

    def step():
        if before:
            before()
        y = forward(x)
        return (y, *torch.autograd.grad(y, wrt, dy))

    return step


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An nn.Linear that holds the problem's own parameters (built on meta: nothing is allocated or copied)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    return lin


class EagerGatedMLP(nn.Module):
    """What a Llama/Gemma MLP is in transformers: three nn.Linear and the activation, eager."""

    def __init__(self, p, act, glu=None):
        super().__init__()
        self.gate_proj = _linear(p["gate_weight"], None)
        self.up_proj = _linear(p["up_weight"], None)
        self.down_proj = _linear(p["down_weight"], None)
        self.act = act
        self.glu = glu  # a fused act(g) * u (Liger's), else the two eager ops

    def forward(self, x):
        if self.glu is not None:
            return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EagerMLP(nn.Module):
    def __init__(self, p, act):
        super().__init__()
        self.fc1 = _linear(p["fc1_weight"], p["fc1_bias"])
        self.fc2 = _linear(p["fc2_weight"], p["fc2_bias"])
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EagerLinear(nn.Module):
    def __init__(self, p, act):
        super().__init__()
        self.linear = _linear(p["weight"], p["bias"])
        self.act = act

    def forward(self, x):
        return self.act(self.linear(x))


def eager_module(problem: Problem) -> nn.Module:
    act = activations.get(problem.case.activation).forward
    kind = problem.case.kind
    if kind == "gated":
        return EagerGatedMLP(problem.params, act)
    return EagerMLP(problem.params, act) if kind == "mlp" else EagerLinear(problem.params, act)


# --- the variants --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    build: Callable[[Problem], Step]
    peer: bool = False  # peers are what mlpfuse is measured against
    needs_cuda: bool = False
    about: str = ""
    skip: Callable[[Case], str | None] = field(default=lambda case: None)  # a reason this case is not applicable
    missing: Callable[[], str | None] = field(default=lambda: None)  # a reason it cannot run here at all
    floor: bool = False  # a yardstick that computes something else (its output is not checked): GEMMs alone
    fp8: bool = False  # rounds to FP8: checked against FP8_TOLERANCE instead of its dtype's

    def tolerance(self, case: Case) -> float:
        return FP8_TOLERANCE if self.fp8 else TOLERANCE[case.dtype]


def _build_eager(problem: Problem) -> Step:
    return as_step(eager_module(problem), problem)


def _compile_builder(mode: str | None) -> Callable[[Problem], Step]:
    def build(problem: Problem) -> Step:
        # dynamic=False: one specialised graph per shape, as a model with fixed shapes gets; the runner resets
        # dynamo between cases so no case inherits another's graphs or recompile budget.
        compiled = torch.compile(eager_module(problem), mode=mode, dynamic=False)
        before = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else None
        return as_step(compiled, problem, before)

    return build


class GemmsAlone(nn.Module):
    """The block's projections and nothing else, forward: y = down(gate(x)) with up(x) computed and dropped (gated),
    or fc2(fc1(x)) / linear(x) without the activation. The fused block's floor: what its GEMMs cost when the
    activation, the multiply, their memory traffic and their launches are free."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, x):
        m = self.inner
        if isinstance(m, EagerGatedMLP):
            m.up_proj(x)
            return m.down_proj(m.gate_proj(x))
        if isinstance(m, EagerMLP):
            return m.fc2(m.fc1(x))
        return m.linear(x)


def _build_gemms_alone(problem: Problem) -> Step:
    return as_step(GemmsAlone(eager_module(problem)), problem)


def _liger_missing() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel not installed (pip install liger-kernel)"
    return None


_LIGER_ACTS = {"gelu_tanh": "LigerGELUMulFunction", "silu": "LigerSiLUMulFunction"}


def _liger_skip(case: Case) -> str | None:
    if case.kind != "gated" or case.activation not in _LIGER_ACTS:
        return "Liger fuses only GeGLU (gelu_tanh) and SwiGLU (silu) gated MLPs"
    return None


def _build_liger(problem: Problem) -> Step:
    # LigerGEGLUMLP / LigerSwiGLUMLP are exactly three nn.Linear around these Functions; using the Functions over
    # our shared Linears keeps the weights identical without a transformers config object.
    import liger_kernel.ops as liger_ops

    fn = getattr(liger_ops, _LIGER_ACTS[problem.case.activation])
    module = EagerGatedMLP(problem.params, None, glu=lambda g, u: fn.apply(g, u))
    return as_step(module, problem)


def graphed(step: Step, warmup: int = 3) -> Step:
    """`step` captured once in a torch.cuda.CUDAGraph; the returned step replays it and returns the captured outputs.

    Warm-up runs on a side stream first (cuBLAS handles, workspaces, autograd's state, compiled kernels), as a
    capture needs; the tensors `step` reads are the graph's inputs, so every replay reads their current values."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    def replay():
        graph.replay()
        return static_out

    replay.graph = graph  # keep the graph (and its memory pool) alive as long as the step
    return replay


def _captured(build: Callable[[Problem], Step]) -> Callable[[Problem], Step]:
    """A builder whose step is `build`'s step captured in a CUDA graph and replayed (`graphed`): the same kernels with
    no host work between them, so eager and mlpfuse can be compared with launch cost taken out."""
    return lambda problem: graphed(build(problem))


def _mlpfuse_builder(backend: str) -> Callable[[Problem], Step]:
    """mlpfuse's drop-in module over the problem's parameters (shared, as `eager` holds them): GatedMLP, MLP or
    FusedLinear, each with its call plan -- module against module, what a user swaps in."""

    def build(problem: Problem) -> Step:
        from mlpfuse import modules

        case, eager = problem.case, eager_module(problem)
        if case.kind == "gated":
            module = modules.GatedMLP.from_linears(eager.gate_proj, eager.up_proj, eager.down_proj, case.activation,
                                                   backend)
        elif case.kind == "mlp":
            module = modules.MLP.from_module(eager.fc1, eager.fc2, case.activation, backend)
        else:
            module = modules.FusedLinear.from_module(eager.linear, case.activation, backend)
        return as_step(module, problem)

    return build


def _fp8_missing() -> str | None:
    """Why the CUDA FP8 variants cannot run here (they need FP8 tensor cores: compute capability 8.9+)."""
    return fp8_unavailable("cuda" if torch.cuda.is_available() else "cpu")


def _fp8_skip(case: Case) -> str | None:
    if case.kind != "gated":
        return "FP8 rows cover the gated MLP"
    if case.mode == "fwd+bwd":
        return "FP8 here is inference only (forward)"
    return None


def _build_fp8_gemms_alone(problem: Problem) -> Step:
    """cuBLAS's rowwise FP8 GEMMs of the block with operands quantized beforehand: the FP8 floor."""
    p, x, dt = problem.params, problem.x.detach(), problem.x.dtype
    act = activations.get(problem.case.activation).forward
    g, u, d = (rowwise_fp8(p[k].detach()) for k in ("gate_weight", "up_weight", "down_weight"))
    xq, xs = rowwise_fp8(x)
    hq, hs = rowwise_fp8(act(x @ p["gate_weight"].detach().T) * (x @ p["up_weight"].detach().T))

    def step():
        scaled_mm(xq, xs, *u, dt)
        scaled_mm(xq, xs, *g, dt)
        return scaled_mm(hq, hs, *d, dt)

    return step


def _build_fp8_chain_compiled(problem: Problem) -> Step:
    """The rowwise FP8 chain with its quantization ops (amax, scale, cast) around cuBLAS's FP8 GEMMs, compiled."""
    p = problem.params
    chain = rowwise_fp8_chain(p["gate_weight"], p["up_weight"], p["down_weight"],
                              activations.get(problem.case.activation).forward, problem.x.dtype)
    return as_step(torch.compile(chain, dynamic=False), problem)


def torchao_missing(device: str) -> str | None:
    """Why torchao's float8 cannot run on `device` (None when it can): torchao importable, FP8 tensor cores. The
    block bench's torchao row and the model lab's ask the same."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao not installed (pip install torchao)"
    return fp8_unavailable(device)


def _torchao_missing() -> str | None:
    return torchao_missing("cuda" if torch.cuda.is_available() else "cpu")


def _build_torchao_fp8(problem: Problem) -> Step:
    """torchao's float8 (dynamic activations, rowwise scales) on copies of the block's projections, compiled."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    copies = {k: nn.Parameter(v.detach().clone(), requires_grad=False) for k, v in problem.params.items()}
    module = EagerGatedMLP(copies, activations.get(problem.case.activation).forward)
    quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return as_step(torch.compile(module, dynamic=False), problem)


def _build_mlpfuse_fp8(problem: Problem) -> Step:
    """mlpfuse's GatedMLP over the problem's projections, converted to the FP8 recipe (its own quantized copies)."""
    from mlpfuse import modules

    eager = eager_module(problem)
    module = modules.GatedMLP.from_linears(eager.gate_proj, eager.up_proj, eager.down_proj, problem.case.activation)
    return as_step(module.to_fp8(), problem)


def _triton_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    return None


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager", _build_eager, peer=True, about="nn.Linear + torch activation, eager"),
        Variant("compile", _compile_builder(None), peer=True, about="torch.compile, default mode"),
        Variant(
            "compile-max-autotune", _compile_builder("max-autotune"), peer=True, about="torch.compile max-autotune"
        ),
        Variant(
            "compile-reduce-overhead",
            _compile_builder("reduce-overhead"),
            peer=True,
            needs_cuda=True,
            about="torch.compile reduce-overhead (CUDA graphs)",
        ),
        Variant(
            "liger",
            _build_liger,
            peer=True,
            needs_cuda=True,
            about="Liger's fused GELU/SiLU·mul between nn.Linear GEMMs",
            skip=_liger_skip,
            missing=_liger_missing,
        ),
        Variant(
            "eager-cudagraph",
            _captured(_build_eager),
            peer=True,
            needs_cuda=True,
            about="the eager module captured once in a torch.cuda.CUDAGraph, replayed",
        ),
        Variant("gemms-alone", _build_gemms_alone, floor=True,
                about="the block's GEMMs alone (cuBLAS, no activation, no multiply): the fusion's floor",
                skip=lambda case: "forward only" if case.mode == "fwd+bwd" else None),
        Variant("mlpfuse", _mlpfuse_builder("auto"),
                about="mlpfuse's drop-in module (GatedMLP / MLP / FusedLinear), backend auto"),
        Variant(
            "mlpfuse-triton",
            _mlpfuse_builder("triton"),
            needs_cuda=True,
            about="the drop-in module, Triton kernels forced",
            missing=_triton_missing,
        ),
        Variant("mlpfuse-torch", _mlpfuse_builder("torch"), about="the drop-in module, pure-PyTorch backend"),
        Variant(
            "mlpfuse-cudagraph",
            _captured(_mlpfuse_builder("auto")),
            needs_cuda=True,
            about="the drop-in module (auto) captured once in a torch.cuda.CUDAGraph, replayed: eager-cudagraph's pair",
        ),
        Variant("fp8-gemms-alone", _build_fp8_gemms_alone, floor=True, needs_cuda=True, skip=_fp8_skip,
                missing=_fp8_missing,
                about="cuBLAS's rowwise FP8 GEMMs (torch._scaled_mm), operands quantized beforehand: the FP8 floor"),
        Variant("fp8-scaled-mm-compile", _build_fp8_chain_compiled, peer=True, needs_cuda=True, fp8=True,
                skip=_fp8_skip, missing=_fp8_missing,
                about="rowwise FP8 with its quantization ops around torch._scaled_mm, torch.compile"),
        Variant("torchao-fp8", _build_torchao_fp8, peer=True, needs_cuda=True, fp8=True, skip=_fp8_skip,
                missing=_torchao_missing, about="torchao float8 (dynamic activations, rowwise), torch.compile"),
        Variant("mlpfuse-fp8", _build_mlpfuse_fp8, fp8=True, skip=_fp8_skip,
                about="GatedMLP(precision='fp8'): e4m3, 128×128 weight blocks, 1×128 activation groups"),
        Variant("mlpfuse-fp8-cudagraph", _captured(_build_mlpfuse_fp8), needs_cuda=True, fp8=True, skip=_fp8_skip,
                missing=_fp8_missing, about="mlpfuse-fp8 captured once in a torch.cuda.CUDAGraph, replayed"),
    )
}

DEFAULT_VARIANTS = (
    "eager", "compile", "liger", "eager-cudagraph", "gemms-alone", "mlpfuse", "mlpfuse-triton", "mlpfuse-torch",
    "mlpfuse-cudagraph",
)
# --precision fp8: bf16's rows beside FP8's
FP8_VARIANTS = ("eager", "compile", "eager-cudagraph", "mlpfuse", "mlpfuse-cudagraph", "fp8-gemms-alone",
                "fp8-scaled-mm-compile", "torchao-fp8", "mlpfuse-fp8", "mlpfuse-fp8-cudagraph")
COMPILE_MODES = ("default", "max-autotune", "reduce-overhead")


def parse_variants(text: str | None, compile_mode: str | None = None, precision: str | None = None) -> list[Variant]:
    """Comma list of variant names (or 'all'); --compile-mode turns `compile` into `compile-<mode>`; without a list,
    --precision fp8 picks FP8_VARIANTS."""
    if precision not in (None, "fp8"):
        raise InputError(f"--precision: expected fp8 (or leave it out), got {precision!r}")
    default = FP8_VARIANTS if precision == "fp8" else DEFAULT_VARIANTS
    names = [n.strip().lower() for n in (text or "").split(",") if n.strip()] or list(default)
    if names == ["all"]:
        names = list(VARIANTS)
    if compile_mode is not None:
        if compile_mode not in COMPILE_MODES:
            valid = ", ".join(COMPILE_MODES)
            raise InputError(f"--compile-mode: unknown mode {compile_mode!r}; expected one of {valid}")
        if compile_mode != "default":
            names = [f"compile-{compile_mode}" if n == "compile" else n for n in names]
    out = []
    for n in names:
        if n not in VARIANTS:
            raise InputError(f"--variants: unknown variant {n!r}; expected one of {', '.join(VARIANTS)} or all")
        if VARIANTS[n] not in out:
            out.append(VARIANTS[n])
    return out
