"""Programs hop.testing found wrong, shrunk by hypothesis, kept as plain regression tests.

Each test names the transform that disagreed. The xfail ones are bugs whose fix
lies in the tracing (fake / proxy) rules; they hold the minimal program until fixed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hop
from hop.testing import CheckFailure, check


def test_associative_scan_jvp_of_an_empty_scan() -> None:
    """jvp / grad of a scan over a dimension of length 0 selected element 0 of nothing."""

    def program(x: torch.Tensor) -> Any:
        return hop.associative_scan(lambda a, b: a + b, x, dim=0)

    report = check(program, torch.zeros(0, 3, dtype=torch.float64), transforms=["eager", "autograd", "jvp", "vmap"])
    assert report.ran == ["eager", "autograd", "jvp", "vmap"]


def test_fori_loop_with_a_tensor_bound_inside_a_traced_body() -> None:
    """A tensor-bound fori_loop inside another loop's body made a tensor constant there,
    which torch.export.save cannot serialize."""

    def program(x: torch.Tensor) -> Any:
        inner = lambda i, a: hop.fori_loop(0, torch.full((), 2), lambda j, b: b + 0.1 * j, a)  # noqa: E731
        return hop.fori_loop(0, torch.full((), 2), inner, x)

    assert "export" in check(program, torch.ones(3), transforms=["eager", "export"]).ran


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="branches returning different strides: the traced output is taken as contiguous (a later reshape "
    "becomes a view) while the true branch returns a transposed tensor; the fix lies in the fake/proxy rule",
)
def test_cond_branches_with_different_strides() -> None:
    def program(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a.mT * 2.0, lambda a: a * 1.0, (x,)).reshape(-1)

    check(program, torch.arange(4.0).reshape(2, 2), transforms=["eager", "make_fx_fake"])


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="the body is traced on the carry tensors themselves, so a body reading the tensor the loop started "
    "with reads the carry instead; the fix lies in the proxy rule (trace on fresh fake carries)",
)
def test_while_loop_body_reads_its_initial_carry() -> None:
    def program(y: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, y.sin()), (0, y))[1]

    check(program, torch.tensor(0.5), transforms=["eager", "make_fx_fake"])


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="torch.tensor(...) in a traced body is a tensor constant of the subgraph, which torch.export does not "
    "lift and torch.export.save cannot serialize; the fix lies in the proxy rule (lift subgraph constants)",
)
def test_tensor_constant_in_a_traced_body() -> None:
    def program(x: torch.Tensor) -> Any:
        inner = lambda a: hop.while_loop(lambda j, b: j < 1, lambda j, b: (j + 1, b * 2), (torch.tensor(0), a))[1]  # noqa: E731
        return hop.while_loop(lambda i, a: i < 1, lambda i, a: (i + 1, inner(a)), (0, x))[1]

    check(program, torch.ones(2), transforms=["eager", "export"])


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="make_fx(tracing_mode='symbolic') of a branch using the symbolic sizes of a tensor it closes over "
    "fails: the lifted SymInt placeholders are not passed to the branch graph (forward() missing lifted_arg); "
    "the fix lies in the closure lifting of the fake/proxy rules",
)
def test_closure_sizes_in_symbolic_make_fx() -> None:
    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: y.reshape(-1).reshape(y.shape), lambda a: a, (x,))

    check(program, torch.ones(3, 2), torch.ones(3, 2), transforms=["eager", "make_fx_symbolic"])
