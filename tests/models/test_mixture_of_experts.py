"""A mixture of experts routed per token: ``hop.switch`` on a batched index under
``torch.vmap`` (one expert per token), and a sequence-level ``hop.switch``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import check_aoti, check_compile, check_compile_grad, check_export, sharing

import hop
from hop.errors import CompileUnsupported

D, EXPERTS = 4, 3


class MoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(D, EXPERTS, dtype=torch.float64)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D, dtype=torch.float64) for _ in range(EXPERTS))

    def branches(self) -> list[Any]:
        return [lambda v, e=e: torch.tanh(e(v)) for e in self.experts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = self.router(x).argmax(-1)  # one expert per token
        routed = torch.vmap(lambda i, v: hop.switch(i, self.branches(), (v,)))(index, x)
        mode = (x.abs().mean() * 2).long().clamp(0, EXPERTS - 1)  # one expert for the whole sequence
        return routed + hop.switch(mode, self.branches(), (routed,))


class PythonMoE(MoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = self.router(x).argmax(-1)
        routed = torch.stack([self.branches()[int(i)](v) for i, v in zip(index, x, strict=True)])
        mode = int((x.abs().mean() * 2).long().clamp(0, EXPERTS - 1))
        return routed + self.branches()[mode](routed)


def make() -> tuple[MoE, list[tuple[torch.Tensor]]]:
    model = MoE()
    return model, [(torch.randn(5, D, dtype=torch.float64) * s,) for s in (0.2, 1.0, 2.5)]


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonMoE(), model)
    for case in cases:
        torch.testing.assert_close(model(*case), twin(*case))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str) -> None:
    model, cases = make()
    check_compile(model, cases, backend)


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


def test_exported_equals_eager() -> None:
    model, cases = make()
    check_export(model, cases[0], cases, strict_modes=(False,))


def test_strict_export_says_what_to_do() -> None:
    # torch's Dynamo cannot lift the experts' parameters under vmap (torch.cond fails alike)
    model, cases = make()
    with pytest.raises(CompileUnsupported, match="Export without strict=True"):
        torch.export.export(model, cases[0], strict=True)


def test_aoti_package_equals_eager(tmp_path: Path) -> None:
    model, cases = make()
    check_aoti(model, cases[0], cases, tmp_path)
