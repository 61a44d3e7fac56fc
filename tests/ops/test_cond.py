"""hop.cond across the transform matrix, one section per column, then errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import (
    check_autograd,
    check_eager,
    check_export,
    check_jvp,
    check_make_fx,
    check_vmap,
    roundtrip,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop import _validation as validation
from hop.errors import HopError, HopRuntimeError, HopTypeError, HopValueError, OutputMismatchError
from hop.ops.branching.cond import cond_op
from hop.ops.branching.switch import switch_op
from hop.testing import check

# --- the program table: (hop program, plain-Python reference, inputs) ----------------------


def simple(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos() * 2, (x,))


def simple_ref(x: torch.Tensor) -> torch.Tensor:
    return x.sin() if x.sum() > 0 else x.cos() * 2


def pytrees(x: torch.Tensor, y: torch.Tensor) -> Any:
    def t(a: torch.Tensor, d: dict[str, torch.Tensor]) -> Any:
        return {"out": a * d["h"], "pair": (a + 1, d["h"].exp())}

    def f(a: torch.Tensor, d: dict[str, torch.Tensor]) -> Any:
        return {"out": a - d["h"], "pair": (a.tanh(), d["h"] * 3)}

    return hop.cond(x.mean() > y.mean(), t, f, (x, {"h": y}))


def pytrees_ref(x: torch.Tensor, y: torch.Tensor) -> Any:
    if x.mean() > y.mean():
        return {"out": x * y, "pair": (x + 1, y.exp())}
    return {"out": x - y, "pair": (x.tanh(), y * 3)}


def closure(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a * w, lambda a: a + w.sin(), (x,))


def closure_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w if x.sum() > 0 else x + w.sin()


def nested(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    def t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return hop.cond(b.sum() > 0, lambda c: c * 2, lambda c: c.cos(), (a,))

    return hop.cond(x.sum() > 0, t, lambda a, b: a * b, (x, y))


def nested_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x * 2 if y.sum() > 0 else x.cos()
    return x * y


def identity_branch(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a, lambda a: a.flip(0), (x,))


def identity_ref(x: torch.Tensor) -> torch.Tensor:
    return x.clone() if x.sum() > 0 else x.flip(0)


POS, NEG = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([-0.5, -1.0, -2.0])
PROGRAMS = {
    "simple": (simple, simple_ref, [(POS,), (NEG,)]),
    "pytrees": (pytrees, pytrees_ref, [(POS, NEG), (NEG, POS)]),
    "closure": (closure, closure_ref, [(POS, NEG), (NEG, POS)]),
    "nested": (nested, nested_ref, [(POS, POS * 2), (POS, NEG), (NEG, POS)]),
    "identity": (identity_branch, identity_ref, [(POS,), (NEG,)]),
}


@pytest.fixture(params=sorted(PROGRAMS))
def program(request: pytest.FixtureRequest) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    return PROGRAMS[request.param]


# --- eager -----------------------------------------------------------------------------------


def test_eager(program: Any) -> None:
    fn, ref, inputs = program
    check_eager(fn, ref, inputs)


def test_python_bool_just_runs_the_branch() -> None:
    ran: list[str] = []
    out = hop.cond(True, lambda a: ran.append("t") or a + 1, lambda a: ran.append("f") or a, (torch.zeros(1),))
    assert ran == ["t"] and out.item() == 1.0


def test_eager_runs_only_the_chosen_branch_after_validation() -> None:
    calls: list[str] = []

    def t(a: torch.Tensor) -> torch.Tensor:
        calls.append("t")
        return a + 1

    def f(a: torch.Tensor) -> torch.Tensor:
        calls.append("f")
        return a - 1

    x = torch.ones(2)
    hop.cond(torch.tensor(True), t, f, (x,))  # first call: both validated on fake tensors, t runs
    calls.clear()
    for _ in range(3):
        hop.cond(torch.tensor(False), t, f, (x,))
    assert calls == ["f", "f", "f"]


def test_outputs_never_alias_operands() -> None:
    x = torch.randn(3, 3)
    for pred in (True, False):
        out = hop.cond(torch.tensor(pred), lambda a: a, lambda a: a.t(), (x,))
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    raw = cond_op(torch.tensor(True), lambda a: a, lambda a: a, (x,))
    assert raw.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_in_place_update_of_an_operand_runs_in_eager() -> None:
    x = torch.ones(3)

    def t(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * 2

    out = hop.cond(torch.tensor(True), t, lambda a: a.clone(), (x,))
    torch.testing.assert_close(x, torch.full((3,), 2.0))
    torch.testing.assert_close(out, torch.full((3,), 4.0))


def test_meta_device() -> None:
    x = torch.empty(4, device="meta")
    out = hop.cond(torch.empty((), dtype=torch.bool, device="meta"), lambda a: a + 1, lambda a: a * 2, (x,))
    assert out.device.type == "meta" and out.shape == (4,)


def test_int_operands() -> None:
    out = hop.cond(torch.tensor(False), lambda a, n: a * n, lambda a, n: a + n, (torch.ones(2), 3))
    torch.testing.assert_close(out, torch.full((2,), 4.0))


def test_raw_op_in_eager_and_its_dispatch_trace() -> None:
    x = torch.randn(3)
    with hop.debug.trace() as rec:
        out = torch.ops.hop.cond(torch.tensor(False), lambda a: a.sin(), lambda a: a.cos(), (x,))
    torch.testing.assert_close(out, x.cos())
    assert [r.route for r in rec] == ["below-autograd", "kernel"] and rec[-1].kernel == "cond_dense"


# --- autograd ----------------------------------------------------------------------------------


def test_autograd(program: Any) -> None:
    fn, ref, inputs = program
    check_autograd(fn, ref, inputs)


def test_gradients_reach_parameters_the_branches_close_over() -> None:
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    out = hop.cond(x.sum() > -100, lambda a: lin(a).tanh(), lambda a: a, (x,))  # x needs no grad
    out.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    expected = torch.autograd.grad(lin(x).tanh().sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, expected)


def _closure_loss(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Both branches read ``w`` from their closure only."""
    inner = lambda a: hop.cond(a.sum() > 0, lambda b: (b @ w).cos().sum(), lambda b: (b @ w).sum(), (a,))  # noqa: E731
    return hop.cond(p, lambda a: (a @ w).sin().sum() + inner(a), lambda a: (a @ w).sum() * 2, (x,))


