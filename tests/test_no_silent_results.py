"""Eager never returns a result that differs from what was validated, and no silent
fallbacks: outputs checked on every call, loop carries and per-step outputs checked,
selectors that cannot choose refused, closed-over parameters differentiated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._C import DispatchKey

import hop
from hop.errors import HopError, HopValueError, MissingRuleError, OutputMismatchError

X = torch.ones(3)


def plain(v: torch.Tensor) -> torch.Tensor:
    return v * 1


# --- cond / switch: outputs checked on every call ---------------------------------------


def _defaults_factory() -> Callable[..., torch.Tensor]:
    def to_dtype(v: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return v.to(dtype)

    return to_dtype


CALLS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "cond fast path": lambda fn: hop.cond(torch.tensor(True), fn, plain, (X,)),
    "cond two operands": lambda fn: hop.cond(torch.tensor(True), lambda a, b: fn(a) + 0 * b, lambda a, b: a, (X, X)),
    "cond pytree": lambda fn: hop.cond(torch.tensor(True), lambda d: fn(d["x"]), lambda d: d["x"], ({"x": X},)),
    "switch": lambda fn: hop.switch(torch.tensor(1), [plain, fn], (X,)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_changed_defaults_raise_instead_of_returning_another_dtype(call: str) -> None:
    fn = _defaults_factory()
    assert CALLS[call](fn).dtype == torch.float32
    fn.__defaults__ = (torch.float64,)
    with pytest.raises(OutputMismatchError, match=r"dtype float(64 vs float32|32 vs float64)"):  # in branch order
        CALLS[call](fn)


def test_changed_global_raises() -> None:
    state = {"dtype": torch.float32}

    def read_global(v: torch.Tensor) -> torch.Tensor:
        return v.to(state["dtype"])

    assert hop.cond(torch.tensor(True), read_global, plain, (X,)).dtype == torch.float32
    state["dtype"] = torch.float64
    with pytest.raises(OutputMismatchError, match=r"hop.cond: true_fn and false_fn disagree at output"):
        hop.cond(torch.tensor(True), read_global, plain, (X,))


def test_changed_structure_of_both_branches_is_validated_again() -> None:
    state = {"pair": False}

    def t(v: torch.Tensor) -> Any:
        return (v, v + 1) if state["pair"] else v

    def f(v: torch.Tensor) -> Any:
        return (v, v - 1) if state["pair"] else v

    assert isinstance(hop.cond(torch.tensor(True), t, f, (X,)), torch.Tensor)
    state["pair"] = True  # both branches change alike: a valid new kind, validated again
    out = hop.cond(torch.tensor(False), t, f, (X,))
    assert isinstance(out, tuple) and len(out) == 2


def test_output_differing_from_its_fake_run_is_an_error() -> None:
    def real_only(v: torch.Tensor) -> torch.Tensor:
        # a real run and a fake run of this branch disagree on the dtype
        return v.double() if not isinstance(v, torch._subclasses.FakeTensor) else v

    with pytest.raises(OutputMismatchError, match=r"true_fn \(.*\) returned a float64 tensor of rank 1 on cpu, but"):
        hop.cond(torch.tensor(True), real_only, plain, (X,))


def test_autocast_is_a_valid_new_output_kind() -> None:
    lin = torch.nn.Linear(3, 3)

    def t(v: torch.Tensor) -> torch.Tensor:
        return lin(v)

    def f(v: torch.Tensor) -> torch.Tensor:
        return lin(v) * 2

    assert hop.cond(torch.tensor(True), t, f, (X,)).dtype == torch.float32
    with torch.autocast("cpu", torch.bfloat16):
        assert hop.cond(torch.tensor(False), t, f, (X,)).dtype == torch.bfloat16
    assert hop.cond(torch.tensor(True), t, f, (X,)).dtype == torch.float32


# --- loops: carries and per-step outputs ----------------------------------------------


def test_while_loop_body_changing_dtype_in_a_later_iteration() -> None:
    def body(i: int, v: torch.Tensor) -> tuple[int, torch.Tensor]:
        return i + 1, (v.double() if i >= 1 else v)

    with pytest.raises(OutputMismatchError, match=r"hop.while_loop: carried_inputs and body_fn disagree at carry\[1\]"):
        hop.while_loop(lambda i, v: i < 3, body, (0, X))


def test_while_loop_body_changing_the_number_of_carries() -> None:
    def body(i: int, v: torch.Tensor, *rest: Any) -> Any:
        return (i + 1, v) if i < 1 else (i + 1, v, v)

    with pytest.raises(OutputMismatchError, match=r"hop.while_loop: carried_inputs and body_fn return different"):
        hop.while_loop(lambda i, v, *r: i < 3, body, (0, X))


def test_map_step_changing_dtype() -> None:
    steps = iter(range(100))

    def f(v: torch.Tensor) -> torch.Tensor:
        return v.double() if next(steps) == 1 else v

    with pytest.raises(HopValueError, match=r"hop.map: f: output: iterations 0 and 1 differ: dtype float32 vs float64"):
        hop.map(f, torch.ones(3, 2))


def test_scan_ys_changing_dtype() -> None:
    def step(c: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c + v, (v.double() if v.sum() > 2.5 else v)

    with pytest.raises(HopValueError, match=r"hop.scan: combine_fn: y: iterations 0 and 1 differ: dtype"):
        hop.scan(step, torch.zeros(2), torch.arange(6.0).reshape(3, 2))


def test_scan_ys_in_a_pytree_changing_dtype() -> None:
    def step(c: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return c + v, {"y": v.half() if v.sum() > 2.5 else v}

    with pytest.raises(HopValueError, match=r"hop.scan: combine_fn: y\[.y.\]: iterations 0 and 1 differ"):
        hop.scan(step, torch.zeros(2), torch.arange(6.0).reshape(3, 2))


# --- selectors that cannot choose -------------------------------------------------------


def test_meta_pred_with_real_operands_is_refused() -> None:
    with pytest.raises(HopValueError, match=r"hop.cond: pred is on the meta device .* operands are on cpu"):
        hop.cond(torch.tensor(False, device="meta"), plain, lambda v: v - 1, (X,))
    with pytest.raises(HopValueError, match=r"hop.switch: index is on the meta device"):
        hop.switch(torch.tensor(0, device="meta"), [plain, plain], (X,))


def test_meta_pred_with_meta_operands_gives_metadata() -> None:
    out = hop.cond(torch.tensor(False, device="meta"), plain, lambda v: v - 1, (X.to("meta"),))
    assert out.is_meta and out.shape == (3,)


# --- closed-over parameters ------------------------------------------------------------


def test_raw_op_differentiates_a_closed_over_parameter_when_inputs_need_no_grad() -> None:
    w = torch.nn.Parameter(torch.full((3,), 2.0))
    out = torch.ops.hop.cond(torch.tensor(True), lambda v: v * w, lambda v: v, (torch.arange(3.0),))
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch.arange(3.0))


def test_user_hop_without_autograd_rule_refuses_a_closed_over_parameter() -> None:
    twice = hop.HigherOrderOperator("test_silent_twice")

    @twice.py_impl(DispatchKey.CompositeExplicitAutograd)
    def twice_dense(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(fn(x))

    w = torch.nn.Parameter(torch.full((3,), 2.0))
    with pytest.raises(MissingRuleError, match=r"hop.test_silent_twice: has no autograd rule"):
        twice(lambda v: v * w, torch.ones(3))
    with torch.no_grad():
        torch.testing.assert_close(twice(lambda v: v * w, torch.ones(3)), torch.full((3,), 4.0))


def test_errors_are_hop_errors() -> None:
    assert issubclass(OutputMismatchError, HopError)


# --- closed-over numbers: validated once, checked on every call ---------------------------


def test_a_closed_over_loop_counter_is_validated_once() -> None:
    fake_runs = []
    x = torch.randn(4)

    def branches(step: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def t(v: torch.Tensor) -> torch.Tensor:
            if isinstance(v, torch._subclasses.FakeTensor):
                fake_runs.append(step)
            return v * step

        def f(v: torch.Tensor) -> torch.Tensor:
            return v - step

        return t, f

    for step in range(50):
        t, f = branches(step)
        torch.testing.assert_close(
            hop.cond(torch.tensor(step % 2 == 0), t, f, (x,)), x * step if step % 2 == 0 else x - step
        )
    assert fake_runs == [0]


def _solve(y: torch.Tensor, k: float, fake_runs: list[str], helpers: list[Any]) -> torch.Tensor:
    """An adaptive step whose branches read a helper defined here, new on every call."""

    def rhs(v: torch.Tensor) -> torch.Tensor:
        if isinstance(v, torch._subclasses.FakeTensor):
            fake_runs.append("rhs")
        return -k * v

    helpers.append(rhs)  # kept alive by the caller: no later helper can take its address

    def step(t: torch.Tensor, h: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        trial = v + h * rhs(v)
        err = (trial - (v + 0.5 * h * (rhs(v) + rhs(trial)))).abs().max()
        return hop.cond(err < 1e-3, lambda: (t + h, h * 1.2, trial), lambda: (t, h * 0.5, v), ())

    return hop.while_loop(lambda t, h, v: t < 1.0, step, (torch.tensor(0.0), torch.tensor(0.1), y))[2]


def test_helpers_defined_in_the_calling_function_are_validated_once() -> None:
    # Note [closures by kind, not identity]: the helper is a new object each call
    fake_runs: list[str] = []
    y = torch.ones(3)
    helpers: list[Any] = []
    for n in range(6):
        want = _solve_python(y, 1.0 + n)
        torch.testing.assert_close(_solve(y, 1.0 + n, fake_runs, helpers), want, rtol=1e-5, atol=1e-6)
        if n == 0:
            first = len(fake_runs)
    assert first > 0 and len(fake_runs) == first


def _solve_python(y: torch.Tensor, k: float) -> torch.Tensor:
    with hop.testing.reference():
        return _solve(y, k, [], [])


def test_a_helper_of_another_kind_is_validated_again() -> None:
    def branches(helper: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
        return (lambda v: helper(v)), (lambda v: v)

    for _ in range(3):
        hop.cond(torch.tensor(True), *branches(lambda v: v * 2), (X,))

    def other(v: torch.Tensor) -> torch.Tensor:  # other code: a verdict of its own, checked again
        return v.double()

    with pytest.raises(OutputMismatchError, match="dtype float64 vs float32"):
        hop.cond(torch.tensor(True), *branches(other), (X,))


def test_a_verdict_by_identity_never_matches_a_new_object_at_a_freed_address() -> None:
    class Scale:
        def __init__(self, dtype: torch.dtype) -> None:
            self.dtype = dtype

    def branches(scale: Scale) -> tuple[Callable[..., Any], Callable[..., Any]]:
        return (lambda v: v.to(scale.dtype)), (lambda v: v)

    freed = set()
    for _ in range(5):
        scale = Scale(torch.float32)
        freed.add(id(scale))
        hop.cond(torch.tensor(False), *branches(scale), (X,))
        del scale
    held = []  # kept alive, so that each new object takes another address
    scale = Scale(torch.float64)
    while id(scale) not in freed and len(held) < 10_000:
        held.append(scale)
        scale = Scale(torch.float64)
    if id(scale) not in freed:
        pytest.skip("CPython gave no freed address to a new object")
    # an object at a freed one's address is another object: validated, so its mistake is seen
    with pytest.raises(OutputMismatchError, match="dtype float64 vs float32"):
        hop.cond(torch.tensor(False), *branches(scale), (X,))


def test_a_closed_over_number_that_changes_the_dtype_is_caught() -> None:
    def branches(scale: float | int) -> tuple[Callable[..., Any], Callable[..., Any]]:
        def t(v: torch.Tensor) -> torch.Tensor:
            return v * scale if scale < 10 else (v * scale).double()

        return t, lambda v: v

    t, f = branches(2)
    hop.cond(torch.tensor(True), t, f, (X,))
    t, f = branches(20)
    with pytest.raises(OutputMismatchError, match="dtype float64 vs float32"):
        hop.cond(torch.tensor(True), t, f, (X,))
