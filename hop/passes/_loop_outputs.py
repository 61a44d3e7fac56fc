"""Which outputs of a while_loop/scan/map are live, and dropping the others from its subgraphs.

A loop's outputs are its final carries (while_loop, scan) then its stacked per-step
outputs (scan's ys, map's outputs). A carry is live if it is read after the loop, if
the condition reads it, or if the body needs it to compute a live output: a carry's
output feeds its own input at the next iteration, so liveness is a fixed point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from hop.passes import _program


def plan(gm: torch.fx.GraphModule, node: torch.fx.Node, read: list[int]) -> tuple[list[int], Callable[[], None]] | None:
    """The live outputs of loop ``node`` whose outputs ``read`` are read, and an edit that
    drops the others from the node and its subgraphs; None where the layout is unknown."""
    at = _program.node_layout(node)
    assert at is not None and at.body is not None
    args = node.args
    init_at, readers, body_at = at.carries, at.subgraph_positions(args), at.body  # every subgraph reads the carries
    carries = len(args[init_at]) if init_at is not None else 0  # type: ignore[arg-type]
    body = _program.subgraph(gm, args[body_at])  # type: ignore[arg-type]
    _, outputs = _program.output_nodes(body)
    needs = [_placeholders_read(body, o) for o in outputs]
    live = set(read)
    for position in readers:  # what the condition reads, and what an effect (an assert) reads
        sub = _program.subgraph(gm, args[position])  # type: ignore[arg-type]
        roots = [n for n in sub.graph.nodes if n.op == "call_function" and n.is_impure()]
        if position != body_at:
            roots += _program.output_nodes(sub)[1]
        live |= {i for r in roots for i in _placeholders_read(sub, r) if i < carries}
    grew = True
    while grew:  # a live output's inputs among the carries are live
        grew = False
        for j in sorted(live):
            new = {i for i in needs[j] if i < carries} - live
            live |= new
            grew |= bool(new)
    kept = sorted(live)
    dead = [i for i in range(carries) if i not in live]

    def apply() -> None:
        for position in readers:
            sub = _program.copy_graph_module(_program.subgraph(gm, args[position]))  # type: ignore[arg-type]
            if position == body_at:
                out, outs = _program.output_nodes(sub)
                out.args = (tuple(outs[j] for j in kept),)  # a body returns a tuple, even of one
            _drop_inputs(sub, dead)
            _program.replace_subgraph(gm, node, args[position], sub, "pruned")  # type: ignore[arg-type]
        if init_at is not None:
            new_args = list(node.args)
            new_args[init_at] = tuple(c for i, c in enumerate(args[init_at]) if i not in dead)  # type: ignore[arg-type]
            node.args = tuple(new_args)

    return kept, apply


def _placeholders_read(sub: torch.fx.GraphModule, value: Any) -> set[int]:
    """Indices of the placeholders of ``sub`` that ``value`` is computed from."""
    index = {p: i for i, p in enumerate(n for n in sub.graph.nodes if n.op == "placeholder")}
    seen: set[torch.fx.Node] = set()
    stack = [value] if isinstance(value, torch.fx.Node) else []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return {index[n] for n in seen if n in index}


def _drop_inputs(sub: torch.fx.GraphModule, dead: list[int]) -> None:
    """Remove placeholders ``dead`` of ``sub`` (after what only fed dropped outputs)."""
    _program.eliminate_dead_code(sub)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for i in dead:
        assert not placeholders[i].users, "a dead carry is read by a live computation"  # excluded by plan
        sub.graph.erase_node(placeholders[i])
    sub.graph.lint()
    sub.recompile()
