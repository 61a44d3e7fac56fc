"""An implicit layer ``z = tanh(W z + x)`` solved by Newton's method: a ``hop.while_loop``
until the residual norm is below ``TOL`` (or ``MAX_ITERS`` steps; an int counter and a
tensor in the condition), each step a ``torch.linalg.solve`` (an op torch orders with
effect tokens once functionalized) and a ``hop.cond`` that takes a damped step where
the full one makes the residual grow. Gradients flow through the unrolled iterations.

The damping choice is also written with torch's own ``torch.cond`` inside the hop loop,
as library code might: eager, export and compiled inference work; compiled training
raises a HopError by design (tests/compile/test_torch_ops_inside.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_compile_training, check_export, sharing

import hop
from hop.errors import HopError

D, TOL, MAX_ITERS = 4, 1e-9, 12


class ImplicitLayer(torch.nn.Module):
    def __init__(self, choose: str = "hop") -> None:
        super().__init__()
        self.choose = choose  # "hop": hop.cond; "torch": torch.cond
        self.w = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64) * 1.5 / D**0.5)

    def residual(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return z - torch.tanh(z @ self.w.T + x)

    def newton_step(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(z @ self.w.T + x)
        jacobian = torch.eye(D, dtype=z.dtype) - (1 - t * t).unsqueeze(-1) * self.w
        return torch.linalg.solve(jacobian, (z - t).unsqueeze(-1)).squeeze(-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: batch, D. Returns ``z``, the number of steps and of damped steps."""

        def cond_fn(k: int, z: torch.Tensor, res: torch.Tensor, damped: torch.Tensor) -> Any:
            return (res > TOL) & (k < MAX_ITERS)

        def body_fn(k: int, z: torch.Tensor, res: torch.Tensor, damped: torch.Tensor) -> Any:
            dz = self.newton_step(z, x)
            grew = self.residual(z - dz, x).norm(dim=-1).amax() > res
            cond = torch.cond if self.choose == "torch" else hop.cond
            z = cond(grew, lambda z, dz: z - 0.5 * dz, lambda z, dz: z - dz, (z, dz))
            return k + 1, z, self.residual(z, x).norm(dim=-1).amax(), damped + grew.long()

        z0 = torch.zeros_like(x)
        res0 = self.residual(z0, x).norm(dim=-1).amax()
        k, z, _, damped = hop.while_loop(cond_fn, body_fn, (0, z0, res0, torch.zeros((), dtype=torch.long)))
        return z, torch.tensor(k), damped


class PythonImplicitLayer(ImplicitLayer):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z, k, damped = torch.zeros_like(x), 0, 0
        res = self.residual(z, x).norm(dim=-1).amax()
        while res > TOL and k < MAX_ITERS:
            dz = self.newton_step(z, x)
            if self.residual(z - dz, x).norm(dim=-1).amax() > res:
                z, damped = z - 0.5 * dz, damped + 1
            else:
                z = z - dz
            k += 1
            res = self.residual(z, x).norm(dim=-1).amax()
        return z, torch.tensor(k), torch.tensor(damped)


def make(choose: str = "hop") -> tuple[ImplicitLayer, list[tuple[torch.Tensor]]]:
    model = ImplicitLayer(choose)
    return model, [(torch.randn(3, D, dtype=torch.float64) * s,) for s in (0.1, 1.0, 4.0)]


def twin_of(model: ImplicitLayer) -> PythonImplicitLayer:
    twin = sharing(PythonImplicitLayer(), model)
    return twin


@pytest.mark.parametrize("choose", ["hop", "torch"])
def test_eager_equals_the_python_twin(choose: str) -> None:
    model, cases = make(choose)
    twin = twin_of(model)
    steps, damped = set(), 0
    for case in cases:
        got, want = model(*case), twin(*case)
        torch.testing.assert_close(got, want)
        steps.add(int(got[1]))
        damped += int(got[2])
    assert len(steps) > 1 and damped > 0  # other trip counts, and both branches


def test_eager_gradients_equal_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    for (x,) in cases:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ga = torch.autograd.grad(model(a)[0].sum(), [a, model.w])
        gb = torch.autograd.grad(twin(b)[0].sum(), [b, twin.w])
        torch.testing.assert_close(ga, gb)


def test_jvp_equals_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    (x,) = cases[1]
    tangent = torch.randn_like(x)
    torch.testing.assert_close(
        torch.func.jvp(lambda v: model(v)[0], (x,), (tangent,)),
        torch.func.jvp(lambda v: twin(v)[0], (x,), (tangent,)),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


def test_inductor_training_equals_the_python_twin() -> None:
    model, cases = make()
    check_compile_training(model, cases, "inductor", reference=twin_of(model))


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path)


def test_torch_cond_inside_compiles_and_exports() -> None:
    model, cases = make("torch")
    with torch.no_grad():  # compiled inference: the parameters need no gradient
        check_compile(model, cases, "aot_eager")
    check_export(model, cases[0], cases)


def test_torch_cond_inside_compiled_training_says_what_to_do() -> None:
    model, cases = make("torch")
    torch._dynamo.reset()
    x = cases[1][0].clone().requires_grad_()
    with pytest.raises(Exception, match="calls one of torch's own control-flow operators") as info:
        torch.compile(model, backend="aot_eager", fullgraph=True)(x)[0].sum().backward()
    cause: BaseException | None = info.value
    while cause is not None and not isinstance(cause, HopError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, HopError)
