"""`mlpfuse bench --model`: a whole transformers model, timed the way its users run it.

Variants, each on its own copy of the model's module tree sharing one set of weights (nothing is duplicated):
    eager             the model as transformers builds it
    compile           torch.compile of the model; in decode mode generate with a static cache and transformers'
                      CompileConfig, which compiles the decode step (the recipe transformers documents)
    liger             Liger's MLP patch for the model's type (apply_liger_kernel_to_<type>(swiglu/geglu only))
    mlpfuse           mlpfuse.patch(model)
    mlpfuse-compile   mlpfuse.patch(model), then as `compile`
    mlpfuse-recompute, mlpfuse-recompute-compile
                      mlpfuse.patch(model, recompute=True) (training keeps only each MLP's input; the backward
                      recomputes the pre-activations), eager and compiled; asked for by name, not in the default set
    mlpfuse-fp8, mlpfuse-fp8-compile
                      mlpfuse.patch(model, precision="fp8") (each swapped gated or two-layer MLP in FP8; in train
                      mode every GEMM of its forward and backward on bf16 weights), eager and compiled; by name, or
                      with --precision fp8
    mlpfuse-noresidual, mlpfuse-compile-noresidual, mlpfuse-nopdl, mlpfuse-compile-nopdl, mlpfuse-noattn,
    mlpfuse-compile-noattn, mlpfuse-fp8-noattn, mlpfuse-fp8-compile-noattn
                      A/B of one part of mlpfuse in the same run: patch(fuse_residuals=False) (each layer keeps its
                      add after the MLP), patch(fuse_attention=False) (the attention's projections and its input norm
                      as the model runs them), or the decode kernels' plans made with kernels.decode_mlp.PDL off
                      (launched without programmatic dependent launch; meant for decode-step, whose graphs are
                      captured while the setting holds); by name only
    mlpfuse-fp8-pdl   mlpfuse-fp8 with the FP8 weight-only decode kernels launched as programmatic dependents
                      (kernels.fp8_gemm.PDL on; off by default: measured slower); decode-step, by name only
    mlpfuse-fp8-nonorm
                      mlpfuse-fp8 with a handed-over RMSNorm run by its own module in front of the FP8 decode kernels
                      instead of in their prologue (ops.fp8_mlp.NORM_IN_WEIGHT_ONLY off; decode-step only, as
                      above); by name only
    mlpfuse-balanced, mlpfuse-compile-balanced
                      mlpfuse (compiled) with the decode kernels' plans made under kernels.decode_mlp.BALANCED_ROWS
                      (fewer hidden units per program where whole tiles leave SMs idle); decode-step, by name only
    mlpfuse-fp8-onekernel
                      mlpfuse-fp8 with each decode-sized MLP in kernels.decode_mlp's one kernel reading e4m3 weights
                      (h on chip; ops.fp8_mlp.DECODE_KERNEL on; its atomic modes are not bit-reproducible);
                      decode-step only, by name only
    mlpfuse-save-fp8  mlpfuse.patch(model, save="fp8"): eager training keeps each MLP's g and u in FP8 (by name only)
    torchao-fp8-compile
                      the FP8 peer: torchao's float8 on the MLPs' nn.Linear projections, then as `compile` (torchao's
                      own advice) — in train mode its float8 training with the "rowwise" recipe, for inference its
                      dynamic float8 activations with float8 weights, per-row scales; needs torchao and a CUDA GPU
                      with FP8 tensor cores (skipped with why otherwise); with --precision fp8 or by name
    compile-pdl, mlpfuse-compile-pdl
                      as `compile` / `mlpfuse-compile` with Inductor's own programmatic dependent launch switch on
                      (torch._inductor.config.triton.enable_pdl) while the variant is compiled; by name only
    compile-checkpoint
                      train mode: the model's own activation checkpointing (transformers'
                      gradient_checkpointing_enable, every decoder layer recomputed in the backward), then as
                      `compile` — the memory-for-time trade recompute is measured against; by name only
Modes: prefill (a forward under no_grad keeping the last position's logits, `logits_to_keep=1` as generate runs
it, and beside it the same forward returning every position's logits), decode (greedy generate: ms per token is
(T(N+1 new tokens) − T(1)) / N, so the prompt's prefill cancels; host wall time, and on CUDA the GPU's busy time per
token from a profile of the same calls), decode-step (one decode step with a static cache at a fixed position,
replayed from a CUDA graph on CUDA and cross-checked with Triton's do_bench: `bench.decode_step`), train (forward,
loss, backward; gradients of every parameter). Every case first runs the fp32 model on the same input: each
variant's last-position logits are compared with those (relative Frobenius error), beside eager's own error, and
with eager's logits in the measured dtype. Timing reuses bench.timing: rounds interleave the variants
(A B C A B C ...), medians over rounds with the spread and every round's value kept; GPU time from CUDA events for
prefill, decode-step and train, wall time for decode (generate synchronises the host every step).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import inspect
import itertools
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from mlpfuse.bench import decode_step, models, timing
from mlpfuse.bench.variants import torchao_missing
from mlpfuse.bench.sweep import BenchResult, environment
from mlpfuse.errors import InputError

MODES = ("prefill", "decode", "decode-step", "train")
GENERATES = ("decode", "decode-step")  # modes a masked LM cannot run
DEFAULT_VARIANTS = ("eager", "compile", "liger", "mlpfuse", "mlpfuse-compile")
VARIANTS = (*DEFAULT_VARIANTS, "mlpfuse-recompute", "mlpfuse-recompute-compile", "compile-checkpoint", "mlpfuse-fp8",
            "mlpfuse-fp8-compile", "mlpfuse-noresidual", "mlpfuse-compile-noresidual", "mlpfuse-nopdl",
            "mlpfuse-compile-nopdl", "compile-pdl", "mlpfuse-compile-pdl", "mlpfuse-save-fp8", "mlpfuse-fp8-nonorm",
            "mlpfuse-fp8-onekernel", "mlpfuse-balanced", "mlpfuse-compile-balanced", "mlpfuse-fp8-pdl",
            "mlpfuse-noattn", "mlpfuse-compile-noattn", "mlpfuse-fp8-noattn", "mlpfuse-fp8-compile-noattn",
            "torchao-fp8-compile")
FP8_VARIANTS = ("eager", "compile", "mlpfuse", "mlpfuse-compile", "mlpfuse-fp8", "mlpfuse-fp8-compile",
                "torchao-fp8-compile")
_MODE_ALIASES = {"fwd": "prefill", "forward": "prefill", "generate": "decode", "fwd+bwd": "train",
                 "step": "decode-step"}


@dataclass(frozen=True)
class LabCase:
    mode: str
    batch: int
    seq: int

    @property
    def label(self) -> str:
        return f"{self.mode} {self.batch}x{self.seq}"


@dataclass
class LabSettings:
    rounds: int = 5  # at least 5 for a spread worth reading
    target_ms: float = 200.0
    warmup: int = 2
    new_tokens: int = 32
    backend: str = "auto"
    compile_backend: str = "inductor"
    compile_mode: str | None = None  # torch.compile's mode for prefill/train; decode uses CompileConfig's own
    seed: int = 0


def parse_modes(text: str | None) -> list[str]:
    out = []
    for word in (text or "prefill").split(","):
        word = word.strip().lower()
        if not word:
            continue
        word = _MODE_ALIASES.get(word, word)
        if word not in MODES:
            raise InputError(f"--mode: unknown mode {word!r} for --model; expected one of {', '.join(MODES)}")
        if word not in out:
            out.append(word)
    return out


def parse_variants(text: str | None, precision: str | None = None) -> list[str]:
    """Comma list of the lab's variants (or 'all'); without a list, --precision fp8 picks FP8_VARIANTS."""
    if precision not in (None, "fp8"):
        raise InputError(f"--precision: expected fp8 (or leave it out), got {precision!r}")
    default = FP8_VARIANTS if precision == "fp8" else DEFAULT_VARIANTS
    names = [n.strip().lower() for n in (text or "").split(",") if n.strip()] or list(default)
    if names == ["all"]:
        names = list(VARIANTS)
    for n in names:
        if n not in VARIANTS:
            raise InputError(f"--variants: unknown variant {n!r} for --model; expected one of {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def parse_shapes(text: str | None, default: tuple[str, ...]) -> list[tuple[int, int]]:
    """BxS shapes (a bare S means batch 1)."""
    out = []
    for word in (text.split(",") if text else default):
        word = word.strip().lower()
        if not word:
            continue
        parts = word.split("x")
        try:
            b, s = (1, int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
        except ValueError:
            b = s = 0
        if len(parts) > 2 or b < 1 or s < 1:
            raise InputError(f"--tokens: expected BATCHxSEQ shapes like 1x128 or 8x2048, got {word!r}")
        if (b, s) not in out:
            out.append((b, s))
    return out


# --- building the variants -----------------------------------------------------------------------------------


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree holding the same Parameter and buffer objects: patching or compiling one copy leaves
    the others alone, and no weight is duplicated."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def liger_missing(device: torch.device) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel not installed (pip install 'mlpfuse[liger]')"
    if device.type != "cuda":
        return "Liger's kernels need CUDA"
    return None


def _liger_fn(model_type: str):
    """(Liger's apply function for this model type, its MLP options), or (None, why not)."""
    from liger_kernel.transformers import monkey_patch

    fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        return None, f"Liger has no patch for model type {model_type!r}"
    mlp = [p for p in ("swiglu", "geglu") if p in inspect.signature(fn).parameters]
    if not mlp:
        return None, f"Liger's patch for {model_type!r} has no MLP option"
    return fn, mlp


def apply_liger(model: torch.nn.Module, model_type: str) -> None:
    """Liger's patch for this model type with only its MLP option on. Liger also rebinds names in the model's
    transformers module (its MLP class) for models built later: those are put back, so other variants built from
    the same classes stay what they are."""
    fn, mlp = _liger_fn(model_type)
    if fn is None:
        raise InputError(f"liger: {mlp}")
    params = inspect.signature(fn).parameters
    flags = {p: p in mlp for p, v in params.items() if p != "model" and isinstance(v.default, bool)}
    module = sys.modules[type(model).__module__]
    saved = dict(vars(module))
    try:
        fn(model=model, **flags)
    finally:
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


def _mlp_projection(module: torch.nn.Module, fqn: str) -> bool:
    """An nn.Linear inside a module named `mlp` (transformers' decoder MLPs): what torchao-fp8 converts."""
    return isinstance(module, torch.nn.Linear) and ".mlp." in f".{fqn}."


def apply_torchao_fp8(model: torch.nn.Module, training: bool) -> None:
    """torchao's float8 on the model's MLP projections: float8 training with its "rowwise" recipe (e4m3 everywhere,
    per-row scales) in train mode, else dynamic float8 activations and float8 weights with per-row scales. Raises
    one InputError line when the model has no such projection."""
    if not any(_mlp_projection(m, fqn) for fqn, m in model.named_modules()):
        raise InputError("torchao-fp8: no nn.Linear projection inside an `mlp` module to convert")
    if training:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=_mlp_projection)
    else:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=_mlp_projection)


