"""A masked LSTM over padded sequences: a ``hop.scan`` over time whose step keeps each
row's state where its mask is off (``torch.where``) and skips the cell altogether with a
``hop.cond`` when no row is on at that step (the padding at the end of a batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from matrix import check_compile, check_compile_grad, check_export, sharing
from torch.export import Dim

import hop

IN, HIDDEN = 3, 4


class MaskedLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gates = torch.nn.Linear(IN + HIDDEN, 4 * HIDDEN, dtype=torch.float64)  # (aten::lstm_cell has no vmap rule)

    def step(self, state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, on: torch.Tensor) -> Any:
        i, f, g, o = self.gates(torch.cat([x, state[0]], -1)).chunk(4, -1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        keep = on.unsqueeze(-1)
        return torch.where(keep, h, state[0]), torch.where(keep, c, state[1])

    def forward(self, xs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``xs``: batch, length, IN; ``mask``: batch, length. Returns the outputs (zero
        where masked) and the last hidden state of each row."""

        def body(state: tuple[torch.Tensor, torch.Tensor], inp: Any) -> Any:
            x, on = inp
            h, c = hop.cond(
                on.any(), lambda h, c, x, on: self.step((h, c), x, on), lambda h, c, x, on: (h, c), (*state, x, on)
            )
            return (h, c), h * on.unsqueeze(-1)

        zeros = xs.new_zeros(xs.shape[0], HIDDEN)
        (h, _), ys = hop.scan(body, (zeros, zeros), (xs, mask), dim=1)
        return ys, h


class PythonMaskedLSTM(MaskedLSTM):
    def forward(self, xs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zeros = xs.new_zeros(xs.shape[0], HIDDEN)
        state, ys = (zeros, zeros), []
        for t in range(xs.shape[1]):
            if mask[:, t].any():
                state = self.step(state, xs[:, t], mask[:, t])
            ys.append(state[0] * mask[:, t].unsqueeze(-1))
        return torch.stack(ys, 1), state[0]


def padded(lengths: list[int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.arange(total).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return torch.randn(len(lengths), total, IN, dtype=torch.float64), mask


def make() -> tuple[MaskedLSTM, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = MaskedLSTM()
    return model, [padded([3, 5, 1], 6), padded([2, 2], 4), padded([7, 4, 6, 7], 7)]


def twin_of(model: MaskedLSTM) -> PythonMaskedLSTM:
    twin = sharing(PythonMaskedLSTM(), model)
    return twin


def test_eager_and_gradients_equal_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    for xs, mask in cases:
        torch.testing.assert_close(model(xs, mask), twin(xs, mask))
        a, b = xs.clone().requires_grad_(), xs.clone().requires_grad_()
        ga = torch.autograd.grad(model(a, mask)[0].pow(2).sum(), [a, *model.parameters()])
        gb = torch.autograd.grad(twin(b, mask)[0].pow(2).sum(), [b, *twin.parameters()])
        torch.testing.assert_close(ga, gb)


def test_vmap_and_jvp_equal_the_python_twin() -> None:
    model, cases = make()
    twin = twin_of(model)
    xs, mask = cases[0]
    pairs = [(xs, mask), (xs * 2, mask & (torch.arange(6) < 2))]  # the second skips steps 2 to 5
    per_pair = [twin(*pair) for pair in pairs]  # the twin's Python if cannot be vmapped
    want = tuple(torch.stack([out[k] for out in per_pair]) for k in range(2))
    torch.testing.assert_close(torch.vmap(model)(*(torch.stack(col) for col in zip(*pairs, strict=True))), want)
    tangent = torch.randn_like(xs)
    torch.testing.assert_close(
        torch.func.jvp(lambda v: model(v, mask), (xs,), (tangent,)),
        torch.func.jvp(lambda v: twin(v, mask), (xs,), (tangent,)),
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


def test_exported_equals_eager() -> None:
    model, cases = make()
    batch, length = Dim("batch", min=2, max=16), Dim("length", min=2, max=64)
    check_export(model, cases[0], cases, dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}))
