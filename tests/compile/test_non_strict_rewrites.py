"""Non-strict export rewrites Python its tracer cannot see (``w[k]`` with a SymInt
``k``) with a torch-function mode; a hop body sees those rewrites as its caller's
code does (Note [rewriting torch-function modes] in hop._transforms)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hop

W = torch.randn(5, 3, dtype=torch.float64)


class Loop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        _, y = hop.while_loop(lambda k, y: k < 4, lambda k, y: (k + 1, y * 0.5 + W[k]), (0, x))
        return y


class ForiLoop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return hop.fori_loop(0, 4, lambda i, y: y + W[i] * i, x)


class BranchIndexed(torch.nn.Module):
    def forward(self, x: torch.Tensor, k: torch.Tensor) -> Any:
        j = k.item()
        torch._check(j >= 0)
        torch._check(j < W.shape[0])
        return hop.cond(x.sum() > 0, lambda x: x + W[j], lambda x: x - W[j], (x,))


def _python_loop(x: torch.Tensor) -> torch.Tensor:
    for k in range(4):
        x = x * 0.5 + W[k]
    return x


def _python_fori(x: torch.Tensor) -> torch.Tensor:
    for i in range(4):
        x = x + W[i] * i
    return x


@pytest.mark.parametrize(("model", "twin"), [(Loop(), _python_loop), (ForiLoop(), _python_fori)])
def test_a_loop_body_indexes_by_its_int_carry(model: torch.nn.Module, twin: Any) -> None:
    ep = torch.export.export(model, (torch.randn(3, dtype=torch.float64),), strict=False)
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(ep.module()(x), twin(x))
    # the rewrite traced a select, not a constant index
    inner = [n.target for m in ep.graph_module.modules() for n in m.graph.nodes]  # type: ignore[union-attr]
    assert torch.ops.aten.select.int in inner


def test_a_branch_indexes_by_a_data_dependent_int() -> None:
    ep = torch.export.export(BranchIndexed(), (torch.randn(3, dtype=torch.float64), torch.tensor(1)), strict=False)
    x = torch.randn(3, dtype=torch.float64)
    for k in range(5):
        for sign in (1, -1):
            want = sign * x + (W[k] if (sign * x).sum() > 0 else -W[k])
            torch.testing.assert_close(ep.module()(sign * x, torch.tensor(k)), want)


def test_no_mode_is_left_behind_after_a_failing_body() -> None:
    class Failing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return hop.fori_loop(0, 2, lambda i, y: y + W[i].reshape(7), x)

    before = torch._C._len_torch_function_stack()
    with pytest.raises(Exception, match="shape"):
        torch.export.export(Failing(), (torch.randn(3, dtype=torch.float64),), strict=False)
    assert torch._C._len_torch_function_stack() == before