@dataclass
class Prepared:
    """One variant on one case: its own module tree, the steps to time, and how to get its last logits."""

    name: str
    module: torch.nn.Module
    steps: dict  # timing key -> step()
    logits: object  # () -> [B, 1, V] logits
    main: str | None = None  # the step whose first call, peak memory and time are the row's (default: the last)
    setup_ms: float | None = None  # building the step took this (compile and graph capture), when not its first call
    note: str | None = None  # what the row's status says beside "ok" (e.g. a patch that swapped nothing)
    floor_bytes: int | None = None  # decode-step: the bytes the step must read (decode_step.step_bytes)

    @property
    def main_key(self) -> str:
        return self.main or list(self.steps)[-1]

    @property
    def main_step(self):
        return self.steps[self.main_key]


def _loss(logits, ids, kind):
    if kind == models.CAUSAL:
        logits, ids = logits[:, :-1], ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1))


def _forward_last(module, ids, kind):
    """Logits of the last position only (transformers' logits_to_keep=1 for causal LMs)."""
    if kind == models.CAUSAL:
        return module(input_ids=ids, logits_to_keep=1).logits
    return module(input_ids=ids).logits[:, -1:]


def prepare(variant: str, built: models.Built, case: LabCase, ids: torch.Tensor, settings: LabSettings,
            device: torch.device) -> Prepared:
    module = twin(built.model)
    module.train(case.mode == "train")  # before patch, as a user trains: patch(precision="fp8") then trains in FP8
    note = None
    if variant == "liger":
        apply_liger(module, built.model_type)
    if variant.startswith("torchao-fp8"):
        apply_torchao_fp8(module, training=case.mode == "train")
    if variant.startswith("mlpfuse"):
        from mlpfuse.patching import patch

        report = patch(module, backend=settings.backend, recompute="recompute" in variant,
                       precision="fp8" if variant.startswith("mlpfuse-fp8") else None,
                       fuse_residuals="noresidual" not in variant, save="fp8" if "save-fp8" in variant else "high",
                       fuse_attention="noattn" not in variant)
        if not report.changed:  # timed all the same: what a user who patches this model runs is eager's model
            reasons = "; ".join(sorted({item.reason for item in report.left})) or "no MLP block mlpfuse recognises"
            note = f"mlpfuse.patch swapped nothing, so this is the unpatched model: {reasons}"
    if variant == "compile-checkpoint":
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prepared = _prepare_steps(variant, module, built, case, ids, settings, device)
    prepared.note = note
    return prepared


