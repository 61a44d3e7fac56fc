"""A subgraph returning one value twice, compiled by Inductor (Note [a subgraph's outputs
are distinct buffers] in hop.compile.inductor).

The backward of ``hop.cond(p, lambda a: (x + a).flip(0), ...)`` returns the same tensor as
the gradient of ``x`` and of ``a``; Inductor handed out one buffer as both, and the
parent graph accumulated ``2 * y``'s gradient into it in place: the gradient of ``x``
came out as ``y``'s, silently (found by hop.testing's long profile of
``compile_inductor``). torch's own cond was right.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hop

Program = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

PROGRAMS: dict[str, Program] = {
    "cond": lambda x, y: hop.cond(y.sum() > 0, lambda a: (x + a).flip(0), lambda a: x.clone(), (y,)) + 2 * y,
    "cond of two operands": lambda x, y: (
        hop.cond(y.sum() > 0, lambda a, b: (b + a).flip(0), lambda a, b: b * 1.0, (y, x)) + 2 * y
    ),
    "switch": lambda x, y: (
        hop.switch((y.sum() > 0).long(), [lambda a: x * 1.0, lambda a: (x + a).flip(0)], (y,)) + 2 * y
    ),
    "while_loop returning one value twice": lambda x, y: (
        sum(
            hop.while_loop(
                lambda k, a, b: k < 2,
                lambda k, a, b: (k + 1, (a + b).flip(0), (a + b).flip(0)),
                (torch.zeros((), dtype=torch.long), x, y),
            )[1:]
        )
        + 2 * y
    ),
}


def _grads(f: Program, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = f(x, y)
    return (out.detach(), *torch.autograd.grad((out * torch.arange(1.0, 4.0)).sum(), (x, y)))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("dynamic", [True, False])
def test_gradients_through_a_subgraph_returning_one_value_twice(name: str, dynamic: bool) -> None:
    f = PROGRAMS[name]
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=dynamic)
    x = torch.tensor([1.7, -0.3, 0.5])
    for y in (torch.full((3,), -0.8), torch.tensor([0.8, 0.1, -0.2]), torch.full((3,), -0.4)):
        for got, want in zip(_grads(compiled, x, y), _grads(f, x, y), strict=True):
            torch.testing.assert_close(got, want)
