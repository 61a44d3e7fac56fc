"""A loop body's writes to its carries, made in place for Inductor (the cost of the slice written).

Note [a written carry is written in place]
A body that writes one row of a carried buffer (a KV cache, a ring buffer: the state
of docs/state.md, or a carry written out of place with ``index_copy``) reaches
Inductor functionalized: its output is ``index_put(buffer, [i], row)``, a new
buffer. Inductor's while loop then allocates and fills a whole new buffer every
step, so a step costs the buffer, not the row. Its generated loop hands each step's
outputs to the next step by reference, and a body that writes a carried input in
place is lowered as a mutation of that input (hop's scan rewrite writes its stacked
outputs so). So before lowering, a carry whose body output is a chain of scatters
(``index_put``, ``index_copy``, ``scatter``, ``select_scatter``, ``slice_scatter``)
into that same carry's placeholder, with no read of the placeholder after the
first scatter and no read of the written value but the output (the next step's),
becomes the in-place chain, returning the placeholder. The loop's
initial value of such a carry is copied once before the loop (the caller's tensor,
a graph input, keeps its value for every other reader): one copy per call, a row
per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = ["write_carries_in_place"]

aten = torch.ops.aten

# functional scatter -> how to do it in place on its first argument
_IN_PLACE: dict[Any, Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]] = {}


def _same_args(in_place: Any) -> Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]:
    def emit(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(in_place, node.args, node.kwargs)

    return emit


def _view_then_copy(view: Any) -> Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]:
    """``select_scatter(x, src, dim, i)`` is ``x.select(dim, i).copy_(src)`` (the slice
    form alike); the chain goes on from ``x``."""

    def emit(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        target, src, *where = node.args
        part = graph.call_function(view, (target, *where))
        graph.call_function(aten.copy_.default, (part, src))
        return target  # type: ignore[return-value]

    return emit


_IN_PLACE.update(
    {
        aten.index_put.default: _same_args(aten.index_put_.default),
        aten.index_copy.default: _same_args(aten.index_copy_.default),
        aten.scatter.src: _same_args(aten.scatter_.src),
        aten.scatter.value: _same_args(aten.scatter_.value),
        aten.scatter_add.default: _same_args(aten.scatter_add_.default),
        aten.select_scatter.default: _view_then_copy(aten.select.int),
        aten.slice_scatter.default: _view_then_copy(aten.slice.Tensor),
    }
)


def write_carries_in_place(body: torch.fx.GraphModule, n_carries: int) -> list[int]:
    """Note [a written carry is written in place]: rewrite ``body`` (its first
    ``n_carries`` placeholders and outputs are the carries) and return the carries
    now written in place."""
    graph = body.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    order = {n: k for k, n in enumerate(graph.nodes)}
    done = []
    for k in range(min(n_carries, len(outs), len(placeholders))):
        chain = _chain(outs[k], placeholders[k])
        if chain is None or any(order[u] > order[chain[0]] for u in placeholders[k].users if u is not chain[0]):
            continue
        if set(chain[-1].users) != {output}:
            # read again after its write in the same step (attention reading the cache it just
            # wrote): such a carry, written in place, tripped Inductor's stride checks of the
            # loop's outputs, so it stays functional (a copy per step)
            continue
        target: Any = placeholders[k]
        for node in chain:
            with graph.inserting_before(node):
                new = _IN_PLACE[node.target](graph, node)
            node.replace_all_uses_with(target)
            graph.erase_node(node)
            del new
        done.append(k)
    if done:
        graph.lint()
        body.recompile()
    return done


def _chain(out: Any, placeholder: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The scatters from ``placeholder`` to ``out``, first first; None when ``out`` is not
    such a chain (or an intermediate has another reader)."""
    chain: list[torch.fx.Node] = []
    node = out
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _IN_PLACE:
        chain.append(node)
        first = node.args[0]
        if first is placeholder:
            chain.reverse()
            return chain
        if not isinstance(first, torch.fx.Node) or len(first.users) != 1:
            return None
        node = first
    return None