def _prepare_steps(variant: str, module: torch.nn.Module, built: models.Built, case: LabCase, ids: torch.Tensor,
                   settings: LabSettings, device: torch.device) -> Prepared:
    compiled = "compile" in variant
    kind = built.kind

    if case.mode == "decode":
        return _prepare_decode(variant, module, built, case, ids, settings, device, compiled)
    if case.mode == "decode-step":
        return _prepare_decode_step(variant, module, case, ids, settings, device, compiled)

    fn = module
    if compiled:
        fn = torch.compile(module, backend=settings.compile_backend, mode=settings.compile_mode, dynamic=False)

    if case.mode == "prefill":
        def step():
            with torch.no_grad():
                return _forward_last(fn, ids, kind)

        steps = {variant: step}
        if kind == models.CAUSAL:  # beside logits_to_keep=1, every position's logits (a masked LM has only those)
            steps[f"{variant}|full"] = decode_step.inference(lambda: fn(input_ids=ids).logits)
        return Prepared(variant, module, steps, step, main=variant)

    def train_step():
        module.zero_grad(set_to_none=True)
        logits = fn(input_ids=ids).logits
        _loss(logits, ids, kind).backward()
        return logits[:, -1:].detach()

    return Prepared(variant, module, {variant: train_step}, train_step)


