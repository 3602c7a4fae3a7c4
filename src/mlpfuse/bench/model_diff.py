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
                  by_module: bool = False) -> ModelDiff:
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

    def forward(x):
        with torch.no_grad():
            return model_lab._forward_last(model, x, kind)

    label = f"{built.label} {batch}x{seq} {str(torch_dtype).replace('torch.', '')}"
    traces = {}
    for side in ("eager", "mlpfuse"):
        if side == "mlpfuse":
            report = patch(model, backend=backend)
            if not report.changed:
                raise InputError(f"--model: mlpfuse.patch swapped nothing in {built.label}: {report.summary()}")
        path = os.path.join(out, f"model-{side}.pt.trace.json.gz") if out else None
        traces[side] = profile(forward, ids, steps=steps, wait=wait, warmup=warmup, active=active,
                               label=f"model-{side}", trace_path=path, threads=None,  # the caller pins them
                               modules=model if by_module else None)
    return ModelDiff(label, traces["eager"], traces["mlpfuse"], diff(traces["eager"], traces["mlpfuse"]), report)
