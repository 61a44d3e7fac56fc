"""fold_constant_selectors: a cond/switch whose selector is known before the program runs
becomes the chosen branch, inlined into the parent graph."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from hop.passes import _program
from hop.passes._constants import UNKNOWN, evaluate, lifted_constants
from hop.passes._program import Program


def fold_constant_selectors(program: Program) -> Program:
    """A copy of ``program`` in which every ``torch.ops.hop.cond`` / ``switch`` whose
    selector is a Python constant, or is computed only from tensor constants, is replaced
    by the nodes of the branch it selects.

    An index out of range is left alone (its runtime assert still fires), and so is a
    node whose outputs have data-dependent sizes (their fresh symbols are bound to it).
    """
    constants = lifted_constants(program)

    def fold(gm: torch.fx.GraphModule, top: bool) -> bool:
        return _fold_graph(gm, constants)

    return _program.apply(program, fold, nested=False)


def _fold_graph(gm: torch.fx.GraphModule, constants: dict[str, Any]) -> bool:
    """Fold in ``gm``, whose placeholders named in ``constants`` hold those values, and in its subgraphs."""
    changed = False
    for child in list(gm.children()):
        if isinstance(child, torch.fx.GraphModule):
            changed |= _fold_graph(child, {})
    for node in _program.branching_nodes(gm):
        changed |= _fold(gm, node, constants)
    for node in [n for n in gm.graph.nodes if _folds_inside(n)]:
        changed |= _specialize(gm, node, constants)
    for node in [n for n in gm.graph.nodes if n.target in _ASSERTS]:
        changed |= _drop_passing_assert(gm, node, constants)
    if changed:
        _program.eliminate_dead_code(gm)
        gm.graph.lint()
        gm.recompile()
    return changed


def _specialize(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    """Fold inside the subgraphs of a node that stays, knowing which of their inputs are
    constants (hop lifts a constant a body reads into an input, so its selector reads a placeholder)."""
    changed = False
    for attr, inputs in _subgraph_inputs(node):
        values = [evaluate(gm, i, constants, {}) for i in inputs]
        branch = _program.copy_graph_module(_program.subgraph(gm, attr))
        placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
        if all(v is UNKNOWN for v in values) or len(placeholders) != len(values):
            continue
        known = {p.name: v for p, v in zip(placeholders, values, strict=True) if v is not UNKNOWN}
        if _fold_graph(branch, known):  # a copy: another node may share the attribute
            _program.replace_subgraph(gm, node, attr, branch, "folded")
            changed = True
    return changed


def _folds_inside(node: torch.fx.Node) -> bool:
    """A cond, a switch or a while_loop: a loop over xs (scan, map) is not folded into."""
    layout = _program.node_layout(node)
    if layout is None:
        return False
    return layout.selector is not None or (layout.body is not None and layout.xs is None)


def _subgraph_inputs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, tuple[Any, ...]]]:
    """Each subgraph with its inputs: carries change from one iteration to the next
    (unknown), operands and additional inputs do not."""
    layout = _program.node_layout(node)
    assert layout is not None and layout.inputs is not None
    args: tuple[Any, ...] = node.args
    inputs = (UNKNOWN,) * layout.leading(args) + tuple(args[layout.inputs])
    return [(args[p], inputs) for p in layout.subgraph_positions(args)]


def _fold(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    if node.meta.get("unbacked_bindings"):
        return False
    tuple_valued = isinstance(node.meta.get("val"), (tuple, list))
    if tuple_valued and any(u.target is not operator.getitem for u in node.users):
        return False  # a layout this pass does not know: leave the node
    sel, operands, branches = _program.layout(node)
    value = evaluate(gm, sel, constants, {})
    if value is UNKNOWN:
        return False
    spec = _program.spec(node)
    assert spec is not None and spec.branch is not None
    chosen = spec.branch(value)  # cond: truthy as a Python if, true_gm first; switch: the index
    if not 0 <= chosen < len(branches):
        return False
    results = _program.inline(gm, node, _program.subgraph(gm, branches[chosen]), operands)
    if results is None:
        return False
    _program.replace_results(node, results, tuple_valued=tuple_valued)
    return True


# Runtime asserts hop and torch.export emit (a switch index in range, say): one whose
# condition is a constant that holds checks nothing, and its inputs become dead.
_ASSERTS = (torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default)


def _drop_passing_assert(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    holds = evaluate(gm, node.args[0], constants, {})
    if holds is UNKNOWN or not bool(holds):
        return False  # unknown, or fails: it must still fire at run time
    gm.graph.erase_node(node)
    return True
