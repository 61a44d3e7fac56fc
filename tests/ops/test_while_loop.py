"""hop.while_loop across the transform matrix, one section per column, then errors."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import harness
import pytest
import torch
from harness import check_autograd, check_eager, check_export, check_jvp, check_make_fx, check_vmap, roundtrip
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from uninitialized import all_finite, observer, traced_with_nan_fill

import hop
from hop.compile._torch_api import at_least
from hop.errors import HopRuntimeError, HopTypeError, HopValueError, MutationError, OutputMismatchError
from hop.ops.while_loops import _checkpoint
from hop.ops.while_loops.while_loop import while_loop_op


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


def test_traced_in_place_update_of_a_carry_writes_it_as_python_does() -> None:
    def bump(v: torch.Tensor) -> tuple[torch.Tensor]:
        v.add_(1)
        return (v,)

    want = torch.zeros(2)
    out = hop.while_loop(lambda a: a.sum() < 4, bump, (want,))
    gm = make_fx(lambda v: hop.while_loop(lambda a: a.sum() < 4, bump, (v,)))(torch.zeros(2))
    v = torch.zeros(2)
    torch.testing.assert_close(gm(v), out)
    torch.testing.assert_close(v, want)  # the initial carry was written, as in Python
    assert v.tolist() == [2.0, 2.0]


def test_a_carry_written_then_replaced_is_refused_when_traced() -> None:
    def bump(v: torch.Tensor) -> tuple[torch.Tensor]:
        v.add_(1)
        return (v * 1,)

    with pytest.raises(MutationError, match=r"hop.while_loop: body_fn \(.*bump.*\) writes carry 0 in place"):
        make_fx(lambda v: hop.while_loop(lambda a: a.sum() < 4, bump, (v,)))(torch.zeros(2))


def test_checkpoint_is_first_order_only() -> None:
    x = torch.tensor([0.5, 0.2], dtype=torch.float64, requires_grad=True)
    y = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin()), (0, x), checkpoint=True)[1]
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(HopRuntimeError, match=r"^hop.while_loop: .*checkpoint=True is first-order only"):
        g.sum().backward()  # not a silent zero, nor torch's "does not require grad"


# --- tracing bugs found by torch's own test suite ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_of_a_nested_loop_never_runs_it_on_placeholder_values(mode: str) -> None:
    seen: list[torch.Tensor] = []
    observe = observer(seen)

    def nested(x: torch.Tensor, n: torch.Tensor) -> Any:
        def body(i: torch.Tensor, v: torch.Tensor) -> Any:
            def inner_cond(j: torch.Tensor, w: torch.Tensor) -> Any:
                observe(w)
                return (j < 40) & ~(w.sum() >= 8)  # a data-dependent trip count; NaN keeps it going

            _, w = hop.while_loop(inner_cond, lambda j, w: (j + 1, w + 1), (torch.zeros_like(i), v))
            return i + 1, w * 0.5

        return hop.while_loop(lambda i, v: i < n, body, (torch.zeros((), dtype=torch.int64), x))

    def nested_ref(x: torch.Tensor, n: torch.Tensor) -> Any:
        i, v = 0, x
        while i < n:
            j, w = 0, v
            while j < 40 and not w.sum() >= 8:
                j, w = j + 1, w + 1
            i, v = i + 1, w * 0.5
        return torch.tensor(i), v

    gm = traced_with_nan_fill(nested, mode, (torch.ones(3), torch.tensor(3)))
    assert all_finite(seen), "an inner loop ran on uninitialized memory"
    assert any(n.target is while_loop_op for n in gm.graph.nodes)
    for args in [(torch.full((3,), -2.0), torch.tensor(4)), (torch.ones(3) * 5, torch.tensor(0))]:
        torch.testing.assert_close(gm(*args), nested_ref(*args))


def with_a_new_tensor(i: torch.Tensor, x: torch.Tensor) -> Any:  # torch.tensor in the body: no mutation
    return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * torch.tensor([1.0, 2.0, 0.5]) + 1), (i, x))


def test_a_body_building_a_tensor_from_python_data_traces_and_exports() -> None:
    inputs = [(torch.tensor(0), torch.randn(3)), (torch.tensor(2), torch.randn(3)), (torch.tensor(5), torch.ones(3))]
    check_make_fx(with_a_new_tensor, while_loop_op, inputs[0], inputs)
    check_export(Programs(with_a_new_tensor), while_loop_op, inputs[0], inputs)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_raw_op_body_changing_a_carrys_dtype_or_count_is_refused_when_traced(mode: str) -> None:
    def nonzero(c: torch.Tensor, a: torch.Tensor) -> Any:
        return c - 1, a.nonzero()  # int64 where the carry is float32

    def raw(c: torch.Tensor, a: torch.Tensor, body: Any) -> Any:
        return while_loop_op(lambda c, a: c > 0, body, (c, a), ())

    args = (torch.tensor(0), torch.randn(2, 3))
    with pytest.raises(OutputMismatchError, match=r"^hop.while_loop: .* at carry\[1\]: dtype float32 vs int64"):
        make_fx(lambda c, a: raw(c, a, nonzero), tracing_mode=mode)(*args)
    with pytest.raises(OutputMismatchError, match=r"^hop.while_loop: .* different structures: \(\*, \*\) vs \(\*,\)"):
        make_fx(lambda c, a: raw(c, a, lambda c, a: (c - 1,)), tracing_mode=mode)(*args)


# --- linear-time traced reverse mode ----------------------------------------------------------------
# Note [reverse mode of a traced loop] (hop/ops/while_loops/_reverse.py): the backward of a traced
# loop stacks the carries (or, with checkpoint=True, one per segment of about sqrt(n)
# steps) and pulls the cotangent through each step once.

BODY_RUNS = [0]


@torch.library.custom_op("hop_test_while_loop::zero_that_counts", mutates_args=())
def zero_that_counts(x: torch.Tensor) -> torch.Tensor:
    """Zeros like ``x``; counts its runs, so in a body it counts the body's runs in a traced graph."""
    BODY_RUNS[0] += 1
    return torch.zeros_like(x)


