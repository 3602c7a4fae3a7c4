"""Every model type transformers has installed, built tiny from its config class's defaults (mlpfuse.patching.tiny,
2 layers, random init, fp32, CPU), patched on the torch backend: what was swapped per layout, what was left and
why, and whether the patched model's outputs equal the unpatched model's and unpatching restores them exactly.

Each family that patches in fp32 is built again in fp16 and in bf16 and patched there: the same modules must be
swapped with the same activations (a decision that does not depend on the dtype), a float64 copy of the patched
model must compute what a float64 copy of the unpatched one computes (MATH_TOLERANCE: the math, not the rounding),
and the patched model's own output may be no further from that float64 result than the rounding bound allows
(twice the unpatched model's own error plus the dtype's epsilon).

`TABLE` collects one line per family; conftest prints it at the end of the run, whatever pytest's capture.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import inspect
import math
import multiprocessing
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

import mlpfuse
from mlpfuse.patching import PatchedBlock
from mlpfuse.patching.tiny import shrink

TABLE: list[str] = []
MAX_PARAMETERS = 3_000_000  # a config the key names did not shrink (its own size keys): skipped, not built
# Outputs of the patched model against the unpatched one: relative error (norm-wise) within this many fp32 epsilons.
# The fused block sums in another order (one GEMM over gate|up, F.gelu's tanh form against transformers' formula
# op by op); each layer adds rounding of a few ulps, amplified at most by the layers after it.
EPS_BUDGET = 256
TOLERANCE = EPS_BUDGET * torch.finfo(torch.float32).eps
# Patched against unpatched, both in float64: a different function (QuickGELU read as the tanh GELU moved CLIP's
# output by 6e-2) is far above; float64 rounding, amplified through layers that round some steps in float32 inside
# (softmax, rotary tables), far below.
MATH_TOLERANCE = 1e-6
LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Row:
    family: str
    status: str = ""  # "patched", "nothing to patch", "skipped: why", "MISMATCH: what"
    swapped: collections.Counter = field(default_factory=collections.Counter)  # "gated/name" -> count
    left: collections.Counter = field(default_factory=collections.Counter)  # "Class: reason" -> count
    error: float = 0.0
    seconds: float = 0.0

    def line(self) -> str:
        swapped = ", ".join(f"{k} {n}" for k, n in sorted(self.swapped.items())) or "-"
        left = "; ".join(f"{k} [{n}x]" for k, n in sorted(self.left.items())) or "-"
        err = f" err {self.error:.1e}" if self.swapped else ""
        return f"{self.family:34s} {self.status:16s} swapped: {swapped}{err} | left: {left}"


def model_types() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return [(t, c if isinstance(c, str) else c[0]) for t, c in MODEL_MAPPING_NAMES.items()]


def build(model_type: str, class_name: str):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class = getattr(transformers, class_name)
    if model_class.main_input_name not in ("input_ids", "pixel_values"):
        raise _Skip("takes no token ids or images")
    config_class = CONFIG_MAPPING[model_type]
    config = config_class.from_dict(shrink(config_class().to_dict(), layers=2))
    with torch.device("meta"):
        size = sum(p.numel() for p in model_class(config).parameters())
    if size > MAX_PARAMETERS:
        raise _Skip(f"{size / 1e6:.0f} M parameters after shrinking")
    torch.manual_seed(0)
    return model_class(config).eval()


class _Skip(Exception):
    pass


def _input_sets(model) -> list[dict]:
    """Inputs to try, in order: token ids (with decoder ids for an encoder-decoder), images, both."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or 64
    g = torch.Generator().manual_seed(1)
    params = inspect.signature(model.forward).parameters
    ids = {"input_ids": torch.randint(3, max(4, min(vocab, 200) - 8), (2, 7), generator=g)}
    if "decoder_input_ids" in params:
        ids["decoder_input_ids"] = torch.randint(3, max(4, min(vocab, 200) - 8), (2, 5), generator=g)
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(vision, "num_channels", 3)
    pixels = {}
    if "pixel_values" in params and isinstance(size, int) and isinstance(channels, int):
        pixels = {"pixel_values": torch.randn(2, channels, size, size, generator=g)}
    sets = []
    if "input_ids" in params:
        sets.append(ids)
    if pixels:
        sets += [pixels, ids | pixels] if "input_ids" in params else [pixels]
    return sets


