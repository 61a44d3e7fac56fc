"""What every pass shares: copying a program, visiting its subgraphs, reading cond/switch nodes.

A pass never edits its argument: it works on :func:`copy_program`'s copy, in which
every nested branch or loop body is a fresh ``GraphModule`` too (two nodes may share
one subgraph attribute in the original; an edit must not leak into the other).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.fx
from torch.fx.node import map_arg

from hop import _operator, _spec
from hop.errors import HopTypeError, format_message, type_name
from hop.passes import _constants

Program = TypeVar("Program", torch.fx.GraphModule, torch.export.ExportedProgram)
GraphPass = Callable[[torch.fx.GraphModule, bool], bool]  # (graph, is it the top level?) -> changed


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
    placeholders or outputs of the top-level graph; an output may become another node
    (a loop replaced by its body's result), whose name the signature then gives.
    """
    check_program(program)
    if isinstance(program, torch.export.ExportedProgram):
        gm = copy_graph_module(program.graph_module)
        _run(gm, graph_pass, nested)
        return program._update(gm, _renamed_outputs(program.graph_signature, gm))  # type: ignore[return-value]
    gm = program if _IN_PLACE.get() else copy_graph_module(program)
    _run(gm, graph_pass, nested)
    return gm


def check_program(program: object) -> None:
    """Raise :class:`hop.errors.HopTypeError` unless ``program`` is one a pass takes."""
    if not isinstance(program, (torch.fx.GraphModule, torch.export.ExportedProgram)):
        raise HopTypeError(
            format_message(
                "passes",
                f"a pass takes a torch.fx.GraphModule or a torch.export.ExportedProgram, got {type_name(program)}",
                fix="Trace the function first: make_fx(fn)(*args) or torch.export.export(module, args).",
            ),
            op="passes",
        )


# Set by in_place(): a compiler's pass hands over a graph to edit, not one to copy.
_IN_PLACE: contextvars.ContextVar[bool] = contextvars.ContextVar("hop_passes_in_place", default=False)


@contextlib.contextmanager
def in_place() -> Iterator[None]:
    """Within it, a pass applied to a GraphModule edits and returns that GraphModule
    (its subgraphs are still replaced by edited copies, never edited where they are)."""
    token = _IN_PLACE.set(True)
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


def _renamed_outputs(
    signature: torch.export.ExportGraphSignature, gm: torch.fx.GraphModule
) -> torch.export.ExportGraphSignature:
    """``signature`` with each output spec naming the node ``gm`` now returns in its place."""
    _, values = output_nodes(gm)
    specs = []
    for spec, value in zip(signature.output_specs, values, strict=True):
        if isinstance(value, torch.fx.Node) and isinstance(spec.arg, torch.export.graph_signature.TensorArgument):
            spec = dataclasses.replace(spec, arg=torch.export.graph_signature.TensorArgument(name=value.name))
        specs.append(spec)
    return torch.export.ExportGraphSignature(input_specs=signature.input_specs, output_specs=specs)


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


def rewrite_nodes(
    program: Program,
    wanted: Callable[[torch.fx.Node], bool],
    rewrite: Callable[[torch.fx.GraphModule, torch.fx.Node], bool],
) -> Program:
    """:func:`apply` of a pass that calls ``rewrite(gm, node)`` on each node of each graph
    that is ``wanted`` (True where it changed something), then removes what became dead."""

    def graph_pass(gm: torch.fx.GraphModule, top: bool) -> bool:
        changed = False
        for node in [n for n in gm.graph.nodes if wanted(n)]:
            changed |= rewrite(gm, node)
        if changed:
            eliminate_dead_code(gm)
        return changed

    return apply(program, graph_pass)


def spec(node: torch.fx.Node) -> _spec.OpSpec | None:
    """The spec of the hop operator ``node`` calls, where its arguments are (None for any other node)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, _operator.HigherOrderOperator):
        return None
    found = _spec.spec_of(target.name())
    if found is None or found.layout is None or _operator.registered_ops().get(target.name()) is not target:
        return None
    return found


def node_layout(node: torch.fx.Node) -> _spec.Layout | None:
    found = spec(node)
    return None if found is None else found.layout


def is_branching(node: torch.fx.Node) -> bool:
    """A cond or switch: a selector picks the one subgraph that runs."""
    at = node_layout(node)
    return at is not None and at.selector is not None


def is_loop(node: torch.fx.Node) -> bool:
    """A while_loop, scan or map: a body steps carries (or slices of xs)."""
    at = node_layout(node)
    return at is not None and at.body is not None


def branching_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    """The cond and switch nodes of ``gm``'s own graph (a list: callers edit the graph)."""
    return iter([n for n in gm.graph.nodes if is_branching(n)])


def layout(node: torch.fx.Node) -> tuple[Any, tuple[Any, ...], list[torch.fx.Node]]:
    """``(selector, operands, branch get_attr nodes)`` of a branching node."""
    at = node_layout(node)
    assert at is not None and at.selector is not None and at.inputs is not None
    args: tuple[Any, ...] = node.args
    return args[at.selector], tuple(args[at.inputs]), [args[p] for p in at.subgraph_positions(args)]


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
    name = fresh_name(gm, f"{attr.target}_{suffix}")
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


