"""Traced vmap of loops with int carries: a fori_loop with Python-int bounds, a
while_loop counting with an int. The int stays one int for the whole batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopValueError

Fn = Callable[..., Any]


def decayed(x: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, 3, lambda i, a: a.sin() * (i + 1), x)


def counted(x: torch.Tensor) -> torch.Tensor:
    # the condition reads only the int: every element takes the same steps
    return hop.while_loop(lambda a, n: n < 4, lambda a, n: (a * 0.5 + n, n + 1), (x, 0))[0]


def frozen_int(x: torch.Tensor) -> torch.Tensor:
    # a batched condition with an int that never changes
    return hop.while_loop(lambda a, k: a.sum() < 10, lambda a, k: (a * 2 + k, k), (x, 1))[0]


def python_decayed(x: torch.Tensor) -> torch.Tensor:
    for i in range(3):
        x = x.sin() * (i + 1)
    return x


def python_counted(x: torch.Tensor) -> torch.Tensor:
    for n in range(4):
        x = x * 0.5 + n
    return x


def python_frozen_int(x: torch.Tensor) -> torch.Tensor:
    while x.sum() < 10:
        x = x * 2 + 1
    return x


PROGRAMS = {"fori_loop": (decayed, python_decayed), "while_loop": (counted, python_counted)}
XS = torch.tensor([[0.5, 1.0], [2.0, -1.0], [0.1, 0.3]], dtype=torch.float64)


def per_element(fn: Fn, xs: torch.Tensor) -> torch.Tensor:
    return torch.stack([fn(x) for x in xs])


def loss_grad(fn: Fn) -> Fn:
    return torch.func.grad(lambda x: fn(x).sum())


def traced(how: str, fn: Fn) -> Fn:
    if how == "make_fx":
        return make_fx(fn, tracing_mode="fake")(XS)  # type: ignore[no-any-return]
    torch._dynamo.reset()
    return torch.compile(fn, backend=how, fullgraph=True)


@pytest.mark.parametrize("how", ["make_fx", "aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_traced_vmap_of_a_loop_with_an_int_carry(name: str, how: str) -> None:
    fn, ref = PROGRAMS[name]
    torch.testing.assert_close(traced(how, torch.vmap(fn))(XS), per_element(ref, XS))
    torch.testing.assert_close(traced(how, torch.vmap(loss_grad(fn)))(XS), per_element(loss_grad(ref), XS))


@pytest.mark.parametrize("how", ["make_fx", "aot_eager"])
def test_an_int_that_a_batched_condition_leaves_alone(how: str) -> None:
    xs = XS.abs() + 0.5
    torch.testing.assert_close(traced(how, torch.vmap(frozen_int))(xs), per_element(python_frozen_int, xs))


def test_an_int_that_a_batched_condition_changes_is_refused() -> None:
    def changing(x: torch.Tensor) -> torch.Tensor:
        return hop.while_loop(lambda a, k: a.sum() < 10, lambda a, k: (a * 2, k + 1), (x, 0))[0]

    with pytest.raises(HopValueError, match="int carries cannot change"):
        make_fx(torch.vmap(changing), tracing_mode="fake")(XS.abs() + 0.5)


class Batched(torch.nn.Module):
    def __init__(self, fn: Fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(self.fn)(x)


@pytest.mark.parametrize("strict", [False, True])
def test_export_refuses_int_carries_under_vmap_and_takes_tensor_bounds(strict: bool) -> None:
    with pytest.raises(
        HopValueError, match=r"^hop.fori_loop: under vmap, exported loops carry tensors only.*tensor bounds"
    ):
        torch.export.export(Batched(decayed), (XS,), strict=strict)

    def tensor_bounds(x: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, a: a.sin() * (i + 1), x)

    ep = torch.export.export(Batched(tensor_bounds), (XS,), strict=strict)
    torch.testing.assert_close(ep.module()(XS), per_element(python_decayed, XS))


class BatchedClosure(torch.nn.Module):
    """The loop's carry is unbatched; the tensor its body closes over is batched."""

    def forward(self, x: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        def per(y: torch.Tensor) -> torch.Tensor:
            return hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a + y), (0, x))[1]

        return torch.vmap(per)(ys)


@pytest.mark.parametrize("strict", [False, True])
def test_export_refuses_int_carries_when_only_a_closed_over_tensor_is_batched(strict: bool) -> None:
    """Non-strict export failed with vmap's own .item() message; strict export raised
    inside the graph's vmap level and left it on functorch's stack, so that the next
    strict export of any vmap failed."""
    with pytest.raises(HopValueError, match=r"^hop.while_loop: under vmap, exported loops carry tensors only"):
        torch.export.export(BatchedClosure(), (XS[0], XS), strict=strict)
    ep = torch.export.export(Batched(lambda r: r * 2), (XS,), strict=strict)
    torch.testing.assert_close(ep.module()(XS), XS * 2)
