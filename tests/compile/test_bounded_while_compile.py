"""hop.bounded_while under torch.compile and strict export (its rules all come from its
decomposition: Note [an operator from its decomposition])."""

from __future__ import annotations

import pytest
import torch

import hop


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.9, 0.5, 0.7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, s = hop.bounded_while(
            lambda c, s: c.abs().max() > 0.1, lambda c, s: (c * self.w, s + c.sum()), (x, x.new_zeros(())), 6
        )
        return c * s


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_and_gradients_equal_eager(backend: str) -> None:
    torch._dynamo.reset()
    m = Model()
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    for x in (torch.tensor([3.0, -2.0, 0.5]), torch.tensor([0.15, 0.0, 0.01]), torch.tensor([90.0, 1.0, 2.0])):
        torch.testing.assert_close(compiled(x), m(x))
        want = torch.autograd.grad(m(x).sum(), m.w)[0]
        got = torch.autograd.grad(compiled(x).sum(), m.w)[0]
        torch.testing.assert_close(got, want)


def test_strict_export_equals_eager() -> None:
    m, x = Model(), torch.tensor([3.0, -2.0, 0.5])
    ep = torch.export.export(m, (x,), strict=True)
    for y in (x, x * 0.01, x * 30):
        torch.testing.assert_close(ep.module()(y), m(y))
