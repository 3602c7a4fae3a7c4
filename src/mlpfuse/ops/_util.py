"""Small helpers the ops share: 2-D views of activations, placeholders, and the "is a gradient needed" rule."""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


# Whether torch.profiler is recording right now: one C call, so the eager fast paths name themselves in a trace only
# when someone is looking. `op_span(name)` records a CPU op (category cpu_op, like the dispatcher's ATen ops; a
# Python `record_function` would be a user annotation), so the kernels launched inside are attributed to it.
profiling = torch._C._autograd._profiler_enabled
op_span = torch._C._profiler._RecordFunctionFast


def rows(t: Tensor) -> Tensor:
    """t as [tokens, features]: a view whenever the leading dimensions allow it (reshape copies otherwise)."""
    if t.dim() == 2 and (t.stride(1) == 1 or t.stride(0) == 1):
        return t  # already 2-D with a unit-stride dimension: the common case, on every call
    if t.dim() > 2 and t.is_contiguous():
        return t.view(leading(t), t.shape[-1])  # one dispatcher op, where flatten records two (flatten, view)
    t2 = t.unsqueeze(0) if t.dim() == 1 else t.flatten(0, -2)
    if t2.stride(0) != 1 and t2.stride(1) != 1 and t2.numel() > 0:
        # Neither dimension is unit-stride (e.g. an expanded gradient): kernels need one of them to be.
        t2 = t2.contiguous()
    return t2


def unrows(y: Tensor, x: Tensor) -> Tensor:
    """A 2-D result y [tokens, n] back in x's leading dimensions (a view of the fresh, contiguous y)."""
    if x.dim() == 2:
        return y
    return y.view(*x.shape[:-1], y.shape[1]) if y.is_contiguous() else y.reshape(*x.shape[:-1], y.shape[1])


def linear2d(t: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """F.linear on 2-D t computed as F.linear computes it there — one mm, or addmm with the bias, on weight.t() —
    without its two outer dispatcher ops (aten::linear, aten::matmul): host time on every call, most of all while
    torch.profiler records each op's shapes."""
    return torch.mm(t, weight.t()) if bias is None else torch.addmm(bias, t, weight.t())


def plain_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], act=None) -> Optional[Tensor]:
    """act(F.linear(x, weight, bias)) (act None: none) — a module call that is eager's own math — or None where
    F.linear refuses the input, which then goes on to the op layer's checks (they name the argument)."""
    try:
        y = F.linear(x, weight, bias)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, IndexError, ValueError):
        return None
    return y if act is None else act(y)


def nothing(like: Tensor) -> Tensor:
    """A placeholder output (custom ops return tensors, never None)."""
    return like.new_empty(0)


def leading(x: Tensor) -> int:
    n = 1
    for s in x.shape[:-1]:
        n = n * s
    return n


def needs_grad(tensors: List[Optional[Tensor]]) -> bool:
    """Whether autograd will need this call's backward, by its own rule: grad mode on and an input requiring grad.

    Read at the entry of a call, where grad mode is still visible: inside a custom op's implementation autograd has
    turned it off, and a model's Parameters require grad under `torch.no_grad()` / `torch.inference_mode()` too,
    so no implementation can tell (`needs_input_grad` has the same flaw). TorchScript-compatible."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


@torch.jit.unused
def plain_eager(x) -> bool:
    """True for a plain tensor in plain eager execution, where a call may run its path's kernels directly.

    Not while torch.compile / torch.export / jit.trace record a graph, nor for tensor subclasses (fake, functional,
    proxies) or non-tensors: those go through the registered custom ops. is_compiling() first: Dynamo cannot trace
    torch._C._is_tracing() (a torch.* call returning a bool), and under it the rest is never reached.
    """
    return not torch.compiler.is_compiling() and type(x) is Tensor and not torch._C._is_tracing()


@torch.jit.unused
def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The dtype torch.autocast runs matmuls in for x's device, or None outside autocast (or for fp64 inputs)."""
    # is_cuda first: building x.device costs ~1 µs, paid on every CUDA call otherwise. (Not is_cpu: Dynamo in
    # torch 2.11 records reading it as a graph node.)
    device = "cuda" if x.is_cuda else x.device.type
    if x.dtype == torch.float64 or device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


@torch.jit.unused
def cast_all(tensors: List[Optional[Tensor]], dtype: torch.dtype) -> List[Optional[Tensor]]:
    """Tensors in dtype, as autocast would cast nn.Linear's inputs (differentiable, so fp32 masters get grads)."""
    return [t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors]


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed (activation checkpointing, offloading to the CPU,
    torch.autograd.graph.saved_tensors_hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def hold(ctx, saved: tuple, g: Optional[Tensor], u: Optional[Tensor]) -> None:
    """Keep what a training forward's backward reads: `saved` through save_for_backward, and g and u. Those two go on
    ctx plainly (the fused backward writes dg and du over them and frees each as soon as its last reader ran;
    save_for_backward would hold them to the node's end) — except under saved-tensor hooks, which must see every
    tensor a backward keeps: a checkpointed layer would otherwise hold its g and u from its forward to its
    backward (measured: FSDP2 + activation checkpointing, 8 Llama-3-8B layers, 4×2048 tokens per rank, 3.5 GiB more
    peak than without mlpfuse). There they are saved with the rest."""
    pre = [] if g is None else [*g, *u] if isinstance(g, tuple) else [g, u]  # FP8: (values, scale_inv) each
    ctx.n_held = len(pre)
    ctx.hooked = g is not None and _saved_tensor_hooks_active()
    ctx.held = None if g is None or ctx.hooked else pre
    ctx.save_for_backward(*saved, *(pre if ctx.hooked else ()))


def take_held(ctx) -> tuple[tuple, Optional[List[Tensor]]]:
    """(the saved tensors, [g, u] as `hold` kept them), unpacked once (a checkpoint allows one unpack); [g, u] only
    the first time, None when there were none or a backward already took them (the caller then recomputes them).
    Saved through hooks, they come back from the hooks (recomputed by a checkpoint). FP8-saved g and u come back
    as [(g values, g scale_inv), (u values, u scale_inv)]."""
    saved = ctx.saved_tensors
    n = ctx.n_held
    if ctx.hooked:
        saved, held = saved[:-n], list(saved[-n:])
    else:
        held, ctx.held = ctx.held, None
    if held is not None and n == 4:
        held = [(held[0], held[1]), (held[2], held[3])]
    return saved, held

