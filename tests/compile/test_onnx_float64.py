"""Float64 constants in the subgraphs of hop's operators stay exact in an ONNX file.

torch's exporter writes a Python float as a float32 constant cast to double, and its
optimizer (``optimize=True``, the default) drops ``x + c`` and ``x * c`` where ``c`` is
within float32's tolerance of 0 or 1. In an adaptive solver this silently makes the
tolerance 0 and the loop run to its cap (Note [float64 constants in ONNX subgraphs]).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import hop

pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (a dev extra)")
ort = pytest.importorskip("onnxruntime", reason="the exported files run in onnxruntime (a dev extra)")

F64 = torch.float64


class AdaptiveDecay(torch.nn.Module):
    """dy/dt = -k y to t = 1 with an adaptive Euler/Heun pair: a step is accepted when its
    error is within atol + rtol |y|, and the next step size follows the error."""

    def forward(self, y0: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        atol, rtol = 1e-9, 1e-7

        def step(t: torch.Tensor, h: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> Any:
            h = torch.minimum(h, 1.0 - t)
            euler = y + h * (-k * y)
            heun = y + 0.5 * h * (-k * y - k * euler)
            err = ((heun - euler).abs() / (atol + rtol * heun.abs())).max()
            accept = err <= 1.0
            t2, y2 = hop.cond(accept, lambda: (t + h, heun), lambda: (t, y), ())
            grow = torch.clamp(0.9 * torch.rsqrt(err + 1e-12), 0.2, 5.0)
            return t2, h * grow, y2, n + 1

        def going(t: torch.Tensor, h: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            return (t < 1.0 - 1e-12) & (n < 10_000)

        start = (torch.zeros((), dtype=F64), torch.full((), 1e-3, dtype=F64), y0, torch.zeros((), dtype=torch.int64))
        _, _, y, n = hop.while_loop(going, step, start)
        return y, n


class TinyTerms(torch.nn.Module):
    """Constants an optimizer would call 0 or 1, on a 0-dim carry and on a vector."""

    def forward(self, s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def body(i: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> Any:
            return i + 1, s + 1e-10, v * (1 + 1e-12) - 1e-11

        _, s, v = hop.while_loop(lambda i, s, v: i < 5, body, (torch.zeros((), dtype=torch.int64), s, v))
        return s, v


def _onnx_run(model: torch.nn.Module, args: tuple[torch.Tensor, ...], optimize: bool) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, args, dynamo=True, optimize=optimize, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return [torch.from_numpy(o) for o in session.run(None, dict(zip(names, [a.numpy() for a in args], strict=True)))]


@pytest.mark.parametrize("optimize", [True, False])
def test_an_adaptive_solver_keeps_its_tolerances(optimize: bool) -> None:
    model, args = AdaptiveDecay(), (torch.tensor([1.0, 2.0], dtype=F64), torch.tensor(3.0, dtype=F64))
    y, n = _onnx_run(model, args, optimize)
    want_y, want_n = model(*args)
    assert 10 < int(want_n) < 10_000
    assert int(n) == int(want_n)  # the same accepted and rejected steps
    torch.testing.assert_close(y, want_y, rtol=1e-13, atol=0)


@pytest.mark.parametrize("optimize", [True, False])
def test_constants_near_zero_and_one_are_not_dropped(optimize: bool) -> None:
    model = TinyTerms()
    args = (torch.tensor(1.0, dtype=F64), torch.tensor([1.0, -2.0, 3.0], dtype=F64))
    got = _onnx_run(model, args, optimize)
    want = model(*args)
    assert got[0].shape == want[0].shape == torch.Size([])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)
    assert float(got[0]) != 1.0


def test_the_program_passed_is_left_alone() -> None:
    model, args = TinyTerms(), (torch.tensor(1.0, dtype=F64), torch.ones(3, dtype=F64))
    ep = torch.export.export(model, args)
    before = ep.graph_module.print_readable(print_output=False)
    _onnx_run(ep, args, optimize=True)  # type: ignore[arg-type]
    assert ep.graph_module.print_readable(print_output=False) == before