def _closure_grad(x: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w = w.detach().requires_grad_()
    return torch.autograd.grad(_closure_loss(x, p, w), w)[0]


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_traced_backward_reaches_closed_over_tensors(mode: str) -> None:
    # the predicate cannot be read while tracing: the node takes the closure as inputs
    x, w = torch.randn(2, 3), torch.randn(3, 3)
    gm = make_fx(_closure_grad, tracing_mode=mode)(x, torch.tensor(True), w)
    for p in (torch.tensor(True), torch.tensor(False)):
        want = torch.autograd.grad(_closure_loss(x, p, w.requires_grad_()), w)[0]
        torch.testing.assert_close(gm(x, p, w.detach()), want)


def test_fake_backward_reaches_closed_over_tensors() -> None:
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.randn(2, 3)), mode.from_tensor(torch.randn(3, 3)).requires_grad_()
        _closure_loss(x, mode.from_tensor(torch.tensor(True)), w).backward()
        assert w.grad is not None and w.grad.shape == (3, 3)


def test_vmap_of_grad_and_jvp_wrt_a_closure_with_a_batched_pred() -> None:
    x, w = torch.randn(4, 2, 3), torch.randn(3, 3)
    ps = torch.tensor([True, False, True, False])
    got = torch.vmap(torch.func.grad(lambda w, x, p: _closure_loss(x, p, w)), in_dims=(None, 0, 0))(w, x, ps)
    want = torch.stack([_closure_grad(x[i], ps[i], w) for i in range(4)])
    torch.testing.assert_close(got, want)
    tangent = torch.randn(3, 3)
    _, t = torch.func.jvp(lambda w: torch.vmap(lambda x, p: _closure_loss(x, p, w))(x, ps), (w,), (tangent,))
    torch.testing.assert_close(t, torch.stack([(want[i] * tangent).sum() for i in range(4)]))


# --- untaken branch gets zero gradients -------------------------------------------------------
# Note [untaken branches get zero gradients]: every differentiable tensor either branch reads
# gets a gradient, zeros for the untaken branch (as torch.cond and JAX), so that DDP needs no
# find_unused_parameters.

_G_TRUE, _G_FALSE = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)


def _global_true(a: torch.Tensor) -> torch.Tensor:  # plain functions: hop.cond's long-hand fast path
    return _G_TRUE(a).tanh()


def _global_false(a: torch.Tensor) -> torch.Tensor:
    return _G_FALSE(a).sin()


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda v: self.a(v).relu(), lambda v: self.b(v) * 2, (x,))


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


@pytest.mark.parametrize("taken", [True, False])
def test_untaken_module_attributes_get_zero_grads(taken: bool) -> None:
    model = TwoHeads()
    x = torch.randn(2, 3).abs() * (1 if taken else -1)
    for _ in range(3):  # the first call validates, later ones take the fast paths
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        used, unused = (model.a, model.b) if taken else (model.b, model.a)
        want = torch.autograd.grad((used(x).relu() if taken else used(x) * 2).sum(), list(used.parameters()))
        for p, w in zip(used.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, w)
        for p in unused.parameters():
            assert p.grad is not None and p.grad.layout == torch.strided and not p.grad.any()


@pytest.mark.parametrize("taken", [True, False])
def test_untaken_globals_and_closure_cells_get_zero_grads(taken: bool) -> None:
    x, w = torch.randn(2, 3), torch.randn(3, requires_grad=True)
    params = [*_G_TRUE.parameters(), *_G_FALSE.parameters()]
    for _ in range(3):
        for t in (*params, w):
            t.grad = None
        hop.cond(torch.tensor(taken), _global_true, _global_false, (x,)).sum().backward()
        hop.cond(torch.tensor(taken), lambda a: a * 2, lambda a: a * w, (x,)).sum().backward()
        used, unused = (_G_TRUE, _G_FALSE) if taken else (_G_FALSE, _G_TRUE)
        assert all(g is not None and not g.any() for g in _grads(list(unused.parameters())))
        assert all(g is not None and g.abs().sum() > 0 for g in _grads(list(used.parameters())))
        assert w.grad is not None and (not w.grad.any()) == taken


