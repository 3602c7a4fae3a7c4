"""FusedLinear's held weight.t() (ops._plan.HeldTranspose): with no activation on `auto`, a 2-D call is F.linear's
own addmm / mm over a view kept between calls. Every way a weight can change under it must give what nn.Linear
gives on the same parameters: outputs and gradients compared bit for bit with an nn.Linear twin, whose F.linear
makes its view afresh on every call."""

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn as nn

from mlpfuse import FusedLinear
from mlpfuse.errors import InputError


def _pair(bias=True, dtype=torch.float32, n_in=8, n_out=12):
    torch.manual_seed(0)
    ref = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    return ref, FusedLinear.from_module(copy.deepcopy(ref), backend="auto")


def _held(m):
    h = m._plan.weight_t.held
    return None if h is None else h[-1]


def _same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("bias", [True, False])
def test_training_steps_match_nn_linear_bit_for_bit(bias):
    """Three SGD steps (in-place updates the held view shares): outputs and gradients equal every step, and the
    view made by the first call serves all of them."""
    ref, m = _pair(bias)
    opt_r, opt_m = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    first = None
    for step in range(3):
        x = torch.randn(5, 8)
        yr, ym = ref(x), m(x)
        assert torch.equal(ym, yr), step
        first = first if first is not None else _held(m)
        assert _held(m) is first
        (yr ** 2).sum().backward()
        (ym ** 2).sum().backward()
        _same_grads(ref, m)
        opt_r.step(), opt_m.step(), opt_r.zero_grad(), opt_m.zero_grad()


