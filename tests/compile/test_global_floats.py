"""A global float read inside hop's callables under ``torch.compile(dynamic=True)``, where
Dynamo makes it a graph input: read by both branches of a cond, by a loop's condition
and body, and by a loop differentiated through (its backward is a counted loop).

Found by tests/models (an implicit layer's tolerance, an ACT RNN's epsilon): torch 2.13
and 2.14 failed in Dynamo on the second read (``lift_tracked_freevar_to_input should
not be called on root SubgraphTracer``, Note [values a subgraph reads stay readable]),
and Inductor on the float among a cond's operands or a loop's inputs (``'float' object
has no attribute 'get_device'``, ``KeyError: 'val'``, torch's while_loop's "can only
be of (Tensor, int, SymInt)").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop

EPS = 0.25


def both_branches(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda v: v * EPS, lambda v: v - EPS, (x,))


def condition_and_body(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda v: v.abs().sum() < 10 - EPS, lambda v: v * (1 + EPS) + 0.1, (x,))[0]


def counted_body(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, v: (i < 3) & (v.sum() < 100 - EPS), lambda i, v: (i + 1, v.sin() * EPS), (0, x))[1]


def read_by_the_body(x: torch.Tensor) -> torch.Tensor:
    # torch 2.13 and 2.14 read the float in the body's subgraph: Inductor's lowering of
    # that read had no symbol to define (found by tests/models' early-exit transformer)
    def body(i: int, v: torch.Tensor, done: torch.Tensor) -> Any:
        v = torch.where(done, v, v.sin() + 0.5)
        return i + 1, v, done | (v > EPS)

    start = (0, x, torch.zeros_like(x, dtype=torch.bool))
    return hop.while_loop(lambda i, v, done: (i < 4) & (~done).any(), body, start)[1]


def arithmetic_in_a_nested_loop(x: torch.Tensor) -> torch.Tensor:
    # the float, read in an inner loop's body, takes part in arithmetic before it meets a
    # tensor (``0.5 * EPS``): the symbol hop gave the read was not the one that arithmetic
    # used (Inductor: "zuf8 not in {...}"; found by tests/models' HMC sampler)
    def inner(c: torch.Tensor) -> torch.Tensor:
        return hop.while_loop(lambda k, v: k < 2, lambda k, v: (k + 1, v - 0.5 * EPS * v.sin()), (0, c))[1]

    return hop.scan(lambda c, r: (inner(c) + r, c), x, torch.ones(3, x.shape[0]))[0]


PROGRAMS: list[Callable[[torch.Tensor], Any]] = [
    both_branches,
    condition_and_body,
    counted_body,
    read_by_the_body,
    arithmetic_in_a_nested_loop,
]
INPUTS = [torch.tensor([1.0, 0.5, -0.25]), torch.tensor([-2.0, 0.5, 0.25]), torch.tensor([0.1, 0.2, 0.3, 0.4])]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_compiled_equals_eager(fn: Callable[[torch.Tensor], Any], backend: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    for x in INPUTS:
        torch.testing.assert_close(compiled(x), fn(x))


def test_inductor_training_equals_eager() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(counted_body, backend="inductor", fullgraph=True, dynamic=True)
    for x in INPUTS:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(a).pow(2).sum().backward()
        counted_body(b).pow(2).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)
