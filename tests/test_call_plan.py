"""A module's per-layout call plan (ops.gated_mlp.CallPlan; FusedLinear's ops.linear_act.LinearActPlan at the
end): a repeated call skips the checks and the path choice, and an entry never serves a call it was not made for —
other strides, alignment, dtype, device, grad mode, backend, or weights replaced, re-pointed or freed and their
memory reused.

Every result is checked against a float64 reference of the weights the module holds at that moment. On CPU the
torch path runs everywhere and the Triton paths through the interpreter (fp32); on CUDA the same tests run the
compiled kernels.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import mlpfuse
from mlpfuse.modules import PackedGatedMLP
from mlpfuse.errors import InputError
from mlpfuse.kernels import available
from mlpfuse.ops import dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch"] + (["triton"] if available() else [])
DIM, HIDDEN = 24, 40


def ref(m: mlpfuse.GatedMLP, x: torch.Tensor) -> torch.Tensor:
    w = [t.double() if t is not None else None for t in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight,
                                                          m.gate_proj.bias, m.up_proj.bias, m.down_proj.bias)]
    x = x.double()
    g = F.linear(x, w[0], w[3])
    u = F.linear(x, w[1], w[4])
    return F.linear(F.silu(g) * u, w[2], w[5])


def close(y, want, tol=1e-4):
    assert y.shape == want.shape
    err = ((y.double() - want).norm() / want.norm()).item()
    assert err < tol, err


def module(backend, bias=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mlpfuse.GatedMLP(DIM, HIDDEN, activation="silu", bias=bias, device=DEVICE, dtype=dtype, backend=backend)


def rand(*shape, dtype=torch.float32, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def gated_rows() -> int:
    """Rows past every decode path, so that backend="triton" runs the gated GEMM (the paths' plans differ)."""
    return dispatch.decode_max_m() + 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_take_one_entry_and_stay_right(backend):
    m = module(backend)
    x = rand(gated_rows(), DIM)
    with torch.no_grad():
        for _ in range(3):
            close(m(x), ref(m, x))
    assert len(m._plan.entries) == 1
    with torch.no_grad():  # in-place weight updates (optimizer steps, load_state_dict) keep the entry and are seen
        m.up_proj.weight.mul_(-0.5)
        m.gate_proj.weight.add_(0.25)
        close(m(x), ref(m, x))
    assert len(m._plan.entries) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_layouts_of_x_get_their_own_entries(backend):
    m = module(backend)
    n = gated_rows()
    base = rand(n + 1, 2 * DIM, seed=3)
    with torch.no_grad():
        xs = [base[:n, :DIM].contiguous(),   # plain
              base[:n, :DIM],                # row stride 2·DIM
              base.flatten()[1:n * DIM + 1].view(n, DIM),  # 4 bytes off a 16-byte boundary
              base[:n, :DIM].t().contiguous().t(),  # column-major
              base[: 2 * 3, :DIM].reshape(2, 3, DIM)]  # 3-D, fewer rows: another path may apply
        for x in xs:
            close(m(x), ref(m, x))
    assert len(m._plan.entries) == len(xs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replaced_weights_are_never_served_by_an_old_entry(backend):
    m = module(backend, bias=True)
    x = rand(gated_rows(), DIM)
    with torch.no_grad():
        m(x)
        m.gate_proj.weight = torch.nn.Parameter(rand(HIDDEN, DIM, seed=7))  # a new tensor: another address
        close(m(x), ref(m, x))
        m.up_proj.bias = torch.nn.Parameter(rand(HIDDEN, seed=8))
        close(m(x), ref(m, x))
        m.down_proj.weight.data = rand(DIM, HIDDEN, seed=9)  # .data re-pointed on the same Parameter
        close(m(x), ref(m, x))
        m.down_proj.bias = None
        close(m(x), ref(m, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_freed_weight_memory_reused_by_another_tensor(backend):
    # A weight freed and a new one of the same size allocated: the allocator may hand out the same address. The
    # entry keyed on that address must then serve only if the new tensor has the same layout, and reads its values.
    m = module(backend)
    x = rand(gated_rows(), DIM)
    with torch.no_grad():
        m(x)
        reused = 0
        for seed in range(10, 20):
            old = m.up_proj.weight.data_ptr()
            m.up_proj.weight = None
            m.up_proj.weight = torch.nn.Parameter(rand(HIDDEN, DIM, seed=seed))
            reused += m.up_proj.weight.data_ptr() == old
            close(m(x), ref(m, x))
    if DEVICE == "cuda":
        assert reused, "the caching allocator gave every new weight a fresh address: the case was not exercised"


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_address_other_shape_or_dtype_gets_the_checks(backend):
    m = module(backend)
    x = rand(gated_rows(), DIM)
    with torch.no_grad():
        m(x)
        w = m.gate_proj.weight
        keep = w.data
        w.data = keep[:, : DIM - 8]  # same address, fewer columns
        with pytest.raises(InputError, match=r"^x: expected last dimension 16 \(the module"):
            m(x)
        w.requires_grad_(False)  # (autograd refuses integer data on a parameter that requires grad)
        w.data = keep.view(torch.int32)  # same address and shape, another dtype
        with pytest.raises(InputError, match="gate_weight"):
            m(x)
        w.data = keep
        close(m(x), ref(m, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_and_grad_mode_switch_entries(backend):
    m = module(backend)
    x = rand(gated_rows(), DIM)
    with torch.no_grad():
        close(m(x), ref(m, x))
    # Autograd on: the training path, with every gradient right.
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    close(y.detach(), ref(m, x))
    dy = rand(*y.shape, seed=5)
    y.backward(dy)
    x64 = x.double().requires_grad_(True)
    params = [p.detach().double().requires_grad_(True) for p in (m.gate_proj.weight, m.up_proj.weight,
                                                                  m.down_proj.weight)]
    y64 = F.linear(F.silu(F.linear(x64, params[0])) * F.linear(x64, params[1]), params[2])
    y64.backward(dy.double())
    close(xg.grad, x64.grad, 1e-3)
    for p, p64 in zip((m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight), params):
        close(p.grad, p64.grad, 1e-3)
    assert len(m._plan.entries) == 2
    if backend == "torch":  # fp64 has no Triton kernel
        m64 = copy.deepcopy(m).double()
        with torch.no_grad():
            close(m64(x.double()), ref(m64, x), 1e-12)
        assert len(m64._plan.entries) == 1  # the copy started empty, then took one for its own dtype


def test_backend_from_the_environment_is_read_per_call(monkeypatch):
    m = module(None)
    x = rand(3, DIM)
    monkeypatch.setenv("MLPFUSE_BACKEND", "torch")
    with torch.no_grad():
        close(m(x), ref(m, x))
        monkeypatch.setenv("MLPFUSE_BACKEND", "bogus")
        with pytest.raises(InputError, match="^MLPFUSE_BACKEND: "):
            m(x)


def assert_bad_input_after_a_good_call_is_refused(m):
    """A module whose plan served a good call still raises the op layer's errors for a new, bad layout."""
    m(rand(4, DIM))
    with pytest.raises(InputError, match=r"^x: "):
        m(rand(4, DIM + 1))
    with pytest.raises(InputError, match="dtype"):
        m(rand(4, DIM, dtype=torch.float64))


def test_bad_input_after_a_good_call_gets_the_same_error():
    m = module("torch")
    with torch.no_grad():
        assert_bad_input_after_a_good_call_is_refused(m)
        if DEVICE == "cuda":
            with pytest.raises(InputError, match=r"^x: x is on cpu but the module.s weights \(gate_proj.weight\) are on cuda"):
                m(torch.randn(4, DIM))


def test_entries_are_bounded_and_copies_start_empty():
    m = module("torch")
    with torch.no_grad():
        for n in range(1, m._plan.MAX_ENTRIES + 5):
            m(rand(n, DIM))
    assert 0 < len(m._plan.entries) <= m._plan.MAX_ENTRIES
    assert len(copy.deepcopy(m)._plan.entries) == 0
    assert len(pickle.loads(pickle.dumps(m))._plan.entries) == 0


def test_autocast_calls_bypass_the_plan():
    m = module("torch")
    x = rand(3, DIM)
    with torch.no_grad():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            # autocast casts the weights on every call: fresh copies, no layout worth remembering
            assert m(x).dtype == torch.bfloat16
    assert len(m._plan.entries) == 0


@pytest.mark.skipif(not available(), reason="Triton kernels cannot run here")
def test_packed_module_uses_its_plan():
    torch.manual_seed(0)
    m = PackedGatedMLP(DIM, HIDDEN, activation="silu", device=DEVICE, backend="triton")
    x = rand(gated_rows(), DIM)
    w = m.gate_up_proj.weight.double()
    with torch.no_grad():
        want = F.linear(F.silu(x.double() @ w[:HIDDEN].T) * (x.double() @ w[HIDDEN:].T), m.down_proj.weight.double())
        close(m(x), want)
        close(m(x), want)
    assert len(m._plan.entries) == 1


# --- FusedLinear and the patched linear+activation blocks: ops.linear_act.LinearActPlan -------------------------

def linear(backend, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return mlpfuse.FusedLinear(DIM, HIDDEN, bias=bias, activation="gelu", device=DEVICE, dtype=dtype, backend=backend)


def linear_ref(m: mlpfuse.FusedLinear, x: torch.Tensor) -> torch.Tensor:
    b = m.bias.double() if m.bias is not None else None
    return F.gelu(F.linear(x.double(), m.weight.double(), b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_plan_serves_layouts_and_sees_replaced_weights(backend):
    m = linear(backend)
    # On the torch backend every call is eager's F.linear + activation: nothing to plan, so the plan stays empty.
    planned = backend != "torch"
    x = rand(5, 3, DIM)  # leading dimensions kept
    with torch.no_grad():
        for _ in range(2):
            close(m(x), linear_ref(m, x))
        assert len(m._plan.entries) == planned
        m.weight.mul_(-0.5)  # in place: same entry, new values
        close(m(x), linear_ref(m, x))
        assert len(m._plan.entries) == planned
        m.weight = torch.nn.Parameter(rand(HIDDEN, DIM, seed=9))  # replaced: another address, another entry
        close(m(x), linear_ref(m, x))
        xt = rand(DIM, 7, seed=4).t()  # strided x
        close(m(xt), linear_ref(m, xt))
    assert len(m._plan.entries) == 3 * planned


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_plan_grad_switch_and_gradients(backend):
    m = linear(backend)
    x = rand(6, DIM, seed=5)
    with torch.no_grad():
        close(m(x), linear_ref(m, x))
    xg = x.clone().requires_grad_()
    y = m(xg)
    dy = rand(*y.shape, seed=6)
    y.backward(dy)
    w64 = m.weight.detach().double().requires_grad_()
    b64 = m.bias.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    F.gelu(F.linear(x64, w64, b64)).backward(dy.double())
    close(xg.grad, x64.grad)
    close(m.weight.grad, w64.grad)
    close(m.bias.grad, b64.grad)
    # Inference and training are separate entries (none on the torch backend: every call is eager's own ops).
    assert len(m._plan.entries) == (2 if backend != "torch" else 0)


def test_fused_linear_bad_input_after_a_good_call_gets_the_same_error():
    m = linear("torch")
    with torch.no_grad():
        assert_bad_input_after_a_good_call_is_refused(m)
        entries = len(m._plan.entries)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            assert m(rand(4, DIM)).dtype == torch.bfloat16
        assert len(m._plan.entries) == entries  # autocast's casts bypass the plan
    assert len(copy.deepcopy(m)._plan.entries) == 0
    assert len(pickle.loads(pickle.dumps(m))._plan.entries) == 0


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs the Triton kernels (or their interpreter)")
@pytest.mark.parametrize("bias", [False, True])
def test_a_planned_call_records_few_dispatcher_ops_under_the_profiler(bias):
    """Under torch.profiler (shapes recorded, as the walkthrough runs it) every dispatcher op costs host time. A
    planned call on the gated path views 3-D x as rows (no flatten), runs the down projection as the mm / addmm that
    F.linear would reach (no aten::linear, aten::matmul around it) and views the result back (no reshape)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(5)
    m = mlpfuse.GatedMLP(DIM, HIDDEN, activation="silu", bias=bias, backend="triton", device=DEVICE)
    x = torch.randn(3, 70, DIM, device=DEVICE)
    with torch.no_grad():
        assert dispatch.gated_mlp_path("triton", x.view(-1, DIM), HIDDEN, False) == dispatch.GATED
        for _ in range(2):
            m(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            y = m(x)
    names = {e.name for e in prof.events()}
    assert "mlpfuse::gated_mlp" in names
    assert not names & {"aten::linear", "aten::matmul", "aten::flatten", "aten::reshape"}, sorted(names)
    assert ("aten::addmm" if bias else "aten::mm") in names
    close(y, ref(m, x))


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs the Triton kernels (or their interpreter)")
def test_decode_calls_of_any_rank_and_layout_keep_their_shape_and_values():
    """The decode path's steady call reads a contiguous x of any rank as its rows; other layouts go through a 2-D
    copy or view. Each layout, called twice (the second through the held plan), matches the fp64 reference."""
    torch.manual_seed(6)
    m = mlpfuse.GatedMLP(DIM, HIDDEN, activation="silu", backend="triton", device=DEVICE)
    base = torch.randn(4, 3, 2 * DIM, device=DEVICE)
    layouts = {
        "3-D": base[..., :DIM].contiguous(),
        "4-D": base[..., :DIM].contiguous().view(2, 2, 3, DIM),
        "strided rows": base[..., ::2],  # every other feature: no unit stride, copied as rows
        "transposed": base[..., :DIM].transpose(0, 1),  # leading dims swapped: not contiguous
        "2-D": base[0, :, :DIM],
    }
    with torch.no_grad():
        for name, x in layouts.items():
            assert dispatch.gated_mlp_path("triton", x.reshape(-1, DIM), HIDDEN, False) == dispatch.DECODE
            for _ in range(2):
                y = m(x)
                assert y.shape == x.shape, name
                close(y, ref(m, x))
