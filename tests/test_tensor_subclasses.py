"""Tensor subclasses with their own __torch_dispatch__ run every operator as the plain
Python program in eager, with autograd (Note [tensor subclasses run as Python] in
hop.ops._common), unless a rule is registered for the subclass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import hop


def _pair() -> TwoTensor:
    return TwoTensor(torch.randn(4, 3), torch.randn(4, 3)).requires_grad_()


def _cond(t: Any) -> Any:
    return hop.cond(t.sum() > 0, lambda x: x * 2, lambda x: x.sin(), (t,))


def _switch(t: Any) -> Any:
    index = (t.sum() > 0).long()  # a TwoTensor index
    return hop.switch(index, [lambda x: x.cos(), lambda x: x * 3], (t,))


def _while(t: Any) -> Any:
    return hop.while_loop(lambda x, i: x.abs().sum() < 100, lambda x, i: (x * 2, i + 1), (t, torch.tensor(0)))[0]


def _fori(t: Any) -> Any:
    return hop.fori_loop(0, 3, lambda i, x: x * 0.5 + i, t)


def _scan(t: Any) -> Any:
    c, ys = hop.scan(lambda c, x: (c + x, c * x), torch.zeros(3), t)
    return c.sum() + ys.sum()


def _map(t: Any) -> Any:
    return hop.map(lambda r: r.exp(), t)


def _associative_scan(t: Any) -> Any:
    return hop.associative_scan(lambda x, y: x * y + y, t, 0)


PROGRAMS: dict[str, Callable[[Any], Any]] = {
    "cond": _cond,
    "switch": _switch,
    "while_loop": _while,
    "fori_loop": _fori,
    "scan": _scan,
    "map": _map,
    "associative_scan": _associative_scan,
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_two_tensor_runs_as_the_python_program(name: str) -> None:
    program = PROGRAMS[name]
    t = _pair()
    got = program(t)
    assert isinstance(got, TwoTensor)
    (grad,) = torch.autograd.grad(got.sum(), t)
    u = TwoTensor(t.a.detach(), t.b.detach()).requires_grad_()
    with hop.testing.reference():  # the operators as plain Python
        want = program(u)
    (want_grad,) = torch.autograd.grad(want.sum(), u)
    for g, w in ((got, want), (grad, want_grad)):
        torch.testing.assert_close(g.a, w.a)
        torch.testing.assert_close(g.b, w.b)


def test_a_predicate_that_is_a_subclass_is_read_as_python_reads_it() -> None:
    t = TwoTensor(torch.ones(3), torch.ones(3))
    pred = TwoTensor(torch.tensor(False), torch.tensor(False))
    out = hop.cond(pred, lambda x: x + 1, lambda x: x - 1, (t,))
    torch.testing.assert_close(out.a, torch.zeros(3))


class Marked(TwoTensor):
    """A subclass with a rule of its own on hop.scan's raw op (registered once, below)."""


class _RuleRan(Exception):
    pass


def _marked_scan_rule(*args: Any) -> Any:
    raise _RuleRan


torch.ops.hop.scan.py_impl(Marked)(_marked_scan_rule)


def test_a_registered_rule_takes_the_subclass() -> None:
    t = Marked(torch.ones(3, 2), torch.ones(3, 2))
    with pytest.raises(_RuleRan):  # not the plain Python program
        hop.scan(lambda c, x: (c + x, c), torch.zeros(2), t)
    plain = TwoTensor(torch.ones(3, 2), torch.ones(3, 2))
    assert isinstance(hop.scan(lambda c, x: (c + x, c), torch.zeros(2), plain)[0], TwoTensor)
