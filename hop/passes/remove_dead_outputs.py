"""remove_dead_outputs: outputs of a cond/switch/while_loop/scan/map that nothing reads
leave the node and every subgraph; so do the inputs no subgraph reads."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from hop.passes import _loop_outputs, _program, _unread_inputs
from hop.passes._program import Program


def remove_dead_outputs(program: Program) -> Program:
    """A copy of ``program`` in which every ``torch.ops.hop.cond`` / ``switch`` /
    ``while_loop`` / ``scan`` / ``map`` returns only the outputs some node reads (through
    a ``getitem``); each branch or body stops returning the others, and the computations
    that only fed them are removed from it.

    A loop keeps every carry its condition reads and every carry the body needs to
    compute a kept output (a final carry nobody reads may still feed the next
    iteration); a carry dropped from a loop leaves its initial value, its body input
    and output, and the condition's input. A node whose dropped outputs bind
    data-dependent sizes is left alone (the symbols would lose their binding).

    Then the inputs no subgraph reads any more leave the node and its subgraphs: a
    cond/switch operand (one is kept), a loop's additional input (a closed-over tensor
    whose use was hoisted or pruned away); never a carry, nor a scan's or map's ``xs``.
    """
    return _program.rewrite_nodes(program, _unread_inputs.targets, _prune_outputs_and_inputs)


def _prune_outputs_and_inputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    pruned = _prune(gm, node)  # first: a dropped output can leave an input unread
    return _unread_inputs.drop_unread_inputs(gm, node) or pruned


def _prune(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    vals = node.meta.get("val")
    if not isinstance(vals, (tuple, list)) or any(
        u.target is not operator.getitem or not isinstance(u.args[1], int) for u in node.users
    ):
        return False  # one value, or read other than by index: every output is live
    for user in [u for u in node.users if not u.users]:
        gm.graph.erase_node(user)  # a getitem nobody reads
    read = sorted({_index(u) for u in node.users})
    if len(read) == len(vals) or not read:  # nothing to drop, or the whole node is dead (DCE's job)
        return False
    if _program.is_loop(node):
        plan = _loop_outputs.plan(gm, node, read)
        if plan is None:
            return False
        live, apply = plan
    else:
        live = read
        apply = lambda: _prune_branches(gm, node, live)  # noqa: E731
    bindings = _renumber_bindings(node.meta.get("unbacked_bindings"), live)
    if bindings is None or len(live) == len(vals):
        return False
    apply()
    _renumber_users(node, vals, live, bindings)
    return True


def _prune_branches(gm: torch.fx.GraphModule, node: torch.fx.Node, live: list[int]) -> None:
    _, _, branches = _program.layout(node)
    for attr in branches:  # a pruned copy: another node may share the original attribute
        _program.replace_subgraph(gm, node, attr, _pruned(_program.subgraph(gm, attr), live), "pruned")


def _renumber_users(
    node: torch.fx.Node, vals: Any, live: list[int], bindings: dict[object, tuple[object, ...]]
) -> None:
    """``node`` returns outputs ``live`` of ``vals``: its getitems and metadata follow."""
    if len(live) == 1:  # hop's layout for one output: the value itself, no getitem
        for user in list(node.users):
            user.replace_all_uses_with(node)
            node.graph.erase_node(user)
        node.meta["val"] = vals[live[0]]
        bindings = {s: path[1:] for s, path in bindings.items()}
    else:
        for user in list(node.users):
            user.args = (node, live.index(_index(user)))
        node.meta["val"] = tuple(vals[i] for i in live)
    if bindings:
        node.meta["unbacked_bindings"] = bindings


def _index(getitem: torch.fx.Node) -> int:
    index = getitem.args[1]
    assert isinstance(index, int)  # checked by _prune before any edit
    return index


def _pruned(branch: torch.fx.GraphModule, live: list[int]) -> torch.fx.GraphModule:
    """A copy of ``branch`` returning outputs ``live`` only, without what fed only the others."""
    branch = _program.copy_graph_module(branch)
    out, outputs = _program.output_nodes(branch)
    out.args = (outputs[live[0]] if len(live) == 1 else tuple(outputs[i] for i in live),)
    _program.eliminate_dead_code(branch)
    branch.recompile()
    return branch


def _renumber_bindings(
    bindings: dict[object, tuple[object, ...]] | None, live: list[int]
) -> dict[object, tuple[object, ...]] | None:
    """Unbacked-symbol bindings with output indices renumbered; None where a binding reads a
    dropped output (or a path this pass does not know)."""
    renumbered: dict[object, tuple[object, ...]] = {}
    for symbol, path in (bindings or {}).items():
        if not path or not isinstance(path[0], pytree.SequenceKey) or path[0].idx not in live:
            return None
        renumbered[symbol] = (pytree.SequenceKey(live.index(path[0].idx)), *path[1:])
    return renumbered
