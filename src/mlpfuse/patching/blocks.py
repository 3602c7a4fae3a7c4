"""The modules `mlpfuse.patch` puts in place of a model's MLP blocks.

A block keeps every child of the module it replaces, as the same objects under the same names: the Parameters are
the model's own (nothing is copied), state_dict keys do not change, `model.train()` / `.eval()` still reach the
dropout modules, and `.to()` / `.half()` move what the model's own module holds. The block's own attributes are
named `fused_*`, so that none can shadow a child of the module it replaces. The replaced module is kept outside the
module tree (`block.fused_source`): `mlpfuse.unpatch` puts it back, and a call the fused path cannot compute exactly
(a dropout between the activation and the last projection while it is active, projections in different dtypes)
runs the module's own forward over the same children instead of a different function.

Under tensor parallelism (`mlpfuse.parallel.tensor_parallel` after `mlpfuse.patch`, or parallelize_module on the
projections) each block runs the same ops on each rank's shards (`mlpfuse.ops.sharded`), and the replaced
module's forward, where a block falls back to it, runs eager tensor parallelism over the same children.

Layouts (mlpfuse.patching.table names the families that use them):
    GatedBlock      down(act(gate(x)) · up(x)), separate or packed gate/up weights (halves in either order; the
                    sharded path runs the module's own forward for (up, gate)), optional gate and down
                    multipliers (Falcon-H1): one `mlpfuse::gated_mlp` call, with GatedMLP's per-layout call plan.
    TwoLayerBlock   proj(act(fc(x))): fc + bias + activation as one `mlpfuse::linear_act` call, then the model's own
                    second projection (a GEMM with its bias already is one kernel). fc may be a Conv1D ([in, out]
                    weight): the op reads it through a transposed view.
    LinearActBlock  act(dense(x)) (BERT's intermediate): one `mlpfuse::linear_act` call.
    PostNormBlock   norm(dropout(dense(x)) + residual) (BERT's output blocks), two inputs: the module's own three
                    ops (the projection's GEMM with its bias, the residual add, layer_norm) in one module call
                    instead of three (the projection, the dropout that returns its input in eval mode, the norm).
                    Encoders of BERT's size are host-bound at inference: the saving is the module calls.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _module

from mlpfuse.modules import _sharded, _weight_bias
from mlpfuse.ops import _checks, dispatch, fp8_mlp, fp8_train
from mlpfuse.ops._util import linear2d, rows, unrows
from mlpfuse.ops.gated_mlp import CallPlan, gated_mlp_call, residual_fits
from mlpfuse.ops.linear_act import LinearActPlan, linear_act_call


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run more than its forward: a hook of its own or a global module hook (what
    nn.Module.__call__ itself checks before it takes its fast path)."""
    m = _module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def _does_more(drop: nn.Module) -> bool:
    """Whether calling a dropout child would do more than return its input: active (training, p > 0) or hooked."""
    return (drop.training and drop.p > 0) or _hooked(drop)


class PatchedBlock(nn.Module):
    """Base of the blocks: the source module's children, adopted, and the source kept for unpatching."""

    fused_layout = ""

    def __init__(self, source: nn.Module, family: str, activation: str, backend: str, dropout: str = ""):
        super().__init__()
        for name, child in source.named_children():
            self.add_module(name, child)
        # Outside the module tree (a plain attribute): its children are ours, so nothing is registered twice.
        self.__dict__["fused_source"] = source
        self.training = source.training
        self.fused_family = family
        self.fused_activation = activation
        self.fused_backend = backend
        self.fused_dropout = dropout  # a dropout child that sits inside the fused computation ('' when none)
        # "fp8" once patch(precision="fp8") quantized the projections (mlpfuse.patching.quantize): they are then
        # modules.Fp8Linear, in this block and in the module it replaced. "fp8-train" (patch(precision="fp8") on a
        # model in train mode): the projections stay as they are, and each call quantizes their weights and runs
        # every GEMM of the forward and the backward in FP8 (ops.fp8_train).
        self.fused_precision = ""

    def _dropout_active(self) -> bool:
        if not self.fused_dropout:
            return False
        drop = self._modules[self.fused_dropout]
        return drop.training and drop.p > 0

    def _source_forward(self, *args, **kwargs) -> Tensor:
        """The replaced module's own forward, over the same children."""
        source = self.__dict__["fused_source"]
        source.training = self.training
        return source(*args, **kwargs)

    def extra_repr(self) -> str:
        backend = self.fused_backend or "env"
        fp8 = {"fp8": ", precision=fp8", "fp8-train": ", precision=fp8 (training)"}.get(self.fused_precision, "")
        return f"{type(self.fused_source).__name__} fused: activation={self.fused_activation}, backend={backend}{fp8}"


