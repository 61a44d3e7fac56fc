"""Ops with a registered side effect inside hop bodies: ``torch.linalg.solve``,
``inv`` and ``cholesky`` call ``aten::_linalg_check_errors``, which torch orders
with effect tokens once functionalized (AOTAutograd, ``run_decompositions``).

Each model has a plain-Python twin; eager, ``torch.compile`` (forward and
gradients), export (strict and not, decomposed, saved and loaded) and one
AOTInductor package must all agree with it.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hop
from hop.errors import CompileUnsupported

ROOT = Path(__file__).resolve().parents[2]
Fn = Callable[..., torch.Tensor]


def spd(a: torch.Tensor) -> torch.Tensor:
    return a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype)


def newton_step(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One Newton step on F(y) = a y + y^3 / 10 - 1 (an implicit layer)."""
    residual = a @ y + 0.1 * y**3 - 1.0
    jacobian = a + torch.diag(0.3 * y**2)
    return y - torch.linalg.solve(jacobian, residual)


# --- the models and their plain-Python twins ---------------------------------------


def cond_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.cond(
        y.sum() > 0,
        lambda a, y: torch.linalg.inv(a) @ y,
        lambda a, y: torch.linalg.solve(a, y) * 2,
        (a, y),
    )


def cond_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(a) @ y if y.sum() > 0 else torch.linalg.solve(a, y) * 2


def switch_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    k = (y.sum() > 0).long() + (y.sum() > 1).long()
    return hop.switch(
        k,
        [
            lambda a, y: torch.linalg.solve(a, y),
            lambda a, y: torch.linalg.cholesky(spd(a)) @ y,
            lambda a, y: torch.linalg.inv(a) @ y,
        ],
        (a, y),
    )


def switch_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    k = int(y.sum() > 0) + int(y.sum() > 1)
    return [torch.linalg.solve(a, y), torch.linalg.cholesky(spd(a)) @ y, torch.linalg.inv(a) @ y][k]


def while_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    counter = torch.zeros((), dtype=torch.int64)
    return hop.while_loop(lambda i, v: i < 4, lambda i, v: (i + 1, newton_step(a, v)), (counter, y[:, 0]))[1]


def while_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    v = y[:, 0]
    for _ in range(4):
        v = newton_step(a, v)
    return v


def fori_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, 3, lambda i, v: torch.linalg.solve(a, v) + v.sin(), y)


def fori_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        y = torch.linalg.solve(a, y) + y.sin()
    return y


def map_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return hop.map(lambda row, a: torch.linalg.solve(a, row) * row.cos(), y, a)


def map_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.linalg.solve(a, row) * row.cos() for row in y])