def _cache_keyword() -> str:
    """generate's name for a cache passed in: `cache` where transformers renamed it (it warns about the old
    `past_key_values` from then on), `past_key_values` before (5.17 knows no other)."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _prepare_decode(variant, module, built, case, ids, settings, device, compiled) -> Prepared:
    import transformers

    cfg = module.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    mask = torch.ones_like(ids)
    longest = settings.new_tokens + 1
    extra = {}
    cache = None
    if compiled:
        # The documented fast path: a static cache (reused, reset before each call, so no new cache shape ever
        # reaches the compiled step) and CompileConfig, with which generate compiles the decode step only.
        cache = transformers.StaticCache(config=cfg, max_cache_len=case.seq + longest)
        config = transformers.CompileConfig(backend=settings.compile_backend)
        if settings.compile_backend != "inductor":
            config.mode = None
        if device.type != "cuda":
            config._compile_all_devices = True  # transformers' switch to compile off CUDA (CPU runs and tests)
        extra = {_cache_keyword(): cache, "compile_config": config}

    def generate(n):
        def step():
            if cache is not None:
                cache.reset()
            with torch.no_grad():
                return module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                       do_sample=False, pad_token_id=pad, **extra)
        return step

    def logits():
        with torch.no_grad():
            return _forward_last(module, ids, built.kind)

    return Prepared(variant, module, {f"{variant}|1": generate(1), f"{variant}|{longest}": generate(longest)},
                    logits)


def _prepare_decode_step(variant, module, case, ids, settings, device, compiled) -> Prepared:
    """The static-cache step of `bench.decode_step`, compiled with fullgraph=True for the compile variants, captured
    in a CUDA graph on CUDA (replays timed); on a CPU it runs as it is."""
    import time

    started = time.perf_counter()
    step = decode_step.StaticStep(module, ids, _token(case, module.config.vocab_size, device, settings.seed))
    floor_bytes = decode_step.step_bytes(module, step.cache)
    if compiled:
        step = torch.compile(step, backend=settings.compile_backend, mode=settings.compile_mode, fullgraph=True)
    step = decode_step.inference(step)
    if device.type == "cuda":
        replay, out = decode_step.capture(step, device)

        def logits():
            replay()
            return out.clone()
    else:
        replay = logits = step
        logits()  # the first call (compilation included) belongs to the setup time
    setup = (time.perf_counter() - started) * 1e3
    return Prepared(variant, module, {variant: replay}, logits, main=variant, setup_ms=setup, floor_bytes=floor_bytes)


# --- running ---------------------------------------------------------------------------------------------------


def _inputs(case: LabCase, vocab: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed + 1000 * case.batch + case.seq)
    return torch.randint(3, vocab, (case.batch, case.seq), generator=g).to(device)


def _token(case: LabCase, vocab: int, device: torch.device, seed: int) -> torch.Tensor:
    """The token every variant's decode step feeds, one per sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed + 7 + case.batch)
    return torch.randint(3, vocab, (case.batch, 1), generator=g).to(device)


