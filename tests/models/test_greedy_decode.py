"""Greedy decoding with early stop: a while_loop whose condition mixes an int step
counter with a tensor 'done' mask (``(~done).any() & (t < max_len)``), writing each
step's token into a fixed-size buffer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_export, sharing

import hop
from hop.errors import HopValueError

EOS, MAX_LEN, VOCAB, HIDDEN = 0, 5, 7, 6


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.cell = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def step(self, h: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.cell(torch.cat([h, self.embed(token)], -1)))
        return h, self.out(h).argmax(-1)

    def forward(self, h: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def cond_fn(
            t: int, done: torch.Tensor, h: torch.Tensor, token: torch.Tensor, buf: torch.Tensor
        ) -> torch.Tensor:
            return (~done).any() & (t < MAX_LEN)

        def body_fn(
            t: int, done: torch.Tensor, h: torch.Tensor, token: torch.Tensor, buf: torch.Tensor
        ) -> tuple[Any, ...]:
            h, token = self.step(h, token)
            token = torch.where(done, torch.full_like(token, EOS), token)
            buf = buf.index_copy(1, torch.full((1,), t, dtype=torch.long), token.unsqueeze(1))
            return t + 1, done | (token == EOS), h, token, buf

        done = torch.zeros(h.shape[0], dtype=torch.bool)
        buf = torch.full((h.shape[0], MAX_LEN), EOS, dtype=torch.long)
        t, _, h, _, buf = hop.while_loop(cond_fn, body_fn, (0, done, h, start, buf))
        return torch.tensor(t), buf, h


class PythonDecoder(Decoder):
    def forward(self, h: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, done, token = 0, torch.zeros(h.shape[0], dtype=torch.bool), start
        buf = torch.full((h.shape[0], MAX_LEN), EOS, dtype=torch.long)
        while (~done).any() and t < MAX_LEN:
            h, token = self.step(h, token)
            token = torch.where(done, torch.full_like(token, EOS), token)
            buf[:, t] = token
            t, done = t + 1, done | (token == EOS)
        return torch.tensor(t), buf, h


def make() -> tuple[Decoder, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = Decoder()
    cases = [(torch.randn(3, HIDDEN) * s, torch.tensor([1, 2, 3])) for s in (0.1, 1.0, 3.0)]
    return model, cases


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonDecoder(), model)
    lengths = set()
    for case in cases:
        got, want = model(*case), twin(*case)
        assert int(got[0]) == int(want[0])
        torch.testing.assert_close(got[1:], want[1:])
        lengths.add(int(got[0]))
    assert len(lengths) > 1 or MAX_LEN not in lengths  # the cases stop early, or at different steps


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path)


def test_vmap_and_jvp_equal_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonDecoder(), model)
    # vmap over batches of prompts: each batch would stop after its own number of
    # steps, which the Python int step counter cannot hold: a clear error
    with pytest.raises(HopValueError, match="int carries cannot change"):
        torch.vmap(model)(*(torch.stack(col) for col in zip(*cases, strict=True)))
    h, start = cases[1]
    tangent = torch.randn_like(h)
    # the final hidden state's tangent flows through every step the loop took (the
    # tokens, argmax integers, carry none)
    got = torch.func.jvp(lambda v: model(v, start)[2], (h,), (tangent,))
    want = torch.func.jvp(lambda v: twin(v, start)[2], (h,), (tangent,))
    assert want[1].abs().sum() > 0
    torch.testing.assert_close(got, want)


class TensorStepDecoder(Decoder):
    """The step counter carried as a tensor, as the vmap error advises: then each
    vmapped batch stops after its own number of steps."""

    def forward(self, h: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def cond_fn(t: Any, done: torch.Tensor, h: torch.Tensor, token: torch.Tensor, buf: torch.Tensor) -> Any:
            return (~done).any() & (t < MAX_LEN)

        def body_fn(t: Any, done: torch.Tensor, h: torch.Tensor, token: torch.Tensor, buf: torch.Tensor) -> Any:
            h, token = self.step(h, token)
            token = torch.where(done, torch.full_like(token, EOS), token)
            here = torch.arange(MAX_LEN) == t  # the step's column (an index_copy at a batched t has no vmap rule)
            buf = torch.where(here, token.unsqueeze(1), buf)
            return t + 1, done | (token == EOS), h, token, buf

        done = torch.zeros(h.shape[0], dtype=torch.bool)
        buf = torch.full((h.shape[0], MAX_LEN), EOS, dtype=torch.long)
        t, _, h, _, buf = hop.while_loop(cond_fn, body_fn, (torch.tensor(0), done, h, start, buf))
        return t, buf, h


def test_vmap_of_a_tensor_step_counter_equals_the_python_twin() -> None:
    model, cases = make()
    tensor_step = sharing(TensorStepDecoder(), model)
    twin = sharing(PythonDecoder(), model)
    per_case = [twin(*case) for case in cases]
    got = torch.vmap(tensor_step)(*(torch.stack(col) for col in zip(*cases, strict=True)))
    assert got[0].tolist() == [int(t) for t, _, _ in per_case]
    assert len(set(got[0].tolist())) > 1  # the batches stop after different numbers of steps
    torch.testing.assert_close(got[1], torch.stack([buf for _, buf, _ in per_case]))
    torch.testing.assert_close(got[2], torch.stack([h for _, _, h in per_case]))
