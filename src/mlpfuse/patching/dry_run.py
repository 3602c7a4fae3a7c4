"""What `mlpfuse.patch` would do to a model, from its folder's config.json alone: no weights read or allocated.

The model is built twice: on the meta device at the config's sizes (shapes only, no memory), and on the CPU from
a copy of the config at a small width (mlpfuse.patching.tiny) with the same layer pattern, where `patch` runs for
real, each block verified on numbers. Module paths are the same in both, so the report of the small copy is the
report of the real model, and the meta model gives each swapped block's real sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from mlpfuse.errors import InputError
from mlpfuse.patching import folder as model_folder
from mlpfuse.patching import structure, tiny
from mlpfuse.patching.report import Left, PatchReport
from mlpfuse.patching.swap import patch
from mlpfuse.patching.verify import one_line


@dataclass
class DryRun:
    folder: str
    model_type: str
    model_class: str
    parameters: int  # of the real-size model
    report: PatchReport  # of the small copy: paths, layouts, reasons
    sizes: dict[str, str]  # swapped path -> "4096 x 14336" at the real size

    def lines(self) -> list[str]:
        r = self.report
        head = (f"mlpfuse patch --dry-run {self.folder}: {self.model_type} ({self.model_class}), "
                f"{_count(self.parameters)} parameters on the meta device; each block verified on a copy "
                f"{tiny.WIDTH} wide, backend {r.backend!r}")
        if not r.swapped and not r.left:
            return [head, "would swap nothing: no MLP block mlpfuse recognises"]
        return [head, f"would swap {len(r.swapped)}, leave {len(r.left)}", *r.group_lines(self.sizes)]

    def to_dict(self) -> dict:
        return {"folder": self.folder, "model_type": self.model_type, "model_class": self.model_class,
                "parameters": self.parameters, "verified_width": tiny.WIDTH, "sizes": self.sizes,
                **self.report.to_dict()}


def dry_run(folder: str, backend: str = "auto") -> DryRun:
    """The report `mlpfuse.patch(model, backend)` would give for the model in `folder`, without its weights."""
    transformers = _transformers()
    config = model_folder.load_config(folder, "MODEL_DIR", transformers)
    model_class = _model_class(config, transformers)
    try:
        with torch.device("meta"):
            real = model_class(config)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses in this config is bad input here
        raise InputError(f"config.json: transformers cannot build {model_class.__name__} from it: "
                         f"{one_line(exc)}") from None
    try:
        small_config = type(config).from_dict(tiny.shrink(config.to_dict()))
        with torch.random.fork_rng(devices=[]):  # the random init leaves the caller's random state as it was
            torch.manual_seed(0)
            small = model_class(small_config).eval()
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"config.json: a {tiny.WIDTH}-wide copy of it does not build ({one_line(exc)}); "
                         f"nothing could be verified") from None
    report = patch(small, backend)
    report.model = type(real).__name__
    report.left = [_at_real_size(real, item) for item in report.left]
    sizes = {s.path: _size(real, s.path) for s in report.swapped}
    return DryRun(folder, config.model_type, model_class.__name__, sum(p.numel() for p in real.parameters()),
                  report, sizes)


def _count(n: int) -> str:
    """A parameter count as model cards write it: 8.03 B, 124.44 M, 20.54 K, 96."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise InputError("patch --dry-run reads transformers configs: pip install 'mlpfuse[models]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _model_class(config, transformers) -> type:
    """The config's first architecture transformers has, else the base model of its type."""
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(config.model_type)
    name = name[0] if isinstance(name, (list, tuple)) else name
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise InputError(f"config.json: transformers {transformers.__version__} has no model class for "
                         f"{config.model_type!r} (architectures {getattr(config, 'architectures', None)})")
    return cls


def _at_real_size(real: nn.Module, item: Left) -> Left:
    """A mixture of experts' reason with the real expert weights' shapes, not the small copy's."""
    head, found, _ = item.reason.partition("grouped expert weights")
    if not found:
        return item
    try:
        text = structure.grouped_parameters(real.get_submodule(item.path))
    except AttributeError:
        return item
    return Left(item.path, item.source, head + text) if text else item


def _size(real: nn.Module, path: str) -> str:
    """dim x hidden of the real module at `path`: its first projection's inputs, its last one's."""
    try:
        module = real.get_submodule(path)
    except AttributeError:
        return "not in the real-size model"
    projs = [p for p in (structure.projection(n, c) for n, c in module.named_children()) if p is not None]
    if not projs:
        return ""
    hidden = projs[-1].d_in if len(projs) > 1 else projs[0].d_out
    return f"{projs[0].d_in} x {hidden}"