def test_graphs_share_the_view_and_input_gradients_flow():
    """Two forwards before one backward (the view's TBackward node in both graphs), x requiring grad, and a
    second-order gradient: as nn.Linear computes them, the weight's gradient up to the order its contributions are
    summed in (one shared node adds them before the transpose, nn.Linear's fresh nodes after), so in float64."""
    ref, m = _pair(dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    loss_m = (m(x) * m(x * 2)).sum()
    loss_r = (ref(xr) * ref(xr * 2)).sum()
    (gx_m,) = torch.autograd.grad(loss_m, x, create_graph=True)
    (gx_r,) = torch.autograd.grad(loss_r, xr, create_graph=True)
    assert torch.equal(gx_m, gx_r)
    gx_m.sum().backward()
    gx_r.sum().backward()
    assert torch.equal(m.bias.grad, ref.bias.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad, rtol=1e-14, atol=1e-14)


def test_view_made_without_grad_still_carries_the_gradient():
    """The first call under no_grad and under inference_mode: a later training call still reaches the weight."""
    for mode in (torch.no_grad, torch.inference_mode):
        ref, m = _pair()
        with mode():
            assert torch.equal(m(torch.ones(2, 8)), ref(torch.ones(2, 8)))
        assert _held(m) is not None and _held(m).requires_grad
        x = torch.randn(3, 8)
        m(x).sum().backward()
        ref(x).sum().backward()
        _same_grads(ref, m)


def test_requires_grad_off_then_on():
    ref, m = _pair()
    x = torch.randn(3, 8)
    m(x)
    for p in (*ref.parameters(), *m.parameters()):
        p.requires_grad_(False)
    y = m(x)
    assert not y.requires_grad and torch.equal(y, ref(x))
    for p in (*ref.parameters(), *m.parameters()):
        p.requires_grad_(True)
    m(x).sum().backward()
    ref(x).sum().backward()
    _same_grads(ref, m)


def test_data_assignments_are_seen():
    """`.data =` a new tensor, the same storage reshaped, the same storage as another dtype, and a transposed
    (non-contiguous) square weight: each call equals F.linear on the weight as it is now."""
    ref, m = _pair(n_in=8, n_out=8)
    x = torch.randn(3, 8)
    m(x)
    for change in (lambda w: torch.randn(8, 8),
                   lambda w: w.data.t(),                       # same address and shape, other strides
                   lambda w: w.data.flatten()[:32].view(4, 8)):  # same address, other shape
        new = change(m.weight)
        ref.weight.data = new.clone() if new.is_contiguous() else new.clone().t().contiguous().t()
        m.weight.data = new
        b = ref.bias[: m.weight.shape[0]]
        m.bias.data = ref.bias.data = b.detach().clone()
        assert torch.equal(m(x), ref(x))
    # same storage read as another dtype of the same size
    ref2, m2 = _pair(dtype=torch.float16)
    xh = torch.randn(3, 8, dtype=torch.float16)
    m2(xh)
    as_bf16 = m2.weight.data.view(torch.bfloat16)
    m2.weight.data, ref2.weight.data = as_bf16, as_bf16.clone()
    m2.bias.data = ref2.bias.data = ref2.bias.data.to(torch.bfloat16)
    xb = xh.to(torch.bfloat16)
    assert torch.equal(m2(xb), ref2(xb))


def test_same_address_other_shape_or_dtype_without_bias():
    """Without a bias nothing else in the call would notice: the first rows of the same storage as the weight give
    fewer outputs, and the same bytes read as another dtype refuse an input of the old one, as F.linear does."""
    ref, m = _pair(bias=False)
    x = torch.randn(3, 8)
    m(x)
    m.weight.data = m.weight.data[:6]
    ref.weight.data = m.weight.data.clone()
    assert m(x).shape == (3, 6) and torch.equal(m(x), ref(x))
    _, m2 = _pair(bias=False, dtype=torch.float16)
    xh = torch.randn(3, 8, dtype=torch.float16)
    m2(xh)
    m2.weight.data = m2.weight.data.view(torch.bfloat16)
    with pytest.raises(InputError, match="dtype"):
        m2(xh)


def test_replaced_and_moved_weights_are_released():
    """`module.weight = Parameter(...)` drops the view, so the old weight is freed with its last reference, and
    `.to()` drops it; the module then computes with the new weight."""
    ref, m = _pair()
    x = torch.randn(3, 8)
    m(x)
    old = weakref.ref(m.weight)
    m.weight = nn.Parameter(torch.randn(12, 8))
    gc.collect()
    assert old() is None
    assert torch.equal(m(x), torch.addmm(m.bias, x, m.weight.t()))
    m.to(torch.float64)  # the Parameter stays, its data is replaced: the view of the old data goes
    assert _held(m) is None
    y = m(x.double())
    assert y.dtype == torch.float64 and torch.equal(y, torch.nn.functional.linear(x.double(), m.weight, m.bias))


def test_copies_and_pickles_start_without_the_view():
    """deepcopy and pickle after a training call: a view with a grad_fn cannot be deep-copied, so the plan's copy
    starts empty; the copy computes what the original does, with its own weights."""
    ref, m = _pair()
    x = torch.randn(3, 8)
    m(x).sum().backward()
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert _held(twin) is None
        assert torch.equal(twin(x), m(x))
        assert _held(twin)._base is twin.weight


def test_autocast_tracing_and_other_layouts_take_f_linear():
    """Autocast (it caches its cast of the weight itself), jit.trace (a held view would be baked in as a constant)
    and 3-D input: F.linear itself, so the results are nn.Linear's."""
    ref, m = _pair()
    x = torch.randn(3, 8)
    m(x)

    def casts(module):  # the copies a second call under autocast makes: the weight's cast is cached after the first
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                module(x)
        return y, sorted(e.name for e in prof.events() if e.name in ("aten::to", "aten::_to_copy", "aten::copy_"))

    view = _held(m)
    (y_ref, casts_ref), (y_m, casts_m) = casts(ref), casts(m)
    assert torch.equal(y_m, y_ref) and casts_m == casts_ref, (casts_m, casts_ref)
    assert _held(m) is view  # autocast calls neither use the view nor make it again
    traced = torch.jit.trace(m, x)
    with torch.no_grad():
        m.weight.data = torch.randn(12, 8)
        ref.weight.data = m.weight.data.clone()
    assert torch.equal(traced(x), ref(x))
    x3 = torch.randn(2, 3, 8)
    assert torch.equal(m(x3), ref(x3))


def test_shared_weight_in_two_modules():
    """Two FusedLinears over one Parameter (tied weights) hold a view each; both follow an update."""
    _, a = _pair()
    b = FusedLinear(8, 12, backend="auto")
    b.weight = a.weight
    x = torch.randn(3, 8)
    a(x), b(x)
    with torch.no_grad():
        a.weight.mul_(3)
    assert torch.equal(b(x), torch.addmm(b.bias, x, a.weight.t()))
    assert torch.equal(a(x), torch.addmm(a.bias, x, a.weight.t()))
