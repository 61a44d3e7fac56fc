"""Note [a scatter's base is dense] (hop.compile._inductor_scatter): Inductor's
reinplacing wrote a scatter into a stride-0 base, every batch row into one row.

Each gradient here was silently wrong under Inductor before hop's pass gave such a
base a dense copy: the batched backward of an ``index_select`` scatters into an
unbatched ``zeros`` that vmap expanded. torch's own programs (no hop operator) were
wrong too, once hop is imported they are right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop


def halves(t: torch.Tensor) -> torch.Tensor:
    """Rows 0, 0, 1, 1, ...: the gradient of a row sums two."""
    return t.index_select(0, torch.arange(t.shape[0]) // 2)


def zeros_index(t: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, torch.zeros(t.shape[0], dtype=torch.long))


def weighted_grad(f: Callable[..., Any], x: torch.Tensor, compiled: bool, dynamic: bool = False) -> torch.Tensor:
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="inductor", fullgraph=True, dynamic=dynamic)
    x = x.clone().requires_grad_()
    weights = torch.arange(float(x.numel())).reshape(x.shape)
    (g,) = torch.autograd.grad((f(x) * weights).sum(), x)
    return g


BATCHED = {
    "cond": lambda r: hop.cond(r.sum() > 0, lambda a: halves(a) * 2, lambda a: a * 1.0, (r,)),
    "switch": lambda r: hop.switch((r.sum() > 0).long(), [lambda a: a * 1.0, lambda a: halves(a) * 2], (r,)),
    "fori_loop": lambda r: hop.fori_loop(0, 2, lambda i, a: halves(a) * 0.5, r),
    "while_loop": lambda r: hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, halves(a).sin()), (0, r))[1],
    "map": lambda r: hop.map(lambda s: halves(s) * 3, r),
    "scan": lambda r: hop.scan(lambda c, s: (halves(c) + s, c * 1.0), r[0], r)[1],
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", list(BATCHED))
def test_gradient_of_a_vmapped_operator_whose_callable_gathers_rows(name: str, dynamic: bool) -> None:
    """The gradient taken outside the vmap: hop's backward is the vmap of each callable's vjp."""
    program = torch.vmap(BATCHED[name])
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(0))
    want = weighted_grad(program, x, compiled=False)
    torch.testing.assert_close(weighted_grad(program, x, compiled=True, dynamic=dynamic), want)


@pytest.mark.parametrize("index", [halves, zeros_index], ids=["arange", "zeros"])
def test_torchs_own_vmap_of_a_vjp_of_index_select(index: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """No hop operator: torch's Inductor gave the sum of every row's gradient to each."""

    def program(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda r, gr: torch.func.vjp(lambda a: index(a) * 2, r)[1](gr)[0])(x, g)

    x, g = torch.randn(4, 3, 2), torch.arange(24.0).reshape(4, 3, 2)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(program, backend="inductor", fullgraph=True)(x, g), program(x, g))


def test_torchs_own_vmap_of_grad_of_index_select_by_a_zeros_index() -> None:
    """No hop operator (kept as a strict xfail on torch 2.13 until hop's pass fixed it)."""

    def s(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (zeros_index(y) * x * torch.arange(8.0).reshape(2, 4)).sum()

    gen = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    program = torch.vmap(torch.func.grad(s, argnums=(0, 1)))
    torch._dynamo.reset()
    got = torch.compile(program, backend="inductor", fullgraph=True)(xs, ys)
    torch.testing.assert_close(got, program(xs, ys))


def test_a_scatter_into_a_dense_base_is_left_as_it_is() -> None:
    from hop.compile._inductor_scatter import dense_bases

    def f(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(4, 3).index_put((torch.tensor([0, 0]),), v, accumulate=True) + x

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.ones(4, 3), torch.ones(2, 3))
    assert not dense_bases(gm.graph)

    def g(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        base = torch.zeros(3).expand(4, 3)
        return base.index_put((torch.tensor([0, 0]),), v, accumulate=True) + x

    gm = torch.fx.experimental.proxy_tensor.make_fx(g, tracing_mode="fake")(torch.ones(4, 3), torch.ones(2, 3))
    assert dense_bases(gm.graph)
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 1 and clones[0].meta["val"].stride() == (3, 1)
