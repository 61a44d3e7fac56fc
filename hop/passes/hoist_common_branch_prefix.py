"""hoist_common_branch_prefix: a computation that every branch of a cond/switch starts
with is computed once, before the node."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from hop.passes import _program
from hop.passes._program import Program


def hoist_common_branch_prefix(program: Program) -> Program:
    """A copy of ``program`` in which the computations that every branch of a
    ``torch.ops.hop.cond`` / ``switch`` makes from the node's operands alone, the same op
    on the same inputs, run once before the node; their results become new operands.

    Exactly one branch runs, so a common computation ran anyway: moving it changes
    when it runs, not whether. What moves (see :func:`hop.passes._program.movable`):
    pure aten ops with one tensor output and no unbacked-size binding, from branches
    without in-place ops; a value a branch returns as it is stays (a branch's result
    never aliases an operand). The node's other users and its outputs are unchanged.
    """
    return _program.rewrite_nodes(program, _program.is_branching, _hoist)


def _hoist(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    _, operands, attrs = _program.layout(node)
    branches = [_program.copy_graph_module(_program.subgraph(gm, a)) for a in attrs]
    inputs = [[n for n in b.graph.nodes if n.op == "placeholder"] for b in branches]
    if len(branches) < 2 or any(
        len(p) != len(operands) or _program.mutates(b) for p, b in zip(inputs, branches, strict=True)
    ):
        return False
    common = _common_prefix(branches, inputs)
    if not common:
        return False
    env: dict[torch.fx.Node, Any] = dict(zip(inputs[0], operands, strict=True))
    first = [group[0] for group in common]
    _program.copy_nodes(gm, node, branches[0], first, env)
    moved = {n for group in common for n in group}
    # A common node read by a node that stays (in any branch) becomes an operand.
    frontier = [k for k, group in enumerate(common) if any(u not in moved for n in group for u in n.users)]
    extra = [env[first[k]] for k in frontier]
    for b, (branch, attr) in enumerate(zip(branches, attrs, strict=True)):
        _program.add_inputs(branch, extra, {common[k][b]: i for i, k in enumerate(frontier)})
        _program.replace_subgraph(gm, node, attr, branch, "hoisted")
    _set_operands(node, (*operands, *extra))
    return True


def _common_prefix(
    branches: list[torch.fx.GraphModule], inputs: list[list[torch.fx.Node]]
) -> list[list[torch.fx.Node]]:
    """Groups of nodes, one per branch, that compute the same value: the same movable op
    on the same operands or earlier groups. In the first branch's graph order."""
    keys: list[dict[torch.fx.Node, Any]] = [{p: ("operand", i) for i, p in enumerate(ps)} for ps in inputs]
    returned = [{o for o in _program.output_nodes(b)[1] if isinstance(o, torch.fx.Node)} for b in branches]
    candidates = [
        [n for n in b.graph.nodes if n not in r and _program.movable(n, may_be_skipped=False)]
        for b, r in zip(branches, returned, strict=True)
    ]
    groups: list[list[torch.fx.Node]] = []
    for n in candidates[0]:
        key = _key(n, keys[0])
        if key is None:
            continue
        group = [n]
        for b in range(1, len(branches)):
            match = next((m for m in candidates[b] if m not in keys[b] and _key(m, keys[b]) == key), None)
            if match is None:
                break
            group.append(match)
        if len(group) == len(branches):
            for b, m in enumerate(group):
                keys[b][m] = ("common", len(groups))
            groups.append(group)
    return groups


def _key(node: torch.fx.Node, keys: dict[torch.fx.Node, Any]) -> Any:
    """What ``node`` computes, its inputs named by ``keys``; None if it reads another node."""
    known = True

    def name(a: torch.fx.Node) -> Any:
        nonlocal known
        known &= a in keys
        return keys.get(a)

    args = map_arg((node.args, node.kwargs), name)
    return (node.target, repr(args)) if known else None


def _set_operands(node: torch.fx.Node, operands: tuple[Any, ...]) -> None:
    layout = _program.node_layout(node)
    assert layout is not None and layout.inputs is not None
    args = list(node.args)
    args[layout.inputs] = operands
    node.args = tuple(args)
