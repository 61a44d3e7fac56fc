"""torch's own control-flow operators inside hop's callables (library code that uses
torch.cond, called from a hop loop or branch): they work where they work outside hop,
or raise a HopError that says what to do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop as torch_while_loop

import hop
from hop.errors import HopError

Fn = Callable[..., Any]
X = torch.tensor([0.5, -0.25, 1.0])


def library_step(v: torch.Tensor) -> torch.Tensor:
    """Code that already uses torch.cond."""
    return torch.cond(v.sum() > 0, lambda a: a * 0.5, lambda a: a + 1.0, (v,))


def in_loop(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, library_step(v)), (0, x))[1]


def in_branch(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, library_step, lambda a: a - 1, (x,))  # the untaken branch calls it too


def in_scan(x: torch.Tensor) -> torch.Tensor:
    return hop.scan(lambda c, r: (c + library_step(r), c), torch.zeros(()), x)[0]


def python_twin(fn: Fn) -> Fn:
    def twin(x: torch.Tensor) -> torch.Tensor:
        with hop.testing.reference():
            return fn(x)

    return twin


PROGRAMS = [in_loop, in_branch, in_scan]


def inputs() -> list[torch.Tensor]:
    return [X, -X, X * 3]


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_eager_value_and_gradient_equal_plain_python(fn: Fn) -> None:
    # eager failed: hop's validation runs the callable on fake tensors, where torch.cond
    # compiles itself with Dynamo, which cannot trace that run
    for x in inputs():
        torch.testing.assert_close(fn(x), python_twin(fn)(x))
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn(a).sum().backward()
        python_twin(fn)(b).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_export(fn: Fn, strict: bool) -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x)

    ep = torch.export.export(M(), (X,), strict=strict)
    for x in inputs():
        torch.testing.assert_close(ep.module()(x), fn(x))


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_compile_without_grad(fn: Fn) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for x in inputs():
        torch.testing.assert_close(compiled(x), fn(x))


CALLED = {"in_loop": "while_loop", "in_branch": "cond", "in_scan": "scan"}


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_compiled_training_says_what_to_do(fn: Fn) -> None:
    # was: KeyError: <TransformType.Grad: 2> (hop differentiates its callables with
    # torch.func.vjp, for which torch's own cond has no rule)
    torch._dynamo.reset()
    x = X.clone().requires_grad_()
    with pytest.raises(Exception, match="calls one of torch's own control-flow operators") as info:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(x).sum().backward()
    cause: BaseException | None = info.value
    while cause is not None and not isinstance(cause, HopError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, HopError)
    # the operator the user called (a loop's backward is a scan: it said "hop.scan")
    assert str(cause).startswith(f"hop.{CALLED[fn.__name__]}: "), str(cause)


def test_torch_while_loop_inside_a_hop_loop_runs_eagerly() -> None:
    def inner(v: torch.Tensor) -> torch.Tensor:
        return torch_while_loop(lambda j, u: j < 2, lambda j, u: (j + 1, u * 2.0), (torch.tensor(0), v))[1]

    out = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, inner(v)), (0, X))[1]
    torch.testing.assert_close(out, X * 64)
