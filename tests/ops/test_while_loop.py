"""hop.while_loop across the transform matrix, one section per column, then errors."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import pytest
import torch
from harness import check_autograd, check_eager, check_export, check_jvp, check_make_fx, check_vmap, roundtrip
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopRuntimeError, HopTypeError, HopValueError, MutationError, OutputMismatchError
from hop.ops import _checkpoint
from hop.ops.while_loop import while_loop_op


def reference(cond_fn: Any, body_fn: Any, carried: Any) -> Any:
    carry = carried
    while cond_fn(*carry):
        carry = body_fn(*carry)
    return carry


# --- the program table ------------------------------------------------------------------------


def halve(x: torch.Tensor) -> torch.Tensor:  # data-dependent trip count
    return hop.while_loop(lambda v: v.abs().sum() > 1, lambda v: v * 0.5, (x,))[0]


def halve_ref(x: torch.Tensor) -> torch.Tensor:
    return reference(lambda v: v.abs().sum() > 1, lambda v: (v * 0.5,), (x,))[0]


def counted(x: torch.Tensor) -> Any:  # an int counter and a pytree carry
    def body(i: int, s: dict[str, torch.Tensor]) -> Any:
        return i + 1, {"h": s["h"].sin() + s["c"], "c": s["c"] * 1.1}

    return hop.while_loop(lambda i, s: i < 4, body, (0, {"h": x, "c": x * 0.1}))


def counted_ref(x: torch.Tensor) -> Any:
    i, s = 0, {"h": x, "c": x * 0.1}
    while i < 4:
        i, s = i + 1, {"h": s["h"].sin() + s["c"], "c": s["c"] * 1.1}
    return i, s


def closure(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda v: v.sum() < 20, lambda v: v * w + 1, (x,))[0]


def closure_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    v = x
    while v.sum() < 20:
        v = v * w + 1
    return v


X = torch.tensor([0.5, 1.5, 3.0])
W = torch.tensor([1.2, 0.9, 1.1])
PROGRAMS = {
    "halve": (halve, halve_ref, [(X,), (X * 10,)]),
    "counted": (counted, counted_ref, [(X,), (-X,)]),
    "closure": (closure, closure_ref, [(X, W), (X * 3, W)]),
}


@pytest.fixture(params=sorted(PROGRAMS))
def program(request: pytest.FixtureRequest) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    return PROGRAMS[request.param]


# --- eager --------------------------------------------------------------------------------------


def test_eager(program: Any) -> None:
    fn, ref, inputs = program
    check_eager(fn, ref, inputs)


def test_zero_iterations_returns_fresh_carries() -> None:
    x = torch.ones(2)
    (out,) = hop.while_loop(lambda v: v.sum() > 100, lambda v: v + 1, (x,))
    torch.testing.assert_close(out, x)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_python_bool_condition_and_list_carries() -> None:
    out = hop.while_loop(lambda n, v: n > 0, lambda n, v: (n - 1, v * 2), [3, torch.ones(1)])
    assert out[0] == 0 and out[1].item() == 8.0


def test_growing_carry_in_eager() -> None:
    (seq,) = hop.while_loop(lambda s: s.shape[0] < 5, lambda s: (torch.cat([s, s[-1:] * 2]),), (torch.ones(1),))
    torch.testing.assert_close(seq, torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0]))


def test_body_runs_only_the_real_number_of_times() -> None:
    calls: list[int] = []

    def body(v: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return v + 1

    def cond(v: torch.Tensor) -> torch.Tensor:
        return v.sum() < 3

    hop.while_loop(cond, body, (torch.zeros(1),))  # the first call also checks one iteration on fake tensors
    calls.clear()
    hop.while_loop(cond, body, (torch.zeros(1),))
    assert len(calls) == 3


def test_raw_op() -> None:
    out = while_loop_op(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2), (0, torch.ones(1)), ())
    assert out[0] == 3 and out[1].item() == 8.0


# --- autograd ---------------------------------------------------------------------------------------


def test_autograd(program: Any) -> None:
    fn, ref, inputs = program
    check_autograd(fn, ref, inputs)


def test_gradients_reach_parameters_the_body_closes_over() -> None:
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():  # a contraction towards 0: the loop ends
        lin.weight.copy_(torch.eye(2) * 0.5)
        lin.bias.zero_()
    x = torch.ones(2)
    (out,) = hop.while_loop(lambda v: v.norm() > 0.1, lambda v: lin(v).tanh(), (x,))
    out.sum().backward()
    expected = torch.autograd.grad(
        reference(lambda v: v.norm() > 0.1, lambda v: (lin(v).tanh(),), (x,))[0].sum(), lin.weight
    )
    torch.testing.assert_close(lin.weight.grad, expected[0])


# --- bounded-memory reverse mode --------------------------------------------------------------------


def _live_saved_tensors(fn: Any) -> tuple[int, Any]:
    """Peak number of tensors alive in autograd's saved-tensor slots while fn runs."""
    live, peak = [0], [0]

    def dec() -> None:
        live[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        holder = t.detach()
        weakref.finalize(holder, dec)
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return peak[0], result


@pytest.mark.parametrize("n", [1, 10, 100, 1024])
def test_checkpointing_matches_and_keeps_about_sqrt_n_carries(n: int) -> None:
    x = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)

    def run(checkpoint: bool) -> Any:
        def go() -> Any:
            out = hop.while_loop(lambda i, v: i < n, lambda i, v: (i + 1, (v * w).sin()), (0, x), checkpoint=checkpoint)
            return torch.autograd.grad(out[1].sum(), (x, w))

        return _live_saved_tensors(go)

    plain_peak, plain = run(False)
    ckpt_peak, ckpt = run(True)
    torch.testing.assert_close(ckpt, plain)
    assert plain_peak >= 2 * n  # every iteration saves v * w and the sin input
    # carries kept + one replayed segment's saved tensors, each about sqrt(2n), times 2 saved per step
    assert ckpt_peak <= 2 * 4 * max(n, 1) ** 0.5 + 4


