"""A Mamba-like selective scan: the step size ``dt`` and the projections ``B`` and ``C``
depend on the input, and the state follows ``h[t] = a[t] * h[t - 1] + b[t] * x[t]``
with ``a[t] = exp(dt[t] * A)``. The recurrence runs once as a ``hop.scan`` (the body
computes ``a`` and ``b`` from its slice) and once as a ``hop.associative_scan`` over
``(a, b x)`` pairs with the affine combine, each against the Python loop, forward and
backward, over sequences of several lengths (one compiled or exported program for all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_compile_training, check_export, sharing
from torch.export import Dim

import hop

D, N = 3, 4  # channels, state size per channel


class SelectiveScan(torch.nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode  # "scan" or "associative"
        self.a_log = torch.nn.Parameter(torch.rand(D, N, dtype=torch.float64))
        self.to_dt = torch.nn.Linear(D, D, dtype=torch.float64)
        self.to_b = torch.nn.Linear(D, N, dtype=torch.float64)
        self.to_c = torch.nn.Linear(D, N, dtype=torch.float64)

    def selective(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per position: the decay ``a`` and the input ``b x`` (``... D N``), and ``C`` (``... N``)."""
        dt = torch.nn.functional.softplus(self.to_dt(x))
        a = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.a_log))
        bx = (dt * x).unsqueeze(-1) * self.to_b(x).unsqueeze(-2)
        return a, bx, self.to_c(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: batch, length, channels. Returns ``y`` (like ``x``) and the last state."""
        h0 = x.new_zeros(x.shape[0], D, N)
        if self.mode == "scan":

            def step(h: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                a, bx, c = self.selective(x_t)
                h = a * h + bx
                return h, (h * c.unsqueeze(-2)).sum(-1)

            return tuple(reversed(hop.scan(step, h0, x, dim=1)))  # type: ignore[return-value]

        def compose(first: Any, then: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return first[0] * then[0], then[0] * first[1] + then[1]

        a, bx, c = self.selective(x)
        _, h = hop.associative_scan(compose, (a, bx), 1)
        return (h * c.unsqueeze(-2)).sum(-1), h[:, -1]


class PythonSelectiveScan(SelectiveScan):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, ys = x.new_zeros(x.shape[0], D, N), []
        for t in range(x.shape[1]):
            a, bx, c = self.selective(x[:, t])
            h = a * h + bx
            ys.append((h * c.unsqueeze(-2)).sum(-1))
        return torch.stack(ys, 1), h


MODES = ["scan", "associative"]


def make(mode: str) -> tuple[SelectiveScan, list[tuple[torch.Tensor]]]:
    model = SelectiveScan(mode)
    return model, [(torch.randn(2, length, D, dtype=torch.float64),) for length in (5, 8, 2)]


def twin_of(model: SelectiveScan) -> PythonSelectiveScan:
    twin = sharing(PythonSelectiveScan(model.mode), model)
    return twin


def weighted_loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    y, h = out
    return (y * torch.linspace(-1, 1, y.shape[1], dtype=y.dtype).unsqueeze(-1)).sum() + h.pow(2).sum()


def grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    return list(torch.autograd.grad(weighted_loss(model(x)), [x, *model.parameters()]))


@pytest.mark.parametrize("mode", MODES)
def test_eager_equals_the_python_twin(mode: str) -> None:
    model, cases = make(mode)
    twin = twin_of(model)
    for case in cases:
        torch.testing.assert_close(model(*case), twin(*case))


@pytest.mark.parametrize("mode", MODES)
def test_eager_gradients_equal_the_python_twin(mode: str) -> None:
    model, cases = make(mode)
    twin = twin_of(model)
    for (x,) in cases:
        torch.testing.assert_close(grads(model, x), grads(twin, x))


@pytest.mark.parametrize("mode", MODES)
def test_vmap_and_jvp_equal_the_python_twin(mode: str) -> None:
    model, cases = make(mode)
    twin = twin_of(model)
    xs = torch.stack([cases[0][0], cases[0][0] * 0.5 + 1])  # a vmapped batch of batches
    torch.testing.assert_close(torch.vmap(model)(xs), torch.vmap(twin)(xs))
    (x,) = cases[1]
    tangent = torch.randn_like(x)
    torch.testing.assert_close(torch.func.jvp(model, (x,), (tangent,)), torch.func.jvp(twin, (x,), (tangent,)))


@pytest.mark.parametrize("mode", MODES)
def test_compiled_equals_eager(mode: str) -> None:
    model, cases = make(mode)
    check_compile(model, cases, "aot_eager")
    if mode == "scan":  # the associative scan's Inductor inference graph: the AOTInductor test
        check_compile(model, cases, "inductor")


@pytest.mark.parametrize("mode", MODES)
def test_compiled_gradients_equal_eager(mode: str) -> None:
    model, cases = make(mode)
    check_compile_grad(model, cases, "aot_eager")


@pytest.mark.parametrize("mode", MODES)
def test_inductor_training_equals_the_python_twin(mode: str) -> None:
    # one training graph: its values, and gradients of a loss weighing every position differently
    model, cases = make(mode)
    check_compile_training(model, cases, "inductor", loss=weighted_loss, reference=twin_of(model))


DYNAMIC_LENGTH = ({1: Dim("length", min=2, max=64)},)


@pytest.mark.parametrize("mode", MODES)
def test_exported_equals_eager(mode: str) -> None:
    model, cases = make(mode)
    check_export(model, cases[0], cases, dynamic_shapes=DYNAMIC_LENGTH)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make("associative")
    check_aoti(model, cases[0], cases, tmp_path, dynamic_shapes=DYNAMIC_LENGTH)
