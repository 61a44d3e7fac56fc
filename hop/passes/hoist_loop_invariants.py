"""hoist_loop_invariants: what a loop body computes from its loop-invariant inputs alone
is computed once, before the loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from hop.passes import _program
from hop.passes._program import Program


def hoist_loop_invariants(program: Program) -> Program:
    """A copy of ``program`` in which the computations of a ``while_loop`` (condition and
    body), ``scan`` or ``map`` body that read neither a carry nor a slice of ``xs``
    (only the loop's additional inputs, the tensors it closes over) run once before the
    node; their results become new additional inputs of the loop.

    What moves (see :func:`hop.passes._program.movable`): pure aten ops with one tensor
    output, no unbacked-size binding, from a subgraph without in-place ops. A body may run
    zero times (a while_loop whose condition is false at once, a scan over zero slices),
    so nothing that can raise on its inputs' values moves out of it (indexing, integer
    division, asserts, ``.item()``): a hoisted computation may run and go unused, never
    fail where the loop did not. A while_loop's condition runs at least once, so it has no
    such limit. A value the body returns as it is stays in the body (the loop's results
    never alias its inputs).
    """
    return _program.rewrite_nodes(program, _LAYOUTS, _hoist)


# Per loop op: (position of its additional inputs in the node's args, number of a
# subgraph's placeholders before the additional inputs, (subgraph arg position, whether
# it may run zero times) for each subgraph).
_Layout = tuple[int, Callable[[tuple[Any, ...]], int], tuple[tuple[int, bool], ...]]
_LAYOUTS: dict[Any, _Layout] = {
    # while_loop(cond_gm, body_gm, carries, additional): both read carries then additional
    torch.ops.hop.while_loop: (3, lambda a: len(a[2]), ((0, False), (1, True))),
    # scan(body, init, xs, additional, reverse): body(carries, slices, additional)
    torch.ops.hop.scan: (3, lambda a: len(a[1]) + len(a[2]), ((0, True),)),
    # map(body, xs, additional): body(slices, additional)
    torch.ops.hop.map: (2, lambda a: len(a[1]), ((0, True),)),
}


def _hoist(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    at, varying, subgraphs = _LAYOUTS[node.target]
    args = node.args
    additional: list[Any] = list(args[at])  # type: ignore[arg-type]
    fixed = varying(args)
    plans = []
    for position, skippable in subgraphs:
        sub = _program.copy_graph_module(_program.subgraph(gm, args[position]))  # type: ignore[arg-type]
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != fixed + len(additional):
            return False  # not a layout this pass knows: leave the node
        hoisted = _invariants(sub, set(placeholders[fixed:]), skippable)
        plans.append((position, sub, dict(zip(placeholders[fixed:], additional, strict=True)), hoisted))
    if not any(hoisted for *_, hoisted in plans):
        return False
    extra: list[torch.fx.Node] = []  # the hoisted values the loop reads, in the parent graph
    for _, sub, env, hoisted in plans:
        _program.copy_nodes(gm, node, sub, hoisted, env)
        extra += [env[h] for h in _frontier(hoisted)]
    start = 0
    for position, sub, _, hoisted in plans:  # every subgraph gets every new input
        frontier = _frontier(hoisted)
        _program.add_inputs(sub, extra, {h: start + i for i, h in enumerate(frontier)})
        start += len(frontier)
        _program.replace_subgraph(gm, node, args[position], sub, "hoisted")  # type: ignore[arg-type]
    new_args = list(node.args)
    new_args[at] = (*additional, *extra)
    node.args = tuple(new_args)
    return True


def _invariants(sub: torch.fx.GraphModule, invariant: set[torch.fx.Node], skippable: bool) -> list[torch.fx.Node]:
    """The nodes of ``sub`` that read only ``invariant`` placeholders and each other, in
    graph order, that may move out of the loop."""
    if _program.mutates(sub):
        return []  # an in-place op could write a value that would then be shared by every iteration
    _, outputs = _program.output_nodes(sub)
    returned = {o for o in outputs if isinstance(o, torch.fx.Node)}
    hoisted = []
    for n in sub.graph.nodes:
        if n in returned or not _program.movable(n, may_be_skipped=skippable):
            continue
        if all(a in invariant for a in n.all_input_nodes):
            invariant.add(n)
            hoisted.append(n)
    return hoisted


def _frontier(hoisted: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The hoisted nodes the rest of the subgraph reads (they become its inputs)."""
    moved = set(hoisted)
    return [h for h in hoisted if any(u not in moved for u in h.users)]