def _reference(built, case, ids, settings, device) -> torch.Tensor:
    """The fp32 model's last logits for the case: the prompt's last position, or the decode step's token."""
    if case.mode == "decode-step":
        step = decode_step.StaticStep(built.model, ids, _token(case, built.vocab, device, settings.seed))
        return decode_step.inference(step)()
    return _forward_last(built.model, ids, built.kind)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().to(torch.float64)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def _row(built, layers, case, variant, dtype_name, settings) -> dict:
    return {
        "model": built.label, "model_type": built.model_type, "weights": built.weights, "layers": layers,
        "mode": case.mode, "batch": case.batch, "seq": case.seq,
        "new_tokens": settings.new_tokens if case.mode == "decode" else None,
        "case": case.label, "variant": variant, "dtype": dtype_name, "status": "ok", "error": None,
        "time_ms": None, "spread_pct": None, "rounds": settings.rounds, "time_rounds_ms": None, "wall_ms": None,
        "unit": "ms/token" if case.mode == "decode" else "ms",
        "gpu_busy_ms": None, "gpu_busy_spread_pct": None, "gpu_busy_rounds_ms": None,
        "do_bench_ms": None, "do_bench_spread_pct": None, "do_bench_rounds_ms": None,
        "full_logits_ms": None, "full_logits_spread_pct": None, "full_logits_rounds_ms": None,
        "peak_mem_mb": None, "first_call_ms": None, "rel_err": None, "err_vs_eager": None, "logits_vs_eager": None,
        "vs_eager": None, "vs_eager_paired": None, "vs_eager_paired_range": None, "vs_compile": None,
        "mem_vs_eager": None, "mem_vs_compile": None, "patched": None,
        "floor_mb": None, "floor_ms": None, "of_floor": None,
    }


def _layers(model) -> int | None:
    cfg = model.config
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(cfg, key, None), int):
            return getattr(cfg, key)
    return None


