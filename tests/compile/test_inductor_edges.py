"""Edge cases of hop's operators under Inductor: zero-length scans, int outputs of
branches, loop carries that change size. Each test compiles one small program."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hop
from hop.errors import CompileUnsupported


def _scans(xs: torch.Tensor) -> Any:
    ys = hop.map(lambda r: r * 2, xs)
    carry, zs = hop.scan(lambda c, r: (c * r, c + r), torch.ones(2), xs)
    return ys, carry, zs


@pytest.mark.parametrize("dynamic", [False, True])
def test_zero_length_map_and_scan(dynamic: bool) -> None:
    """A length-0 map or scan runs no step: empty ys and a copy of init, as in eager
    (the rewritten loop's body was traced anyway, and its bound checks failed). With
    ``dynamic=True``, length 0 recompiles after a length-4 call (0 is specialized)."""
    torch._dynamo.reset()
    compiled = torch.compile(_scans, backend="inductor", fullgraph=True, dynamic=dynamic)
    for n in (4, 0) if dynamic else (0,):
        xs = torch.randn(n, 2)
        torch.testing.assert_close(compiled(xs), _scans(xs))
    torch._dynamo.reset()


def _grow(s: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda a: a.shape[0] < 8, lambda a: torch.cat([a, a[-1:] + 1]), (s,))[0] * 2


def _shrink(s: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda a: a.sum() > 1, lambda a: a[a > a.mean()] * 0.9, (s,))[0] + 1


_RESIZED = (
    "hop.while_loop: loop carries that change size between iterations (carry 0, dim 0) do not compile with Inductor"
)
_CARRIES = [(_grow, torch.zeros(2)), (_shrink, torch.tensor([3.0, 1, 2, 5]))]


@pytest.mark.parametrize(("fn", "x"), _CARRIES, ids=["grow", "shrink"])
def test_resized_carries_are_refused_with_fullgraph(fn: Any, x: torch.Tensor) -> None:
    """Inductor's while loop keeps carries at their initial size: Dynamo refuses the loop
    (before any Inductor build) with a message that says what to do instead."""
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=re.escape(_RESIZED)) as info:
        torch.compile(fn, backend="inductor", fullgraph=True)(x)
    assert 'backend="aot_eager"' in str(info.value)
    torch._dynamo.reset()


def test_resized_carries_break_the_graph_without_fullgraph() -> None:
    """The loop runs eagerly, the rest compiles: the result is eager's."""
    torch._dynamo.reset()
    for fn, x in _CARRIES:
        torch.testing.assert_close(torch.compile(fn, backend="inductor")(x), fn(x))
    torch._dynamo.reset()


def test_resized_carries_are_refused_by_aoti() -> None:
    """An exported program reaches Inductor without Dynamo's check: hop's post-grad pass
    refuses the loop (the build stops before any code is generated)."""

    class Grow(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return _grow(s)

    ep = torch.export.export(Grow(), (torch.zeros(2),))
    with pytest.raises(Exception, match=re.escape(_RESIZED)) as info:
        torch._inductor.aoti_compile_and_package(ep)
    assert any(isinstance(e, CompileUnsupported) for e in _causes(info.value))


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__
