"""The CUDA backend (mlpfuse/csrc): its sources compile, its absence is one clear error, its numerics match fp64.

On a CPU machine with nvcc the sources are compiled to object files with the flags torch.utils.cpp_extension writes
into its own build file (no link: a CPU torch has no CUDA libraries), which catches syntax and type errors. The
numerical tests need a CUDA device.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from cli_run import HANG_S

import mlpfuse
from mlpfuse import csrc, ops, reference
from mlpfuse.activations import NAMES
from mlpfuse.errors import InputError
from mlpfuse.ops import dispatch

HAS_CUDA = torch.cuda.is_available()
NVCC = csrc.find_nvcc()


def _cuda_home(nvcc: str) -> str:
    """The toolkit root nvcc itself reports (`TOP=` of its dry run): /usr/local/bin/nvcc may be a wrapper script."""
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=HANG_S)
    top = re.search(r"TOP=(\S+)", out.stdout + out.stderr)
    return os.path.realpath(top.group(1)) if top else str(Path(nvcc).resolve().parent.parent)


def _compile(tmp_path_factory, arch: str, cuda_only: bool = False):
    """Compile the sources with cpp_extension's generated build.ninja for TORCH_CUDA_ARCH_LIST=arch (only the .cu
    ones with cuda_only); (returncode, output, objects, build.ninja text, folder)."""
    from torch.utils import cpp_extension

    folder = tmp_path_factory.mktemp("cuda-objects")
    home = _cuda_home(NVCC)
    extra_cflags = list(csrc.EXTRA_CFLAGS)
    extra_cuda = list(csrc.EXTRA_CUDA_CFLAGS)
    torch_include = Path(cpp_extension.include_paths()[0])
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        # A CPU wheel ships c10/cuda's headers without this generated one (a CUDA wheel has it).
        extra_cflags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
        extra_cuda.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    saved_home, saved_arch = cpp_extension.CUDA_HOME, os.environ.get("TORCH_CUDA_ARCH_LIST")
    cpp_extension.CUDA_HOME = home  # a CPU torch found no toolkit; tell it where nvcc's is
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        write = cpp_extension._write_ninja_file_to_build_library
        wanted = dict(path=str(folder / "build.ninja"), name="mlpfuse_cuda_check",
                      sources=[str(csrc.HERE / s) for s in csrc.SOURCES], extra_cflags=extra_cflags,
                      extra_cuda_cflags=extra_cuda, extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[],
                      with_cuda=True, with_sycl=False, is_standalone=False)
        params = inspect.signature(write).parameters
        write(**{k: v for k, v in wanted.items() if k in params})
    finally:
        cpp_extension.CUDA_HOME = saved_home
        if saved_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch
    ninja = (folder / "build.ninja").read_text()
    objects = re.findall(r"^build (\S+\.o):", ninja, flags=re.M)
    if cuda_only:
        objects = [o for o in objects if o.endswith(".cuda.o")]
    env = dict(os.environ, PATH=f"{home}/bin:{os.environ.get('PATH', '')}")
    run = subprocess.run(["ninja", "-C", str(folder), f"-j{min(3, len(objects))}", *objects], capture_output=True,
                         text=True, env=env, timeout=HANG_S)
    return run.returncode, run.stdout + run.stderr, objects, ninja, folder


@pytest.fixture(scope="session")
def compiled_objects(tmp_path_factory):
    """Every source compiled once per session for the GPU the backend is measured on (H200, sm_90)."""
    return _compile(tmp_path_factory, "9.0")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME or PATH): the CUDA sources cannot be compiled")
def test_sources_compile_with_cpp_extension_flags(compiled_objects):
    rc, output, objects, ninja, folder = compiled_objects
    assert rc == 0, output[-6000:]
    assert len(objects) == len(csrc.SOURCES)
    for obj in objects:
        assert (folder / obj).stat().st_size > 0
    # The flags are cpp_extension's: its nvcc defines, the sm_90 target, its C++ standard.
    assert "-D__CUDA_NO_HALF_CONVERSIONS__" in ninja and "sm_90" in ninja and re.search(r"-std=c\+\+\d\d", ninja)
    # Every kernel family is in the objects: the pointwise GLU kernels and the decode kernels (tensor-core ones for
    # 16-bit types, through registers or, on sm_90, shared memory; CUDA-core ones for fp32), each per dtype.
    symbols = subprocess.run(["nm", "-C", *(str(folder / o) for o in objects)], capture_output=True, text=True).stdout
    for name in ("glu_forward_kernel<__nv_bfloat16, 8", "glu_backward_kernel<__half, 4", "bias_act_kernel<float, 4",
                 "decode_gemv_mma_kernel<__nv_bfloat16, 2, 2", "decode_gemv_mma_kernel<__half, 1, 1",
                 "decode_gemv_bulk_kernel<__nv_bfloat16, 1, 2", "decode_gemv_bulk_kernel<__half, 1, 1",
                 "decode_gate_up_tma_kernel<__nv_bfloat16, 2", "decode_gate_up_tma_kernel<__half, 1",
                 "decode_gemv_fma_kernel<2, 16>", "mlpfuse::gated_mlp_backward"):
        assert name in symbols, name


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME or PATH): the CUDA sources cannot be compiled")
def test_cuda_sources_compile_for_sm80(tmp_path_factory):
    # sm_90-only code (programmatic dependent launch, 16-byte float atomics) sits behind __CUDA_ARCH__ guards: the
    # sources must still build for an A100.
    rc, output, objects, ninja, folder = _compile(tmp_path_factory, "8.0", cuda_only=True)
    assert rc == 0, output[-6000:]
    assert "sm_80" in ninja and "sm_90" not in ninja
    assert len(objects) == sum(s.endswith(".cu") for s in csrc.SOURCES)


def test_backend_name_is_accepted(monkeypatch):
    assert dispatch.check_backend_name("cuda") == "cuda"
    assert dispatch.check_backend_name(" CUDA ") == "cuda"
    assert dispatch.resolve_backend("cuda") == "cuda"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    assert dispatch.resolve_backend("") == "cuda"


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process that has not tried the extension yet, building into its own cache folder."""
    monkeypatch.setattr(csrc, "_state", {})
    monkeypatch.setenv("MLPFUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_backend_without_cuda_is_one_input_error(fresh_state, monkeypatch):
    x, w, wd = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    calls = [
        lambda: ops.gated_mlp(x, w, w, wd, backend="cuda"),
        lambda: ops.linear_act(x, w, activation="silu", backend="cuda"),
        lambda: mlpfuse.GatedMLP(8, 16, backend="cuda")(x),
        lambda: mlpfuse.FusedLinear(8, 16, activation="gelu_tanh", backend="cuda")(x),
    ]
    for call in calls:
        with pytest.raises(InputError) as err:
            call()
        text = str(err.value)
        assert "\n" not in text and text.startswith("backend: 'cuda' is not available: ")
        assert ("without CUDA" in text) or ("no CUDA device" in text)
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")  # the environment variable selects it the same way
    with pytest.raises(InputError, match="backend: 'cuda' is not available"):
        ops.gated_mlp(x, w, w, wd)


def test_auto_never_picks_cuda():
    x = torch.randn(2048, 768)
    for training in (False, True):
        assert dispatch.gated_mlp_path("auto", x, 3072, training) != dispatch.CUDA
    assert dispatch.linear_act_path("auto", x, 3072, 1) != "cuda"


@pytest.mark.skipif(HAS_CUDA, reason="a CPU torch makes the real build fail quickly")
def test_failed_build_names_its_log_and_is_not_retried(fresh_state, monkeypatch):
    # Past the environment checks, the real cpp_extension build runs and fails (this torch has no CUDA).
    monkeypatch.setattr(csrc, "environment_problem", lambda: None)
    with pytest.raises(InputError) as err:
        csrc.extension()
    text = str(err.value)
    assert "\n" not in text and "building the CUDA extension failed; build log: " in text
    log = Path(text.split("build log: ", 1)[1])
    assert log.is_file() and log.parent.parent == fresh_state / "cuda-ext" and log.read_text().strip()
    log.unlink()
    with pytest.raises(InputError, match="build log"):  # the same answer, without building again
        csrc.extension()
    assert not log.exists()


def test_sources_are_package_data():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for pattern in ("csrc/*.cpp", "csrc/*.cu", "csrc/*.cuh", "csrc/*.h"):
        assert pattern in text
    for name in csrc.SOURCES + csrc.HEADERS:
        assert (csrc.HERE / name).is_file()


# --- on a GPU -------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (and nvcc to build the extension)")
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.fixture
def strict_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _weights(dim, hidden, dtype, bias, scale=0.5):
    def t(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale).to(dtype)

    return t(hidden, dim) / dim**0.5, t(hidden, dim) / dim**0.5, t(dim, hidden) / hidden**0.5, \
        (t(hidden) if bias else None), (t(hidden) if bias else None), (t(dim) if bias else None)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", NAMES)
@pytest.mark.parametrize("m", [1, 5, 16, 300])  # decode kernel up to 16 tokens, GEMMs + GLU kernel above
def test_gated_forward_matches_fp64(dtype, activation, m, strict_fp32):
    dim, hidden = 264, 712
    for bias in (False, True):
        wg, wu, wd, bg, bu, bd = _weights(dim, hidden, dtype, bias)
        x = torch.randn(m, dim, device="cuda", dtype=dtype)
        y = ops.gated_mlp(x, wg, wu, wd, activation, bg, bu, bd, backend="cuda")
        want = reference.gated_mlp(x, wg, wu, wd, activation, bg, bu, bd)
        assert _err(y, want) < TOL[dtype], (dtype, activation, m, bias)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_at_every_token_count_matches_fp64_and_repeats_bitwise(dtype, strict_fp32):
    # The decode kernels at 1..16 tokens (one and two token tiles, partial ones), x with a row stride past its width,
    # sizes that end in partial k chunks and partial 16-row tiles, and warps whose span of k is empty (264 and 712
    # are a few chunks each); fixed-order sums give the same bits every run.
    ext = csrc.extension()
    act = mlpfuse.activations.get("silu")
    dim, hidden = 264, 712
    for bias in (False, True):
        wg, wu, wd, bg, bu, bd = _weights(dim, hidden, dtype, bias)
        for m in range(1, 17):
            x = torch.randn(m, dim + 8, device="cuda", dtype=dtype)[:, :dim]
            y = ext.gated_mlp_forward(x, wg, wu, wd, bg, bu, bd, act.id, False, True)[0]
            want = reference.gated_mlp(x, wg, wu, wd, "silu", bg, bu, bd)
            assert _err(y, want) < TOL[dtype], (dtype, m, bias)
            again = ext.gated_mlp_forward(x, wg, wu, wd, bg, bu, bd, act.id, False, True)[0]
            assert torch.equal(y, again), (dtype, m, bias)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_decode_streams_the_weights_through_shared_memory_on_sm90(dtype):
    # On sm_90 gate/up is the tensor-copy kernel and down the shared-memory one (bulk copies), not the register
    # kernel. The kernels that ran, read off the profiler's trace.
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the shared-memory decode kernel needs sm_90")
    from torch.profiler import ProfilerActivity, profile

    ext = csrc.extension()
    act = mlpfuse.activations.get("gelu_tanh")
    wg, wu, wd, *_ = _weights(264, 712, dtype, False)
    for m in (1, 16):
        x = torch.randn(m, 264, device="cuda", dtype=dtype)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ext.gated_mlp_forward(x, wg, wu, wd, None, None, None, act.id, False, True)
            torch.cuda.synchronize()
        names = sorted(e.name for e in prof.events() if "decode_g" in e.name)
        assert len(names) == 2, names
        up, down = names  # "decode_gate_up_tma_kernel<T, NT, ...>" sorts before "decode_gemv_bulk_kernel<T, 1, ...>"
        assert "decode_gate_up_tma_kernel" in up and f", {1 if m <= 8 else 2}, " in up, names
        assert "decode_gemv_bulk_kernel" in down and ", 1, " in down, names


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_decode_captured_in_a_cuda_graph_replays_the_uncaptured_bits(dtype):
    # The decode pair as a CUDA graph (the dependent launch recorded as a programmatic edge, the shared-memory kernel
    # on sm_90): a replay gives the bits of an uncaptured call, and follows new contents of the captured input.
    ext = csrc.extension()
    act = mlpfuse.activations.get("silu")
    wg, wu, wd, bg, bu, bd = _weights(264, 712, dtype, True)
    for m in (1, 16):
        x = torch.randn(m, 264, device="cuda", dtype=dtype)
        call = lambda: ext.gated_mlp_forward(x, wg, wu, wd, bg, bu, bd, act.id, False, True)[0]  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = call()
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, call()), (dtype, m)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", NAMES)
def test_gated_gradients_match_fp64(dtype, activation, strict_fp32):
    m, dim, hidden = 200, 136, 328
    wg, wu, wd, bg, bu, bd = _weights(dim, hidden, dtype, True)
    params = [t.detach().requires_grad_() for t in (wg, wu, wd, bg, bu, bd)]
    x = torch.randn(3, m // 3, dim, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(3, m // 3, dim, device="cuda", dtype=dtype)
    y = ops.gated_mlp(x, params[0], params[1], params[2], activation, *params[3:], backend="cuda")
    y.backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, *params)]
    yr = reference.gated_mlp(ref[0], ref[1], ref[2], ref[3], activation, *ref[4:])
    yr.backward(dy.double())
    assert _err(y, yr.detach()) < TOL[dtype]
    for got, want in zip((x, *params), ref):
        assert _err(got.grad, want.grad) < 2 * TOL[dtype]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", (None, *NAMES))