def run(name: str, *, layers: int | None, tiny: bool, shapes: list[tuple[int, int]], modes: list[str],
        variants: list[str], dtype: torch.dtype, dtype_name: str, device: torch.device, settings: LabSettings,
        command: str, progress=None, on_case=None) -> BenchResult:
    progress = progress or (lambda text: None)
    cases = [LabCase(m, b, s) for m in modes for b, s in shapes]
    progress("building the fp32 model")
    built = models.build(name, layers=layers, tiny=tiny, device=device, seed=settings.seed)
    n_layers = _layers(built.model)
    longest = max(s for _, s in shapes)
    if built.max_positions is not None and longest > built.max_positions:
        raise InputError(f"--tokens: {longest} positions but the model has {built.max_positions} position embeddings")
    too_long = {}  # decode cases whose prompt leaves no room for the new tokens: skipped, the others still run
    for case in cases:
        need = case.seq + (settings.new_tokens + 1 if case.mode == "decode" else 1)
        if case.mode in GENERATES and built.max_positions is not None and need > built.max_positions:
            too_long[case] = (f"skipped: {need} positions (prompt + new tokens) but the model has "
                              f"{built.max_positions} position embeddings; ask for a shorter prompt with --tokens")
    refs = {}
    for case in cases:  # fp32 references first, then the weights go to the measured dtype in place
        if (case.mode in GENERATES and built.kind != models.CAUSAL) or case in too_long:
            continue
        progress(f"fp32 reference: {case.label}")
        ids = _inputs(case, built.vocab, device, settings.seed)
        with torch.no_grad(), _no_tf32():
            refs[case] = _reference(built, case, ids, settings, device).double()
    if dtype != torch.float32:
        models.cast_parameters(built.model, dtype)
    _free(device)

    copy_gbps = None
    if "decode-step" in modes:  # the step's floor: its bytes at this device's measured copy rate
        from mlpfuse.bench import roofline

        progress("this device's copy bandwidth (the decode step's floor)")
        copy_gbps = roofline.load_peaks(device, [], log=progress).copy_gbps
    meta = environment(device, _NoPeaks(), _sweep_settings(settings), command)
    meta["copy_gbps"] = copy_gbps
    meta["transformers"] = sys.modules["transformers"].__version__
    meta.update(lab={**asdict(settings), "dtype": dtype_name, "model": built.label, "weights": built.weights,
                     "layers": n_layers, "modes": modes, "shapes": [f"{b}x{s}" for b, s in shapes]})
    result = BenchResult(meta)
    for case in cases:
        rows = {v: _row(built, n_layers, case, v, dtype_name, settings) for v in variants}
        if case in too_long:
            for row in rows.values():
                row.update(status="skipped", error=too_long[case])
            result.rows.extend(rows.values())
            continue
        try:
            _run_case(built, case, variants, rows, refs.get(case), settings, device, progress, copy_gbps)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the inputs: every row says so
            for row in rows.values():
                if row["status"] == "ok" and row["time_ms"] is None:
                    row.update(status="error", error=timing.one_line(exc))
        finally:
            _reset_compiler()
            _free(device)
        _derive(list(rows.values()))
        result.rows.extend(rows.values())
        if on_case:
            on_case(result)
    return result


class _NoPeaks:
    """environment() records the roofline peaks; a model has no single roofline."""

    def to_dict(self):
        return None


def _sweep_settings(settings: LabSettings):
    from mlpfuse.bench.sweep import Settings

    return Settings(rounds=settings.rounds, target_ms=settings.target_ms, warmup=settings.warmup, profile=False,
                    seed=settings.seed)


