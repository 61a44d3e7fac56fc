"""Inductor's view of a user's operator defined by a decomposition: a node of it is
replaced by the trace of its decomposition before hop's other rewrites, so its graph
holds hop's operators, which Inductor lowers (Note [an operator from its
decomposition] in ``hop._decomposed``).

Such a node reaches Inductor from a program that recorded it: an exported program
compiled by AOTInductor, or its module by ``torch.compile`` after AOTAutograd kept
the node through functionalization. (Dynamo inlines the decomposition itself.)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from hop._operator import HigherOrderOperator

__all__ = ["inline_decompositions"]


def inline_decompositions(graph: torch.fx.Graph) -> bool:
    """Replace every node of an operator with a decomposition by its trace; whether one was."""

    nodes = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, HigherOrderOperator)
        and n.target._hop_decomposition is not None
    ]
    for node in nodes:
        _inline(node)
    return bool(nodes)


def _inline(node: torch.fx.Node) -> None:
    from torch._inductor.pattern_matcher import CallFunctionVarArgs

    root = node.graph.owning_module
    resolved = pytree.tree_map(lambda a: _graph_module(root, a), (tuple(node.args), dict(node.kwargs)))
    flat, spec = pytree.tree_flatten(resolved, is_leaf=lambda a: isinstance(a, torch.fx.GraphModule))
    inputs = [a for a in flat if isinstance(a, torch.fx.Node)]
    derived = node.target._hop_decomposition  # type: ignore[union-attr]

    def replacement(*values: Any) -> Any:
        it = iter(values)
        args, kwargs = pytree.tree_unflatten([next(it) if isinstance(a, torch.fx.Node) else a for a in flat], spec)
        return derived.run(args, kwargs)  # a node's call: its output's leaves

    match: Any = CallFunctionVarArgs(node.target).match(node)
    match.replace_by_example(replacement, inputs, run_functional_passes=False)


def _graph_module(root: Any, arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        value = operator.attrgetter(str(arg.target))(root)
        if isinstance(value, torch.fx.GraphModule):
            return value
    return arg