def test_linear_act_matches_fp64(dtype, activation, strict_fp32):
    for bias in (False, True):
        x = torch.randn(2, 97, 200, device="cuda", dtype=dtype, requires_grad=True)
        w = (torch.randn(328, 200, device="cuda", dtype=dtype) / 200**0.5).requires_grad_()
        b = torch.randn(328, device="cuda", dtype=dtype).requires_grad_() if bias else None
        y = ops.linear_act(x, w, b, activation, backend="cuda")
        want = reference.linear_act(x, w, b, activation)
        assert _err(y, want) < TOL[dtype], (dtype, activation, bias)
        y.sum().backward()  # the saved pre-activation feeds the backward
        xr = x.detach().double().requires_grad_()
        reference.linear_act(xr, w.double(), None if b is None else b.double(), activation).sum().backward()
        assert _err(x.grad, xr.grad) < 2 * TOL[dtype]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", NAMES)
def test_glu_kernels_alone_match_fp64_odd_layouts(dtype, activation):
    ext = csrc.extension()
    act = mlpfuse.activations.get(activation)
    for rows, cols, sliced in ((513, 3072, False), (77, 1001, False), (64, 512, True)):
        base = torch.randn(rows, cols + 8, device="cuda", dtype=dtype) * 2
        g = base[:, 1:cols + 1] if sliced else base[:, :cols].contiguous()  # sliced: misaligned, scalar path
        u = torch.randn(rows, cols, device="cuda", dtype=dtype)
        dh = torch.randn(rows, cols, device="cuda", dtype=dtype)
        gd, ud, dhd = g.double(), u.double(), dh.double()
        assert _err(ext.glu_forward(g, u, act.id), act.forward(gd) * ud) < TOL[dtype]
        dg, du, h, dbg, dbu = ext.glu_backward(dh, g, u, act.id, True, True)
        want_dg, want_du = dhd * ud * act.grad(gd), dhd * act.forward(gd)
        assert _err(dg, want_dg) < 2 * TOL[dtype] and _err(du, want_du) < TOL[dtype]
        assert _err(h, act.forward(gd) * ud) < TOL[dtype]
        assert _err(dbg, want_dg.sum(0)) < 2 * TOL[dtype] and _err(dbu, want_du.sum(0)) < 2 * TOL[dtype]