@contextlib.contextmanager
def _no_tf32():
    """The fp32 reference in true fp32 on a GPU (TF32 would make it a 10-bit-mantissa reference)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_compiler():
    with contextlib.suppress(Exception):
        torch._dynamo.reset()


def _skip_reason(variant: str, built: models.Built, case: LabCase, device: torch.device) -> str | None:
    if case.mode in GENERATES and built.kind != models.CAUSAL:
        return f"a {built.kind} LM does not generate"
    if variant == "compile-checkpoint" and case.mode != "train":
        return "activation checkpointing changes training only"
    if variant in ("mlpfuse-fp8-pdl", "mlpfuse-fp8-nonorm", "mlpfuse-fp8-onekernel") and case.mode == "train":
        return "switches an FP8 decode kernel: inference only"
    if variant.startswith("torchao-fp8"):
        return torchao_missing(str(device))
    if variant == "liger":
        missing = liger_missing(device)
        if missing:
            return missing
        fn, why = _liger_fn(built.model_type)
        return why if fn is None else None
    return None


def _run_case(built, case, variants, rows, ref, settings, device, progress, copy_gbps=None) -> None:
    ids = _inputs(case, built.vocab, device, settings.seed)
    prepared: dict[str, Prepared] = {}
    outputs: dict[str, torch.Tensor] = {}
    for v in variants:
        row = rows[v]
        reason = _skip_reason(v, built, case, device)
        if reason:
            row.update(status="skipped", error=f"skipped: {reason}")
            continue
        progress(f"{case.label}: {v} (build, first call, logits check)")
        try:
            with _switches(v):
                p = _prepare_checked(v, built, case, ids, settings, device, row, ref, outputs)
            if p is None:
                continue
            prepared[v] = p
        except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the others
            row.update(status="error", error=timing.one_line(exc))
            _free(device)
    if "eager" in outputs:  # the same input through every variant: how far each lands from eager's logits
        for v, out in outputs.items():
            rows[v]["logits_vs_eager"] = rel_error(out, outputs["eager"])
    if not prepared:
        return
    progress(f"{case.label}: timing {len(prepared)} variants in {settings.rounds} rounds")
    _time_case(case, prepared, rows, settings, device, progress, copy_gbps)


@contextlib.contextmanager
def _switches(variant: str):
    """The module settings a variant is built under (its plans and captured graphs keep them)."""
    from torch._inductor import config as inductor

    from mlpfuse.kernels import decode_mlp, fp8_gemm
    from mlpfuse.ops import fp8_mlp

    kept = (decode_mlp.PDL, inductor.triton.enable_pdl, fp8_mlp.NORM_IN_WEIGHT_ONLY, fp8_mlp.DECODE_KERNEL,
            decode_mlp.BALANCED_ROWS, fp8_gemm.PDL)
    decode_mlp.PDL = kept[0] and "nopdl" not in variant
    fp8_gemm.PDL = kept[5] or variant == "mlpfuse-fp8-pdl"
    inductor.triton.enable_pdl = kept[1] or variant.endswith("compile-pdl")
    fp8_mlp.NORM_IN_WEIGHT_ONLY = kept[2] and variant != "mlpfuse-fp8-nonorm"
    fp8_mlp.DECODE_KERNEL = kept[3] or variant == "mlpfuse-fp8-onekernel"
    decode_mlp.BALANCED_ROWS = kept[4] or variant.endswith("balanced")
    try:
        yield
    finally:
        (decode_mlp.PDL, inductor.triton.enable_pdl, fp8_mlp.NORM_IN_WEIGHT_ONLY, fp8_mlp.DECODE_KERNEL,
         decode_mlp.BALANCED_ROWS, fp8_gemm.PDL) = kept


def _prepare_checked(v, built, case, ids, settings, device, row, ref, outputs) -> Prepared | None:
    """The variant built, its first call timed, its logits checked and its steps warmed up; None if its logits are
    not finite (the row says so)."""
    p = prepare(v, built, case, ids, settings, device)
    if v.startswith("mlpfuse"):
        from mlpfuse.patching import PatchedBlock

        row["patched"] = sum(1 for m in p.module.modules() if isinstance(m, PatchedBlock))
    row["error"] = p.note
    _, row["first_call_ms"] = timing.first_call_ms(p.main_step, device)
    if p.setup_ms is not None:
        row["first_call_ms"] = p.setup_ms
    if case.mode == "decode" and "compile" in v and not hasattr(p.module, "_compiled_call"):
        raise RuntimeError("generate did not compile the decode step (transformers' criteria not met)")
    out = p.logits()
    row["rel_err"] = rel_error(out, ref)
    if row["rel_err"] == float("inf"):
        row.update(status="wrong", error="non-finite logits")
        return None
    outputs[v] = out.detach().double()
    for _ in range(settings.warmup):
        for step in p.steps.values():
            step()
    row["peak_mem_mb"] = _peak_mb(p, device)
    return p


def _peak_mb(p: Prepared, device) -> float | None:
    """CUDA: the allocator's peak during the main step, above what was allocated before it."""
    if device.type != "cuda":
        return None
    p.module.zero_grad(set_to_none=True)  # the peak above the weights: a train step's gradients count
    timing.sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    p.main_step()
    timing.sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _put(row: dict, field: str, stat: timing.Stat, scale: float = 1e-3) -> None:
    """A timing's median, spread and every round's value into `field`, `field`'s spread and rounds (ms)."""
    base = field[:-3] if field.endswith("_ms") else field
    spread_key = "spread_pct" if field == "time_ms" else f"{base}_spread_pct"
    row[field], row[spread_key] = stat.median_us * scale, abs(stat.spread_pct)
    row["time_rounds_ms" if field == "time_ms" else f"{base}_rounds_ms"] = [v * scale for v in stat.rounds_us]


