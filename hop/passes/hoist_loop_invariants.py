"""hoist_loop_invariants: what a loop body computes from its loop-invariant inputs alone
is computed once, before the loop."""

from __future__ import annotations

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
    return _program.rewrite_nodes(program, _program.is_loop, _hoist)


def _hoist(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    layout = _program.node_layout(node)
    assert layout is not None and layout.inputs is not None
    args = node.args
    at = layout.inputs  # the additional inputs: after the carries and slices of xs
    additional: list[Any] = list(args[at])  # type: ignore[arg-type]
    fixed = layout.leading(args)
    plans = []
    for position in layout.subgraph_positions(args):
        skippable = position != layout.condition  # a body may run zero times, the condition runs once
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
