"""fold_constant_selectors: a cond/switch whose selector is known before the program runs
becomes the chosen branch, inlined into the parent graph."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from hop.passes import _program
from hop.passes._program import Program

_UNKNOWN = object()  # a value only known at run time


def fold_constant_selectors(program: Program) -> Program:
    """A copy of ``program`` in which every ``torch.ops.hop.cond`` / ``switch`` whose
    selector is a Python constant, or is computed only from tensor constants, is replaced
    by the nodes of the branch it selects.

    An index out of range is left alone (its runtime assert still fires), and so is a
    node whose outputs have data-dependent sizes (their fresh symbols are bound to it).
    """
    constants: dict[str, Any] = {}
    if isinstance(program, torch.export.ExportedProgram):
        lifted = program.graph_signature.inputs_to_lifted_tensor_constants
        constants = {name: program.constants[target] for name, target in lifted.items()}

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
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SUBGRAPH_INPUTS]:
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
    for attr, inputs in _SUBGRAPH_INPUTS[node.target](node):  # type: ignore[index]
        values = [_evaluate(gm, i, constants, {}) for i in inputs]
        branch = _program.copy_graph_module(_program.subgraph(gm, attr))
        placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
        if all(v is _UNKNOWN for v in values) or len(placeholders) != len(values):
            continue
        known = {p.name: v for p, v in zip(placeholders, values, strict=True) if v is not _UNKNOWN}
        if _fold_graph(branch, known):  # a copy: another node may share the attribute
            _program.replace_subgraph(gm, node, attr, branch, "folded")
            changed = True
    return changed


def _branch_inputs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, tuple[Any, ...]]]:
    _, operands, branches = _program.layout(node)
    return [(b, operands) for b in branches]


def _loop_inputs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, tuple[Any, ...]]]:
    # while_loop(cond_gm, body_gm, carries, additional_inputs): carries change from one
    # iteration to the next (unknown), additional inputs do not.
    cond_gm, body_gm, carries, additional = node.args
    inputs = (_UNKNOWN,) * len(carries) + tuple(additional)  # type: ignore[arg-type]
    return [(cond_gm, inputs), (body_gm, inputs)]  # type: ignore[list-item]


_SUBGRAPH_INPUTS = {
    torch.ops.hop.cond: _branch_inputs,
    torch.ops.hop.switch: _branch_inputs,
    torch.ops.hop.while_loop: _loop_inputs,
}


def _fold(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    if node.meta.get("unbacked_bindings"):
        return False
    tuple_valued = isinstance(node.meta.get("val"), (tuple, list))
    if tuple_valued and any(u.target is not operator.getitem for u in node.users):
        return False  # a layout this pass does not know: leave the node
    sel, operands, branches = _program.layout(node)
    value = _evaluate(gm, sel, constants, {})
    if value is _UNKNOWN:
        return False
    if node.target is torch.ops.hop.cond:
        chosen = 0 if bool(value) else 1  # truthy as a Python if: true_gm comes first
    else:
        chosen = int(value)
        if not 0 <= chosen < len(branches):
            return False
    results = _inline(gm, node, _program.subgraph(gm, branches[chosen]), operands)
    if results is None:
        return False
    _replace_results(node, results, tuple_valued=tuple_valued)
    return True


# Runtime asserts hop and torch.export emit (a switch index in range, say): one whose
# condition is a constant that holds checks nothing, and its inputs become dead.
_ASSERTS = (torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default)


def _drop_passing_assert(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    holds = _evaluate(gm, node.args[0], constants, {})
    if holds is _UNKNOWN or not bool(holds):
        return False  # unknown, or fails: it must still fire at run time
    gm.graph.erase_node(node)
    return True


def _evaluate(gm: torch.fx.GraphModule, arg: Any, constants: dict[str, Any], memo: dict[torch.fx.Node, Any]) -> Any:
    """The value of ``arg`` if it depends on constants only, else ``_UNKNOWN``."""
    if arg is _UNKNOWN or not isinstance(arg, torch.fx.Node):
        return arg if isinstance(arg, (bool, int, float)) or arg is None else _UNKNOWN
    if arg not in memo:
        memo[arg] = _evaluate_node(gm, arg, constants, memo)
    return memo[arg]


def _evaluate_node(
    gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any], memo: dict[torch.fx.Node, Any]
) -> Any:
    if node.op == "placeholder":
        return constants.get(node.name, _UNKNOWN)
    if node.op == "get_attr":
        value = _attr(gm, str(node.target))
        # A parameter is state a user trains, not a constant, even where make_fx stores it
        # as an attribute; a fake tensor has no value to fold.
        constant = isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
        return value if constant and not value.requires_grad else _UNKNOWN
    if node.op != "call_function" or not _pure(node.target):
        return _UNKNOWN
    known = True

    def value_of(a: torch.fx.Node) -> Any:
        nonlocal known
        v = _evaluate(gm, a, constants, memo)
        known &= v is not _UNKNOWN
        return v

    args, kwargs = map_arg((node.args, node.kwargs), value_of)
    if not known:
        return _UNKNOWN
    try:
        with torch.no_grad():
            return node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # an op that cannot run ahead of time (a device missing here): keep the node
        return _UNKNOWN


def _pure(target: Any) -> bool:
    """Whether running ``target`` ahead of time gives the value it has at run time."""
    if target is torch.ops.aten.detach_.default:  # export detaches a lifted constant in place: values unchanged
        return True
    if isinstance(target, torch._ops.OpOverload):
        tags = target.tags
        return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in tags
    return getattr(target, "__module__", None) == operator.__name__ or target in (operator.getitem,)


def _attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _inline(
    gm: torch.fx.GraphModule, node: torch.fx.Node, branch: torch.fx.GraphModule, operands: tuple[Any, ...]
) -> list[Any] | None:
    """Copy ``branch``'s nodes before ``node``, its placeholders read as ``operands``; its results."""
    placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        return None  # not a layout this pass knows: leave the node
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    with gm.graph.inserting_before(node):
        for n in branch.graph.nodes:
            if n.op == "get_attr":  # a nested subgraph or constant: now an attribute of gm
                name = _fresh_attr(gm, str(n.target))
                _program.register_attr(gm, name, _attr(branch, str(n.target)))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
            elif n.op not in ("placeholder", "output"):
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
    _, outputs = _program.output_nodes(branch)
    return [env[o] if isinstance(o, torch.fx.Node) else o for o in outputs]


def _fresh_attr(gm: torch.nn.Module, target: str) -> str:
    base = "inlined_" + target.replace(".", "_")
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _replace_results(node: torch.fx.Node, results: list[Any], *, tuple_valued: bool) -> None:
    """Users of ``node`` read ``results``: a getitem reads one, a single-output node is its only result."""
    for user in list(node.users):
        if tuple_valued:
            _replace_uses(user, results[user.args[1]])  # type: ignore[index]
            user.graph.erase_node(user)
        else:
            _replace_uses(node, results[0])
    node.graph.erase_node(node)


def _replace_uses(old: torch.fx.Node, new: Any) -> None:
    for user in list(old.users):
        user.args, user.kwargs = map_arg((user.args, user.kwargs), lambda a: new if a is old else a)
