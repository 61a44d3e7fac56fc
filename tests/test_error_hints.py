"""Errors that say what to do, for the mistakes a new user makes first (issue: real
programs, item 9): a body of the wrong arity, a body returning fewer carries than it
takes, a Python list of tensors as a scan's xs, a combine_fn that is not elementwise
in associative_scan's pointwise mode, a float or multi-element switch index; a traced
in-place write of a closed-over tensor names it (`self.cache`, `buf`) and the user's body;
a write to an object outside a callable under torch.compile names the line."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop
from hop.errors import HopError, HopTypeError, HopValueError, OutputMismatchError

X = torch.randn(3)


def _wide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.reshape(2, 2) + b.reshape(2, 2)).reshape(4)


CASES: list[tuple[str, Callable[[], Any], type[HopError], str]] = [
    (
        "fori_loop body of one argument",
        lambda: hop.fori_loop(0, 3, lambda v: v * 2, X),
        HopTypeError,
        r"^hop\.fori_loop: body_fn takes \(i, val\): it is called with 2 positional arguments, but .* accepts 1\. "
        r"Define body_fn to take \(i, val\)\.$",
    ),
    (
        "while_loop cond of one argument for two carries",
        lambda: hop.while_loop(lambda v: v.sum() < 3, lambda i, v: (i, v * 2), (0, X)),
        HopTypeError,
        r"^hop\.while_loop: cond_fn takes one argument per carry \(2\): .* accepts 1\.",
    ),
    (
        "while_loop body returning one carry of two",
        lambda: hop.while_loop(lambda i, v: i < 3, lambda i, v: v * 2, (0, X)),
        OutputMismatchError,
        r"return different structures: \(\*, \*\) vs \(\*,\): 2 values vs 1 \(body_fn is",
    ),
    (
        "scan over a list of tensors",
        lambda: hop.scan(lambda c, r: (c + r, c), torch.zeros(3), [torch.randn(3), torch.randn(3)]),
        HopTypeError,
        r"^hop\.scan: combine_fn raised TypeError \(.*\) on xs, a list of 2 tensors: .* pass one tensor: "
        r"torch\.stack\(xs\)\.$",
    ),
    (
        "scan combine_fn of one argument",
        lambda: hop.scan(lambda c: (c, c), torch.zeros(3), torch.randn(2, 3)),
        HopTypeError,
        r"^hop\.scan: combine_fn takes \(carry, x\)",
    ),
    (
        "associative_scan reshaping in pointwise mode",
        lambda: hop.associative_scan(_wide, torch.randn(5, 4), 0),
        HopValueError,
        r"^hop\.associative_scan: combine_fn raised RuntimeError: shape .* needs combine_mode=\"generic\"\.$",
    ),
    (
        "switch with a float index",
        lambda: hop.switch(torch.tensor(1.0), [lambda a: a, lambda a: a + 1], (X,)),
        HopTypeError,
        r"got dtype float32\. Convert it with index\.long\(\)",
    ),
]


@pytest.mark.parametrize(("what", "call", "kind", "message"), CASES, ids=[c[0] for c in CASES])
def test_the_error_says_what_to_do(what: str, call: Callable[[], Any], kind: type[HopError], message: str) -> None:
    with pytest.raises(kind, match=message):
        call()


def test_associative_scan_generic_mode_takes_the_same_combine_fn() -> None:
    xs = torch.randn(5, 4)
    got = hop.associative_scan(_wide, xs, 0, combine_mode="generic")
    torch.testing.assert_close(got, xs.cumsum(0))


def test_arity_is_read_from_defaults_varargs_and_methods() -> None:
    class Stepper:
        def step(self, i: Any, v: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
            return v * scale

    torch.testing.assert_close(hop.fori_loop(0, 2, Stepper().step, X), X * 4)
    torch.testing.assert_close(hop.fori_loop(0, 2, lambda *a: a[1] + 1, X), X + 2)
    with pytest.raises(HopTypeError, match=r"accepts 3 to 4"):
        hop.fori_loop(0, 2, lambda i, v, w, z=1: v, X)


# --- a traced write names what the user wrote ---------------------------------------------------


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            v.add_(self.cache[0])  # writes the carry, then hands on another tensor
            return v + 1

        return hop.fori_loop(torch.tensor(0), torch.tensor(4), body, y)


def test_a_refused_write_in_fori_loop_names_the_users_body_and_carry() -> None:
    from hop.errors import MutationError

    with pytest.raises(MutationError) as info:
        torch.export.export(_Cache(), (torch.randn(3),))
    message = str(info.value)
    assert message.startswith("hop.fori_loop: body_fn (_Cache.forward.<locals>.body (test_error_hints.py:")
    assert "writes val (leaf 0) in place" in message
    assert "_counted_body" not in message and "carry 1" not in message


def test_a_written_closure_variable_is_named() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from hop.errors import MutationError

    def program(xs: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        def bump(a: torch.Tensor) -> torch.Tensor:
            buf.add_(1)
            return a + buf

        return hop.map(bump, xs)

    with pytest.raises(MutationError, match=r"hop.map: f \(.*bump.*\) writes buf in place.*no fixed order"):
        make_fx(program, tracing_mode="fake")(torch.randn(2, 3), torch.zeros(3))


# --- a callable that writes an object from outside it, under torch.compile ---------------------

_STATE = {"calls": 0}


def _counting(a: torch.Tensor) -> torch.Tensor:
    _STATE["calls"] += 1
    return a + 1


def _marked(a: torch.Tensor) -> torch.Tensor:

    token = _CURRENT.set("attention")
    try:
        return a * 2
    finally:
        _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("current", default=None)


@pytest.mark.parametrize(
    ("branch", "line"),
    [(_counting, '_STATE["calls"] += 1'), (_marked, 'token = _CURRENT.set("attention")')],
    ids=["global dict", "context variable"],
)
def test_a_write_outside_the_callable_names_the_line_and_what_to_do(branch: Any, line: str) -> None:
    from hop.errors import CompileUnsupported

    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported) as info:
        torch.compile(lambda x: hop.cond(x.sum() > 0, branch, lambda a: a - 1, (x,)), backend="eager", fullgraph=True)(
            X
        )
    torch._dynamo.reset()
    message = str(info.value)
    assert message.startswith("hop.cond: true_fn, which Dynamo cannot trace into one graph (")
    assert "test_error_hints.py:" in message and f"in {branch.__name__} (`{line}`)" in message
    assert "Move that statement out of true_fn" in message