def _tensors(out) -> list[torch.Tensor]:
    """Every floating-point tensor of a model output (last hidden state, logits, pooled, embeddings...)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [t for v in values for t in _tensors(v)]


def _run(model, inputs, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    if dtype is not None:  # images in the model's dtype; token ids as they are
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        return _tensors(model(**inputs))


def _relative_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
        return math.inf
    worst = 0.0
    for a, b in zip(got, expected):
        ref = b.double()
        worst = max(worst, (torch.linalg.vector_norm(a.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(
            1e-30)).item())
    return worst


def sweep_one(model_type: str, class_name: str) -> Row:
    row = Row(model_type)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _sweep(row, model_type, class_name)
    except _Skip as why:
        row.status = f"skipped: {why}"
    finally:
        row.seconds = time.perf_counter() - start
    return row


def _sweep(row: Row, model_type: str, class_name: str) -> None:
    try:
        model = build(model_type, class_name)
    except _Skip:
        raise
    except Exception as exc:  # noqa: BLE001 - a config the shrinking breaks, a model that needs more to build
        raise _Skip(f"does not build tiny ({type(exc).__name__})") from None
    expected = inputs = None
    for candidate in _input_sets(model):
        try:
            expected = _run(model, candidate)
            inputs = candidate
            break
        except Exception:  # noqa: BLE001 - inputs this model does not take alone
            continue
    if inputs is None or not expected:
        raise _Skip("runs on no token ids or images alone")
    again = _run(model, inputs)
    if len(again) != len(expected) or not all(torch.equal(a, b) for a, b in zip(again, expected)):
        raise _Skip("its eval forward is random (masking, sampling)")
    types = [type(m) for m in model.modules()]
    report = mlpfuse.patch(model, backend="torch")
    for s in report.swapped:
        row.swapped[f"{s.layout}/{s.matched}"] += 1
    for item in report.left:
        row.left[f"{item.source}: {item.reason}"] += 1
    if not report.swapped:
        row.status = "nothing to patch"
        return
    blocks = sum(isinstance(m, PatchedBlock) for m in model.modules())
    got = _run(model, inputs)
    row.error = _relative_error(got, expected)
    restored = mlpfuse.unpatch(model)
    back = _run(model, inputs)
    problems = []
    if blocks != len(report.swapped) or len(restored) != blocks:
        problems.append(f"{blocks} blocks in the model, {len(report.swapped)} reported, {len(restored)} restored")
    if not row.error <= TOLERANCE:
        problems.append(f"outputs differ (relative error {row.error:.2g} > {TOLERANCE:.2g})")
    if [type(m) for m in model.modules()] != types:
        problems.append("unpatch did not restore the module types")
    if len(back) != len(expected) or not all(torch.equal(a, b) for a, b in zip(back, expected)):
        problems.append("unpatched outputs are not the original's exactly")
    decided = _decisions(report)
    for dtype in LOW_DTYPES if not problems else ():
        problems += _in_dtype(model_type, class_name, inputs, dtype, decided)
    row.status = "MISMATCH: " + "; ".join(problems) if problems else "patched"


def _decisions(report) -> list[tuple[str, str, str]]:
    return sorted((s.path, s.layout, s.activation) for s in report.swapped)


def _in_dtype(model_type: str, class_name: str, inputs: dict, dtype: torch.dtype, decided: list) -> list[str]:
    """The fp32 decisions and outputs held against the same family built in `dtype` (see the module's doc)."""
    name = str(dtype).removeprefix("torch.")
    model = build(model_type, class_name).to(dtype)
    exact = copy.deepcopy(model).double()
    try:
        reference = _run(exact, inputs, torch.float64)
    except Exception as exc:  # noqa: BLE001 - a model that cannot run in float64 is checked in its dtype only
        return [] if _decisions(mlpfuse.patch(model, backend="torch")) == decided else [
            f"{name}: swaps differ from fp32's (and float64 fails: {type(exc).__name__})"]
    try:
        own = _relative_error(_run(model, inputs, dtype), reference)
    except Exception as exc:  # noqa: BLE001 - a family that does not run in this dtype on a CPU
        return [] if _decisions(mlpfuse.patch(model, backend="torch")) == decided else [
            f"{name}: swaps differ from fp32's (and {name} does not run: {type(exc).__name__})"]
    report = mlpfuse.patch(model, backend="torch")
    if _decisions(report) != decided:
        return [f"{name}: swaps differ from fp32's: {_decisions(report)}"]
    problems = []
    math_error = _relative_error(_run(copy.deepcopy(model).double(), inputs, torch.float64), reference)
    if not math_error <= MATH_TOLERANCE:
        problems.append(f"{name}: the patched model in float64 differs (relative error {math_error:.2g})")
    error = _relative_error(_run(model, inputs, dtype), reference)
    bound = 2 * own + torch.finfo(dtype).eps
    if not error <= bound:
        problems.append(f"{name}: error against float64 {error:.2g} over {bound:.2g} (unpatched {own:.2g})")
    return problems


def _worker_setup() -> None:
    import transformers

    torch.set_num_threads(1)  # tiny ops: one thread each, one worker per core
    transformers.logging.set_verbosity_error()


def _sweep_pair(pair: tuple[str, str]) -> Row:
    return sweep_one(*pair)


def sweep(workers: int | None = None) -> list[Row]:
    """All families, spread over worker processes (one per core, at most 4): most of the time goes to importing
    each family's modeling file, which a single process does one after the other."""
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    pairs = model_types()
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads of the parent's torch to fork
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_setup) as pool:
        rows = list(pool.map(_sweep_pair, pairs, chunksize=4))
    TABLE.clear()
    TABLE.extend(table_lines(rows))
    return rows


def table_lines(rows: list[Row]) -> list[str]:
    patched = [r for r in rows if r.status == "patched"]
    lines = [r.line() for r in rows if not r.status.startswith("skipped")]
    skipped = collections.Counter(r.status for r in rows if r.status.startswith("skipped"))
    per_layout = collections.Counter()
    for r in patched:
        per_layout.update(r.swapped)
    lines.append(f"families patched with equal outputs: {len(patched)}; modules swapped per layout: "
                 + ", ".join(f"{k} {n}" for k, n in sorted(per_layout.items())))
    lines.append("families skipped: " + "; ".join(f"{k.removeprefix('skipped: ')} ({n})" for k, n in
                                                  skipped.most_common()))
    return lines
