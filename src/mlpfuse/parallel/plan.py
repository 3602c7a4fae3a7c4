"""Tensor-parallel plans for mlpfuse's MLP blocks, built from PyTorch's own ParallelStyles.

Megatron's split: the first projections (gate and up, or fc1) column-parallel, the last (down, or fc2)
row-parallel, so that each rank computes a slice of the hidden activation with no communication inside the block
and the ranks' partial outputs are summed once at its end.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mlpfuse.errors import InputError
from mlpfuse.parallel.sharded import PACKED


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a packed [gate; up] projection ([2·hidden, dim], gate rows first, as in Phi-3's
    gate_up_proj): each rank gets its slice of the gate rows and the matching slice of the up rows, held locally as
    one [2·hidden/n, dim] tensor. A plain Shard(0) would give rank 0 of 2 the gate rows and rank 1 the up rows.

    The parameters are DTensors with a `_StridedShard(0, split_factor=2)` placement, which describes exactly that
    layout: `full_tensor()`, state_dict and redistribution see the original [gate; up] order.
    """

    def _partition_linear_fn(self, name, module, device_mesh):
        n = device_mesh.size()
        rows = module.weight.shape[0]
        if rows % (2 * n):
            raise InputError(f"device_mesh: {n} ranks do not divide the {rows // 2} gate (and up) rows of the packed "
                             f"projection{' ' + name if name else ''} evenly")
        for key, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param, device_mesh, list(PACKED), src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(shard, requires_grad=param.requires_grad))


def _block_kind(module: nn.Module) -> Optional[str]:
    from mlpfuse.modules import MLP, GatedMLP, PackedGatedMLP

    if isinstance(module, PackedGatedMLP):
        return "packed"
    if isinstance(module, GatedMLP):
        return "gated"
    if isinstance(module, MLP):
        return "mlp"
    return None


def block_plan(kind: str, activations: Placement) -> dict[str, object]:
    """The ParallelStyles of one block, keyed by child name; `activations` is the layout of the block's input and
    output on each rank (Replicate(), or Shard(d) for sequence parallelism)."""
    first = {"input_layouts": activations}
    last = {"output_layouts": activations}
    if kind == "gated":
        return {"gate_proj": ColwiseParallel(**first), "up_proj": ColwiseParallel(**first),
                "down_proj": RowwiseParallel(**last)}
    if kind == "packed":
        return {"gate_up_proj": PackedColwiseParallel(**first), "down_proj": RowwiseParallel(**last)}
    return {"fc1": ColwiseParallel(**first), "fc2": RowwiseParallel(**last)}


def tensor_parallel(module: nn.Module, device_mesh, *, sequence_dim: Optional[int] = None) -> nn.Module:
    """Shard every mlpfuse MLP block in `module` (GatedMLP, PackedGatedMLP, MLP; the module itself included) over
    the ranks of a 1-D `device_mesh`, in place, and return `module`.

    gate and up (or fc1) become column-parallel, down (or fc2) row-parallel (`parallelize_module` with
    ColwiseParallel / RowwiseParallel; PackedColwiseParallel for a packed gate_up_proj). Each rank then runs the
    fused kernels on its slice of the hidden dimension and the block ends in one all-reduce. sequence_dim: the
    blocks' inputs and outputs are sharded along this dimension on each rank (sequence parallelism): one all-gather
    at the block's start and a reduce-scatter at its end instead of the all-reduce.
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise InputError(f"device_mesh: expected a torch.distributed DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise InputError(f"device_mesh: expected a 1-D mesh of the tensor-parallel ranks, got a {device_mesh.ndim}-D "
                         f"one; pass its tensor-parallel dimension (e.g. mesh['tp'])")
    if sequence_dim is not None and (isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int)):
        raise InputError(f"sequence_dim: expected None or an int, got {sequence_dim!r}")
    n = device_mesh.size()
    activations = Replicate() if sequence_dim is None else Shard(sequence_dim)
    plan: dict[str, object] = {}
    for name, block in module.named_modules():
        kind = _block_kind(block)
        if kind is None:
            continue
        where = f"{name or type(block).__name__} ({type(block).__name__})"
        if any(isinstance(p, DTensor) for p in block.parameters()):
            raise InputError(f"module: {where} already has DTensor parameters; apply tensor_parallel once, to "
                             f"plain modules")
        if block.hidden % n:
            raise InputError(f"device_mesh: {n} ranks do not divide the hidden size {block.hidden} of {where}; each "
                             f"rank must hold an equal slice of it")
        for child, style in block_plan(kind, activations).items():
            plan[f"{name}.{child}" if name else child] = style
    if not plan:
        raise InputError(f"module: no mlpfuse GatedMLP, PackedGatedMLP or MLP in {type(module).__name__}; convert "
                         f"its MLPs first (GatedMLP.from_module, MLP.from_module)")
    parallelize_module(module, device_mesh, plan)
    return module

