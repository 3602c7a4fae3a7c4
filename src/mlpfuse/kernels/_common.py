"""Pieces shared by the GEMM-with-epilogue kernels: tile order, TMA eligibility, output buffers.

Every GEMM here runs a persistent grid: a fixed number of programs per SM (one, or two when small tiles let one CTA's
epilogue hide behind another's main loop), each looping over output tiles in grouped order (GROUP_M row-tiles share
one sweep over the columns, so a band of x and the weight columns it meets stay in L2).
Operands come either through TMA tensor descriptors (Hopper and newer, 16-byte aligned rows, unit inner stride) or
through masked pointer loads (any GPU, any strides, the interpreter); the two paths share the same kernel body and
differ only in a constexpr branch at the loads.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from mlpfuse.errors import InputError


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear tile index to (pid_m, pid_n) so that consecutive tiles walk GROUP_M row-tiles column by column."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def prefetch_l2(ptrs, mask, base):
    """Ask L2 for the lines at `ptrs` (where `mask`; `base` stands in elsewhere, so no address leaves the tensor).
    Issued before a kernel waits on the one before it: weights are constants, and their first lines arrive while that
    kernel drains."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, base)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait():
    """Programmatic dependent launch (PDL): this kernel may start while the one before it drains; nothing it
    writes, and no activation it reads, may be touched before this wait (which is a no-op when the launch was
    not programmatic)."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release():
    """Let the next kernel launch (it waits for this one's end before it reads what this one wrote)."""
    tl.extra.cuda.gdc_launch_dependents()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether this process's kernels run in Triton's interpreter: `triton.jit` fixes that when a kernel is defined, so it
# is read once, at import, like the kernels themselves (and kept off the launch path).
INTERPRET = interpreting()


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major


def num_sms(device: torch.device) -> int:
    """Programs a persistent grid launches; the interpreter runs one program per tile instead."""
    if device.type != "cuda":
        return 1 << 30
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())[0]


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The CUDA device's name ('' elsewhere): which card's tuned rows apply (kernels.configs.card)."""
    if device.type != "cuda":
        return ""
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def arch_major(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())[1]


def pdl_ok(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` can launch as programmatic dependents (PDL): CUDA sm90+, not the interpreter.
    Where not, they launch as usual, and their PDL constexpr is off."""
    return not INTERPRET and t.is_cuda and arch_major(t.device) >= 9


def tma_capable(device: torch.device) -> bool:
    # The interpreter emulates descriptors, so the TMA branch is testable on CPU; on GPUs it needs sm_90+.
    if device.type != "cuda":
        return interpreting()
    return arch_major(device) >= 9


def tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor can back a TMA descriptor: unit inner stride, 16-byte aligned base and row pitch, no empty dim."""
    shape = t.shape
    if len(shape) != 2:
        return False
    rows, cols = shape
    s0, s1 = t.stride()
    es = t.element_size()
    aligned = (s0 * es) % 16 == 0 and (cols * es) % 16 == 0 and t.data_ptr() % 16 == 0
    return rows > 0 and cols > 0 and s1 == 1 and aligned


def desc(t: torch.Tensor, block: Sequence[int], shape=None, strides=None) -> TensorDescriptor:
    """A host-side TMA descriptor. Callers check `tma_ok` first, so the dataclass's own validation (a sizeable part
    of the launch cost at small M) is skipped."""
    d = object.__new__(TensorDescriptor)
    d.base, d.block_shape, d.padding = t, list(block), "zero"
    d.shape = list(t.shape) if shape is None else shape
    d.strides = [t.stride(0), 1] if strides is None else strides
    return d


def pair_desc(a: torch.Tensor, b: torch.Tensor, block: Sequence[int]) -> tuple[TensorDescriptor, bool] | None:
    """One 3-D descriptor [2, N, K] whose two slices are `a` and `b`, if their layouts allow (same shape and row
    pitch, 16-byte aligned distance); also says whether `b` is the first slice. Packed gate_up views always qualify.
    """
    if a.shape != b.shape or a.stride() != b.stride() or a.data_ptr() == b.data_ptr():
        return None
    es = a.element_size()
    first, second, swapped = (a, b, False) if a.data_ptr() < b.data_ptr() else (b, a, True)
    delta = second.data_ptr() - first.data_ptr()
    if delta % 16:
        return None
    if first.device.type != "cuda" and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None  # the interpreter only reads inside one storage; a GPU's TMA takes any two allocations
    n, k = a.shape
    return desc(first, block, [2, n, k], [delta // es, a.stride(0), 1]), swapped


def grid_size(cfg, sms: int, m: int, n: int) -> int:
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if not cfg.persistent:
        return tiles
    return min(sms * cfg.programs_per_sm, tiles)


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    # Only fp32 operands have a choice; 16-bit operands always run on the tensor cores.
    if dtype == torch.float32 and not allow_tf32:
        return "ieee"
    return "tf32"


def outputs(out, shapes: Sequence[tuple[int, int]], like: torch.Tensor, argument: str = "out") -> list[torch.Tensor]:
    """Fresh outputs, or the caller's (checked): `out` mirrors the launcher's return (a tensor or a tuple)."""
    if out is None:
        return [torch.empty(s, device=like.device, dtype=like.dtype) for s in shapes]
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    if len(outs) != len(shapes):
        raise InputError(f"{argument}: expected {len(shapes)} tensor(s), got {len(outs)}")
    for o, s in zip(outs, shapes):
        if tuple(o.shape) != tuple(s) or o.dtype != like.dtype or o.device != like.device:
            raise InputError(f"{argument}: expected {like.dtype} tensors of shape {tuple(s)} on {like.device}")
    return outs


def check_2d(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dim() != 2:
        raise InputError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype != like.dtype or t.device != like.device:
        raise InputError(f"{name}: expected {like.dtype} on {like.device}, got {t.dtype} on {t.device}")


DIRECT_LAUNCH = True  # False sends every launch through Triton's own path (benchmarks compare the two)


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook (e.g. a profiler's) is installed: then every launch goes through Triton."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def _run(entry, device: int, grid, args, consts) -> None:
    """Launch a compiled kernel directly on the device's current stream: `entry` is (run, function, metadata, raw),
    raw a `Raw` for kernels without descriptor arguments (tensors then go to the C launcher as plain addresses)."""
    run, function, metadata, raw = entry
    if raw is not None:
        raw(grid, torch._C._cuda_getCurrentRawStream(device),
            (*[a.data_ptr() if type(a) is torch.Tensor else a for a in args], *consts))
        return
    run(grid[0], grid[1] if len(grid) > 1 else 1, 1, torch._C._cuda_getCurrentRawStream(device), function, metadata,
        None, None, None, *args, *consts)


class Launcher:
    """Launches of one Triton kernel, the compiled kernel cached per caller-given key.

    The first call for a key goes through Triton (`kernel[grid](...)`: binding, specialization, compile or cache
    lookup) and keeps the CompiledKernel it returns; later calls with the same key hand the arguments straight to
    its launcher. Triton's per-call binding and specialization of a ~30-argument kernel costs more host time than a
    small GEMM runs on the GPU (measured on both paths by the retired benchmarks/host_overhead.py:
    benchmarks/results/nvidia-h200/host/).

    The key is the caller's promise: equal keys mean equal specialization, so it must determine every constexpr,
    the launch options, the dtypes, the 16-byte alignment of every pointer argument, and the value class (== 1,
    multiple of 16) of every integer argument not marked do_not_specialize. Descriptors specialize on their dtype and
    block shape only. `args` are the runtime arguments and `consts` the constexpr values, in the kernel's order
    (constexprs last).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}
        self._raw: dict = {}

    def __call__(self, key, grid, args, consts, num_warps: int, num_stages: int, launch_pdl: bool = False) -> None:
        # launch_pdl: launched as a programmatic dependent of the kernel before it (the compiled kernel keeps it, so
        # the key must tell it apart: the kernels taking it have a PDL constexpr)
        options = {"launch_pdl": True} if launch_pdl else {}
        if key is not None and DIRECT_LAUNCH and not INTERPRET:
            device = torch._C._cuda_getDevice()  # CUDA is initialized: the tensors in `args` live there
            entry = self._compiled.get((key, device))
            if entry is not None and not launch_hooks_set():
                _run(entry, device, grid, args, consts)
                return
            compiled = self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, **options)
            # What a launch reads, resolved once (CompiledKernel.run is a property).
            raw = Raw.of(compiled)
            pointers_only = raw if raw is not None and not raw.desc_meta else None
            self._compiled[(key, device)] = (compiled.run, compiled.function, compiled.packed_metadata, pointers_only)
            self._raw[(key, device)] = raw
            return
        self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, **options)

    def compiled(self, key, device_index: int):
        """A launch function for an already compiled key, for callers that keep it in their own plan (skipping even
        this launcher's key lookup); None if the key was not compiled for that device yet or DIRECT_LAUNCH is off. Under
        the interpreter the function launches through Triton."""
        if INTERPRET:
            def through_triton(grid, args, consts, num_warps, num_stages):
                self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages)

            return through_triton
        entry = self._compiled.get((key, device_index)) if DIRECT_LAUNCH else None
        if entry is None:
            return None

        def launch(grid, args, consts, num_warps, num_stages):
            if launch_hooks_set():  # a profiler's launch hook: let Triton's own path call it
                self.kernel[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages)
                return
            _run(entry, device_index, grid, args, consts)

        return launch

    def raw(self, key, device_index: int) -> "Raw | None":
        """The compiled key's C launch function (see Raw), or None where plans must launch through `compiled`."""
        if INTERPRET or not DIRECT_LAUNCH or (key, device_index) not in self._compiled:
            return None
        return self._raw.get((key, device_index))

    def clear(self) -> None:
        self._compiled.clear()
        self._raw.clear()


