"""torch.func's way of differentiating a module: ``functional_call`` swaps the parameters
in for one call, and ``torch.func.grad`` differentiates after the call returned. A
branch or body that reads a parameter through ``self`` is re-run by an autograd node's
backward after the swap was undone; it must still read what its forward read (Note [a
re-run reads the closure it was converted with] in hop._closures). The gradients were
silently zero for a vmapped cond, switch and while_loop: per-example gradients
(``vmap(grad(...))``) and the gradient of a batched model (``grad(vmap(...))``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop

F64 = torch.float64
X = torch.tensor([0.1, 0.5, 0.9, 0.2, 1.4], dtype=F64)


def _python_while(m: Model, x: torch.Tensor) -> torch.Tensor:
    while x < 2:
        x = x * m.w + m.b
    return x


def _python_scan(m: Model, x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = x * m.w + m.b
    return x


# Each: hop's program of one element, and its Python twin.
PROGRAMS: dict[str, tuple[Callable[[Any, torch.Tensor], torch.Tensor], Callable[[Any, torch.Tensor], torch.Tensor]]] = {
    "cond": (
        lambda m, x: hop.cond(x > 0.3, lambda a: (a * m.w).sin() + m.b, lambda a: a * 2, (x,)),
        lambda m, x: (x * m.w).sin() + m.b if x > 0.3 else x * 2,
    ),
    "switch": (
        lambda m, x: hop.switch(
            (x > 0.3).long() + (x > 1).long(), [lambda a: a * 2, lambda a: a * m.w, lambda a: m.b * a], (x,)
        ),
        lambda m, x: [x * 2, x * m.w, m.b * x][int(x > 0.3) + int(x > 1)],
    ),
    "while_loop": (
        lambda m, x: hop.while_loop(lambda a: a < 2, lambda a: a * m.w + m.b, (x,))[0],
        _python_while,
    ),
    "fori_loop": (lambda m, x: hop.fori_loop(0, 3, lambda i, a: a * m.w + m.b, x), _python_scan),
    "scan": (
        lambda m, x: hop.scan(lambda c, r: (c * m.w + m.b * r, c), x, torch.ones(3, dtype=F64))[0],
        _python_scan,
    ),
}


class Model(torch.nn.Module):
    def __init__(self, program: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))
        self.register_buffer("b", torch.tensor(0.25, dtype=F64))
        self.program = program

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(self, x)


class Batched(Model):
    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda x: self.program(self, x))(xs).sum()


class Looped(Model):
    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.program(self, x) for x in xs]).sum()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_per_example_gradients(op: str) -> None:
    program, twin = PROGRAMS[op]
    model, reference = Model(program), Model(twin)
    state = _state(model)
    got = torch.vmap(torch.func.grad(lambda p, x: torch.func.functional_call(model, p, (x,))), (None, 0))(state, X)
    for k, x in enumerate(X):
        want = torch.func.grad(lambda p, x=x: torch.func.functional_call(reference, p, (x,)))(state)
        for name in state:
            torch.testing.assert_close(got[name][k], want[name], msg=f"{op}: d/d{name} at element {k}")
    assert got["w"].abs().sum() > 0 and got["b"].abs().sum() > 0


@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_gradient_of_a_batched_model(op: str) -> None:
    program, twin = PROGRAMS[op]
    model, reference = Batched(program), Looped(twin)
    state = _state(model)
    got = torch.func.grad(lambda p: torch.func.functional_call(model, p, (X,)))(state)
    want = torch.func.grad(lambda p: torch.func.functional_call(reference, p, (X,)))(state)
    torch.testing.assert_close(got, want)
    # the module holds its own parameter and buffer again
    assert isinstance(model.w, torch.nn.Parameter) and model.b is model._buffers["b"]
    assert not torch._C._functorch.is_functorch_wrapped_tensor(model.b)
