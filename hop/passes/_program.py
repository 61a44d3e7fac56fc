"""What every pass shares: copying a program, visiting its subgraphs, reading cond/switch nodes.

A pass never edits its argument: it works on :func:`copy_program`'s copy, in which
every nested branch or loop body is a fresh ``GraphModule`` too (two nodes may share
one subgraph attribute in the original; an edit must not leak into the other).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.fx

Program = TypeVar("Program", torch.fx.GraphModule, torch.export.ExportedProgram)
GraphPass = Callable[[torch.fx.GraphModule, bool], bool]  # (graph, is it the top level?) -> changed

BRANCHING = (torch.ops.hop.cond, torch.ops.hop.switch)


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph and nested GraphModules are new objects; tensors are shared (never edited)."""
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    for name, child in list(new.named_children()):
        if isinstance(child, torch.fx.GraphModule):
            setattr(new, name, copy_graph_module(child))
    return new


def apply(program: Program, graph_pass: GraphPass, *, nested: bool = True) -> Program:
    """``graph_pass`` run in place on a copy of ``program`` and, if ``nested``, on each of its
    subgraphs, innermost first (else the pass visits them itself).

    An ExportedProgram keeps its signature: the passes neither add nor remove
    placeholders or outputs of the top-level graph, so ``ep.graph_signature`` stays true.
    """
    if isinstance(program, torch.export.ExportedProgram):
        gm = copy_graph_module(program.graph_module)
        _run(gm, graph_pass, nested)
        return program._update(gm, program.graph_signature)  # type: ignore[return-value]
    gm = copy_graph_module(program)
    _run(gm, graph_pass, nested)
    return gm


def _run(gm: torch.fx.GraphModule, graph_pass: GraphPass, nested: bool) -> None:
    if nested:
        run_everywhere(gm, graph_pass, top=True)
    elif graph_pass(gm, True):
        gm.graph.lint()
        gm.recompile()


def run_everywhere(gm: torch.fx.GraphModule, graph_pass: GraphPass, *, top: bool) -> bool:
    """Run ``graph_pass`` on every nested GraphModule, then on ``gm``; whether anything changed."""
    changed = False
    for child in list(gm.children()):
        if isinstance(child, torch.fx.GraphModule):
            changed |= run_everywhere(child, graph_pass, top=False)
    if graph_pass(gm, top):
        gm.graph.lint()
        gm.recompile()
        changed = True
    return changed


def branching_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The cond and switch nodes of ``gm``'s own graph (a list: callers edit the graph)."""
    return iter([n for n in gm.graph.nodes if n.op == "call_function" and n.target in BRANCHING])


def layout(node: torch.fx.Node) -> tuple[Any, tuple[Any, ...], list[torch.fx.Node]]:
    """``(selector, operands, branch get_attr nodes)`` of a node of either layout:
    ``cond(pred, true_gm, false_gm, operands)`` or ``switch(index, operands, *branch_gms)``."""
    args: tuple[Any, ...] = node.args
    if node.target is torch.ops.hop.cond:
        sel, true_gm, false_gm, operands = args
        return sel, tuple(operands), [true_gm, false_gm]
    sel, operands, *branches = args
    return sel, tuple(operands), list(branches)


def subgraph(gm: torch.fx.GraphModule, attr: torch.fx.Node) -> torch.fx.GraphModule:
    target = attr.target
    assert isinstance(target, str) and attr.op == "get_attr"
    sub = getattr(gm, target)
    assert isinstance(sub, torch.fx.GraphModule)
    return sub


def output_nodes(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[Any]]:
    """The output node of ``gm`` and its returned values, flattened one level (a branch
    returns a tuple, or one value when the operator has a single output)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = out.args[0]
    return out, list(value) if isinstance(value, (tuple, list)) else [value]


def eliminate_dead_code(gm: torch.fx.GraphModule) -> None:
    """fx's dead-code elimination, plus the in-place ``detach_`` export puts on a fresh copy
    of a lifted constant: fx keeps every in-place op, but one on a tensor nothing else
    reads has no visible effect."""

    def impure(node: torch.fx.Node) -> bool:
        private = node.target is torch.ops.aten.detach_.default and len(node.all_input_nodes[0].users) == 1
        return node.is_impure() and not private

    gm.graph.eliminate_dead_code(is_impure_node=impure)
    # Not GraphModule.delete_all_unused_submodules: it counts a get_attr's target as used
    # but not the target's own submodules, and would strip a branch of its nested graphs.
    used = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm.named_children()):
        if isinstance(child, torch.fx.GraphModule) and name not in used:
            delattr(gm, name)


def replace_subgraph(
    gm: torch.fx.GraphModule, node: torch.fx.Node, attr: torch.fx.Node, new: torch.fx.GraphModule, suffix: str
) -> None:
    """Make hop ``node`` read subgraph ``new``, a new attribute of ``gm``, where it read
    ``attr``; other nodes that read ``attr`` keep the original."""
    name, k = f"{attr.target}_{suffix}", 0
    while hasattr(gm, name):
        k += 1
        name = f"{attr.target}_{suffix}_{k}"
    gm.register_module(name, new)
    with gm.graph.inserting_before(attr):
        new_attr = gm.graph.get_attr(name)
    new_attr.meta = dict(attr.meta)
    node.replace_input_with(attr, new_attr)


def register_attr(module: torch.nn.Module, name: str, value: object) -> None:
    """``value`` as attribute ``name`` of ``module``, registered as what it is (fx warns of a
    get_attr of a plain attribute)."""
    if isinstance(value, torch.nn.Parameter):
        module.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(name, value)
    elif isinstance(value, torch.nn.Module):
        module.add_module(name, value)
    else:
        setattr(module, name, value)