@zero_that_counts.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def decay_step(checkpoint: bool, *, counted: bool = True) -> Any:
    """A training step: gradients of a loop of n (a tensor) steps wrt its carry and a closed-over w."""

    def body(i: int, y: torch.Tensor, w: torch.Tensor) -> Any:
        out = torch.tanh(y * w + 0.1)
        if counted:
            out = out + zero_that_counts(y.detach())  # adds nothing, counts the run
        return i + 1, out

    def step(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        _, y = hop.while_loop(lambda i, y: i < n, lambda i, y: body(i, y, w), (0, x), checkpoint=checkpoint)
        return torch.autograd.grad(y.sum(), (x, w), allow_unused=True, materialize_grads=True)

    return step


def decay_step_ref(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = x
    for _ in range(int(n)):
        y = torch.tanh(y * w + 0.1)
    return torch.autograd.grad(y.sum(), (x, w), allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize(("checkpoint", "runs_per_trip"), [(False, 3), (True, 4)])
def test_traced_reverse_mode_runs_the_body_a_linear_number_of_times(checkpoint: bool, runs_per_trip: int) -> None:
    # forward n, then stacking n and one vjp per step n (checkpoint: + replaying n);
    # recomputing every step from the start would be n + n (n + 1) / 2
    x, w = torch.rand(8), torch.tensor(0.9)
    gm = make_fx(decay_step(checkpoint), tracing_mode="fake")(x, w, torch.tensor(5))
    for n in (0, 1, 16, 64):
        BODY_RUNS[0] = 0
        got = gm(x, w, torch.tensor(n))
        assert BODY_RUNS[0] == runs_per_trip * n
        torch.testing.assert_close(got, decay_step_ref(x, w, torch.tensor(n)))


def test_traced_fori_loop_with_static_bounds_is_linear_too() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = hop.fori_loop(0, 24, lambda i, y: torch.tanh(y * w + 0.1) + zero_that_counts(y.detach()), x)
        return torch.autograd.grad(y.sum(), (x, w))

    x, w = torch.rand(8), torch.tensor(0.9)
    gm = make_fx(step, tracing_mode="fake")(x, w)
    BODY_RUNS[0] = 0
    got = gm(x * 2, w)
    assert BODY_RUNS[0] == 3 * 24
    torch.testing.assert_close(got, decay_step_ref(x * 2, w, torch.tensor(24)))


def _sin_step(checkpoint: bool) -> Any:
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # counted on zeros, not v.detach(): make_fx on torch 2.15 records detach() as an alias
        body = lambda i, v: (i + 1, (v * w).sin() + zero_that_counts(torch.zeros_like(v)))  # noqa: E731
        return hop.while_loop(lambda i, v: i < 16, body, (0, x), checkpoint=checkpoint)[1]

    return step


class _SinLoop(torch.nn.Module):
    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.9, dtype=torch.float64))
        self.step = _sin_step(checkpoint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x, self.w)


@pytest.mark.parametrize("how", ["make_fx", "export", "export_saved"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_traced_loop_keeps_its_checkpoint_flag(how: str, checkpoint: bool, tmp_path: Any) -> None:
    """Note [the checkpoint keyword]: the traced node says checkpoint=True only where
    it was asked for, and training the traced program takes the reverse mode it names:
    the checkpointed one replays the body (4 runs a trip, see above), the plain one
    runs inline (1 run a trip, autograd keeps every step)."""
    x, w = torch.full((2,), 0.3, dtype=torch.float64), torch.tensor(0.9, dtype=torch.float64)
    if how == "make_fx":
        gm = make_fx(_sin_step(checkpoint), tracing_mode="symbolic")(x, w)
        w_in = w.clone().requires_grad_()
        code, call, params = gm.code, (lambda a: gm(a, w_in)), [w_in]
    else:
        ep = torch.export.export(_SinLoop(checkpoint), (x,))
        if how == "export_saved":
            torch.export.save(ep, tmp_path / "loop.pt2")
            ep = torch.export.load(tmp_path / "loop.pt2")
        code, module = ep.graph_module.code, ep.module()
        call, params = module, list(module.parameters())
    assert ("checkpoint = True" in code) == checkpoint, code
    a = x.clone().requires_grad_()
    BODY_RUNS[0] = 0
    grads = torch.autograd.grad(call(a).sum(), [a, *params])
    assert BODY_RUNS[0] == (4 if checkpoint else 1) * 16
    w_ref = w.clone().requires_grad_()
    a_ref = x.clone().requires_grad_()
    y = a_ref
    for _ in range(16):
        y = (y * w_ref).sin()
    torch.testing.assert_close(grads, torch.autograd.grad(y.sum(), [a_ref, w_ref]))


def _hop_targets(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.name() for n in gm.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)]


def test_traced_reverse_mode_nests_no_loop_in_a_loop_body() -> None:
    gm = make_fx(decay_step(False, counted=False), tracing_mode="fake")(
        torch.rand(8), torch.tensor(0.9), torch.tensor(5)
    )
    assert _hop_targets(gm) == ["while_loop", "scan", "scan"]  # the counting forward, the stack, the vjps
    bodies = [m for name, m in gm.named_modules() if name and isinstance(m, torch.fx.GraphModule)]
    assert bodies and all(_hop_targets(b) == [] for b in bodies)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any tensor made while it is active has, loop bodies included
    (hop's ops run their dense rule under it)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from hop.ops.scanning.scan import scan_dense
        from hop.ops.while_loops.while_loop import while_loop_dense

        if isinstance(func, hop.HigherOrderOperator):
            with self:
                return {"while_loop": while_loop_dense, "scan": scan_dense}[func.name()](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            self.largest = max(self.largest, o.numel() if isinstance(o, torch.Tensor) else 0)
        return out


def test_traced_checkpoint_keeps_about_sqrt_n_carries() -> None:
    x, w = torch.rand(16), torch.tensor(0.9)
    default = make_fx(decay_step(False, counted=False), tracing_mode="fake")(x, w, torch.tensor(5))
    ckpt = make_fx(decay_step(True, counted=False), tracing_mode="fake")(x, w, torch.tensor(5))
    for n, carries in ((64, 8), (250, 16)):  # segments of ceil(sqrt(n)) steps, ceil(n / that) segments
        for gm, most in ((default, n), (ckpt, carries)):
            with _LargestTensor() as seen:
                got = gm(x, w, torch.tensor(n))
            assert seen.largest == most * x.numel()
            torch.testing.assert_close(got, decay_step_ref(x, w, torch.tensor(n)))


def issue_step(y0: torch.Tensor, w: torch.Tensor, n: torch.Tensor, checkpoint: bool = False) -> Any:
    """The issue's program: y = tanh(y @ w) n times, gradients wrt the carry and w (a dict carry here)."""
    y0, w = y0.detach().requires_grad_(), w.detach().requires_grad_()
    i0 = torch.zeros((), dtype=torch.int64)
    fns = (lambda i, y: i < n, lambda i, y: (i + 1, {"h": torch.tanh(y["h"] @ w)}))
    _, y = hop.while_loop(*fns, (i0, {"h": y0}), checkpoint=checkpoint)
    return torch.autograd.grad(y["h"].sum(), (y0, w), allow_unused=True, materialize_grads=True)


W8 = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 0.3


@pytest.mark.parametrize("checkpoint", [False, True])
def test_traced_reverse_mode_exports(checkpoint: bool) -> None:
    # make_fx of the training step, then torch.export of that graph: save/load and decompositions
    y0 = torch.randn(4, 8)
    gm = make_fx(lambda y, w, n: issue_step(y, w, n, checkpoint), tracing_mode="symbolic")(y0, W8, torch.tensor(3))
    dims = {"args": ({0: torch.export.Dim("b")}, None, None)}
    ep = torch.export.export(Programs(gm), (y0, W8, torch.tensor(3)), dynamic_shapes=dims)
    assert _hop_targets(ep.graph_module).count("scan") == 2
    programs = [ep, roundtrip(ep), roundtrip(ep).run_decompositions()]
    for y, n in ((y0, 0), (y0, 1), (torch.randn(2, 8), 20)):
        want = issue_step(y, W8, torch.tensor(n))
        for program in programs:
            torch.testing.assert_close(program.module()(y, W8, torch.tensor(n)), want)


class Trained(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(W8.clone())

    def forward(self, y0: torch.Tensor, n: torch.Tensor) -> Any:
        return issue_step(y0, self.w, n)


def test_torch_export_of_a_training_step_says_how_to_export_it() -> None:
    message = (
        r"^hop.while_loop: reverse mode through a loop cannot be traced by torch.export \(torch.autograd.grad "
        r"inside the exported function: .*\)\. Trace the training step with make_fx\(step, tracing_mode='symbolic'\) "
        r"and export that GraphModule, or export the forward only and differentiate ep.module\(\)\.$"
    )
    with pytest.raises(HopRuntimeError, match=message):
        torch.export.export(Trained(), (torch.randn(4, 8), torch.tensor(3)))


def test_traced_growing_carries_fall_back_to_recomputing_each_step() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = hop.while_loop(lambda s: s.shape[0] < 6, lambda s: (torch.cat([s, (s[-1:] * w).sin()]),), (x,))[0]
        return torch.autograd.grad(y.sum(), (x, w), allow_unused=True, materialize_grads=True)

    w = torch.tensor(0.7)
    gm = make_fx(step, tracing_mode="symbolic")(torch.ones(2), w)
    assert "scan" not in _hop_targets(gm)  # nothing stacked: sizes differ between steps
    assert any(_hop_targets(b) for name, b in gm.named_modules() if name)  # the O(n^2) replay loops
    for n in (2, 4, 7):
        torch.testing.assert_close(gm(torch.linspace(0.1, 1, n), w), step(torch.linspace(0.1, 1, n), w))


def test_make_fx_without_a_shape_env_recomputes_instead_of_baking_the_trip_count() -> None:
    y0 = torch.randn(4, 8)
    gm = make_fx(lambda y, w, n: issue_step(y, w, n), tracing_mode="real")(y0, W8, torch.tensor(5))
    assert "scan" not in _hop_targets(gm)
    for n in (0, 3, 11):
        torch.testing.assert_close(gm(y0, W8, torch.tensor(n)), issue_step(y0, W8, torch.tensor(n)))


def test_checkpoint_under_torch_func_vmap_and_traced_vmap() -> None:
    def loss(x: torch.Tensor, w: torch.Tensor, checkpoint: bool) -> torch.Tensor:
        fns = (lambda y: y.sum() < 10, lambda y: (y * w + 1.0,))
        return hop.while_loop(*fns, (x,), checkpoint=checkpoint)[0].sin().sum()  # type: ignore[no-any-return]

    xs, w = torch.tensor([[0.5, 1.0], [2.0, 3.0], [9.0, 9.0]]), torch.tensor(1.1)
    per_row = torch.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None, None))
    want = per_row(xs, w, False)
    torch.testing.assert_close(torch.func.grad(loss)(xs[0], w, True), want[0][0])
    torch.testing.assert_close(per_row(xs, w, True), want)
    torch.testing.assert_close(make_fx(lambda a, b: per_row(a, b, True), tracing_mode="fake")(xs, w)(xs, w), want)


def test_training_through_torch_compile_aot_eager() -> None:
    # AOTAutograd traces the backward on functional tensors: the forward's trip count is known to it
    m = Decay()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager")
    for x in (torch.ones(3), torch.ones(3) * 50):
        got = torch.autograd.grad(compiled(x.requires_grad_())[1].sum(), (x, m.rate))
        want = torch.autograd.grad(m(x)[1].sum(), (x, m.rate))
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_a_literal_counter_is_not_baked_into_the_traced_body(mode: str) -> None:
    # torch.tensor(0) is a value FakeTensorMode knows: traced on it (or on what
    # empty_like makes of it: uninitialized memory) the body read one fixed index
    w = torch.randn(5, 2)

    def reads_the_counter(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v + w[i]), (torch.tensor(0), x))[1]

    if at_least(2, 14):  # torch traces w[i] on an unbacked i, with bounds asserts: the index must not be fixed
        gm = make_fx(reads_the_counter, tracing_mode=mode)(torch.zeros(2), w)
        other = torch.randn(5, 2)
        torch.testing.assert_close(gm(torch.zeros(2), other), other[:3].sum(0))
    else:
        with pytest.raises(Exception, match="data-dependent"):  # as for plain code: w[i] needs i's value
            make_fx(reads_the_counter, tracing_mode=mode)(torch.zeros(2), w)

    def selects_by_the_counter(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        step = lambda i, v: (i + 1, v + w.index_select(0, i.reshape(1))[0])  # noqa: E731
        return hop.while_loop(lambda i, v: i < 3, step, (torch.tensor(0), x))[1]

    gm = make_fx(selects_by_the_counter, tracing_mode=mode)(torch.zeros(2), w)
    torch.testing.assert_close(gm(torch.zeros(2), w), w[:3].sum(0))
    shapes = make_fx(
        lambda x: hop.while_loop(
            lambda i, v: i < 3, lambda i, v: (i + 1, v.new_ones(v.shape[0] + i.item())[:2]), (torch.tensor(0), x)
        )[1],
        tracing_mode="symbolic",
    )(torch.zeros(2))
    torch.testing.assert_close(shapes(torch.zeros(2)), torch.ones(2))


class _EarlyStop(torch.nn.Module):
    """Greedy decoding's loop: an int step counter and a tensor 'done' meet in the condition."""

    def forward(self, h: torch.Tensor) -> Any:
        def cond_fn(t: Any, done: torch.Tensor, h: torch.Tensor) -> Any:
            return (~done).any() & (t < 5)

        def body_fn(t: Any, done: torch.Tensor, h: torch.Tensor) -> Any:
            h = h * 0.5 + 0.25
            return t + 1, h.sum(1) > 3.0, h

        return hop.while_loop(cond_fn, body_fn, (0, torch.zeros(h.shape[0], dtype=torch.bool), h))


def _traced(model: torch.nn.Module, example: torch.Tensor, how: str) -> Any:
    """``model`` traced by make_fx, export (strict or not) or torch.compile (a backend,
    ``"... dynamic"`` for dynamic shapes)."""
    if how == "make_fx":
        return make_fx(model, tracing_mode="symbolic")(example)
    if how.endswith("export"):
        return roundtrip(torch.export.export(model, (example,), strict=how == "strict export")).module()
    torch._dynamo.reset()
    backend = how.removesuffix(" dynamic")
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=True if how.endswith(" dynamic") else None)


@pytest.mark.parametrize("how", ["make_fx", "export", "strict export", "aot_eager", "inductor"])
def test_an_int_carry_meets_a_tensor_in_the_condition(how: str) -> None:
    # "Could not guard on data-dependent expression u1 < 5" in every traced path
    model, example = _EarlyStop(), torch.zeros(2, 4)
    traced = _traced(model, example, how)
    for h in (example, torch.full((2, 4), 5.0), torch.tensor([[0.0] * 4, [9.0] * 4])):
        got, want = traced(h), model(h)
        assert int(got[0]) == want[0]
        torch.testing.assert_close(got[1:], want[1:])


_MARGIN = 0.5  # a global float: Dynamo makes it a graph input under dynamic shapes


class _ForcedStop(torch.nn.Module):
    """An ACT RNN's ponder loop: the int counter meets tensors in body_fn (the last step
    is forced), in cond_fn, or in both, each reading a global float."""

    def __init__(self, mixed: str) -> None:
        super().__init__()
        self.mixed = mixed

    def forward(self, h: torch.Tensor) -> Any:
        def cond_fn(t: Any, stopped: torch.Tensor, h: torch.Tensor) -> Any:
            if self.mixed != "body":
                return (~stopped).any() & (t < 4) & (h.sum() < 100 - _MARGIN)
            return t < 4

        def body_fn(t: Any, stopped: torch.Tensor, h: torch.Tensor) -> Any:
            stop = stopped | (h.sum(1) > 3.0 - _MARGIN)
            if self.mixed != "condition":
                stop = stop | (t + 1 >= 3)
            return t + 1, stop, torch.where(stopped.unsqueeze(1), h, h * 0.5 + 1.0)

        return hop.while_loop(cond_fn, body_fn, (0, torch.zeros(h.shape[0], dtype=torch.bool), h))


@pytest.mark.parametrize("mixed", ["body", "condition", "both"])
@pytest.mark.parametrize("how", ["make_fx", "export", "strict export", "aot_eager", "aot_eager dynamic"])
def test_an_int_carry_meets_a_tensor_in_the_body(how: str, mixed: str) -> None:
    # "Could not guard on data-dependent expression u0 + 1 >= 3" in every traced path;
    # with dynamic shapes the condition's second trace (and the body's) then failed on
    # the global float the first one had read ("lift_tracked_freevar_to_input should
    # not be called on root SubgraphTracer")
    model, example = _ForcedStop(mixed), torch.zeros(2, 4)
    traced = _traced(model, example, how)
    for h in (example, torch.full((2, 4), 5.0), torch.tensor([[0.0] * 4, [9.0] * 4])):
        got, want = traced(h), model(h)
        assert int(got[0]) == want[0]
        torch.testing.assert_close(got[1:], want[1:])


class _TensorForInt(torch.nn.Module):
    """body_fn returns a tensor where the carry is an int (``torch.tensor(t + 1)``)."""

    def forward(self, h: torch.Tensor) -> Any:
        return hop.while_loop(lambda t, h: t < 3, lambda t, h: (torch.tensor(t + 1), h + 1), (0, h))


@pytest.mark.parametrize("how", ["eager", "make_fx", "export", "strict export", "aot_eager"])
def test_a_tensor_returned_for_an_int_carry_is_refused_everywhere(how: str) -> None:
    # eager refused it; a trace gave the body its int carries as tensors (the fallback
    # for a body that mixes them with tensors) and took the tensor back with .item()
    model, example = _TensorForInt(), torch.zeros(3)
    with pytest.raises(OutputMismatchError, match=r"carry\[0\]: int vs Tensor"):
        if how == "eager":
            model(example)
        else:
            _traced(model, example, how)(example)


class _IntFirst(torch.nn.Module):
    """The int's comparison first: ``SymBool & Tensor`` runs ``bitwise_and.Scalar``."""

    def forward(self, h: torch.Tensor) -> Any:
        return hop.while_loop(lambda t, h: (t < 3) & (h.sum() < 100), lambda t, h: (t + 1, h + 1), (0, h))


@pytest.mark.parametrize("how", ["export", "strict export", "aot_eager"])
def test_an_int_compared_first_traces_without_error_logs(
    how: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # traced right, but Dynamo's first attempt (on SymInts) left torch's ERROR log
    # "failed while attempting to run meta for aten.bitwise_and.Scalar" and its traceback
    model, example = _IntFirst(), torch.zeros(3)
    if how.endswith("export"):
        traced: Any = torch.export.export(model, (example,), strict=how == "strict export").module()
    else:
        torch._dynamo.reset()
        traced = torch.compile(model, backend=how, fullgraph=True)
    for h in (example, torch.full((3,), 40.0)):
        got, want = traced(h), model(h)
        assert int(got[0]) == want[0]
        torch.testing.assert_close(got[1], want[1])
    logged = capfd.readouterr().err + caplog.text
    assert "failed while attempting to run meta" not in logged


# --- a traced loop run eagerly (Note [running a traced body per step] in hop.ops._lean_body) -----


class TensorCounted(torch.nn.Module):
    def __init__(self, counter_as_tensor: bool = False) -> None:
        super().__init__()
        self.counter_as_tensor = counter_as_tensor

    def forward(self, x: torch.Tensor, start: torch.Tensor, n: torch.Tensor) -> Any:
        def body(i: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.tanh(y * 1.1 + 0.1)
            return i + 1, (y * (i + 1) if self.counter_as_tensor else y)

        return hop.while_loop(lambda i, y: i < n, body, (start, x))


def tensor_counted_ref(x: torch.Tensor, start: int, n: int, counter_as_tensor: bool = False) -> Any:
    i, y = start, x
    while i < n:
        y = torch.tanh(y * 1.1 + 0.1)
        y = y * (i + 1) if counter_as_tensor else y
        i += 1
    return torch.tensor(i), y


@pytest.mark.parametrize("counter_as_tensor", [False, True])
def test_exported_loop_with_a_tensor_counter_and_bound(counter_as_tensor: bool) -> None:
    # i < n with a tensor n and i + 1: counted in Python when only the condition reads i
    # (the number of steps is known before the first), stepped when the body reads it too
    x = torch.randn(5)
    ep = torch.export.export(TensorCounted(counter_as_tensor), (x, torch.tensor(0), torch.tensor(3)))
    lts = {}
    for start, n in ((0, 0), (0, 1), (2, 9), (5, 3), (-3, 30)):
        with harness.OpCounts() as seen:
            got = ep.module()(x, torch.tensor(start), torch.tensor(n))
        want = tensor_counted_ref(x, start, n, counter_as_tensor)
        torch.testing.assert_close(got, want)
        assert seen.counts.get("tanh", 0) == max(n - start, 0)
        lts[max(n - start, 0)] = seen.counts.get("lt", 0)
    if counter_as_tensor:
        assert lts[33] == 34  # the condition runs every step
    else:
        assert len(set(lts.values())) == 1


def test_traced_loop_gets_contiguous_carries_from_a_counted_body() -> None:
    # Note [traced bodies see contiguous values]: the body returns a transposed carry
    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(0, 3, lambda i, y: (y.reshape(-1).flip(0).reshape(y.shape) + i).t(), x)  # type: ignore[no-any-return]

    x = torch.arange(4.0).reshape(2, 2)
    gm = make_fx(f, tracing_mode="fake")(x)
    want = x
    for i in range(3):
        want = (want.reshape(-1).flip(0).reshape(want.shape) + i).t()
    torch.testing.assert_close(gm(x), want)
