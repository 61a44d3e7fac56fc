"""torch.export of ``torch.vmap`` over every operator with a batched input, strict and
non-strict, saved and loaded (Note [vmapped outputs are batched at dim 0]): a scan's
``ys``, a map's outputs and an associative scan's outputs come out of hop's rule
batched at the front, so non-strict export records no permute of an untracked tensor
(it failed: "fake tensor in the exported program constant's list") and a strict export
with a dynamic length saves (it failed: "Only as_int is supported, got as_expr")."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop

PROGRAMS: dict[str, Callable[[torch.Tensor], Any]] = {
    "cond": lambda x: hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos() * 2, (x,)),
    "switch": lambda x: hop.switch((x.sum() > 0).long(), [lambda a: a.sin(), lambda a: a - 1], (x,)),
    "while_loop": lambda x: hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 0.5 + 1), (torch.tensor(0), x))[
        1
    ],
    "fori_loop": lambda x: hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, a: a.cumsum(0) * 0.5, x),
    "map": lambda x: hop.map(lambda a: a.sin() + a.sum(), x),
    "scan": lambda x: hop.scan(lambda c, xi: (c + xi, c * xi), x[0] * 0, x),
    "associative_scan": lambda x: hop.associative_scan(lambda a, b: a + b, x, 0),
}


class Batched(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, xs: torch.Tensor) -> Any:
        return torch.vmap(self.fn)(xs)


def _save_load(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("op", sorted(PROGRAMS))
def test_vmap_exports_saves_and_loads(op: str, strict: bool) -> None:
    model = Batched(PROGRAMS[op])
    xs = torch.randn(4, 5, 3)
    length = torch.export.Dim("length", min=2, max=64)
    ep = torch.export.export(model, (xs,), dynamic_shapes=({1: length},), strict=strict)
    assert not ep.constants or all(not isinstance(c, torch._subclasses.FakeTensor) for c in ep.constants.values())
    loaded = _save_load(ep)
    for other in (xs, torch.randn(4, 9, 3)):
        torch.testing.assert_close(loaded.module()(other), model(other))


CLOSURES: dict[str, Callable[[torch.Tensor], Any]] = {
    "cond": lambda x: hop.cond(x.sum() > 0, lambda a: a + x.sum(0), lambda a: a - x.mean(0), (x[0],)),
    "while_loop": lambda x: hop.while_loop(
        lambda i, a: i < 3, lambda i, a: (i + 1, a * 0.5 + x.sum(0)), (torch.tensor(0), x[0])
    )[1],
    "scan": lambda x: hop.scan(lambda c, xi: (c + xi * x.sum(), c * xi), x[0] * 0, x),
}


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("op", sorted(CLOSURES))
def test_vmap_of_a_callable_closing_over_a_batched_dynamic_tensor_exports(op: str, strict: bool) -> None:
    # the lifted closure's placeholder was a batched value: binding its size failed
    # ("Batching rule not implemented for aten::sym_size.int")
    model = Batched(CLOSURES[op])
    length = torch.export.Dim("length", min=2, max=64)
    ep = torch.export.export(model, (torch.randn(4, 5, 3),), dynamic_shapes=({1: length},), strict=strict)
    other = torch.randn(4, 8, 3)
    torch.testing.assert_close(_save_load(ep).module()(other), model(other))


def test_non_strict_vmap_of_scan_compiles_with_aotinductor(tmp_path: Any) -> None:
    # the fake constant that non-strict export lifted also blocked AOTInductor
    model = Batched(PROGRAMS["scan"])
    length = torch.export.Dim("length", min=2, max=64)
    ep = torch.export.export(model, (torch.randn(4, 5, 3),), dynamic_shapes=({1: length},), strict=False)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "vmapped_scan.pt2"))
    loaded = torch._inductor.aoti_load_package(package)
    for other in (torch.randn(4, 5, 3), torch.randn(4, 11, 3)):
        torch.testing.assert_close(loaded(other), model(other))


def _switch_in_a_map(x: torch.Tensor) -> Any:
    return hop.map(lambda r: hop.switch((r.sum().abs() * 3).long() % 2, [lambda a: a * 2, lambda a: a - 1], (r,)), x)


@pytest.mark.parametrize("strict", [False, True])
def test_vmap_of_a_traced_switch_range_check(strict: bool) -> None:
    """Note [a recorded range check runs under vmap]: the map body's graph holds the
    switch's index check (``_assert_async``), which torch's vmap had no rule for."""
    xs = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(0))
    ep = _save_load(torch.export.export(Batched(_switch_in_a_map), (xs,), strict=strict))
    torch.testing.assert_close(ep.module()(xs), torch.vmap(_switch_in_a_map)(xs))


def test_a_batched_range_check_fails_for_any_element() -> None:
    def check(i: torch.Tensor) -> torch.Tensor:
        torch._assert_async((i >= 0) & (i < 2), "hop.switch: index out of range for 2 branches")
        return i * 2

    torch.testing.assert_close(torch.vmap(torch.vmap(check))(torch.ones(2, 3)), torch.full((2, 3), 2.0))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.vmap(check)(torch.tensor([0.0, 1.0, 2.0]))


class VmapInside(torch.nn.Module):
    """``torch.vmap`` inside a branch, and inside a map's function that is itself inside
    a vmap of the top graph."""

    def forward(self, x: torch.Tensor) -> Any:
        a = hop.cond(x.sum() > 0, lambda t: torch.vmap(torch.sin)(t), lambda t: t.cos(), (x,))
        b = hop.map(lambda row: torch.vmap(lambda e: e * row.sum())(row), x)
        return a, b, torch.vmap(lambda r: hop.map(lambda e: torch.vmap(torch.exp)(e), r))(x[None])


@pytest.mark.parametrize("strict", [False, True])
def test_vmap_inside_a_callable_exports(strict: bool) -> None:
    # the subgraphs lost functorch's level calls to fx's dead-code elimination (torch's
    # recursion into subgraphs tests purity by its default, which does not know them):
    # "Either your tensor may have escaped from inside a function being vmapped"; and a
    # map's function traced under the pre-dispatch mode of export failed torch's check
    # that there is only one ("Expected only one PreDispatchTorchFunctionMode, found 2")
    x = torch.randn(4, 3)
    ep = torch.export.export(VmapInside(), (x,), strict=strict)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    for program in (ep, torch.export.load(buffer), ep.run_decompositions()):
        for value in (x, -x):
            torch.testing.assert_close(program.module()(value), VmapInside()(value))