class GatedBlock(PatchedBlock):
    fused_layout = "gated"

    def __init__(self, source: nn.Module, family: str, linears: tuple[str, ...], activation: str, backend: str,
                 dropout: str = "", gate_multiplier: float = 1.0, down_multiplier: float = 1.0,
                 gate_second: bool = False, recompute: bool = False):
        super().__init__(source, family, activation, backend, dropout)
        self.fused_recompute = recompute  # training keeps only x; the backward recomputes g and u
        self.fused_save = "high"  # "fp8": training keeps g and u in the FP8 recipe (patch(save="fp8"))
        self.fused_packed = len(linears) == 2
        self.fused_gate_second = gate_second  # packed halves in (up, gate) order (Moonshine's fc1)
        self.fused_linears = linears
        first = self._modules[linears[0]].weight
        self.fused_hidden = first.shape[0] // 2 if self.fused_packed else first.shape[0]
        # act(m_g·g)·u = act(gate(m_g·x))·up(m_g·x) / m_g when neither projection has a bias (the table checks it):
        # scaling x by m_g and the output by m_d / m_g keeps the fused op exact in real arithmetic.
        self.fused_in_scale = float(gate_multiplier)
        self.fused_out_scale = float(down_multiplier) / float(gate_multiplier)
        self._fused_plan = CallPlan()
        # The RMSNorm in front of the block, when patching handed it over (mlpfuse.patching.norms): the norm module
        # then passes its input through and this block applies it (its decode kernels, or the norm's own forward).
        self.fused_norm = None

    def extra_repr(self) -> str:
        extra = ", the norm in front handed over" if self.fused_norm is not None else ""
        save = ", save=fp8" if self.__dict__.get("fused_save") == "fp8" else ""
        return super().extra_repr() + extra + (", recompute=True" if self.fused_recompute else "") + save

    def fused_halves(self, t, rows: int):
        """(gate part, up part) of a packed projection's tensor split after `rows` rows; (None, None) for None."""
        if t is None:
            return None, None
        first, second = t[:rows], t[rows:]
        return (second, first) if self.fused_gate_second else (first, second)

    def fused_weights(self, w, b, wd, bd) -> tuple:
        """(wg, wu, wd, bg, bu, bd) as the GLU reads them, from the first projection's weight and bias (w, b) and the
        down projection's: a packed projection's halves split (views of its parameters), gate first."""
        if self.fused_packed:
            (wg, wu), (bg, bu) = self.fused_halves(w, self.fused_hidden), self.fused_halves(b, self.fused_hidden)
            return wg, wu, wd, bg, bu, bd
        wu, bu = _weight_bias(self._modules[self.fused_linears[1]])
        return w, wu, wd, b, bu, bd

    def fp8_train_call(self, x: Tensor) -> Tensor:
        """The MLP trained in FP8 on this block's own weights (quantized in the call; ops.fp8_train)."""
        mods, names = self._modules, self.fused_linears
        wg, wu, wd, bg, bu, bd = self.fused_weights(*_weight_bias(mods[names[0]]), *_weight_bias(mods[names[-1]]))
        return fp8_train.fp8_gated_mlp_train(x, wg, wu, wd, bg, bu, bd, self.fused_activation, self.fused_backend)

    def fp8_call(self, x: Tensor, children=None, norm=None, residual=None) -> Tensor:
        """The MLP on FP8 projections (modules.Fp8Linear): this block's, or `children` in its layout's order; `norm`
        the RMSNorm in front, which the FP8 kernels apply; `residual` (ops.gated_mlp.residual_fits) added by them."""
        mods = children if children is not None else [self._modules[n] for n in self.fused_linears]
        d = mods[-1]
        if self.fused_packed:
            gu, n = mods[0], self.fused_hidden
            (wg, wu), (sg, su) = self.fused_halves(gu.weight, n), self.fused_halves(gu.weight_scale_inv, n // 128)
            bg, bu = self.fused_halves(gu.bias, n)
        else:
            g, u = mods[0], mods[1]
            wg, sg, bg, wu, su, bu = g.weight, g.weight_scale_inv, g.bias, u.weight, u.weight_scale_inv, u.bias
        return fp8_mlp.fp8_gated_mlp(x, wg, sg, wu, su, d.weight, d.weight_scale_inv, bg, bu, d.bias,
                                     self.fused_activation, self.fused_backend, norm, residual)

    def forward(self, hidden_states: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        """The block's output; with `residual` (the layer's add handed to the block, mlpfuse.patching.residual),
        `residual + output`, added in the down projection's epilogue where the path allows."""
        if residual is not None and self.fused_out_scale != 1.0:
            return residual + self.forward(hidden_states)
        mods = self._modules
        norm = self.fused_norm
        if self.fused_precision == "fp8":
            if self._dropout_active():
                y = self._source_forward(hidden_states if norm is None else norm(hidden_states))
            elif residual is not None and residual_fits(residual, hidden_states, mods[self.fused_linears[-1]].weight):
                return self.fp8_call(hidden_states, norm=norm, residual=residual)
            else:
                y = self.fp8_call(hidden_states, norm=norm)
            return y if residual is None else residual + y
        if self.fused_precision == "fp8-train":
            x = hidden_states if norm is None else norm(hidden_states)
            y = self._source_forward(x) if self._dropout_active() else self.fp8_train_call(x)
            return y if residual is None else residual + y
        names = self.fused_linears
        w, b = _weight_bias(mods[names[0]])
        wd, bd = _weight_bias(mods[names[-1]])
        if _sharded(w, wd):
            y = self._sharded_forward(hidden_states if norm is None else norm(hidden_states), w, wd)
            return y if residual is None else residual + y
        wg, wu, wd, bg, bu, bd = self.fused_weights(w, b, wd, bd)
        if wd.dtype is not wg.dtype or self._dropout_active():
            # T5 keeps `wo` in fp32 and casts to it; a live dropout sits between the GLU and `wo`.
            y = self._source_forward(hidden_states if norm is None else norm(hidden_states))
            return y if residual is None else residual + y
        x = hidden_states if self.fused_in_scale == 1.0 else hidden_states * self.fused_in_scale
        y = gated_mlp_call(x, wg, wu, wd, bg, bu, bd, self.fused_activation, self.fused_backend, self._fused_plan,
                           norm, self.fused_recompute, residual, self.__dict__.get("fused_save") == "fp8")
        return y if self.fused_out_scale == 1.0 else y * self.fused_out_scale

    def _sharded_forward(self, hidden_states: Tensor, w: Tensor, wd: Tensor) -> Tensor:
        from mlpfuse.ops import sharded

        if wd.dtype is not w.dtype or self._dropout_active() or self.fused_gate_second:
            return self._source_forward(hidden_states)
        x = hidden_states if self.fused_in_scale == 1.0 else hidden_states * self.fused_in_scale
        children = [(n, self._modules[n]) for n in self.fused_linears]
        y = sharded.gated(x, children, self.fused_packed, self.fused_activation, self.fused_backend)
        return y if self.fused_out_scale == 1.0 else y * self.fused_out_scale


class TwoLayerBlock(PatchedBlock):
    fused_layout = "two-layer"

    def __init__(self, source: nn.Module, family: str, linears: tuple[str, str], activation: str, backend: str,
                 dropout: str = "", transposed: bool = False, dropout_after: str = ""):
        super().__init__(source, family, activation, backend, dropout)
        self.fused_linears = linears
        self.fused_transposed = transposed
        self.fused_dropout_after = dropout_after  # GPT-2's dropout after c_proj: outside the fusion, applied as is
        self._fused_plan = LinearActPlan()
        # The second projection's class as patched (nn.Linear or Conv1D): while it is still that class and nothing
        # hooks its call, the block computes it from its weight (the module's own math), without its Python forward.
        self.__dict__["fused_proj_type"] = type(self._modules[linears[1]])
        # precision "fp8": the projections as they were (their weight dropped), for `unpatch` to give back
        self.__dict__["fused_fp8_originals"] = {}

    def fp8_call(self, x: Tensor, children=None) -> Tensor:
        """The two-layer MLP on FP8 projections (modules.Fp8Linear, [out, in] whatever the layout patched): this
        block's, or `children` (fc, proj)."""
        fc, proj = children if children is not None else [self._modules[n] for n in self.fused_linears]
        return fp8_mlp.fp8_gated_mlp(x, fc.weight, fc.weight_scale_inv, None, None, proj.weight, proj.weight_scale_inv,
                                     fc.bias, None, proj.bias, self.fused_activation, self.fused_backend)

    def forward(self, hidden_states: Tensor) -> Tensor:
        mods = self._modules
        if self.fused_precision == "fp8":
            if self._dropout_active():
                return self._source_forward(hidden_states)
            return self._dropout_after(self.fp8_call(hidden_states))
        fc, proj = mods[self.fused_linears[0]], mods[self.fused_linears[1]]
        w, b = _weight_bias(fc)
        if proj.weight.dtype is not w.dtype or self._dropout_active():
            return self._source_forward(hidden_states)
        backend = self.fused_backend
        if _sharded(w):
            from mlpfuse.ops import sharded

            if self.fused_transposed:  # a DTensor [in, out] Conv1D weight: no ParallelStyle of PyTorch makes one
                return self._source_forward(hidden_states)
            # fc column-parallel (its hooks run here, as it is not called); proj is called, and runs its own.
            h = sharded.linear(fc, hidden_states, self.fused_activation, backend, self.fused_linears[0], hooks=True)
        else:
            if self.fused_transposed:
                w = w.t()  # Conv1D keeps [in, out]: the [out, in] view the op takes, no copy
                # The GEMM+activation kernel's fast (TMA) mainloop needs unit-stride weight rows; `auto`'s
                # thresholds were measured with them. Over this view `auto` keeps cuBLAS (the activation still runs
                # as one op); backend="triton" forces the kernel's pointer-load path.
                if dispatch.resolve_backend(backend) == "auto":
                    backend = "torch"
            h = linear_act_call(hidden_states, w, b, self.fused_activation, backend, self._fused_plan)
        return self._dropout_after(self._project(proj, h))

    def _dropout_after(self, y: Tensor) -> Tensor:
        if self.fused_dropout_after:
            drop = self._modules[self.fused_dropout_after]
            if _does_more(drop):
                y = drop(y)
        return y

    def _project(self, proj: nn.Module, h: Tensor) -> Tensor:
        """proj(h): nn.Linear's or Conv1D's own GEMM on its weight (one mm/addmm between two views), or the module's
        call where it is no longer the class patched, is hooked or holds weights the plain GEMM must not read."""
        if type(proj) is not self.fused_proj_type or _hooked(proj):
            return proj(h)
        w, b = _weight_bias(proj)
        if type(w) not in _checks.PLAIN or (b is not None and type(b) not in _checks.PLAIN):  # DTensors included
            return proj(h)
        h2 = rows(h)
        if self.fused_transposed:  # Conv1D: y = b + h·W with W [in, out]
            y2 = torch.mm(h2, w) if b is None else torch.addmm(b, h2, w)
        else:
            y2 = linear2d(h2, w, b)
        return unrows(y2, h)


class LinearActBlock(PatchedBlock):
    fused_layout = "linear-act"

    def __init__(self, source: nn.Module, family: str, linears: tuple[str], activation: str, backend: str):
        super().__init__(source, family, activation, backend)
        self.fused_linears = linears
        self._fused_plan = LinearActPlan()

    def forward(self, hidden_states: Tensor) -> Tensor:
        dense = self._modules[self.fused_linears[0]]
        w, b = _weight_bias(dense)
        if _sharded(w):  # column-parallel under a plan that pairs it with the row-parallel projection after it
            from mlpfuse.ops import sharded

            return sharded.linear(dense, hidden_states, self.fused_activation, self.fused_backend,
                                  self.fused_linears[0], hooks=True)
        return linear_act_call(hidden_states, w, b, self.fused_activation, self.fused_backend, self._fused_plan)


class PostNormBlock(PatchedBlock):
    fused_layout = "post-norm"

    def __init__(self, source: nn.Module, family: str, linears: tuple[str], backend: str, dropout: str = "",
                 norm: str = "LayerNorm"):
        super().__init__(source, family, "", backend, dropout)
        self.fused_linears = linears
        self.fused_norm_name = norm

    def extra_repr(self) -> str:
        return f"{type(self.fused_source).__name__} fused: {self.fused_norm_name}({self.fused_linears[0]}(x) + residual)"

    def forward(self, *args, **kwargs) -> Tensor:
        mods = self._modules
        dense, norm = mods[self.fused_linears[0]], mods[self.fused_norm_name]
        # Exactly nn.Linear's and nn.LayerNorm's own math, while they are those classes, nothing hooks them or the
        # dropout and the dropout returns its input; any other call runs the module's own forward.
        if (kwargs or len(args) != 2 or type(dense) is not nn.Linear or type(norm) is not nn.LayerNorm
                or _hooked(dense) or _hooked(norm)
                or (self.fused_dropout and _does_more(mods[self.fused_dropout]))):
            return self._source_forward(*args, **kwargs)
        hidden_states, residual = args
        y = F.linear(hidden_states, dense.weight, dense.bias)
        return F.layer_norm(y + residual, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
