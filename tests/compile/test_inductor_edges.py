"""Edge cases of hop's operators under Inductor: zero-length scans, int outputs of
branches, loop carries that change size. Each test compiles one small program."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hop


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
