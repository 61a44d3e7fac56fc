"""Inputs of a hop node that none of its subgraphs reads: dropped from the node and
from every subgraph's placeholders.

What can go: a cond/switch operand, a while_loop/scan/map additional input (the
tensors a body closes over). Never a carry or an ``xs``: a carry is a result, and
``xs`` sets a scan's or map's length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from hop.passes import _program


def targets(node: torch.fx.Node) -> bool:
    """The nodes this pass knows: branching ones and loops (not associative_scan's, say)."""
    return _program.is_branching(node) or _program.is_loop(node)


def drop_unread_inputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Drop the inputs of hop ``node`` that no subgraph reads; whether any went. A cond or
    switch keeps one operand (the node reads something)."""
    layout = _program.node_layout(node)
    assert layout is not None and layout.inputs is not None
    args = node.args
    at, positions = layout.inputs, layout.subgraph_positions(args)
    inputs: tuple[Any, ...] = tuple(args[at])  # type: ignore[arg-type]
    subs = [_program.subgraph(gm, args[p]) for p in positions]  # type: ignore[arg-type]
    offset = layout.leading(args)
    placeholders = [[n for n in s.graph.nodes if n.op == "placeholder"] for s in subs]
    if any(len(p) != offset + len(inputs) for p in placeholders):
        return False  # not a layout this pass knows: leave the node
    unread = [k for k in range(len(inputs)) if all(not p[offset + k].users for p in placeholders)]
    if layout.selector is not None and len(unread) == len(inputs):
        unread = unread[1:]
    if not unread:
        return False
    for p, sub in zip(positions, subs, strict=True):
        copy = _program.copy_graph_module(sub)  # another node may share the original
        mine = [n for n in copy.graph.nodes if n.op == "placeholder"]
        for k in unread:
            copy.graph.erase_node(mine[offset + k])
        copy.recompile()
        _program.replace_subgraph(gm, node, args[p], copy, "pruned")  # type: ignore[arg-type]
    new_args = list(node.args)
    new_args[at] = tuple(v for k, v in enumerate(inputs) if k not in unread)
    node.args = tuple(new_args)
    return True
