"""torch.compile(torch.vmap(f), fullgraph=True, dynamic=True) of a hop.cond / hop.switch /
hop.while_loop where one callable closes over a batched tensor that another does not.

Failed inside Dynamo with "Batching rule not implemented for aten::sym_size.int":
``share_lifted`` gave the callable that does not read the tensor a placeholder whose
``example_value`` was the parent's BatchedTensor (``_unbatch_placeholders`` had
already run on that subgraph), and Dynamo's runtime-assert pass, binding a size
symbol that only this placeholder carries (specialized before the operator was
traced, here by the shape guard), called ``sym_size`` on it. Found by
``hop.testing``'s ``compile_inductor_vmap`` on a random bundle (a fori_loop whose
torch.cat specialized the batch size, then a cond whose true branch read a
closed-over input).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hop


def _cond(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.cond(y.sum() > 0, lambda u: x, lambda u: u, (y * 2,))


def _switch(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.switch((y.sum() > 0).long(), [lambda u: x, lambda u: u], (y * 2,))


def _while_loop(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a + x), (torch.tensor(0), y * 2))[1]


OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cond": _cond,
    "switch": _switch,
    "while_loop": _while_loop,
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_vmap_of_a_callable_closing_over_a_tensor_its_sibling_does_not_compiles(op: str, backend: str) -> None:
    body = OPS[op]

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 3:  # a guard that specializes x's size (duck-sized with the batch) to 3
            return x
        return body(x, y)

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, generator=gen), torch.randn(3, 3, generator=gen)
    want = torch.vmap(f)(x, y)
    got = torch.compile(torch.vmap(f), backend=backend, fullgraph=True, dynamic=True)(x, y)
    torch.testing.assert_close(got, want)
