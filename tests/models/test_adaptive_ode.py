"""A neural ODE with an adaptive step: a while_loop over steps, each one a cond that
accepts or rejects the candidate (``hop.cond(err < tol, accept, reject, (y_new, y))``).

The candidate also feeds a ``torch.cat`` (the error estimate's stats), so Inductor
lays it out inside the cat's buffer: a strided operand of the cond. Inductor failed
on it with a stride assert and an AOTInductor package returned wrong values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_export, sharing

import hop


class AdaptiveODE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(4, 4, dtype=torch.float64)

    def step(self, t: torch.Tensor, y: torch.Tensor, h: torch.Tensor, tol: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k1 = torch.tanh(self.f(y))
        k2 = torch.tanh(self.f(y + h * k1))
        y_new = y + h * (k1 + k2) / 2
        stats = torch.cat([y_new, (k2 - k1).abs()], dim=1)  # y_new inside the cat's buffer
        err = (h * stats[:, 4:]).abs().amax()
        accepted = err < tol
        y = hop.cond(accepted, lambda a, b: a, lambda a, b: b, (y_new, y))
        t = hop.cond(accepted, lambda t, h: t + h, lambda t, h: t, (t, h))
        h = hop.cond(accepted, lambda h: h * 1.5, lambda h: h * 0.5, (h,))
        return t, y, h, tol

    def forward(self, y0: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
        t0 = torch.zeros((), dtype=y0.dtype)
        h0 = torch.full((), 0.25, dtype=y0.dtype)
        _, y, _, _ = hop.while_loop(lambda t, y, h, tol: t < 1.0, self.step, (t0, y0, h0, tol))
        return y


class PythonODE(AdaptiveODE):
    """The plain-Python twin."""

    def forward(self, y0: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
        t, y, h = torch.zeros((), dtype=y0.dtype), y0, torch.full((), 0.25, dtype=y0.dtype)
        while t < 1.0:
            k1 = torch.tanh(self.f(y))
            k2 = torch.tanh(self.f(y + h * k1))
            y_new = y + h * (k1 + k2) / 2
            err = (h * (k2 - k1)).abs().amax()
            if err < tol:
                t, y, h = t + h, y_new, h * 1.5
            else:
                h = h * 0.5
        return y


def make() -> tuple[AdaptiveODE, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = AdaptiveODE()
    cases = [
        (torch.randn(3, 4, dtype=torch.float64), torch.tensor(tol, dtype=torch.float64)) for tol in (0.05, 0.5, 1e-3)
    ]
    return model, cases


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonODE(), model)
    for case in cases:
        torch.testing.assert_close(model(*case), twin(*case))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_gradients_equal_eager(backend: str) -> None:
    model, cases = make()
    check_compile_grad(model, cases, backend)


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path)


def test_vmap_and_jvp_equal_the_python_twin() -> None:
    # vmap over tolerances: each example takes its own steps and rejections
    model, cases = make()
    twin = sharing(PythonODE(), model)
    y0s = torch.stack([y0 for y0, _ in cases])
    tols = torch.stack([tol for _, tol in cases])
    want = torch.stack([twin(y0, tol) for y0, tol in cases])  # the twin's Python while cannot be vmapped
    torch.testing.assert_close(torch.vmap(model)(y0s, tols), want)
    y0, tol = cases[0]
    tangent = torch.randn_like(y0)
    torch.testing.assert_close(
        torch.func.jvp(lambda y: model(y, tol), (y0,), (tangent,)),
        torch.func.jvp(lambda y: twin(y, tol), (y0,), (tangent,)),
    )
