"""Tensor-parallel plans for mlpfuse's MLP blocks, built from PyTorch's own ParallelStyles.

Megatron's split: the first projections (gate and up, or fc1) column-parallel, the last (down, or fc2)
row-parallel, so that each rank computes a slice of the hidden activation with no communication inside the block
and the ranks' partial outputs are summed once at its end.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mlpfuse.errors import InputError
from mlpfuse.ops.reduce_overlap import REDUCES
from mlpfuse.ops.sharded import PACKED


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
        module.register_state_dict_post_hook(_refuse_resharded_packed)


def _refuse_resharded_packed(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
    """A packed projection sharded again on a second mesh dimension (FSDP2 over tensor parallelism with more than one
    data-parallel rank) computes right, but PyTorch composes the two shards as if the tensor-parallel one were a
    plain Shard(0): the global view (full_tensor, state_dict) comes out with rows permuted. A checkpoint of it
    would be silently wrong, so it is refused (docs/parallel.md)."""
    for key, param in module.named_parameters(recurse=False):
        mesh = param.device_mesh if isinstance(param, DTensor) else None
        if mesh is not None and mesh.ndim > 1 and mesh.size(0) > 1:
            raise InputError(f"state_dict: {prefix}{key} is a packed gate_up projection sharded by FSDP2 over tensor "
                             f"parallelism ({mesh.size(0)} data-parallel ranks); PyTorch would save its rows "
                             "permuted. Save from a 1 x N mesh or an unsharded copy, or use separate gate and up "
                             "projections (docs/parallel.md)")


class ReducedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel to a replicated output (one all-reduce of the ranks' partial sums) that lets the fused block
    run that all-reduce itself: in row chunks, each started as soon as its rows are written, behind the block's
    remaining GEMMs (mlpfuse.ops.reduce_overlap). The output hook then finds the sum already replicated and only
    passes it on. A block that does not (a compiled call, a few tokens) leaves its output partial, and the hook
    all-reduces it as RowwiseParallel's does."""

    def __init__(self, *, use_local_output: bool = True):
        super().__init__(output_layouts=Replicate(), use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        setattr(module, REDUCES, True)
        return module


def _hidden(block: nn.Module) -> Optional[int]:
    """The hidden size of an mlpfuse MLP block (a module or a block mlpfuse.patch put in), else None."""
    from mlpfuse.modules import MLP, GatedMLP
    from mlpfuse.patching.blocks import GatedBlock, PatchedBlock, PostNormBlock

    if isinstance(block, (GatedMLP, MLP)):
        return block.hidden
    if isinstance(block, GatedBlock):
        return block.fused_hidden
    if isinstance(block, PatchedBlock) and not isinstance(block, PostNormBlock):  # a projection + norm: no MLP
        return block._modules[block.fused_linears[0]].weight.shape[0]
    return None


def block_plan(block: nn.Module, sequence_dim: Optional[int] = None, name: str = "",
               overlap: bool = True) -> dict[str, object]:
    """The ParallelStyles of one mlpfuse MLP block, keyed by its children's names: the first projections
    column-parallel, the last row-parallel. sequence_dim: the block's input and output are sharded along it on each
    rank (sequence parallelism), else replicated. name: the block's path, for messages. overlap: a gated block with
    replicated input and output runs its all-reduce itself, behind its own GEMMs (ReducedRowwiseParallel)."""
    from mlpfuse.modules import MLP, GatedMLP, PackedGatedMLP
    from mlpfuse.patching.blocks import GatedBlock, LinearActBlock, TwoLayerBlock

    where = f"{name or type(block).__name__} ({type(block).__name__})"
    if sequence_dim is not None and (isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int)):
        raise InputError(f"sequence_dim: expected None or an int, got {sequence_dim!r}")
    if not isinstance(overlap, bool):
        raise InputError(f"overlap: expected True or False, got {overlap!r}")
    activations = Replicate() if sequence_dim is None else Shard(sequence_dim)
    first = {"input_layouts": activations}
    last = {"output_layouts": activations}
    if isinstance(block, PackedGatedMLP):
        names, packed = ("gate_up_proj", "down_proj"), True
    elif isinstance(block, GatedMLP):
        names, packed = ("gate_proj", "up_proj", "down_proj"), False
    elif isinstance(block, MLP):
        names, packed = ("fc1", "fc2"), False
    elif isinstance(block, GatedBlock):
        names, packed = block.fused_linears, block.fused_packed
    elif isinstance(block, TwoLayerBlock):
        if block.fused_transposed:
            raise InputError(f"module: {where} has Conv1D projections ([in, out] weights); PyTorch's "
                             f"ColwiseParallel / RowwiseParallel shard nn.Linear only")
        names, packed = block.fused_linears, False
    elif isinstance(block, LinearActBlock):
        raise InputError(f"module: {where} is one projection whose row-parallel partner lies outside it; shard the "
                         f"pair with parallelize_module (ColwiseParallel on {name + '.' if name else ''}"
                         f"{block.fused_linears[0]}, RowwiseParallel on the projection after it)")
    else:
        raise InputError(f"module: {where} is not an mlpfuse MLP block")
    plan: dict[str, object] = {n: (PackedColwiseParallel if packed else ColwiseParallel)(**first) for n in names[:-1]}
    # Row-parallel last projection; to a replicated output the fused gated blocks run the all-reduce themselves.
    gated = isinstance(block, (GatedMLP, GatedBlock))
    reduced = overlap and gated and sequence_dim is None
    plan[names[-1]] = ReducedRowwiseParallel() if reduced else RowwiseParallel(**last)
    return plan


