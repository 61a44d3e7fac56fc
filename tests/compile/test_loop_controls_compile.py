"""JAX's loop controls compiled and deployed: ``torch.compile(fullgraph=True)`` with
aot_eager and Inductor (forward and training, static and dynamic lengths),
AOTInductor and ONNX give the values and gradients of the Python loops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hop


class Controls(torch.nn.Module):
    """Each control: an unrolled reverse scan, an unrolled counted loop, a batched map
    with a branch inside, and a scan with no xs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def step(self, c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.tanh(c * self.w + x)
        return c, c.sum() * x

    def field(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda a: a * self.w, lambda a: a.exp() + self.w, (x,))

    def forward(self, init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, ys = hop.scan(self.step, init, xs, reverse=True, unroll=3)
        v = hop.fori_loop(0, 7, lambda i, v: v * 0.9 + torch.sin(v) * i * self.w, c, unroll=2)
        mapped = hop.map(self.field, xs, batch_size=4)
        _, ticks = hop.scan(lambda c, _: (c * self.w + 1, c * 2), init, None, length=5, unroll=2)
        return c, ys, v, mapped, ticks

    def python(self, init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, ys = init, [torch.empty(0)] * xs.shape[0]
        for i in reversed(range(xs.shape[0])):
            c, ys[i] = self.step(c, xs[i])
        v = c
        for i in range(7):
            v = v * 0.9 + torch.sin(v) * i * self.w
        t, ticks = init, []
        for _ in range(5):
            ticks.append(t * 2)
            t = t * self.w + 1
        return c, torch.stack(ys), v, torch.stack([self.field(x) for x in xs]), torch.stack(ticks)


INIT = torch.tensor([0.1, 0.2, 0.3])


def xs_of(n: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 3 * n).reshape(n, 3)


def loss(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sum((o * o).sum() for o in outs)  # type: ignore[return-value]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_controls_equal_python(backend: str, dynamic: bool) -> None:
    torch._dynamo.reset()
    model = Controls()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    # remainders of every size; a static length compiles once per length (Inductor: one)
    lengths = (10, 7, 12) if dynamic else (10, 7) if backend == "aot_eager" else (7,)
    for n in lengths:
        init = INIT.clone().requires_grad_()
        got = compiled(init, xs_of(n))
        want = model.python(init, xs_of(n))
        torch.testing.assert_close(got, want)
        g = torch.autograd.grad(loss(got), (init, model.w))
        torch.testing.assert_close(g, torch.autograd.grad(loss(want), (init, model.w)))


def test_aoti_and_onnx_run_the_controls(tmp_path: Path) -> None:
    model = Controls()
    xs = xs_of(10)
    with torch.no_grad():
        want = model.python(INIT, xs)
    ep = torch.export.export(model, (INIT, xs))
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "controls.pt2"))
    torch.testing.assert_close(torch._inductor.aoti_load_package(package)(INIT, xs), want)
    onnxruntime = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(model, (INIT, xs), dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    got: Any = session.run(None, dict(zip(names, (INIT.numpy(), xs.numpy()), strict=True)))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w)


def test_a_misused_control_is_refused_under_a_dynamic_compile() -> None:
    # with a dynamic length the chunking controls are dropped: their misuse is refused first
    torch._dynamo.reset()
    run = torch.compile(lambda xs: hop.scan(lambda c, x: (c + x, c), xs[0], xs, unroll=0), dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match="unroll must be at least 1"):
        run(xs_of(6))