MAX_PLANS = 4096  # distinct layouts a kernel keeps plans for; past that its table starts over (shape-polymorphic)


def keep_plan(plans: dict, key, plan) -> None:
    """Store a kernel wrapper's per-layout plan under its key, the table bounded by MAX_PLANS."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan


def device_index(device: torch.device) -> int:
    """The CUDA device index a launch on `device` uses (-1 off CUDA, e.g. under the interpreter)."""
    return torch._C._cuda_getDevice() if device.type == "cuda" else -1


class PointerPlan:
    """One layout's launch of a kernel whose tensor arguments are plain pointers (no descriptors): key, grid, integer
    arguments and constexprs decided once by the caller; the first launch goes through `launcher` (a Launcher), later
    ones straight to the compiled kernel's C launcher (Raw) with the tensors' addresses. Holds no tensor."""

    __slots__ = ("launcher", "key", "grid", "ints", "consts", "warps", "stages", "index", "raw", "pdl")

    def __init__(self, launcher: Launcher, key, grid, ints, consts, warps: int, stages: int, device: torch.device,
                 pdl: bool = False):
        self.launcher, self.key, self.grid, self.ints, self.consts = launcher, key, grid, ints, consts
        self.warps, self.stages, self.pdl = warps, stages, pdl
        self.index, self.raw = device_index(device), None

    def launch(self, tensors) -> None:
        raw = self.raw
        if raw is not None and not launch_hooks_set():
            raw(self.grid, torch._C._cuda_getCurrentRawStream(self.index),
                (*[t.data_ptr() for t in tensors], *self.ints, *self.consts))
            return
        self.launcher(self.key, self.grid, (*tensors, *self.ints), self.consts, num_warps=self.warps,
                      num_stages=self.stages, launch_pdl=self.pdl)
        if self.index >= 0:
            self.raw = self.launcher.raw(self.key, self.index)


class Raw:
    """A compiled kernel's own C launch function, called with its arguments already in flat form.

    Triton's launcher wraps a generated C function in two Python layers: one allocates scratch space, the other
    turns each host TMA descriptor into an encoded CUtensorMap plus its shape and strides (a driver call per
    descriptor, every launch), and the C function then asks the driver to confirm every tensor's pointer. A plan
    that already knows its operands' layout calls the C function directly: pointers as plain integers, descriptors
    encoded once per address (`encode`). Built only when the compiled kernel needs no scratch space and every
    descriptor was lowered to a CUtensorMap; otherwise `of` gives None and the plan launches through `compiled`.
    """

    __slots__ = ("c_launch", "tail", "desc_meta", "fill")

    @staticmethod
    def of(compiled) -> "Raw | None":
        try:
            launcher = compiled.run
            wrapped = launcher.launch
            names = getattr(getattr(wrapped, "__code__", None), "co_freevars", ())
            c_launch = wrapped.__closure__[names.index("launcher")].cell_contents if "launcher" in names else wrapped
            if launcher.global_scratch_size or launcher.profile_scratch_size or launcher.num_ctas != 1:
                return None
            signature = list(compiled.src.signature.values())
            descs = [i for i, s in enumerate(signature) if isinstance(s, str) and s.startswith("tensordesc")]
            meta = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
            if len(meta) != len(descs) or any(m is None or m.get("fp4_padded") for m in meta):
                return None
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            r = Raw()
            r.c_launch = c_launch
            r.tail = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                      compiled.packed_metadata, None, None, None)
            r.desc_meta = {i: (m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                               m["block_size"]) for i, m in zip(descs, meta)}
            r.fill = triton.runtime.driver.active.utils.fill_tma_descriptor
            return r
        except (AttributeError, KeyError, IndexError, TypeError, ValueError, ImportError):
            return None  # another Triton's launcher layout: launch through Triton's own path

    def encode(self, index: int, ptr: int, shape, strides) -> tuple:
        """The flat form of the descriptor at argument `index` over memory at `ptr`: (CUtensorMap, *shape, *strides).
        The map holds only the address and the geometry, so one encoded map serves every tensor at that address
        with that layout."""
        swizzle, elem_size, elem_type, block = self.desc_meta[index]
        return (self.fill(ptr, swizzle, elem_size, elem_type, block, list(shape), list(strides), 0),
                *shape, *strides)

    def __call__(self, grid, stream: int, flat) -> None:
        self.c_launch(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, *self.tail, *flat)


class Maps:
    """Encoded descriptors of one plan operand whose address changes between calls (an input, a fresh output), by
    address. The caching allocator hands the same few addresses back step after step, so most calls hit."""

    __slots__ = ("raw", "index", "shape", "strides", "by_ptr")
    LIMIT = 64

    def __init__(self, raw: Raw, index: int, shape, strides):
        self.raw, self.index, self.shape, self.strides, self.by_ptr = raw, index, tuple(shape), tuple(strides), {}

    def __call__(self, ptr: int) -> tuple:
        flat = self.by_ptr.get(ptr)
        if flat is None:
            if len(self.by_ptr) >= self.LIMIT:
                self.by_ptr.clear()
            flat = self.by_ptr[ptr] = self.raw.encode(self.index, ptr, self.shape, self.strides)
        return flat


# Largest element offset a kernel may compute in 32-bit integer math. Triton keeps tensor indices in int32 unless
# told otherwise, so `row * stride` wraps past 2**31 and reads or writes the wrong place: a [75k, 2·14336] buffer is
# enough. Launches whose tensors reach that far compile an int64-index variant (the I64 constexpr); everything
# smaller keeps 32-bit math, which is cheaper in registers and address arithmetic.
INT32_SPAN = 2**31 - 1


def span(t: torch.Tensor) -> int:
    """The largest element offset from `t`'s data pointer that indexing it can reach (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


