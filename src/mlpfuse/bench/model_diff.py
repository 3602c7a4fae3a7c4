"""One layer of a transformers model, profiled before and after `mlpfuse.patch`: the two analyses and their diff, in
the walkthrough's trace language (kernels and launches per step, the CPU op that launched each kernel).

The model is built with one decoder layer (embedding, one layer, head): what changes between the two traces is that
layer's MLP; attention, norms and the head run the same kernels on both sides and show as unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mlpfuse import _outputs
from mlpfuse.bench import footprint, models
from mlpfuse.errors import InputError


@dataclass
class ModelDiff:
    label: str  # what was profiled, for titles
    before: object  # profiling.Analysis
    after: object
    diff: object  # profiling.Diff
    report: object  # patching.PatchReport


def defaults(device: str) -> tuple[bool, str]:
    """(tiny, tokens) when not given: the published widths at 2048 tokens on a GPU, toy widths on a CPU."""
    return (False, "1x2048") if device.startswith("cuda") else (True, "1x64")


def profile_model(name: str, *, layers: int = 1, tiny: bool | None = None, tokens: str | None = None,
                  device: str | None = None, dtype: str | None = None, out: str | None = None, steps: int = 5,
                  wait: int = 1, warmup: int = 1, active: int = 3, backend: str = "auto",
                  by_module: bool = False, decode_step: bool = False) -> ModelDiff:
    """`decode_step`: profile one decode step with a static cache after the prompt (bench.decode_step) instead of the
    prompt's forward; on CUDA the step is captured in a CUDA graph and its replays are profiled, each side's kernels
    attributed to modules through a map of its eager step (`<trace>.map.json` beside the trace)."""
    from mlpfuse import workloads
    from mlpfuse.patching import patch
    from mlpfuse.bench import model_lab
    from mlpfuse.profiling import diff, profile

    device = workloads.resolve_device(device)
    torch_dtype = workloads.resolve_dtype(dtype, device)
    tiny_default, tokens_default = defaults(device)
    tiny = tiny_default if tiny is None and isinstance(models.resolve(name), models.ModelSpec) else bool(tiny)
    shapes = model_lab.parse_shapes(tokens or tokens_default, ())
    if len(shapes) != 1:
        raise InputError(f"--tokens: expected one BATCHxSEQ shape for a profile, got {tokens!r}")
    (batch, seq), = shapes
    if out is not None:
        _outputs.make_folder(out, "--out")
    footprint.check(name, layers=layers, tiny=tiny, shapes=shapes, modes=["prefill"], dtype=torch_dtype,
                    device=torch.device(device))
    built = models.build(name, layers=layers, tiny=tiny, device=torch.device(device), dtype=torch_dtype)
    if built.max_positions is not None and seq > built.max_positions:
        raise InputError(f"--tokens: {seq} positions but the model has {built.max_positions} position embeddings")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, built.vocab, (batch, seq), generator=gen).to(device)
    model, kind = built.model, built.kind
    if decode_step and kind != models.CAUSAL:
        raise InputError(f"--decode-step: needs a causal language model; {built.label} has no decode step")
    token = torch.randint(3, built.vocab, (batch, 1), generator=gen).to(device)

    def forward(x):
        with torch.no_grad():
            return model_lab._forward_last(model, x, kind)

    label = (f"{built.label} {batch}x{seq} {str(torch_dtype).replace('torch.', '')}"
             + (" decode step" if decode_step else ""))
    schedule = dict(steps=steps, wait=wait, warmup=warmup, active=active, threads=None)  # the caller pins threads
    traces = {}
    for side in ("eager", "mlpfuse"):
        if side == "mlpfuse":
            report = patch(model, backend=backend)
            if not report.changed:
                raise InputError(f"--model: mlpfuse.patch swapped nothing in {built.label}: {report.summary()}")
        path = os.path.join(out, f"model-{side}.pt.trace.json.gz") if out else None
        if decode_step:
            traces[side] = _profile_step(model, ids, token, path, torch.device(device), f"model-{side}", schedule)
        else:
            traces[side] = profile(forward, ids, label=f"model-{side}", trace_path=path,
                                   modules=model if by_module else None, **schedule)
    return ModelDiff(label, traces["eager"], traces["mlpfuse"], diff(traces["eager"], traces["mlpfuse"]), report)


def _profile_step(model, ids, token, path, device: torch.device, label: str, schedule: dict):
    """One decode step's analysis by module: on CUDA its replays from a CUDA graph, attributed through the map of
    the eager step written beside the trace; elsewhere the eager step with its modules annotated."""
    import tempfile

    from mlpfuse.bench import decode_step
    from mlpfuse.profiling import modules, profile, record_graph_map

    step = decode_step.inference(decode_step.StaticStep(model, ids, token))
    if device.type != "cuda":
        return profile(step, label=label, trace_path=path, modules=model, **schedule)
    for _ in range(3):  # cuBLAS and autotuning settle before the map is taken
        step()
    with tempfile.TemporaryDirectory(prefix="mlpfuse-map-") as folder:
        graph_map = modules.map_path(path) if path else os.path.join(folder, "step.map.json")
        record_graph_map(step, model, graph_map)
        replay, _ = decode_step.capture(step, device)
        return profile(replay, label=label, trace_path=path, graph_map=graph_map, **schedule)
