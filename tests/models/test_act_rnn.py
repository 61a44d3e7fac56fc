"""An adaptive-computation-time RNN (Graves, 2016): a ``hop.scan`` over the sequence
whose body ponders each input with a ``hop.while_loop`` until every row's cumulative
halting probability reaches ``1 - EPS`` or ``MAX_PONDER`` steps are done. The loop's
condition mixes an int step counter with a tensor mask (``(n < MAX_PONDER) &
(~halted).any()``), the body forces a halt on the last step from the counter, and the
step's output (and next state) is the states weighted by their halting probabilities,
the last one by the remainder. The twin ponders one row at a time in Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_compile_training, check_export, sharing
from torch.export import Dim

import hop
from hop.errors import HopValueError

IN, HIDDEN, MAX_PONDER, EPS = 3, 5, 4, 0.01


class ACTRNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(IN + HIDDEN, HIDDEN, dtype=torch.float64)
        self.halt = torch.nn.Linear(HIDDEN, 1, dtype=torch.float64)

    def ponder_step(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.tanh(self.cell(torch.cat([x, s], -1)))
        return s, torch.sigmoid(self.halt(s)).squeeze(-1)

    def ponder(self, h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        def cond_fn(
            n: int, s: torch.Tensor, cum: torch.Tensor, acc: torch.Tensor, halted: torch.Tensor, steps: torch.Tensor
        ) -> Any:
            return (n < MAX_PONDER) & (~halted).any()

        def body_fn(
            n: int, s: torch.Tensor, cum: torch.Tensor, acc: torch.Tensor, halted: torch.Tensor, steps: torch.Tensor
        ) -> Any:
            s_new, p = self.ponder_step(x, s)
            running = ~halted
            stop = running & ((cum + p >= 1 - EPS) | (n + 1 >= MAX_PONDER))
            weight = torch.where(stop, 1 - cum, torch.where(running, p, torch.zeros_like(p)))
            acc = acc + weight.unsqueeze(-1) * s_new
            s = torch.where(running.unsqueeze(-1), s_new, s)
            return n + 1, s, cum + weight, acc, halted | stop, steps + running.long()

        zeros = h.new_zeros(h.shape[0])
        halted, steps = torch.zeros(h.shape[0], dtype=torch.bool), torch.zeros(h.shape[0], dtype=torch.long)
        _, _, cum, acc, _, steps = hop.while_loop(cond_fn, body_fn, (0, h, zeros, torch.zeros_like(h), halted, steps))
        return acc, (acc, steps, cum)

    def forward(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``xs``: batch, length, IN. Returns the outputs, each row's ponder steps per
        position, and the halting probability spent there (1 up to rounding)."""
        h0 = xs.new_zeros(xs.shape[0], HIDDEN)
        _, (ys, steps, mass) = hop.scan(self.ponder, h0, xs, dim=1)
        return ys, steps, mass


class PythonACTRNN(ACTRNN):
    def forward(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = xs.new_zeros(xs.shape[0], HIDDEN)
        ys, steps, mass = [], [], []
        for t in range(xs.shape[1]):
            rows = []
            for b in range(xs.shape[0]):
                s, cum, acc, n = h[b], xs.new_zeros(()), torch.zeros_like(h[b]), 0
                while n < MAX_PONDER:
                    s, p = self.ponder_step(xs[b, t], s)
                    n += 1
                    if cum + p >= 1 - EPS or n == MAX_PONDER:
                        acc, cum = acc + (1 - cum) * s, cum + (1 - cum)
                        break
                    acc, cum = acc + p * s, cum + p
                rows.append((acc, n, cum))
            h = torch.stack([acc for acc, _, _ in rows])
            ys.append(h)
            steps.append(torch.tensor([n for _, n, _ in rows]))
            mass.append(torch.stack([cum for _, _, cum in rows]))
        return torch.stack(ys, 1), torch.stack(steps, 1), torch.stack(mass, 1)


def make() -> tuple[ACTRNN, list[tuple[torch.Tensor]]]:
    model = ACTRNN()
    with torch.no_grad():
        model.halt.bias.fill_(-1.0)  # most rows ponder more than once
    cases = [
        (torch.randn(batch, length, IN, dtype=torch.float64) * scale,)
        for batch, length, scale in ((3, 4, 1.0), (2, 6, 3.0), (4, 2, 0.3))
    ]
    return model, cases


def twin_of(model: ACTRNN) -> PythonACTRNN:
    return sharing(PythonACTRNN(), model)


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    trips = set()
    for case in cases:
        got, want = model(*case), twin(*case)
        torch.testing.assert_close(got, want)
        trips |= set(got[1].flatten().tolist())
    assert len(trips) > 1  # steps ponder different numbers of times


def test_eager_gradients_equal_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    for (x,) in cases:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ga = torch.autograd.grad(model(a)[0].pow(2).sum(), [a, *model.parameters()])
        gb = torch.autograd.grad(twin(b)[0].pow(2).sum(), [b, *twin.parameters()])
        torch.testing.assert_close(ga, gb)


def test_jvp_equals_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    (x,) = cases[0]
    tangent = torch.randn_like(x)
    torch.testing.assert_close(torch.func.jvp(model, (x,), (tangent,)), torch.func.jvp(twin, (x,), (tangent,)))


def test_vmap_says_to_carry_the_counter_as_a_tensor() -> None:
    # each vmapped sequence would ponder its own number of times: the int counter cannot follow
    model, cases = make()
    (x,) = cases[0]
    with pytest.raises(HopValueError, match=r"int carries cannot change .* Carry the counter as a tensor"):
        torch.vmap(model)(torch.stack([x, x * 3, x * 0.1]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


def test_inductor_training_equals_the_python_twin() -> None:
    model, cases = make()
    check_compile_training(model, cases, "inductor", loss=lambda out: out[0].pow(2).sum(), reference=twin_of(model))


DYNAMIC = ({0: Dim("batch", min=2, max=16), 1: Dim("length", min=2, max=64)},)


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases, dynamic_shapes=DYNAMIC)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path, dynamic_shapes=DYNAMIC)