def needs_i64(*tensors) -> bool:
    """Whether any tensor's reach (see `span`) passes what int32 offsets can address."""
    return any(t is not None and span(t) > INT32_SPAN for t in tensors)


def align16(t) -> bool:
    """The pointer-alignment fact Triton specializes a tensor argument on."""
    return t.data_ptr() % 16 == 0


def int_class(v: int) -> tuple[bool, bool]:
    """The facts Triton specializes an integer argument on (== 1, multiple of 16): what a launch key must hold for
    an integer it does not hold exactly."""
    return v == 1, v % 16 == 0


# RMSNorm prologues (a kernel's NORM constexpr): none; weight·x·r (Llama, Mistral, Qwen, ...); x·r·(1 + weight)
# (Gemma); r = 1/sqrt(mean(x²) + eps) per row, in fp32. ops.norm's WEIGHT_AFTER and ONE_PLUS are these values.
NORM_NONE, NORM_WEIGHT_AFTER, NORM_ONE_PLUS = 0, 1, 2


def check_norm(x: torch.Tensor, weight, eps, kind, same_dtype: bool = False) -> None:
    """The RMSNorm prologue's arguments for x [M, D]: one InputError line naming what is wrong. `same_dtype`: the
    weight in x's dtype too (the kernels whose ops hand over only such norms)."""
    if kind == NORM_NONE:
        if weight is not None:
            raise InputError("norm_weight: given without a norm_kind")
        return
    if kind not in (NORM_WEIGHT_AFTER, NORM_ONE_PLUS):
        raise InputError(f"norm_kind: expected {NORM_WEIGHT_AFTER} (weight·norm(x)) or {NORM_ONE_PLUS} "
                         f"(norm(x)·(1+weight)), got {kind!r}")
    d = x.shape[1]
    if (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (d,) or weight.stride(0) != 1
            or not weight.is_floating_point() or weight.device != x.device):
        raise InputError(f"norm_weight: expected a contiguous floating-point [{d}] tensor on {x.device}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise InputError(f"norm_eps: expected a non-negative number, got {eps!r}")
    if same_dtype and weight.dtype != x.dtype:
        raise InputError(f"norm_weight: expected {x.dtype} (x's dtype), got {weight.dtype}")



def check_residual(residual, shape, like: torch.Tensor) -> None:
    """A residual an epilogue can add: None, or a contiguous tensor of the output's `shape` and `like`'s dtype and
    device."""
    if residual is None:
        return
    if (not isinstance(residual, torch.Tensor) or residual.dtype != like.dtype or residual.device != like.device
            or residual.shape != shape or not residual.is_contiguous()):
        raise InputError(f"residual: expected a contiguous tensor of {tuple(shape)} and dtype {like.dtype} on "
                         f"{like.device}, got {_describe(residual)}")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "" if t.is_contiguous() else "non-contiguous "
    return f"{layout}{tuple(t.shape)} {t.dtype} on {t.device}"

# FP8 weights against 16-bit activations run fp16 MMAs (kernels.fp8_gemm's weight-only kernel, F16; the decode
# kernel's W8): the weights go as W·2^-15 (every e4m3 value is then an fp16 value), the activations as
# x·FP16_X_SHIFT rounded to fp16 (a runtime argument: as a constant, the compiler rounded x before scaling it), and
# each scale block's sums are multiplied back by 2^21 with the block's scale. Why and the range: fp8_gemm's kernel.
FP16_X_SHIFT = 2.0**-6
FP16_X_LIMIT = 65520 / FP16_X_SHIFT  # 16-bit x at or past this magnitude overflows its fp16 copy (±inf)
FP16_UNDO = tl.constexpr(2.0**21)


@triton.jit
def fp16_weights(w):
    """An e4m3 tile as fp16 times 2^-15: exact (e4m3's smallest value, 2^-9, becomes fp16's smallest, 2^-24)."""
    return w.to(tl.float16) * 3.0517578125e-05


@triton.jit
def fp16_activations(v, shift):
    """A 16-bit or fp32 activation tile as fp16 times `shift` (FP16_X_SHIFT, passed at run time), scaled in fp32."""
    return (v.to(tl.float32) * shift).to(tl.float16)
