"""An early-exit transformer: a stack of pre-norm self-attention layers whose weights
are stacked along a layer dimension, run by a ``hop.while_loop`` over the layer index
(an int carry that picks the layer's weights) until every sequence of the batch is
confident (an exit head's top softmax probability above a threshold, read after each
layer) or the stack ends. A sequence that has exited keeps its hidden state, and the
number of layers each one used is returned. The twin runs the layers in a Python loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_export, sharing
from torch.export import Dim

import hop
from hop.errors import HopValueError

LAYERS, WIDTH, CLASSES, THRESHOLD = 4, 8, 3, 0.6


class EarlyExit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def weights(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(LAYERS, *shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5)

        self.qkv, self.proj, self.ffn = weights(WIDTH, 3 * WIDTH), weights(WIDTH, WIDTH), weights(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, CLASSES, dtype=torch.float64)

    def pick(self, w: torch.Tensor, k: Any) -> torch.Tensor:
        return w.select(0, k)  # IndexedEarlyExit indexes w[k]

    def layer(self, k: Any, h: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.layer_norm(h, (WIDTH,))
        q, key, v = (x @ self.pick(self.qkv, k)).chunk(3, -1)
        attention = torch.softmax(q @ key.transpose(-1, -2) / WIDTH**0.5, -1)
        h = h + (attention @ v) @ self.pick(self.proj, k)
        return h + torch.tanh(torch.nn.functional.layer_norm(h, (WIDTH,)) @ self.pick(self.ffn, k))

    def confident(self, h: torch.Tensor) -> torch.Tensor:
        """Per sequence: the exit head's top probability (on the mean token) clears the threshold."""
        return torch.softmax(self.head(h.mean(1)), -1).amax(-1) > THRESHOLD

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def cond_fn(k: int, h: torch.Tensor, done: torch.Tensor, used: torch.Tensor) -> Any:
            return (k < LAYERS) & (~done).any()

        def body_fn(k: int, h: torch.Tensor, done: torch.Tensor, used: torch.Tensor) -> Any:
            h = torch.where(done[:, None, None], h, self.layer(k, h))
            used = used + (~done).long()
            return k + 1, h, done | self.confident(h), used

        start = (0, h, torch.zeros(h.shape[0], dtype=torch.bool), torch.zeros(h.shape[0], dtype=torch.long))
        _, h, _, used = hop.while_loop(cond_fn, body_fn, start)
        return h, self.head(h.mean(1)), used


class PythonEarlyExit(EarlyExit):
    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        done = torch.zeros(h.shape[0], dtype=torch.bool)
        used = torch.zeros(h.shape[0], dtype=torch.long)
        k = 0
        while k < LAYERS and bool((~done).any()):
            h = torch.where(done[:, None, None], h, self.layer(k, h))
            used = used + (~done).long()
            done = done | self.confident(h)
            k += 1
        return h, self.head(h.mean(1)), used


def make() -> tuple[EarlyExit, list[tuple[torch.Tensor]]]:
    model = EarlyExit()
    g = torch.Generator().manual_seed(1)
    cases = [
        (torch.randn(b, t, WIDTH, generator=g, dtype=torch.float64) * s,)
        for b, t, s in ((3, 5, 1.0), (4, 3, 4.0), (2, 6, 0.1))
    ]
    return model, cases


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonEarlyExit(), model)
    used = set()
    for case in cases:
        got, want = model(*case), twin(*case)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        used |= set(got[2].tolist())
    assert len(used) > 1  # sequences exit after different numbers of layers


def test_compiled_equals_eager() -> None:
    model, cases = make()
    check_compile(model, cases, "inductor")


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


DYNAMIC = ({0: Dim("batch", min=2, max=16), 1: Dim("tokens", min=2, max=32)},)


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases, dynamic_shapes=DYNAMIC)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path, dynamic_shapes=DYNAMIC)


class IndexedEarlyExit(EarlyExit):
    def pick(self, w: torch.Tensor, k: Any) -> torch.Tensor:
        return w[k]


def test_weights_indexed_by_the_int_carry_export_non_strict() -> None:
    model, cases = make()
    indexed = sharing(IndexedEarlyExit(), model)
    check_export(indexed, cases[0], cases, dynamic_shapes=DYNAMIC, strict_modes=(False,))


def test_vmap_and_jvp_equal_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonEarlyExit(), model)
    # vmap over groups of sequences: each group would exit after its own number of
    # layers, which one Python int layer counter cannot hold: a clear error
    groups = torch.stack([case[0][:2, :3] for case in cases])
    with pytest.raises(HopValueError, match="int carries cannot change"):
        torch.vmap(model)(groups)
    (h,) = cases[0]
    tangent = torch.randn_like(h)
    got_primal, got_tangent = torch.func.jvp(lambda v: model(v)[:2], (h,), (tangent,))
    want_primal, want_tangent = torch.func.jvp(lambda v: twin(v)[:2], (h,), (tangent,))
    torch.testing.assert_close(got_primal, want_primal)
    torch.testing.assert_close(got_tangent, want_tangent)