_G_W = torch.nn.Parameter(torch.ones(3))


def _nested_reads_global(a: torch.Tensor) -> torch.Tensor:
    return (lambda v: v * _G_W)(a)  # the global is read by the nested code only


def test_global_read_by_nested_code_gets_zero_grads() -> None:
    x = torch.randn(3, requires_grad=True)
    for _ in range(3):  # the first call validates, later ones take the long-hand path
        _G_W.grad = None
        hop.cond(torch.tensor(True), torch.sin, _nested_reads_global, (x.detach(),)).sum().backward()
        assert _G_W.grad is not None and not _G_W.grad.any()
        _G_W.grad = x.grad = None
        hop.cond(torch.tensor(False), torch.sin, _nested_reads_global, (x,)).sum().backward()
        torch.testing.assert_close(_G_W.grad, x.detach())


def test_operand_the_taken_branch_ignores_gets_zeros() -> None:
    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    for _ in range(3):
        x.grad = y.grad = None
        hop.cond(torch.tensor(True), lambda a, b: a.sin(), lambda a, b: b.cos(), (x, y)).sum().backward()
        torch.testing.assert_close(x.grad, x.detach().cos())
        assert y.grad is not None and not y.grad.any()


def test_raw_op_gives_untaken_branch_zero_grads() -> None:
    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)  # x: the autograd rule runs
    cond_op(torch.tensor(True), lambda a: a * 2, lambda a: a * w, (x,)).sum().backward()
    assert w.grad is not None and not w.grad.any()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_constant_taken_branch_still_gives_zeros() -> None:
    # as torch.cond: the output requires grad when anything the branches read does
    lin, x = torch.nn.Linear(3, 3), torch.randn(2, 3)
    out = hop.cond(torch.tensor(True), lambda a: torch.zeros(2, 3), lambda a: lin(a), (x,))
    assert out.requires_grad
    out.sum().backward()
    assert lin.weight.grad is not None and not lin.weight.grad.any()


def test_no_zero_grad_node_without_grad() -> None:
    lin, x = torch.nn.Linear(3, 3), torch.randn(2, 3)
    with torch.no_grad():
        assert not hop.cond(torch.tensor(True), lambda a: a * 2, lambda a: lin(a), (x,)).requires_grad
    out = hop.cond(torch.tensor(True), lambda a: a * 2, lambda a: a.sin(), (x,))  # nothing requires grad
    assert out.grad_fn is None and not out.requires_grad


def test_output_with_zero_grads_can_be_updated_in_place() -> None:
    # the node returns detached aliases: a view returned by a custom Function forbids in-place updates
    lin, x = torch.nn.Linear(3, 3), torch.randn(2, 3)
    out = hop.cond(torch.tensor(True), lambda a: a * 2 + 1, lambda a: lin(a), (x,))
    out.mul_(3)
    out.sum().backward()
    assert lin.weight.grad is not None and not lin.weight.grad.any()
    w = torch.randn(3, requires_grad=True)
    leaf = hop.cond(torch.tensor(True), lambda a: w, lambda a: a * w, (torch.randn(3),))
    with torch.no_grad():
        leaf.add_(1)  # a parameter returned as is comes out as a copy: w is not written
    assert not torch.equal(leaf, w)


def test_second_order_and_forward_mode_through_the_zero_grad_node() -> None:
    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = hop.cond(torch.tensor(True), lambda a: (a**3).sum(), lambda a: (a * w).sum(), (x,))
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(g.sum(), x)[0], 6 * x.detach())
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones(3))
        res = hop.cond(torch.tensor(True), lambda a: a * 3, lambda a: a * w, (dual,))
        torch.testing.assert_close(fwAD.unpack_dual(res).tangent, torch.full((3,), 3.0))


