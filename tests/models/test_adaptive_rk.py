"""An adaptive Runge-Kutta solver: the Bogacki-Shampine 3(2) pair on the Van der Pol
oscillator, in float64, as one while_loop over attempted steps, each a cond that
accepts the step (time and state advance) or rejects it (both stay), the next step
size from the error estimate either way, with absolute and relative tolerances of
1e-9 and 1e-7.

Its reference is a fixed-step RK4 with many small steps (a plain Python loop), which
the adaptive solution must match within the tolerances' reach. Checked in eager, under
autograd (d y(T) / d mu, against a central difference), vmap over initial states,
jvp, torch.compile (aot_eager; Inductor with dynamic and static shapes; a training
step), export (strict and non-strict, saved and loaded, other batch sizes),
AOTInductor in a fresh process, and ONNX in onnxruntime (whose float64 constants stay
exact: Note [float64 constants in ONNX subgraphs]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import DEPLOYMENTS, assert_same, check_compile, check_compile_grad, check_deployment
from torch.export import Dim

import hop

F64 = torch.float64
END, ATOL, RTOL, MAX_STEPS = 2.0, 1e-9, 1e-7, 5_000


class VanDerPol(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))

    def f(self, y: torch.Tensor) -> torch.Tensor:
        x, v = y[..., 0], y[..., 1]
        return torch.stack([v, self.mu * (1 - x * x) * v - x], -1)


class Adaptive(VanDerPol):
    """y(END) for each row of y0 (b, 2), and the number of accepted and attempted steps."""

    def forward(self, y0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def attempt(t: torch.Tensor, h: torch.Tensor, y: torch.Tensor, k1: torch.Tensor, n: torch.Tensor) -> Any:
            h = torch.minimum(h, END - t)
            k2 = self.f(y + 0.5 * h * k1)
            k3 = self.f(y + 0.75 * h * k2)
            y3 = y + h * (2 * k1 + 3 * k2 + 4 * k3) / 9
            k4 = self.f(y3)
            y2 = y + h * (7 * k1 / 24 + k2 / 4 + k3 / 3 + k4 / 8)
            scale = ATOL + RTOL * torch.maximum(y.abs(), y3.abs())
            err = ((y3 - y2) / scale).pow(2).mean().sqrt()
            grow = torch.clamp(0.9 * (err + 1e-16).pow(-1.0 / 3), 0.2, 5.0)
            t, y, k1 = hop.cond(err <= 1.0, lambda: (t + h, y3, k4), lambda: (t, y, k1), ())
            return t, h * grow, y, k1, n + torch.stack([(err <= 1.0).long(), torch.ones((), dtype=torch.long)])

        def going(t: torch.Tensor, h: torch.Tensor, y: torch.Tensor, k1: torch.Tensor, n: torch.Tensor) -> Any:
            return (t < END) & (n[1] < MAX_STEPS)

        start = (
            torch.zeros((), dtype=F64),
            torch.full((), 1e-3, dtype=F64),
            y0,
            self.f(y0),
            torch.zeros(2, dtype=torch.long),
        )
        _, _, y, _, n = hop.while_loop(going, attempt, start)
        return y, n[0], n[1]


class FixedRK4(VanDerPol):
    """The reference: classic RK4 with STEPS equal steps, a Python loop."""

    STEPS = 4000

    def forward(self, y0: torch.Tensor) -> torch.Tensor:
        h, y = END / self.STEPS, y0
        for _ in range(self.STEPS):
            k1 = self.f(y)
            k2 = self.f(y + 0.5 * h * k1)
            k3 = self.f(y + 0.5 * h * k2)
            k4 = self.f(y + h * k3)
            y = y + h * (k1 + 2 * k2 + 2 * k3 + k4) / 6
        return y


def make() -> tuple[Adaptive, list[tuple[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return Adaptive(), [(torch.randn(b, 2, generator=g, dtype=F64) * 2,) for b in (3, 2, 5)]


def test_adaptive_matches_many_fixed_steps() -> None:
    model, cases = make()
    reference = FixedRK4()
    reference.load_state_dict(model.state_dict())
    for (y0,) in cases:
        y, accepted, attempted = model(y0)
        torch.testing.assert_close(y, reference(y0), rtol=1e-5, atol=1e-6)
        assert 10 < int(accepted) < int(attempted) < MAX_STEPS  # some steps rejected, none capped


def test_gradient_in_mu_equals_a_central_difference() -> None:
    model, cases = make()
    (y0,) = cases[0]
    (grad,) = torch.autograd.grad(model(y0)[0].sum(), [model.mu])
    eps = 1e-6
    with torch.no_grad():
        model.mu += eps
        ahead = model(y0)[0].sum()
        model.mu -= 2 * eps
        behind = model(y0)[0].sum()
        model.mu += eps
    # the step sizes are piecewise constant in mu: the pathwise gradient is the solver's,
    # close to the true one within the tolerances' reach
    torch.testing.assert_close(grad, (ahead - behind) / (2 * eps), rtol=1e-3, atol=1e-5)


def test_vmap_over_initial_states_and_jvp() -> None:
    model, cases = make()
    (y0,) = cases[2]
    rows = [model(y0[k : k + 1])[0][0] for k in range(y0.shape[0])]
    batched = torch.vmap(lambda y: model(y[None])[0][0])(y0)
    torch.testing.assert_close(batched, torch.stack(rows), rtol=1e-12, atol=1e-12)  # each row's own steps
    direction = torch.randn_like(y0)
    _, tangent = torch.func.jvp(lambda y: model(y)[0], (y0,), (direction,))
    eps = 1e-6
    with torch.no_grad():
        numeric = (model(y0 + eps * direction)[0] - model(y0 - eps * direction)[0]) / (2 * eps)
    torch.testing.assert_close(tangent, numeric, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_equals_eager(backend: str, dynamic: bool) -> None:
    model, cases = make()
    check_compile(model, cases, backend, dynamic=dynamic)


def test_compiled_training_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


BATCH = Dim("batch", min=2, max=64)


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_deployed_equals_eager(path: str, tmp_path: Path) -> None:
    model, cases = make()
    # nothing here is refused: the strict export path runs like the rest
    check_deployment(path, model, cases[0], cases, tmp_path, dynamic_shapes=({0: BATCH},), strict_refused=False)


def test_steps_counted_are_a_python_loops() -> None:
    model, cases = make()
    (y0,) = cases[1]
    with hop.testing.reference():
        want = model(y0)
    assert_same(model(y0), want, "eager vs the plain-Python program")