def test_checkpoint_schedule() -> None:
    kept, n = _checkpoint.checkpoints(lambda i: i < 1024, lambda i: (i + 1,), (0,))
    starts = [i for i, _ in kept]
    assert n == 1024 and starts[0] == 0 and starts[-1] == 1024
    gaps = {b - a for a, b in itertools.pairwise(starts)}
    assert len(kept) <= 33 and max(gaps) <= 32  # about sqrt(2n)


def test_checkpoint_gradcheck() -> None:
    x = torch.tensor([0.4, 0.2], dtype=torch.float64, requires_grad=True)
    fn = lambda a: hop.while_loop(lambda v: v.sum() < 3, lambda v: v * 1.3 + 0.1, (a,), checkpoint=True)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


def test_checkpoint_is_eager_only() -> None:
    with pytest.raises(HopRuntimeError, match="checkpoint=True runs in eager only"):
        torch.vmap(lambda a: hop.while_loop(lambda v: v.sum() < 3, lambda v: v + 1, (a,), checkpoint=True))(
            torch.zeros(2, 1)
        )


# --- jvp and the torch.func family ----------------------------------------------------------------------


def test_jvp(program: Any) -> None:
    fn, ref, inputs = program
    check_jvp(fn, ref, inputs)


def test_torch_func_family() -> None:
    f = lambda x: hop.while_loop(lambda v: v.sum() < 10, lambda v: v * 2, (x,))[0]  # noqa: E731
    x = torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(torch.func.jacrev(f)(x), 8 * torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(torch.func.jacfwd(f)(x), 8 * torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(torch.func.grad(lambda a: f(a).sum())(x), torch.full((2,), 8.0, dtype=torch.float64))
    xs = torch.tensor([[1.0, 1.0], [3.0, 3.0]], dtype=torch.float64)  # different trip counts per row
    got = torch.vmap(torch.func.grad(lambda a: f(a).sum()))(xs)
    torch.testing.assert_close(got, torch.tensor([[8.0, 8.0], [2.0, 2.0]], dtype=torch.float64))


# --- vmap -------------------------------------------------------------------------------------------------


def test_vmap_batched_condition(program: Any) -> None:
    fn, ref, inputs = program
    batched = torch.stack([X, X * 7, -X * 0.1, X * 30])
    n = len(inputs[0])
    check_vmap(fn, ref, (batched, *inputs[0][1:]), (0,) + (None,) * (n - 1))


def test_vmap_nested() -> None:
    xs = torch.rand(2, 3, 2) * 50
    out = torch.vmap(torch.vmap(halve))(xs)
    want = torch.stack([torch.stack([halve_ref(r) for r in m]) for m in xs])
    torch.testing.assert_close(out, want)


def test_vmap_traced_batched_condition() -> None:
    gm = make_fx(torch.vmap(halve), tracing_mode="fake")(torch.rand(3, 3))
    assert any(n.target is while_loop_op for n in gm.graph.nodes)
    xs = torch.tensor([[0.1, 0.1, 0.1], [5.0, 5.0, 5.0], [40.0, 0.0, 0.0]])
    torch.testing.assert_close(gm(xs), torch.stack([halve_ref(r) for r in xs]))


def test_vmap_int_carry_cannot_diverge() -> None:
    f = lambda x: hop.while_loop(lambda i, v: v.sum() > 1, lambda i, v: (i + 1, v / 2), (0, x))  # noqa: E731
    with pytest.raises(HopValueError, match="int carries cannot change"):
        torch.vmap(f)(torch.tensor([[1.0], [8.0]]))


# --- fake / make_fx / export ----------------------------------------------------------------------------------


def test_fake_mode() -> None:
    with FakeTensorMode():
        out = halve(torch.randn(3))
    assert isinstance(out, FakeTensor) and out.shape == (3,)


def test_make_fx(program: Any) -> None:
    fn, _, inputs = program
    # an int carry the body changes needs an unbacked SymInt: symbolic tracing only
    modes = ("fake", "symbolic") if fn is counted else ("real", "fake", "symbolic")
    check_make_fx(fn, while_loop_op, inputs[0], inputs, modes)


def test_int_carries_become_unbacked_symints() -> None:
    gm = make_fx(counted, tracing_mode="symbolic")(X)
    assert any(n.target is while_loop_op for n in gm.graph.nodes)
    # the counter leaves the loop as an unbacked SymInt bound in the graph
    assert any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes)
    assert gm(X)[0] == 4


class Programs(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def test_export(program: Any) -> None:
    fn, _, inputs = program
    check_export(Programs(fn), while_loop_op, inputs[0], inputs)


class Decay(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rate = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, v: v.abs().sum() > 0.1, lambda i, v: (i + 1, v * self.rate), (0, x))


def test_export_different_trip_counts_dynamic_shapes_and_save_load() -> None:
    m = Decay()
    inputs = [(torch.ones(3),), (torch.ones(5) * 100,), (torch.zeros(2),)]
    ep = check_export(m, while_loop_op, (torch.ones(4),), inputs, {"x": {0: torch.export.Dim("n")}})
    trips = [roundtrip(ep).module()(*a)[0] for a in inputs]
    assert trips == [m(*a)[0] for a in inputs] == [5, 13, 0]


def test_export_growing_carry() -> None:
    def grow(x: torch.Tensor) -> torch.Tensor:
        return hop.while_loop(lambda s: s.shape[0] < 8, lambda s: (torch.cat([s, s[-1:] + 1]),), (x,))[0]

    ep = torch.export.export(Programs(grow), (torch.zeros(2),), dynamic_shapes={"args": ({0: torch.export.Dim("n")},)})
    for n in (1, 3, 9):
        x = torch.arange(float(n))
        torch.testing.assert_close(roundtrip(ep).module()(x), grow(x))


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_traced_reverse_mode(mode: str) -> None:
    # Note [reverse mode of a traced loop]: gradients of the initial carry and of a
    # closed-over tensor, for a trip count decided at run time (zero included)
    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        _, y = hop.while_loop(lambda i, y: y.sum() < 10, lambda i, y: (i + 1, y * w + 1.0), (0, x))
        return y.sin().sum()  # type: ignore[no-any-return]

    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(loss(x, w), (x, w), allow_unused=True, materialize_grads=True)

    w = torch.tensor(0.9)
    gm = make_fx(step, tracing_mode=mode)(torch.tensor([0.5, 1.0]), w)
    for x in (torch.tensor([0.5, 1.0]), torch.tensor([2.0, 3.0]), torch.tensor([9.0, 9.0])):
        for got, want in zip(gm(x, w), step(x, w), strict=True):
            torch.testing.assert_close(got, want)


def test_jvp_wrt_a_closure_inside_vmap_with_a_batched_condition() -> None:
    w, t = torch.tensor(0.9), torch.tensor(1.0)
    xs = torch.tensor([[0.5, 1.0], [2.0, 3.0], [9.0, 9.0]])

    def tangent(x: torch.Tensor) -> Any:
        def f(w: torch.Tensor) -> Any:
            return hop.while_loop(lambda y: y.sum() < 10, lambda y: (y * w + 1.0,), (x,))[0]

        return torch.func.jvp(f, (w,), (t,))[1]

    def ref(x: torch.Tensor) -> Any:
        def g(w: torch.Tensor) -> torch.Tensor:
            y = x
            while y.sum() < 10:
                y = y * w + 1.0
            return y

        return torch.func.jvp(g, (w,), (t,))[1]

    torch.testing.assert_close(torch.vmap(tangent)(xs), torch.stack([ref(x) for x in xs]))


def test_traced_torch_func_grad_and_vmap_of_grad() -> None:
    def loss(a: torch.Tensor) -> torch.Tensor:
        return halve(a).sin().sum()  # type: ignore[no-any-return]

    def loss_ref(a: torch.Tensor) -> torch.Tensor:
        return halve_ref(a).sin().sum()

    x = torch.tensor([3.0, 2.0, 1.0])
    gm = make_fx(torch.func.grad(loss), tracing_mode="fake")(x)
    rows = torch.tensor([[3.0, 2.0, 1.0], [0.1, 0.1, 0.1], [40.0, 0.0, 0.0]])
    for r in rows:
        torch.testing.assert_close(gm(r), torch.func.grad(loss_ref)(r))
    want = torch.stack([torch.func.grad(loss_ref)(r) for r in rows])
    torch.testing.assert_close(torch.vmap(torch.func.grad(loss))(rows), want)
    torch.testing.assert_close(make_fx(torch.vmap(torch.func.grad(loss)), tracing_mode="fake")(rows)(rows), want)


def test_torch_compile_default() -> None:
    m = Decay()
    torch._dynamo.reset()
    compiled = torch.compile(m)
    for x in (torch.ones(3), torch.ones(3) * 50):
        assert compiled(x)[0] == m(x)[0]
        torch.testing.assert_close(compiled(x)[1], m(x)[1])


# --- errors --------------------------------------------------------------------------------------------------------


def test_functions_must_be_callable() -> None:
    with pytest.raises(HopTypeError, match=r"^hop.while_loop: body_fn must be callable, got int"):
        hop.while_loop(lambda v: True, 1, (torch.ones(1),))  # type: ignore[arg-type]


def test_carried_inputs_must_be_a_tuple_or_list() -> None:
    with pytest.raises(HopTypeError, match="carried_inputs must be a tuple or list, got Tensor"):
        hop.while_loop(lambda v: True, lambda v: v, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(HopTypeError, match=r"carried_inputs\[1\] must be a tensor or an int, got str"):
        hop.while_loop(lambda v, s: True, lambda v, s: (v, s), (torch.ones(1), "s"))


def test_body_returning_the_wrong_structure() -> None:
    with pytest.raises(
        OutputMismatchError, match=r"carried_inputs and body_fn return different structures: \(\*, \*\) vs \(\*,\)"
    ):
        hop.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1,), (0, torch.ones(1)))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (lambda v: (v.double(),), r"disagree at carry\[0\]: dtype float32 vs float64"),
        (lambda v: (v.reshape(1, 2),), r"disagree at carry\[0\]: rank 1 vs 2"),
        (lambda v: (v.to("meta"),), r"disagree at carry\[0\]: device cpu vs meta"),
    ],
)
def test_carry_changing_dtype_rank_or_device(body: Any, message: str) -> None:
    with pytest.raises(OutputMismatchError, match=message):
        hop.while_loop(lambda v: v.sum() < 10, body, (torch.ones(2),))