def test_autograd_outside_vmap_gives_untaken_branch_zeros() -> None:
    lin, w, x = torch.nn.Linear(3, 3), torch.randn(3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    out = torch.vmap(lambda v: hop.cond(torch.tensor(True), lambda a: a.sin(), lambda a: lin(a) * w, (v,)))(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
    assert all(t.grad is not None and not t.grad.any() for t in (lin.weight, lin.bias, w))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_jit_trace_records_no_zero_grad_node() -> None:
    model = TwoHeads()
    traced = torch.jit.trace(model, (torch.ones(2, 3),), check_trace=False)
    assert "PythonOp" not in str(traced.graph)


def _two_weights_loss(x: torch.Tensor, p: torch.Tensor, wt: torch.Tensor, wf: torch.Tensor) -> torch.Tensor:
    return hop.cond(p, lambda a, b: (a @ wt).sum(), lambda a, b: (b @ wf).sin().sum(), (x, x * 2))


def test_torch_func_grad_agrees() -> None:
    x, wt, wf = torch.randn(2, 3), torch.randn(3, 3), torch.randn(3, 3)
    for taken in (True, False):
        p = torch.tensor(taken)
        got = torch.func.grad(_two_weights_loss, argnums=(0, 2, 3))(x, p, wt, wf)
        leaves = [t.detach().requires_grad_() for t in (x, wt, wf)]
        _two_weights_loss(leaves[0], p, leaves[1], leaves[2]).backward()
        for g, leaf in zip(got, leaves, strict=True):
            torch.testing.assert_close(g, leaf.grad)
        assert not got[2 if taken else 1].any()


def _two_weights_grads(x: torch.Tensor, p: torch.Tensor, wt: torch.Tensor, wf: torch.Tensor) -> Any:
    x, wt, wf = (t.detach().requires_grad_() for t in (x, wt, wf))
    return torch.autograd.grad(_two_weights_loss(x, p, wt, wf), (x, wt, wf))  # raises if one got None


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_traced_backward_gives_untaken_branch_zeros(mode: str) -> None:
    x, wt, wf = torch.randn(2, 3), torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(_two_weights_grads, tracing_mode=mode)(x, torch.tensor(True), wt, wf)
    for taken in (True, False):
        got = gm(x, torch.tensor(taken), wt, wf)
        for g, w in zip(got, _two_weights_grads(x, torch.tensor(taken), wt, wf), strict=True):
            torch.testing.assert_close(g, w)
        assert not got[2 if taken else 1].any()


def test_grad_through_the_node_with_a_batched_pred_gives_zeros() -> None:
    x, wt, wf = torch.randn(4, 2, 3), torch.randn(3, 3), torch.randn(3, 3)
    ps = torch.tensor([True, True, True, True])  # batched: every branch runs, where() selects
    grads = torch.vmap(torch.func.grad(_two_weights_loss, argnums=3), in_dims=(0, 0, None, None))(x, ps, wt, wf)
    assert not grads.any()


# --- jvp and the torch.func family ---------------------------------------------------------------


def test_jvp(program: Any) -> None:
    fn, ref, inputs = program
    check_jvp(fn, ref, inputs)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_traced_jvp_of_branches_returning_an_int(mode: str) -> None:
    """torch.func.jvp refuses a function returning an int: the branches' jvp leaves the
    int out and gives it no tangent."""
    x, w, t = torch.randn(3, 4), torch.randn(4, 5), torch.randn(4, 5)

    def tangent(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Any:
        def f(w: torch.Tensor) -> torch.Tensor:
            out, k = hop.cond(x.sum() > 0, lambda a: (a @ w, 1), lambda a: ((a @ w).sin(), 2), (x,))
            return out * k

        return torch.func.jvp(f, (w,), (t,))

    gm = make_fx(tangent, tracing_mode=mode)(x, w, t)
    for sign in (1, -1):
        got, want = gm(sign * x, w, t), tangent(sign * x, w, t)
        torch.testing.assert_close(got, want)


def test_jvp_wrt_a_closure_inside_vmap_with_a_batched_pred() -> None:
    # the jvp transform tracks w, which the branches only close over
    w, t = torch.randn(3), torch.randn(3)
    xs, ps = torch.randn(4, 3), torch.tensor([True, False, True, False])

    def tangent(x: torch.Tensor, p: torch.Tensor) -> Any:
        def f(w: torch.Tensor) -> Any:
            return hop.cond(p, lambda a: (a * w).sin(), lambda a: (a * w).cos(), (x,))

        return torch.func.jvp(f, (w,), (t,))[1]

    def ref(x: torch.Tensor, p: torch.Tensor) -> Any:
        return torch.func.jvp(lambda w: (x * w).sin() if p else (x * w).cos(), (w,), (t,))[1]

    want = torch.stack([ref(xs[i], ps[i]) for i in range(4)])
    torch.testing.assert_close(torch.vmap(tangent)(xs, ps), want)


def test_traced_jvp_keeps_tangent_dtypes_when_torch_promotes_one() -> None:
    # torch.func.jvp gives `a * 0.5` on a 0-dim float32 `a` a float64 tangent; the
    # branches' tangents must still agree
    def fn(x: torch.Tensor, p: torch.Tensor) -> Any:
        return torch.func.jvp(lambda a: hop.cond(p, lambda b: b, lambda b: b * 0.5, (a,)), (x,), (torch.ones(()),))

    gm = make_fx(fn, tracing_mode="fake")(torch.tensor(1.0), torch.tensor(True))
    for p, want in ((True, 1.0), (False, 0.5)):
        _, tangent = gm(torch.tensor(1.0), torch.tensor(p))
        assert tangent.dtype == torch.float32
        torch.testing.assert_close(tangent, torch.tensor(want))


def test_torch_func_family() -> None:
    x = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return hop.cond(a.sum() > 0, lambda b: (b**3).sum(), lambda b: b.sin().sum(), (a,))

    torch.testing.assert_close(torch.func.grad(fn)(x), 3 * x**2)
    torch.testing.assert_close(torch.func.jacrev(fn)(x), 3 * x**2)
    torch.testing.assert_close(torch.func.jacfwd(fn)(x), 3 * x**2)
    torch.testing.assert_close(torch.func.hessian(fn)(x), torch.diag(6 * x))
    _, vjp_fn = torch.func.vjp(fn, x)
    torch.testing.assert_close(vjp_fn(torch.tensor(2.0, dtype=torch.float64))[0], 6 * x**2)
    batch = torch.randn(4, 3, dtype=torch.float64)
    want = torch.stack([torch.func.grad(fn)(b) for b in batch])
    torch.testing.assert_close(torch.vmap(torch.func.grad(fn))(batch), want)
    torch.testing.assert_close(torch.func.jacrev(torch.vmap(fn))(batch).sum(1), want)


# --- vmap ------------------------------------------------------------------------------------------


def test_vmap_batched_pred(program: Any) -> None:
    fn, ref, inputs = program
    n = len(inputs[0])
    batched = tuple(
        torch.stack([POS * 0.5, NEG, POS * 2, NEG * 3]) if i == 0 else inp for i, inp in enumerate(inputs[0])
    )
    check_vmap(fn, ref, batched, (0,) + (None,) * (n - 1))


def test_vmap_unbatched_pred_runs_one_branch() -> None:
    calls: list[str] = []

    def t(a: torch.Tensor) -> torch.Tensor:
        calls.append(type(a).__name__)
        return a.sin()

    batch = torch.randn(5, 3)
    out = torch.vmap(lambda a: hop.cond(torch.tensor(True), t, lambda b: b.cos(), (a,)))(batch)
    torch.testing.assert_close(out, batch.sin())
    calls.clear()
    torch.vmap(lambda a: hop.cond(torch.tensor(True), t, lambda b: b.cos(), (a,)))(batch)
    assert calls == ["FakeTensor", "Tensor"]  # validated (Note [validation under torch.func]), then run once


def test_vmap_nested_with_batched_preds() -> None:
    x = torch.randn(3, 4, 5)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return hop.cond(a.sum() > 0, lambda b: b * 2, lambda b: -b, (a,))

    out = torch.vmap(torch.vmap(fn))(x)
    want = torch.stack([torch.stack([fn(r) for r in m]) for m in x])
    torch.testing.assert_close(out, want)


def test_vmap_batched_pred_needs_equal_sizes() -> None:
    with pytest.raises(HopValueError, match=r"batched selector.*equal sizes at output\[0\]: \(2,\) vs \(3,\)"):
        torch.vmap(lambda a: hop.cond(a.sum() > 0, lambda b: b[:2], lambda b: b, (a,)))(torch.randn(4, 3))


def test_vmap_randomness() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        return hop.cond(a.sum() > 0, lambda b: b + torch.rand_like(b), lambda b: b, (a,))

    x = torch.ones(4, 3)
    out = torch.vmap(fn, randomness="different")(x)
    assert not torch.equal(out[0], out[1])
    same = torch.vmap(fn, randomness="same")(x)
    torch.testing.assert_close(same[0], same[1])
    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(fn)(x)


# --- functionalization --------------------------------------------------------------------------------


def test_functionalize() -> None:
    x = torch.randn(3)
    f = torch.func.functionalize(simple)
    torch.testing.assert_close(f(x), simple_ref(x))
    gm = make_fx(f, tracing_mode="fake")(x)
    assert any(n.target is cond_op for n in gm.graph.nodes)
    torch.testing.assert_close(gm(POS), simple_ref(POS))
    torch.testing.assert_close(gm(NEG), simple_ref(NEG))


# --- fake / make_fx ---------------------------------------------------------------------------------


def test_fake_tensor_mode() -> None:
    with FakeTensorMode():
        x = torch.randn(4)
        out = simple(x)
    assert isinstance(out, FakeTensor) and out.shape == (4,)


def test_fake_sizes_that_differ_need_a_shape_env() -> None:
    with (
        pytest.raises(OutputMismatchError, match=r"different sizes at output\[0\] \(\(2,\) vs \(4,\)\)"),
        FakeTensorMode(),
    ):
        hop.cond(torch.randn(4).sum() > 0, lambda a: a[:2], lambda a: a, (torch.randn(4),))


def test_make_fx(program: Any) -> None:
    fn, _, inputs = program
    check_make_fx(fn, cond_op, inputs[0], inputs)


# --- export -------------------------------------------------------------------------------------------


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda a: self.lin(a).relu(), lambda a: a * self.scale - self.lin.bias, (x,))


def test_export_with_parameters_and_buffers() -> None:
    m = Model()
    x = torch.randn(4, 3)
    ep = check_export(m, cond_op, (x,), [(x.abs(),), (-x.abs(),)])
    names = [n.name for n in ep.graph.nodes if n.op == "placeholder"]
    assert names[:3] == ["p_lin_weight", "p_lin_bias", "b_scale"]
    node = next(n for n in ep.graph.nodes if n.target is cond_op)
    assert [a.name for a in node.args[3]] == ["x", "p_lin_weight", "p_lin_bias", "b_scale"]


def test_export_dynamic_shapes() -> None:
    m = Model()
    dims = {"x": {0: torch.export.Dim("batch")}}
    check_export(m, cond_op, (torch.randn(4, 3),), [(torch.randn(7, 3).abs(),), (-torch.randn(2, 3).abs(),)], dims)


class Programs(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def test_export_program_table(program: Any) -> None:
    fn, _, inputs = program
    check_export(Programs(fn), cond_op, inputs[0], inputs)


def test_export_symbolic_predicate() -> None:
    m = Programs(lambda x: hop.cond(x.shape[0] > 4, lambda a: a + 1, lambda a: a - 1, (x,)))
    ep = torch.export.export(m, (torch.zeros(6),), dynamic_shapes={"args": ({0: torch.export.Dim("n")},)})
    assert any(n.target is cond_op for n in ep.graph.nodes)
    loaded = roundtrip(ep)
    assert loaded.module()(torch.zeros(3))[0].item() == -1.0
    assert loaded.module()(torch.zeros(8))[0].item() == 1.0


def test_export_closure_over_a_size() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0]
        return hop.cond(x.sum() > 0, lambda a: a.new_ones(n) * a.sum(), lambda a: a.new_zeros(n), (x,))

    dims = {"args": ({0: torch.export.Dim("a")}, {0: torch.export.Dim("b")})}
    ep = torch.export.export(Programs(fn), (torch.ones(3), torch.ones(5)), dynamic_shapes=dims)
    out = roundtrip(ep).module()(torch.ones(4), torch.ones(7))
    torch.testing.assert_close(out, torch.full((7,), 4.0))


def _operand_twice(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.cond(x.sum() > 0, lambda a, b: a * b + y, lambda a, b: a - b, (x, x))


def _operand_also_closed_over(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.cond(x.sum() > 0, lambda a: x * a.sin(), lambda a: a + y, (x,))


def _nested_over_a_closed_over_operand(x: torch.Tensor, y: torch.Tensor) -> Any:
    inner = lambda a: hop.cond(a.sum() > 0, lambda b: x + b, lambda b: y * b, (a,))  # noqa: E731
    return hop.cond(x.sum() < 1, lambda a: x * inner(a).tanh(), lambda a: a, (x,))


def _an_int_operand(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.cond(x.sum() > 0, lambda a, k: a * k + y, lambda a, k: a - k, (x, 3))


def _switch_of_an_operand_twice(x: torch.Tensor, y: torch.Tensor) -> Any:
    index = (x.sum() > 0).long() + (y.sum() > 0).long()
    return hop.switch(index, [lambda a, b: a * b, lambda a, b: a - b * y, lambda a, b: x], (x, x))


@pytest.mark.parametrize(
    "fn",
    [
        _operand_twice,
        _operand_also_closed_over,
        _nested_over_a_closed_over_operand,
        _an_int_operand,
        _switch_of_an_operand_twice,
    ],
    ids=["operand_twice", "operand_also_closed_over", "nested", "int_operand", "switch"],
)
def test_a_value_given_twice_to_the_branches_traces_once(fn: Any) -> None:
    # Note [one placeholder per value]: found by the compiled fuzzer's long profile (strict
    # export: "duplicate argument 'xs_0' in function definition"); an int operand failed
    # every export ("'int' object has no attribute 'name'")
    x, y = torch.randn(3), torch.randn(3)
    check(fn, x, y, transforms=("eager", "autograd", "export", "export_strict", "compile_aot_eager"))
    ep = torch.export.export(Programs(fn), (x, y), strict=True)
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in (cond_op, switch_op):
            operands = node.args[3] if node.target is cond_op else node.args[1]
            assert len(set(operands)) == len(operands), node.format_node()
    for case in ((x, y), (-x, y), (x, -y), (-x, -y)):
        torch.testing.assert_close(roundtrip(ep).module()(*case), fn(*case))


def test_export_branches_with_different_sizes_get_an_unbacked_size() -> None:
    m = Programs(lambda x: hop.cond(x.sum() > 0, lambda a: a[:2] * 2, lambda a: a + 1, (x,)))
    ep = torch.export.export(m, (torch.randn(5),))
    node = next(n for n in ep.graph.nodes if n.target is cond_op)
    assert node.meta.get("unbacked_bindings")
    asserts = [n for n in ep.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    assert len(asserts) == 2  # the union range [2, 5]
    for program in (ep, roundtrip(ep)):
        assert program.module()(torch.ones(5)).shape == (2,)
        assert program.module()(-torch.ones(5)).shape == (5,)


def test_export_data_dependent_branches() -> None:
    m = Programs(lambda x: hop.cond(x.sum() > 0, lambda a: a.nonzero(), lambda a: (a > 0).nonzero(), (x,)))
    ep = torch.export.export(m, (torch.randn(5),))
    v = torch.tensor([1.0, 0.0, 2.0, -1.0, 3.0])
    assert roundtrip(ep).module()(v).shape == (4, 1)
    assert roundtrip(ep).module()(-v).shape == (1, 1)


def test_export_writes_operands_a_branch_updates_in_place() -> None:
    def t(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * 2

    m = Programs(lambda x: hop.cond(x.sum() > 0, t, lambda a: a.clone(), (x,)))
    ep = torch.export.export(m, (torch.randn(3),))
    for program in (ep, ep.run_decompositions(), roundtrip(ep)):
        for start in (torch.ones(3), -torch.ones(3)):
            want, x = start.clone(), start.clone()
            expected = m(want)
            torch.testing.assert_close(program.module()(x), expected)
            torch.testing.assert_close(x, want)  # written only where the branch that writes ran


def test_export_identity_branch_does_not_alias() -> None:
    m = Programs(lambda x: hop.cond(x.sum() > 0, lambda a: a, lambda a: a.t(), (x,)))
    ep = torch.export.export(m, (torch.randn(3, 3),))
    x = torch.randn(3, 3)
    for program in (ep, ep.run_decompositions(), roundtrip(ep)):
        out = program.module()(x)
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_torch_compile_default() -> None:
    m = Model()
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    compiled = torch.compile(m)
    for v in (x.abs(), -x.abs()):
        torch.testing.assert_close(compiled(v), m(v))


# --- errors --------------------------------------------------------------------------------------------


def test_pred_with_several_elements() -> None:
    with pytest.raises(HopValueError, match=r"^hop.cond: pred must have exactly one element, got shape \(2,\)"):
        hop.cond(torch.tensor([True, False]), lambda a: a, lambda a: a, (torch.ones(1),))


def test_pred_of_the_wrong_type() -> None:
    with pytest.raises(HopTypeError, match="pred must be a bool, a SymBool or a one-element tensor, got str"):
        hop.cond("yes", lambda a: a, lambda a: a, (torch.ones(1),))
    with pytest.raises(HopTypeError, match="pred must be a bool, a SymBool or a one-element tensor, got NoneType"):
        hop.cond(None, lambda a: a, lambda a: a, (torch.ones(1),))


def test_branch_not_callable() -> None:
    with pytest.raises(HopTypeError, match=r"^hop.cond: false_fn must be callable, got int"):
        hop.cond(torch.tensor(True), lambda a: a, 3, (torch.ones(1),))  # type: ignore[arg-type]


def test_operands_must_be_a_tuple_or_list() -> None:
    with pytest.raises(HopTypeError, match=r"operands must be a tuple or list, got Tensor"):
        hop.cond(torch.tensor(True), lambda a: a, lambda a: a, torch.ones(1))  # type: ignore[arg-type]


def test_operand_leaf_must_be_a_tensor_or_int() -> None:
    with pytest.raises(HopTypeError, match=r'^hop.cond: operands\[1\]\["k"\] must be a tensor or an int, got str'):
        hop.cond(torch.tensor(True), lambda a, d: a, lambda a, d: a, (torch.ones(1), {"k": "v"}))


def _mismatch(t: Any, f: Any, operands: tuple[Any, ...] = (torch.ones(2),)) -> str:
    with pytest.raises(OutputMismatchError) as info:
        hop.cond(torch.tensor(True), t, f, operands)
    assert isinstance(info.value, HopError) and isinstance(info.value, TypeError)
    return str(info.value)


def test_structure_mismatch_names_both_structures() -> None:
    msg = _mismatch(lambda a: (a, a), lambda a: a)
    assert msg.startswith("hop.cond: true_fn and false_fn return different structures: (*, *) vs *")


def test_dtype_mismatch_in_the_untaken_branch_names_the_path() -> None:
    msg = _mismatch(lambda a: (a, {"h": a}), lambda a: (a, {"h": a.double()}))
    assert msg.startswith('hop.cond: true_fn and false_fn disagree at output[1]["h"]: dtype float32 vs float64')
    assert "test_cond.py" in msg  # names where the branches are


def test_rank_and_device_mismatch() -> None:
    assert "disagree at output: rank 1 vs 2" in _mismatch(lambda a: a, lambda a: a.reshape(1, 2))
    assert "disagree at output: device cpu vs meta" in _mismatch(lambda a: a, lambda a: a.to("meta"))


def test_mismatch_is_reported_the_same_under_export() -> None:
    m = Programs(lambda x: hop.cond(x.sum() > 0, lambda a: a, lambda a: a.double(), (x,)))
    with pytest.raises(OutputMismatchError, match=r"true_fn and false_fn disagree at output: dtype float32 vs float64"):
        torch.export.export(m, (torch.randn(2),))


def test_untaken_branch_that_fails_is_reported() -> None:
    with pytest.raises(HopRuntimeError, match=r"hop.cond: false_fn \(.*\) fails on the operands .*\[2, 2\] X \[3, 3\]"):
        hop.cond(torch.tensor(True), lambda a: a, lambda a: a @ torch.ones(3, 3), (torch.ones(2, 2),))


def test_validation_can_be_turned_off_or_made_to_run_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return a.double()

    monkeypatch.setattr(hop.config, "validate", "never")
    hop.cond(torch.tensor(True), lambda a: a, f, (torch.ones(2),))  # not checked
    monkeypatch.setattr(hop.config, "validate", "always")
    calls: list[int] = []

    def g(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return a + 1

    for _ in range(3):
        hop.cond(torch.tensor(True), lambda a: a * 2, g, (torch.ones(2),))
    assert len(calls) == 3  # validated (on fake tensors) every call


def test_validation_cache_is_bounded_with_fresh_closures(monkeypatch: pytest.MonkeyPatch) -> None:
    validation.clear()
    x = torch.ones(2)
    for i in range(100_000):  # a fresh closure (over a fresh tensor) every call: one signature
        w = torch.full((2,), float(i))
        hop.cond(torch.tensor(i % 2 == 0), lambda a: a * w, lambda a: a + w, (x,))  # noqa: B023 (used now)
    assert len(validation._VERDICTS) == 1
    monkeypatch.setattr(hop.config, "validation_cache_size", 4)
    for rank in range(1, 11):  # ten signatures
        hop.cond(torch.tensor(True), lambda a: a, lambda a: a, (torch.ones([1] * rank),))
    assert 1 <= len(validation._VERDICTS) <= 4


def test_unknown_validate_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hop.config, "validate", "sometimes")
    with pytest.raises(
        HopValueError, match=r'hop.config: validate must be "once", "always" or "never", got \'sometimes\''
    ):
        hop.cond(torch.tensor(True), lambda a: a, lambda a: a + 1, (torch.ones(3),))


def test_sizes_without_an_upper_bound_become_unbacked() -> None:
    fn = lambda x: hop.cond(x.sum() > 0, lambda a: a[:2] * 2, lambda a: a.sin(), (x,))  # noqa: E731
    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(5))
    assert gm(torch.ones(7)).shape == (2,) and gm(-torch.ones(7)).shape == (7,)


def test_vmap_batched_pred_with_in_place_updates_matches_python() -> None:
    def t(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a * 10

    xs = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    ys = xs.clone()
    out = torch.vmap(lambda x: hop.cond(x.sum() >= 0, t, lambda a: a * 2, (x,)))(xs)
    want = torch.stack([t(y) if y.sum() >= 0 else y * 2 for y in ys])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(xs, ys)


# --- tracing bugs found by torch's own test suite ----------------------------------------------------------


def builds_tensors(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # torch.tensor in a branch: no mutation
    return hop.cond(p, lambda a: a + torch.tensor([1.0, 2.0, 3.0]), lambda a: a * torch.tensor([2.0, 3.0, 4.0]), (x,))


def test_branches_building_tensors_from_python_data_trace_and_export() -> None:
    inputs = [(torch.tensor(True), torch.randn(3)), (torch.tensor(False), torch.randn(3))]
    check_make_fx(builds_tensors, cond_op, inputs[0], inputs)
    check_export(Programs(builds_tensors), cond_op, inputs[0], inputs)


@pytest.mark.parametrize("taken", [True, False])
def test_a_mismatch_names_the_branches_in_their_order_whichever_was_taken(taken: bool) -> None:
    def double(a: torch.Tensor) -> torch.Tensor:
        return a.double()

    def same(a: torch.Tensor) -> torch.Tensor:
        return a

    with pytest.raises(
        OutputMismatchError, match=r"^hop\.cond: true_fn and false_fn disagree at output: dtype float32 vs float64"
    ):
        hop.cond(torch.tensor(taken), same, double, (torch.ones(2),))


def test_zero_gradients_only_for_what_the_taken_branch_does_not_reach() -> None:
    """The zero-gradient node is added only for tensors the taken branch's autograd
    graph does not reach (Note [untaken branches get zero gradients]): an operand the
    branch used gets its gradient from it, with no node in between."""
    x = torch.randn(3, requires_grad=True)
    out = hop.cond(torch.tensor(True), lambda a: a.sin(), lambda a: a.cos(), (x,))
    assert type(out.grad_fn).__name__ == "SinBackward0"
    out.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
    w = torch.nn.Parameter(torch.randn(3))
    y = torch.randn(3, requires_grad=True)
    for p, fns in [(True, (lambda a: a.detach() * w, lambda a: a * 2)), (False, (lambda a: a * w, lambda a: a.exp()))]:
        w.grad = y.grad = None
        z = y * 1  # a non-leaf operand
        hop.cond(torch.tensor(p), *fns, (z,)).sum().backward()
        assert w.grad is not None and y.grad is not None
        if p:  # the taken branch detached the operand: its gradient is the zeros of the node
            assert torch.count_nonzero(y.grad) == 0
        else:  # w is untaken: zeros
            assert torch.count_nonzero(w.grad) == 0
            torch.testing.assert_close(y.grad, z.detach().exp())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_operands_run_without_validation() -> None:
    """Fake tensors cannot stand for a quantized tensor: validation is skipped (it
    raised torch's UnsupportedFakeTensorException) and the real call decides."""
    q = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    for _ in range(3):
        torch.testing.assert_close(
            hop.cond(torch.tensor(False), lambda a: a.dequantize(), lambda a: a.dequantize() * 2, (q,)),
            q.dequantize() * 2,
        )
        hop.switch(torch.tensor(0), [lambda a: a.dequantize(), lambda a: a.dequantize() * 2], (q,))
    i, out = hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a), (torch.tensor(0), q))
    assert int(i) == 2 and out.dtype is torch.qint8
    assert hop.fori_loop(0, 2, lambda i, a: a, q).dtype is torch.qint8
