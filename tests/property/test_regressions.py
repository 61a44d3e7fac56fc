"""Programs hop.testing found wrong, shrunk by hypothesis, kept as plain regression tests.

Each test names the transform that disagreed and what was wrong.
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


def test_cond_branches_with_different_strides() -> None:
    """The traced output was claimed contiguous while the true branch returned a transposed
    tensor (a later reshape became a view); now that branch's graph returns it contiguous."""

    def program(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a.mT * 2.0, lambda a: a * 1.0, (x,)).reshape(-1)

    check(program, torch.arange(4.0).reshape(2, 2), transforms=["eager", "make_fx_fake"])


def test_while_loop_body_reads_its_initial_carry() -> None:
    """The body was traced on the carry tensors themselves, so reading the tensor the loop
    started with (a closure) read the carry; now it is traced on fresh tensors."""

    def program(y: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, y.sin()), (0, y))[1]

    check(program, torch.tensor(0.5), transforms=["eager", "make_fx_fake"])


def test_tensor_constant_in_a_traced_body() -> None:
    """torch.tensor(...) in a traced body was a constant of the subgraph, which torch.export
    neither lifts nor saves; now it is lifted to the parent graph."""

    def program(x: torch.Tensor) -> Any:
        inner = lambda a: hop.while_loop(lambda j, b: j < 1, lambda j, b: (j + 1, b * 2), (torch.tensor(0), a))[1]  # noqa: E731
        return hop.while_loop(lambda i, a: i < 1, lambda i, a: (i + 1, inner(a)), (0, x))[1]

    check(program, torch.ones(2), transforms=["eager", "export"])


def test_closure_sizes_in_symbolic_make_fx() -> None:
    """A branch that lifted one size twice (two SymInts of one expression) kept a stray
    placeholder; now every duplicate maps to the one lifted argument."""

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: y.reshape(-1).reshape(y.shape), lambda a: a, (x,))

    check(program, torch.ones(3, 2), torch.ones(3, 2), transforms=["eager", "make_fx_symbolic"])


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="jvp of a scan over length 0: the jvp rule shapes the empty ys by running the differentiated "
    "combine_fn on fake tensors, where its data-dependent op (a boolean mask) cannot be guarded; eager and "
    "autograd shape them from combine_fn itself. Open: the fix lies in the length-0 path of the jvp rule "
    "(_looping.transform / _empty); computing it there needs fake copies of functorch-wrapped tensors.",
)
def test_scan_jvp_of_an_empty_scan_with_a_boolean_mask() -> None:
    def program(y: torch.Tensor) -> Any:
        return hop.scan(lambda c, r: (c + r[r > 0].sum(), r), y.sum(0), y)

    check(program, torch.zeros(0, 3), transforms=["eager", "jvp"])


@pytest.mark.xfail(
    strict=True,
    raises=CheckFailure,
    reason="jvp of a map over length 0: the empty tangent is float64 for a float32 input, because the length-0 "
    "path shapes the differentiated body on fake 0-dim slices, where the Python scalar 0.1 promotes the "
    "tangent; open, the fix lies in the same length-0 path of the jvp rule as the scan case above.",
)
def test_map_jvp_of_an_empty_map_keeps_the_tangent_dtype() -> None:
    def program(y: torch.Tensor) -> Any:
        return hop.map(lambda r: r * 0.1, y)

    check(program, torch.zeros(0), transforms=["eager", "jvp"])