def copy_nodes(
    gm: torch.fx.GraphModule,
    before: torch.fx.Node,
    source: torch.fx.GraphModule,
    nodes: Iterable[torch.fx.Node],
    env: dict[torch.fx.Node, Any],
) -> None:
    """Copy ``nodes`` of ``source`` (in graph order, none a placeholder or output) into
    ``gm`` before ``before``; ``env`` maps each node of ``source`` they read to its value
    in ``gm`` and receives the copies. A get_attr (a nested subgraph) becomes a new
    attribute of ``gm``."""
    with gm.graph.inserting_before(before):
        for n in nodes:
            if n.op == "get_attr":
                name = fresh_name(gm, "inlined_" + str(n.target).replace(".", "_"))
                register_attr(gm, name, _constants.attr(source, str(n.target)))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
            else:
                env[n] = gm.graph.node_copy(n, lambda a: env[a])


def inline(
    gm: torch.fx.GraphModule, node: torch.fx.Node, branch: torch.fx.GraphModule, operands: Sequence[Any]
) -> list[Any] | None:
    """Copy ``branch``'s nodes before ``node``, its placeholders read as ``operands``; its
    results (None, and nothing copied, where the placeholders do not match the operands)."""
    placeholders = [n for n in branch.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        return None  # not a layout this pass knows: leave the node
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    copy_nodes(gm, node, branch, [n for n in branch.graph.nodes if n.op not in ("placeholder", "output")], env)
    _, outputs = output_nodes(branch)
    return [env[o] if isinstance(o, torch.fx.Node) else o for o in outputs]


def fresh_name(module: torch.nn.Module, base: str) -> str:
    """``base``, or ``base_k`` for the first k that ``module`` has no attribute of that name."""
    name, k = base, 0
    while hasattr(module, name):
        k += 1
        name = f"{base}_{k}"
    return name


# Ops that can raise on the values (not only the shapes) of their inputs: an index out
# of range, an integer division by zero, a failing check. Shapes were checked when the
# program was traced; values were not.
_MAY_RAISE = {
    "_assert_async",
    "_assert_scalar",
    "_assert_tensor_metadata",
    "_local_scalar_dense",
    "bincount",
    "embedding",
    "embedding_bag",
    "fmod",
    "floor_divide",
    "gather",
    "index",
    "index_add",
    "index_copy",
    "index_fill",
    "index_put",
    "index_reduce",
    "index_select",
    "masked_scatter",
    "multinomial",
    "nonzero",
    "one_hot",
    "remainder",
    "repeat_interleave",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "take",
    "take_along_dim",
    "div",  # with rounding_mode on integers
}


def movable(node: torch.fx.Node, *, may_be_skipped: bool) -> bool:
    """Whether ``node`` may be computed elsewhere than where it stands: a pure aten op (not
    in place, not random, no effect) with one tensor output and no unbacked-size
    bindings (those are bound to the node where it stands). With ``may_be_skipped`` (the
    new place runs even when the old one would not: a loop that may run zero times), also
    one that cannot raise on its inputs' values."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not _constants.pure(target) or target is torch.ops.aten.detach_.default or node.is_impure():
        return False
    if node.meta.get("unbacked_bindings") or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return not (may_be_skipped and target._schema.name.split("::")[-1] in _MAY_RAISE)


def mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm``'s own graph has an op that writes one of its inputs in place."""
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in gm.graph.nodes
    )


def add_inputs(sub: torch.fx.GraphModule, values: Sequence[torch.fx.Node], replaces: dict[torch.fx.Node, int]) -> None:
    """Append one placeholder per value of ``values`` (nodes of the parent graph, for their
    metadata) to ``sub``; node ``n`` of ``sub`` in ``replaces`` is then read as placeholder
    ``replaces[n]``, and what only it needed is removed."""
    last = [n for n in sub.graph.nodes if n.op == "placeholder"][-1]
    added = []
    for value in values:
        with sub.graph.inserting_after(last):
            last = sub.graph.placeholder(f"hoisted_{value.name}")
        last.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")}
        added.append(last)
    for old, index in replaces.items():
        old.replace_all_uses_with(added[index])
    eliminate_dead_code(sub)
    sub.graph.lint()
    sub.recompile()


def replace_results(node: torch.fx.Node, results: list[Any], *, tuple_valued: bool) -> None:
    """Users of ``node`` read ``results``: a getitem reads one, a single-output node is its only result."""
    for user in list(node.users):
        if tuple_valued:
            replace_uses(user, results[user.args[1]])  # type: ignore[index]
            user.graph.erase_node(user)
        else:
            replace_uses(node, results[0])
    node.graph.erase_node(node)


def replace_uses(old: torch.fx.Node, new: Any) -> None:
    for user in list(old.users):
        user.args, user.kwargs = map_arg((user.args, user.kwargs), lambda a: new if a is old else a)
