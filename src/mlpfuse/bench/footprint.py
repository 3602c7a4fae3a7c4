"""Will a model fit? The model lab's memory estimate, made before anything is allocated.

A 32-layer Llama-3-8B built in fp32 is 32 GB: on a machine with less, building it takes a minute and ends in the
allocator's traceback. Here the model is built on the meta device instead (exact parameter count, no memory) and
its run is estimated:

    weights      parameters × 4 bytes (the lab builds in fp32 for the reference logits, then casts in place)
    gradients    parameters × dtype bytes, in train mode
    activations  train: what each layer keeps for the backward, B·S·(12·hidden + 4·intermediate) × dtype bytes per
                 layer, and the logits (B·S·vocab in fp32, three times: logits, their softmax, the gradient);
                 prefill and decode: one layer's live tensors, B·S·(4·hidden + 3·intermediate) × 4 bytes (the fp32
                 reference pass), the attention scores B·heads·S² × 4 bytes, the last position's logits

against what this process can get: free GPU memory on CUDA; on a CPU the smallest of the kernel's MemAvailable,
the address-space limit (`ulimit -v`) less what the process already maps, and the cgroup's memory limit less its
use. The estimate is coarse (within tens of percent; weights dominate large models) and is meant to refuse the
runs that cannot work, not to promise that the others do.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from mlpfuse.bench import models
from mlpfuse.errors import InputError

_GB = 1e9


@dataclass
class Estimate:
    parameters: int
    parts: dict  # what -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _size(config, *keys, default=None):
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def estimate(model: torch.nn.Module, shapes: list[tuple[int, int]], modes: list[str], dtype: torch.dtype) -> Estimate:
    """The largest footprint over `modes` × `shapes` of the lab running `model` (a meta-device model) in `dtype`."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    hidden = _size(cfg, "hidden_size", "n_embd", "d_model", default=1)
    inter = _size(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    heads = _size(cfg, "num_attention_heads", "n_head", default=1)
    layers = _size(cfg, "num_hidden_layers", "n_layer", "num_layers", default=1)
    vocab = _size(cfg, "vocab_size", default=1)
    width = torch.finfo(dtype).bits // 8
    worst: dict = {}
    for mode in modes:
        for b, s in shapes:
            tokens = b * s
            if mode == "train":
                parts = {"gradients": params * width,
                         "activations": layers * tokens * (12 * hidden + 4 * inter) * width + 3 * tokens * vocab * 4}
            else:
                parts = {"activations": tokens * (4 * hidden + 3 * inter) * 4 + b * heads * s * s * 4 + b * vocab * 4}
            if sum(parts.values()) > sum(worst.values()):
                worst = parts
    return Estimate(params, {"weights": params * 4, **worst})


def available(device: torch.device) -> tuple[int, str]:
    """(bytes this process can still allocate on `device`, where that figure comes from)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, "free GPU memory"
    found = [(v, why) for v, why in (_mem_available(), _address_space_left(), _cgroup_left()) if v is not None]
    if not found:
        return 1 << 62, "unknown"
    return min(found)


def _mem_available():
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM"
    except (ValueError, OSError, AttributeError):
        return None, ""


def _address_space_left():
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None, ""
    mapped = 0
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - mapped, 0), "the address-space limit (ulimit -v) less what is mapped"


def _cgroup_left():
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        if limit == "max":
            return None, ""
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read().strip())
        return max(int(limit) - used, 0), "the cgroup's memory limit less its use"
    except (OSError, ValueError):
        return None, ""


def check(name: str, *, layers: int | None, tiny: bool, shapes: list[tuple[int, int]], modes: list[str],
          dtype: torch.dtype, device: torch.device) -> Estimate:
    """Refuse, in one line with the estimate, a run whose model and activations cannot fit `device`."""
    model = models.shape_only(name, layers=layers, tiny=tiny)
    need = estimate(model, shapes, modes, dtype)
    have, source = available(device)
    if need.total > have:
        parts = ", ".join(f"{what} {size / _GB:.1f}" for what, size in need.parts.items())
        n = _size(model.config, "num_hidden_layers", "n_layer", "num_layers")
        fewer = f"fewer --layers (this build has {n}), " if n and n > 1 else ""
        raise InputError(f"--model {name}: needs about {need.total / _GB:.1f} GB ({need.parameters / 1e9:.2f} B "
                         f"parameters; GB: {parts}) but {have / _GB:.1f} GB are free on {device.type} ({source}); "
                         f"try {fewer}--tiny or smaller --tokens")
    return need
