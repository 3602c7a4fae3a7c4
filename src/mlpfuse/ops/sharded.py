"""The modules' forwards when tensor parallelism made their parameters DTensors: each rank runs the fused op on its
local shards, and DTensor communicates only at the block's edges. The modules reach this by the weights' type (a
DTensor), so they never import mlpfuse.parallel, which builds the plans that shard them.

`parallelize_module` with ColwiseParallel / RowwiseParallel turns the projections' parameters into DTensors
(gate and up rows Shard(0), down columns Shard(1), down's bias Replicate) and hooks the projections' calls. A
GatedMLP never calls its projections (gate, up and down run as one fused op), so the forward here runs their hooks
itself where the block's data passes them: gate_proj's (or gate_up_proj's) input hooks on x (ColwiseParallel's
gathers a sequence-sharded x, or marks a plain one replicated; up_proj's would do the same again), and down_proj's
output hooks on the block's output (RowwiseParallel's sums the ranks' partial outputs: one all-reduce, or a
reduce-scatter under sequence parallelism). What flows between the projections is each rank's own hidden slice,
so the hooks there would not communicate and are not run.

The math: with hidden split across ranks, h_r = act(x·Wg_rᵀ + bg_r)·(x·Wu_rᵀ + bu_r) is rank r's slice of h, and
y = Σ_r h_r·Wd_rᵀ + bd. Each rank computes its term with the fused kernels; DTensor adds the terms (Partial → the
output layout) and the bias once. In the backward, dx = Σ_r (rank r's dx term): x's local gradient is declared
Partial, and the input hook's backward sums it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from mlpfuse.errors import InputError
from mlpfuse.ops import reduce_overlap
from mlpfuse.ops._util import leading, needs_grad
from mlpfuse.ops.gated_mlp import gated_mlp_call
from mlpfuse.ops.linear_act import linear_act_call

COLUMN = (Shard(0),)  # ColwiseParallel: output features (weight rows, bias) split across ranks
ROW = (Shard(1),)  # RowwiseParallel: input features (weight columns) split; the bias stays whole
REPLICATE = (Replicate(),)
# A packed [gate; up] weight split so that each rank holds its gate rows and the matching up rows: the rows are
# first cut into 2 halves (gate, up), then each half is sharded, and a rank's local tensor is [gate_r; up_r].
PACKED = (_StridedShard(0, split_factor=2),)

_STYLE = {COLUMN: "Shard(0) (ColwiseParallel)", ROW: "Shard(1) (RowwiseParallel)", REPLICATE: "Replicate()",
          PACKED: "_StridedShard(0, split_factor=2) (mlpfuse.parallel.PackedColwiseParallel)"}


def is_distributed(*tensors: Optional[Tensor]) -> bool:
    return any(isinstance(t, DTensor) for t in tensors)


def _check(named: Sequence[tuple[str, Optional[Tensor], tuple]]):
    """Every parameter a DTensor with the placement the plan gives it, all on one 1-D mesh; returns the mesh."""
    mesh = None
    for name, t, placements in named:
        if t is None:
            continue
        if not isinstance(t, DTensor):
            raise InputError(f"{name}: a plain tensor among DTensor parameters; shard every projection of the block "
                             f"(mlpfuse.parallel.tensor_parallel does)")
        got = tuple(t.placements)
        if got != placements:
            if placements == PACKED and got == COLUMN:
                raise InputError(f"{name}: Shard(0) splits the packed [gate; up] rows so that rank 0 holds gate rows "
                                 f"only; shard it with mlpfuse.parallel.PackedColwiseParallel() (tensor_parallel does)")
            raise InputError(f"{name}: expected placements {_STYLE[placements]}, got {list(got)}")
        if mesh is None:
            mesh = t.device_mesh
            if mesh.ndim != 1:
                raise InputError(f"{name}: expected a DTensor on a 1-D device mesh (tensor parallelism), got a "
                                 f"{mesh.ndim}-D mesh")
        elif t.device_mesh != mesh:
            raise InputError(f"{name}: on another device mesh than the block's other parameters")
    return mesh


def _refuse_fsdp_children(children: Sequence[tuple[str, nn.Module]]) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, child in children:
        if isinstance(child, FSDPModule):
            raise InputError(f"{name}: fully_shard was applied to the projection, whose forward the fused block never "
                             f"calls; apply fully_shard to the block or a module around it")


def _run_input_hooks(module: nn.Module, x):
    """module's forward pre-hooks on x, as nn.Module.__call__ runs them."""
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in with_kwargs:
            out = hook(module, (x,), {})
            if out is not None:
                x = out[0][0]
        else:
            out = hook(module, (x,))
            if out is not None:
                x = out[0] if isinstance(out, tuple) else out
    return x


def _run_output_hooks(module: nn.Module, x, y):
    """module's forward hooks on the block's output y (their `input` is the block's input)."""
    with_kwargs = module._forward_hooks_with_kwargs
    for key, hook in list(module._forward_hooks.items()):
        out = hook(module, (x,), {}, y) if key in with_kwargs else hook(module, (x,), y)
        if out is not None:
            y = out
    return y