def _time_case(case, prepared, rows, settings, device, progress, copy_gbps=None) -> None:
    cuda = device.type == "cuda"
    steps = {key: step for p in prepared.values() for key, step in p.steps.items()}
    # Decode: wall time only (generate synchronizes every token), and at least 3 generate calls per round, whose
    # mean is the round's figure: a single call per round left the host's noise in (±50–70 % on a busy host).
    decode = case.mode == "decode"
    gpu, wall, errors = timing.interleaved(steps, device, rounds=settings.rounds, target_ms=settings.target_ms,
                                           reps_bounds=(3, 50) if decode else (1, 50), gpu_clock=not decode)
    timed = {}
    for v, p in prepared.items():
        row = rows[v]
        failed = [errors[k] for k in p.steps if k in errors]
        if failed:
            row.update(status="error", error=failed[0])
            continue
        timed[v] = p
        if decode:
            # Per round: the two generate calls of that round, so a slow round cancels in the difference.
            k1, kn = list(p.steps)
            per_token = [(long - short) / settings.new_tokens
                         for short, long in zip(wall[k1].rounds_us, wall[kn].rounds_us)]
            _put(row, "time_ms", timing.Stat.of_rounds(per_token, len(per_token)))
            row["wall_ms"] = row["time_ms"]
            continue
        key = p.main_key
        _put(row, "time_ms", gpu.get(key) or wall[key])
        row["wall_ms"] = wall[key].median_us / 1e3
        if p.floor_bytes is not None and copy_gbps:
            row["floor_mb"] = p.floor_bytes / 2**20
            row["floor_ms"] = p.floor_bytes / (copy_gbps * 1e9) * 1e3
            row["of_floor"] = row["floor_ms"] / row["time_ms"] if row["time_ms"] else None
        full = f"{v}|full"
        if full in p.steps:
            _put(row, "full_logits_ms", gpu.get(full) or wall[full])
    if cuda and timed and case.mode == "decode-step":
        progress(f"{case.label}: the same replays under triton.testing.do_bench, {settings.rounds} rounds")
        for v, stat in decode_step.do_bench_rounds({v: p.main_step for v, p in timed.items()},
                                                   settings.rounds).items():
            _put(rows[v], "do_bench_ms", stat)
    if cuda and timed and decode:
        progress(f"{case.label}: GPU busy time per token, profiled, {settings.rounds} rounds")
        for v, stat in _busy_per_token(timed, settings).items():
            _put(rows[v], "gpu_busy_ms", stat)


def _busy_per_token(prepared: dict[str, Prepared], settings) -> dict[str, timing.Stat]:
    """GPU busy µs per generated token, (busy(N+1 tokens) − busy(1)) / N from one profiled generate call each,
    per round, the variants interleaved: what the GPU itself spends per token, beside the host's wall time."""
    from mlpfuse.profiling import profile

    def busy(step) -> float:
        return profile(step, steps=1, wait=0, warmup=0, active=1, record_shapes=False,
                       threads=None).per_step["gpu_busy_us"]  # GPU time; the host's threads stay the lab's

    values: dict[str, list[float]] = {v: [] for v in prepared}
    for _ in range(settings.rounds):
        for v, p in prepared.items():
            k1, kn = list(p.steps)
            short, long = busy(p.steps[k1]), busy(p.steps[kn])
            values[v].append((long - short) / settings.new_tokens)
    return {v: timing.Stat.of_rounds(vals, len(vals)) for v, vals in values.items()}


def _paired(rounds: list | None, base: list | None) -> list[float]:
    """Each round's time over the base's in the same round (the variants take turns within a round, so a host that
    slows down for a while slows both sides of a pair); empty unless both have every round."""
    if not rounds or not base or len(rounds) != len(base) or not all(base):
        return []
    return [a / b for a, b in zip(rounds, base)]


def _derive(rows: list[dict]) -> None:
    by = {r["variant"]: r for r in rows}
    eager, compiled = by.get("eager"), by.get("compile")
    for r in rows:
        if r["status"] != "ok":
            continue
        if eager and eager["status"] == "ok":
            if eager["time_ms"] and r["time_ms"] is not None:
                r["vs_eager"] = r["time_ms"] / eager["time_ms"]
                paired = _paired(r["time_rounds_ms"], eager["time_rounds_ms"])
                if paired:
                    r["vs_eager_paired"] = statistics.median(paired)
                    r["vs_eager_paired_range"] = [min(paired), max(paired)]
            if eager["rel_err"] and r["rel_err"] is not None:
                r["err_vs_eager"] = r["rel_err"] / eager["rel_err"]
            if eager["peak_mem_mb"] and r["peak_mem_mb"] is not None:
                r["mem_vs_eager"] = r["peak_mem_mb"] / eager["peak_mem_mb"]
        if compiled and compiled["status"] == "ok" and compiled["time_ms"] and r["time_ms"] is not None:
            r["vs_compile"] = r["time_ms"] / compiled["time_ms"]
            if compiled["peak_mem_mb"] and r["peak_mem_mb"] is not None:
                r["mem_vs_compile"] = r["peak_mem_mb"] / compiled["peak_mem_mb"]

