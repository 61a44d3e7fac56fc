"""``torch.func.grad`` inside a hop callable, compiled for training (Note [a captured
graph finds its transform levels at run time] in hop.compile._functorch_levels).

Dynamo writes the transform level into the graph as a number; hop runs the graph again
under a level of its own (the reverse loop's vjp, a vmapped operator's vmap), where it
failed on functorch's internal assert (``wrapped->level() < level``). And the graph
ran where grad mode was off (hop's autograd node's forward): the inner gradient was
zero, and the compiled forward silently wrong. Found by tests/models' HMC sampler,
whose leapfrog step takes the potential's gradient."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hop

W = torch.nn.Parameter(torch.tensor([1.0, 2.0]))


def potential(q: torch.Tensor) -> torch.Tensor:
    return ((q - W) ** 2 * q.abs()).sum() * 0.5


def step(q: torch.Tensor) -> torch.Tensor:
    return q - 0.1 * torch.func.grad(potential)(q)


PROGRAMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cond": lambda q: hop.cond(q.sum() > 0, step, lambda a: a * 1.0, (q,)),
    "while_loop": lambda q: hop.while_loop(
        lambda k, a: k < 3, lambda k, a: (k + 1, step(a)), (torch.zeros((), dtype=torch.long), q)
    )[1],
    "fori_loop": lambda q: hop.fori_loop(0, 3, lambda i, a: step(a), q),
    "map": lambda q: hop.map(step, q[None])[0],
    "scan": lambda q: hop.scan(lambda c, x: (step(c) + x, c), q, torch.full((2, 2), 0.5))[0],
}


def _values_and_gradient(fn: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor) -> list[torch.Tensor]:
    out = fn(q)
    return [out.detach(), *torch.autograd.grad(out.pow(2).sum(), [W])]


@pytest.mark.parametrize("batched", [False, True], ids=["one", "vmap"])
@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_compiled_training_equals_eager(op: str, batched: bool) -> None:
    fn = PROGRAMS[op]
    program = (lambda q: torch.vmap(fn)(q)) if batched else fn
    q = torch.tensor([[0.5, -1.5], [2.0, 0.25], [-0.75, 1.0]]) if batched else torch.tensor([0.5, -1.5])
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="aot_eager", fullgraph=True)
    for got, want in zip(_values_and_gradient(compiled, q), _values_and_gradient(program, q), strict=True):
        torch.testing.assert_close(got, want)
