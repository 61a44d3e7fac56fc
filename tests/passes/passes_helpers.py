"""What the tests of hop.passes share: counting a program's nodes and operators, and
checking that two programs agree."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

import hop


def hop_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """The hop operators of every graph, nested ones included, by name."""
    return sorted(
        n.target.name()
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function" and isinstance(n.target, hop.HigherOrderOperator)
    )


def count(gm: torch.fx.GraphModule) -> int:
    """Nodes of every graph, nested ones included."""
    return sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


# What an unrolled loop adds around its inlined body: the slice it reads, its output
# stacked, a copy where a loop's result would alias its input. Views and copies, not work.
_GLUE = (torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default, torch.ops.aten.clone.default)


def work(gm: torch.fx.GraphModule) -> int:
    """Computations of every graph, nested ones included: placeholders, outputs and the
    glue of unrolled loops left out."""
    graphs = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(n.op == "call_function" and n.target not in _GLUE for m in graphs for n in m.graph.nodes)


def codes(gm: torch.fx.GraphModule) -> list[str]:
    return [m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def agree(before: Callable[..., Any], after: Callable[..., Any], inputs: list[tuple[Any, ...]]) -> None:
    for args in inputs:
        torch.testing.assert_close(after(*args), before(*args))


def inputs(n: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """Inputs that take either side of a ``x.sum() > 0`` branch, some with another size."""
    torch.manual_seed(0)
    return [(torch.randn(n),), (torch.rand(n) + 0.1,), (-torch.rand(n) - 0.1,), (torch.randn(n + 2),)]


def saved_and_loaded(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` after a ``torch.export.save`` / ``load`` round trip."""
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def called(gm: torch.fx.GraphModule, op: Any) -> list[torch.fx.Node]:
    """The nodes of ``gm``'s own graph that call ``op``."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