@gpu
@pytest.mark.gpu
def test_bad_tensors_are_one_input_error():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    wd = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match="x is on cpu"):
        ops.gated_mlp(x.cpu(), w.cpu(), w.cpu(), wd.cpu(), backend="cuda")
    with pytest.raises(InputError, match="float64"):
        ops.gated_mlp(x.double(), w.double(), w.double(), wd.double(), backend="cuda")
    ext = csrc.extension()
    with pytest.raises(ValueError, match="down_weight: expected shape"):
        ext.gated_mlp_forward(x, w, w, w, None, None, None, 1, False, True)
    with pytest.raises(InputError, match="^down_weight: expected shape") as err:
        dispatch.cuda_call(ext.gated_mlp_forward, x, w, w, w, None, None, None, 1, False, True)
    assert "\n" not in str(err.value)


@gpu
@pytest.mark.gpu
def test_benchmark_script_runs_small():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_backend_gpu.py"
    env = dict(os.environ, PYTHONPATH=str(Path(mlpfuse.__file__).resolve().parents[1]))
    run = subprocess.run(["python3", str(script), "--quick"], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "numerics: PASS" in run.stdout


def test_extension_argument_errors_become_one_input_error_line():
    # What the C++ checks raise (c10 ValueError: argument name first, maybe a C++ trace after) becomes one line;
    # a CUDA error is not an input error and propagates as it is.
    def bad_shape():
        raise ValueError("down_weight: expected shape [64, 128], got [128, 64]\nException raised from check_like")

    def cuda_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(InputError) as err:
        dispatch.cuda_call(bad_shape)
    assert str(err.value) == "down_weight: expected shape [64, 128], got [128, 64]"
    with pytest.raises(RuntimeError, match="CUDA error"):
        dispatch.cuda_call(cuda_error)