def tensor_parallel(module: nn.Module, device_mesh, *, sequence_dim: Optional[int] = None,
                    overlap: bool = True) -> nn.Module:
    """Shard every mlpfuse MLP block in `module` (GatedMLP, PackedGatedMLP, MLP, and the blocks `mlpfuse.patch`
    puts in a model; the module itself included) over the ranks of a 1-D `device_mesh`, in place; returns `module`.
    Patch first: mlpfuse.patch leaves modules with hooks or DTensor weights alone.

    gate and up (or fc1) become column-parallel, down (or fc2) row-parallel (`parallelize_module` with
    ColwiseParallel / RowwiseParallel; PackedColwiseParallel for a packed gate_up_proj). Each rank then runs the
    fused kernels on its slice of the hidden dimension and the block ends in one all-reduce. sequence_dim: the
    blocks' inputs and outputs are sharded along this dimension on each rank (sequence parallelism): one all-gather
    at the block's start and a reduce-scatter at its end instead of the all-reduce. overlap: without sequence
    parallelism, a gated block's all-reduce runs inside it, in row chunks behind its down projection, and x's
    gradient's behind its weight gradients (from 2048 tokens in plain eager calls; mlpfuse.ops.reduce_overlap).
    """
    if not isinstance(module, nn.Module):
        raise InputError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise InputError(f"device_mesh: expected a torch.distributed DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise InputError(f"device_mesh: expected a 1-D mesh of the tensor-parallel ranks, got a {device_mesh.ndim}-D "
                         f"one; pass its tensor-parallel dimension (e.g. mesh['tp'])")
    n = device_mesh.size()
    plan: dict[str, object] = {}
    for name, block in module.named_modules():
        hidden = _hidden(block)
        if hidden is None:
            continue
        where = f"{name or type(block).__name__} ({type(block).__name__})"
        if any(isinstance(p, DTensor) for p in block.parameters()):
            raise InputError(f"module: {where} already has DTensor parameters; apply tensor_parallel once, to "
                             f"plain modules")
        styles = block_plan(block, sequence_dim, name, overlap)
        if hidden % n:
            raise InputError(f"device_mesh: {n} ranks do not divide the hidden size {hidden} of {where}; each "
                             f"rank must hold an equal slice of it")
        for child, style in styles.items():
            plan[f"{name}.{child}" if name else child] = style
    if not plan:
        raise InputError(f"module: no mlpfuse GatedMLP, PackedGatedMLP, MLP or patched MLP block in "
                         f"{type(module).__name__}; patch the model first (mlpfuse.patch)")
    parallelize_module(module, device_mesh, plan)
    return module