def scan_body(a: torch.Tensor, c: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.linalg.solve(a, c + row), torch.linalg.cholesky(spd(a)) @ c


def scan_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    carry, ys = hop.scan(lambda c, row: scan_body(a, c, row), y[0], y)
    return ys + carry


def scan_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    c, ys = y[0], []
    for row in y:
        c, out = scan_body(a, c, row)
        ys.append(out)
    return torch.stack(ys) + c


def nested_model(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A cond inside a while_loop's body, each with its own check."""

    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = hop.cond(v.sum() > 0, lambda m, w: torch.linalg.inv(m) @ w, lambda m, w: w.sin(), (a, v))
        return i + 1, torch.linalg.solve(a, v)

    return hop.while_loop(lambda i, v: i < 2, body, (torch.zeros((), dtype=torch.int64), y))[1]


def nested_twin(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        y = torch.linalg.inv(a) @ y if y.sum() > 0 else y.sin()
        y = torch.linalg.solve(a, y)
    return y


MODELS: dict[str, tuple[Fn, Fn]] = {
    "cond": (cond_model, cond_twin),
    "switch": (switch_model, switch_twin),
    "while_loop": (while_model, while_twin),
    "fori_loop": (fori_model, fori_twin),
    "map": (map_model, map_twin),
    "scan": (scan_model, scan_twin),
    "nested": (nested_model, nested_twin),
}


class Module(torch.nn.Module):
    def __init__(self, fn: Fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fn(a, y)


def inputs(sign: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A well-conditioned matrix and a right-hand side whose sum has the sign ``sign``."""
    a = torch.eye(3, dtype=torch.float64) * 3 + 0.1 * torch.randn(3, 3, dtype=torch.float64)
    y = torch.rand(3, 3, dtype=torch.float64) * sign + 0.1 * sign
    return a, y


def grads(fn: Fn, a: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The output and the gradients of its weighted sum with respect to ``a`` and ``y``."""
    a, y = a.clone().requires_grad_(), y.clone().requires_grad_()
    out = fn(a, y)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    ga, gy = torch.autograd.grad((out * weights).sum(), (a, y))
    return out.detach(), ga, gy


def assert_all_close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# --- eager -------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_eager_equals_twin(name: str, sign: float) -> None:
    model, twin = MODELS[name]
    a, y = inputs(sign)
    assert_all_close(grads(model, a, y), grads(twin, a, y))


# --- torch.compile -----------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_compile_aot_eager(name: str) -> None:
    model, _ = MODELS[name]
    a, y = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert_all_close(compiled(a, y), model(a, y))
    assert_all_close(grads(compiled, a, y), grads(model, a, y))


@pytest.mark.parametrize("name", ["cond", "while_loop", "map", "scan"])
def test_compile_inductor(name: str) -> None:
    model, _ = MODELS[name]
    a, y = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    assert_all_close(grads(compiled, a, y), grads(model, a, y))


@pytest.mark.parametrize(("backend", "name"), [("aot_eager", "cond"), ("inductor", "fori_loop")])
def test_compiled_checks_still_raise(backend: str, name: str) -> None:
    """The error check is kept in the body: a singular matrix fails as in eager."""
    model, _ = MODELS[name]
    a, y = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    assert_all_close(compiled(a, y), model(a, y))
    with pytest.raises(torch.linalg.LinAlgError):
        compiled(torch.zeros(3, 3, dtype=torch.float64), y)


# --- torch.export ------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("name", MODELS)
def test_export(name: str, strict: bool) -> None:
    model, _ = MODELS[name]
    a, y = inputs()
    want = model(a, y)
    ep = torch.export.export(Module(model), (a, y), strict=strict)
    assert_all_close(ep.module()(a, y), want)
    decomposed = ep.run_decompositions()
    assert_all_close(decomposed.module()(a, y), want)
    for program in (ep, decomposed):
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        buffer.seek(0)
        assert_all_close(torch.export.load(buffer).module()(a, y), want)
    if name in ("fori_loop", "map"):  # a body that factors ``a`` whatever the data
        with pytest.raises(torch.linalg.LinAlgError):
            decomposed.module()(torch.zeros(3, 3, dtype=torch.float64), y)


@pytest.mark.parametrize("name", ["cond", "while_loop"])
def test_export_with_grad_inputs(name: str) -> None:
    """Exported for training (inputs requiring grad): the gradients are eager's."""
    model, _ = MODELS[name]
    a, y = inputs()
    ep = torch.export.export(Module(model), (a, y))
    assert_all_close(grads(ep.module(), a, y), grads(model, a, y))


# --- what hop cannot order --------------------------------------------------------


def printing(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.aten._print("step")
        return i + 1, torch.linalg.solve(a, v)

    return hop.while_loop(lambda i, v: i < 2, body, (torch.zeros((), dtype=torch.int64), y))[1]


def test_compile_refuses_other_effects() -> None:
    """An op whose effect is more than a check (``aten::_print``) cannot be ordered
    inside a body: fullgraph raises CompileUnsupported naming it; without fullgraph
    the loop runs eagerly."""
    a, y = inputs()
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=r"^hop\.while_loop: body_fn calling aten::_print"):
        torch.compile(printing, backend="aot_eager", fullgraph=True)(a, y)
    torch._dynamo.reset()
    assert_all_close(torch.compile(printing, backend="aot_eager")(a, y), printing(a, y))


def test_decompositions_refuse_other_effects() -> None:
    a, y = inputs()
    ep = torch.export.export(Module(printing), (a, y))
    assert_all_close(ep.module()(a, y), printing(a, y))
    with pytest.raises(CompileUnsupported, match=r"^hop\.while_loop: body_fn .*calls aten::_print"):
        ep.run_decompositions()


# --- AOTInductor -------------------------------------------------------------------


def test_aoti_package(tmp_path: Path) -> None:
    """A Newton-step while_loop packaged by AOTInductor runs in a process without hop."""
    a, y = inputs()
    ep = torch.export.export(Module(while_model), (a, y))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "newton.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    assert_all_close(runner(a, y), while_model(a, y))
    torch.save((a, y, while_model(a, y)), tmp_path / "io.pt")
    script = (
        "import sys, torch\n"
        "assert 'hop' not in sys.modules\n"
        f"a, y, want = torch.load({str(tmp_path / 'io.pt')!r})\n"
        f"runner = torch._inductor.aoti_load_package({path!r})\n"
        "torch.testing.assert_close(runner(a, y), want, rtol=1e-9, atol=1e-9)\n"
        "assert 'hop' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=300)