def _as_dtensor(x, mesh, placements: tuple) -> DTensor:
    """x (a plain tensor is taken to be laid out so already) as a DTensor with `placements` on mesh."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise InputError("x: a DTensor on another device mesh than the block's parameters")
        return x if tuple(x.placements) == placements else x.redistribute(mesh, placements)
    if not isinstance(x, Tensor):
        raise InputError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    return DTensor.from_local(x, mesh, placements, run_check=False)


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to_local()


def gated(x, children: Sequence[tuple[str, nn.Module]], packed: bool, activation: str, backend: str):
    """A gated block under tensor parallelism. children: (name, module) of its projections in order, gate, up,
    down, or gate_up, down when `packed`."""
    _refuse_fsdp_children(children)
    firsts, (down_name, down) = children[:-1], children[-1]
    first = PACKED if packed else COLUMN
    mesh = _check([(f"{n}.weight", m.weight, first) for n, m in firsts] + [(f"{down_name}.weight", down.weight, ROW)]
                  + [(f"{n}.bias", m.bias, first) for n, m in firsts]
                  + [(f"{down_name}.bias", down.bias, REPLICATE)])
    if packed:
        w, b = firsts[0][1].weight.to_local(), _local(firsts[0][1].bias)
        half = w.shape[0] // 2
        wg, wu = w[:half], w[half:]
        bg, bu = (None, None) if b is None else (b[:half], b[half:])
    else:
        (_, gate), (_, up) = firsts
        wg, wu, bg, bu = gate.weight.to_local(), up.weight.to_local(), _local(gate.bias), _local(up.bias)
    wd = down.weight.to_local()
    if wd.shape[1] != wg.shape[0] or wu.shape != wg.shape:
        raise InputError(f"{down_name}.weight: this rank holds {wd.shape[1]} hidden columns of {down_name} but "
                         f"{wg.shape[0]} hidden rows of gate and {wu.shape[0]} of up; shard them alike")

    # The first projection's input hooks prepare x for all of them: running up's on their result too would add a
    # redistribution whose backward all-reduces dx a second time.
    xr = _as_dtensor(_run_input_hooks(firsts[0][1], x), mesh, REPLICATE)
    overlap = None
    if getattr(down, reduce_overlap.REDUCES, False) and leading(xr) >= 2 * reduce_overlap.CHUNK_ROWS:
        # The plan's all-reduce of the block's output: run here, behind the block's own GEMMs.
        grad = needs_grad([xr, wg, wu, wd, bg, bu])
        with torch.no_grad():
            overlap = reduce_overlap.plan(xr.to_local(), grad, wg.shape[0], backend)
    if overlap is not None:
        # The sum comes back replicated, and so does x's gradient (summed in the op's backward).
        x_local = xr.to_local(grad_placements=[Replicate()])
        y_local = reduce_overlap.gated(x_local, wg, wu, wd, bg, bu, activation, grad, *overlap, mesh.get_group())
        y = DTensor.from_local(y_local, mesh, [Replicate()], run_check=False)
    else:
        # Each rank's dx covers its hidden slice only: the local gradient is a partial sum, which the input's
        # redistribution (or the input hook) adds up in the backward.
        x_local = xr.to_local(grad_placements=[Partial()])
        y_local = gated_mlp_call(x_local, wg, wu, wd, bg, bu, None, activation, backend)
        y = DTensor.from_local(y_local, mesh, [Partial()], run_check=False)
    if down.bias is not None:
        y = y + down.bias  # DTensor adds the whole bias once to the sum over ranks
    return _run_output_hooks(down, x, y)


def linear(module: nn.Module, x, activation: str, backend: str, name: str = "", hooks: bool = False):
    """act(x·Wᵀ + b) of a Linear-like module under ColwiseParallel or, without an activation, RowwiseParallel.
    name: the module's name in its block, for messages. hooks: run the module's input and output hooks here (for
    a block that reads the weights instead of calling the module; a FusedLinear is called, and nn.Module.__call__
    runs them)."""
    label = f"{name}." if name else ""
    if hooks:
        _refuse_fsdp_children([(name or type(module).__name__, module)])
        return _run_output_hooks(module, x, linear(module, _run_input_hooks(module, x), activation, backend, name))
    weight, bias = module.weight, module.bias
    placements = tuple(weight.placements) if isinstance(weight, DTensor) else ()
    if placements == ROW:
        if activation != "identity":
            raise InputError(f"{label}weight: a row-parallel projection would apply {activation} to each rank's "
                             f"partial sum; shard a projection with an activation column-wise (ColwiseParallel)")
        mesh = _check([(f"{label}weight", weight, ROW), (f"{label}bias", bias, REPLICATE)])
        xs = _as_dtensor(x, mesh, (Shard(x.dim() - 1),) if isinstance(x, Tensor) else ROW)
        y_local = linear_act_call(xs.to_local(), weight.to_local(), None, activation, backend)
        y = DTensor.from_local(y_local, mesh, [Partial()], run_check=False)
        return y if bias is None else y + bias
    mesh = _check([(f"{label}weight", weight, COLUMN), (f"{label}bias", bias, COLUMN)])
    xr = _as_dtensor(x, mesh, REPLICATE)
    y_local = linear_act_call(xr.to_local(grad_placements=[Partial()]), weight.to_local(), _local(bias), activation,
                              backend)
    return DTensor.from_local(y_local, mesh, [Shard(y_local.dim() - 1)], run_check=False)
