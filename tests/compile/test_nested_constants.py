"""A plain constant tensor (a global, a closed-over tensor or an unregistered module
attribute: neither parameter nor buffer) read both in a hop body and in a hop op
nested in that body. Reported as a bare StopIteration from non-strict export; each
level lifts the constant, and the levels must agree on one input for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hop

K = torch.tensor([1.0, 2.0, 3.0])  # a global constant


def inner(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return hop.cond(v.sum() > 0, lambda a: a * k, lambda a: a - k, (v,))


def in_map(x: torch.Tensor) -> torch.Tensor:
    return hop.map(lambda r: inner(r, K) + K, x)


def in_while(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, inner(v, K) + K), (torch.tensor(0), x[0]))[1]


def in_while_int_counter(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, inner(v, K) * K), (0, x[0]))[1]


def in_scan(x: torch.Tensor) -> torch.Tensor:
    return hop.scan(lambda c, r: (c + inner(r, K) * K, c), torch.zeros(3), x)[0]


def in_cond(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: inner(a, K) + K, lambda a: a * K, (x,))


def predicate_reads_it(x: torch.Tensor) -> torch.Tensor:
    # the predicate and a branch read the constant: the scan body lifted it twice, one
    # get_attr was left without users (StopIteration in torch's constant lifting)
    body = lambda c, r: (c, hop.cond(K.sum() > 1, lambda a: a * K, lambda a: a - 1, (c + r,)))  # noqa: E731
    return hop.scan(body, torch.zeros(3), x)[1]


def in_fori_in_scan(x: torch.Tensor) -> torch.Tensor:
    def body(c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = hop.fori_loop(0, 2, lambda i, a: hop.cond(K.sum() > 0, lambda b: b + K, lambda b: b - K, (a,)), c)
        return c, c + r

    return hop.scan(body, torch.zeros(3), x)[1]


def closed_over(x: torch.Tensor) -> torch.Tensor:
    k = torch.tensor([0.5, -0.5, 2.0])
    return hop.map(lambda r: inner(r, k) + k, x)


class Attribute(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = torch.tensor([1.0, 2.0, 3.0])  # not registered
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k
        mapped = hop.map(lambda r: hop.cond(r.sum() > 0, lambda a: self.lin(a) * k, lambda a: a - k, (r,)) + k, x)
        scanned = hop.scan(lambda c, r: (c + hop.map(lambda q: q * k, r.unsqueeze(0))[0], c), torch.zeros(3), x)[0]
        return mapped, scanned


class Wrap(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


MODELS = [in_map, in_while, in_while_int_counter, in_scan, in_cond, predicate_reads_it, in_fori_in_scan, closed_over]
X = torch.tensor([[0.5, -1.0, 0.25], [-2.0, 0.5, 0.5]])


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("model", [*MODELS, Attribute], ids=lambda m: m.__name__)
def test_export_and_decompose(model: Callable[..., torch.Tensor] | type[torch.nn.Module], strict: bool) -> None:
    module = model() if isinstance(model, type) else Wrap(model)
    ep = torch.export.export(module, (X,), strict=strict)
    decomposed = ep.run_decompositions()
    for x in (X, -X, X.flip(0)):
        torch.testing.assert_close(ep.module()(x), module(x))
        torch.testing.assert_close(decomposed.module()(x), module(x))