def test_condition_must_be_one_bool() -> None:
    with pytest.raises(
        HopTypeError,
        match=r"cond_fn \(.*\) must return a Python bool or a one-element bool tensor, got a tensor of dtype float32",
    ):
        hop.while_loop(lambda v: v.sum(), lambda v: v + 1, (torch.ones(2),))
    with pytest.raises(HopTypeError, match=r"got a tensor of dtype bool and shape \(2,\)"):
        hop.while_loop(lambda v: v > 0, lambda v: v + 1, (torch.ones(2),))


def test_traced_in_place_update_of_a_carry_is_refused() -> None:
    def bump(v: torch.Tensor) -> tuple[torch.Tensor]:
        v.add_(1)
        return (v,)

    with pytest.raises(MutationError, match=r"hop.while_loop: body_fn \(.*bump.*\) writes carry 0 in place"):
        make_fx(lambda v: hop.while_loop(lambda a: a.sum() < 4, bump, (v,)))(torch.zeros(2))


def test_checkpoint_is_first_order_only() -> None:
    x = torch.tensor([0.5, 0.2], dtype=torch.float64, requires_grad=True)
    y = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin()), (0, x), checkpoint=True)[1]
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"does not require grad|once_differentiable"):  # not a silent zero
        g.sum().backward()
