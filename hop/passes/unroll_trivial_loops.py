"""unroll_trivial_loops: a while_loop, scan or map known to run zero times becomes its
initial carries (and empty outputs), one known to run once becomes its body."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from hop._spec import Layout
from hop.passes import _program
from hop.passes._constants import UNKNOWN, evaluate, lifted_constants
from hop.passes._program import Program

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def unroll_trivial_loops(program: Program) -> Program:
    """A copy of ``program`` in which a ``torch.ops.hop.while_loop`` (a ``fori_loop``
    too) whose trip count is known to be 0 or 1 is replaced: by copies of its initial
    carries (0), or by its body inlined on them (1). So is a ``scan`` or ``map`` over
    ``xs`` of static length 0 (copies of the initial carries, empty stacked outputs)
    or 1 (the body on the one slice, its per-step outputs unsqueezed).

    The trip count is known when the condition is computed from carries whose initial
    values are constants (a ``fori_loop`` counter) and the body computes their next values
    from constants too: the condition is evaluated on them once, or twice. In the
    inlined body, scalars computed from the known counter become Python constants.

    Left alone: a loop whose results have data-dependent sizes (their symbols are bound
    to the node), a condition with side effects (an assert), and a body that reads an
    unknown scalar out of a tensor (``.item()``: a fresh symbol with nothing to bind it).
    """
    constants = lifted_constants(program)

    def unroll(gm: torch.fx.GraphModule, top: bool) -> bool:
        changed = False
        for node in [n for n in gm.graph.nodes if _program.is_loop(n)]:
            changed |= _unrolled(gm, node, constants if top else {})
        if changed:
            _program.eliminate_dead_code(gm)
        return changed

    return _program.apply(program, unroll)


def _unrolled(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any]) -> bool:
    layout = _program.node_layout(node)
    assert layout is not None
    if layout.condition is not None:
        return _unroll(gm, node, layout, constants)
    if layout.xs is not None:
        return _unroll_scan(gm, node, layout, constants)
    return False


def _unroll(gm: torch.fx.GraphModule, node: torch.fx.Node, layout: Layout, constants: dict[str, Any]) -> bool:
    """A while_loop whose condition is false at once, or false after one step."""
    assert layout.condition is not None and layout.carries is not None
    assert layout.inputs is not None and layout.body is not None
    args: tuple[Any, ...] = node.args
    cond_attr, body_attr = args[layout.condition], args[layout.body]
    carries, additional = args[layout.carries], args[layout.inputs]
    cond, body = _program.subgraph(gm, cond_attr), _program.subgraph(gm, body_attr)
    inputs: list[Any] = [*carries, *additional]
    if node.meta.get("unbacked_bindings") or any(n.op == "call_function" and n.is_impure() for n in cond.graph.nodes):
        return False
    if _tuple_valued(node) and any(u.target is not operator.getitem for u in node.users):
        return False  # read other than by index: a layout this pass does not know
    values = [evaluate(gm, i, constants, {}) for i in inputs]
    first = _holds(cond, values)
    if first is False:
        _program.replace_results(node, [_copy(gm, node, c) for c in carries], tuple_valued=_tuple_valued(node))
        return True
    known = _named(body, values)
    memo: dict[torch.fx.Node, Any] = {}
    _, outputs = _program.output_nodes(body)
    after = [evaluate(body, o, known, memo) for o in outputs]
    if first is not True or _holds(cond, after + values[len(after) :]) is not False:
        return False
    if not _inlinable(body, known, memo):
        return False
    results = _inline(gm, node, body, inputs, known, memo)
    if results is None:
        return False
    results = [_copy(gm, node, r) if r in inputs else r for r in results]  # never alias an input
    _program.replace_results(node, results, tuple_valued=_tuple_valued(node))
    return True


def _tuple_valued(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _copy(gm: torch.fx.GraphModule, node: torch.fx.Node, value: Any) -> Any:
    """A fresh copy of ``value`` (a node of ``gm``) before ``node``: a loop's results are new tensors."""
    if not isinstance(value, torch.fx.Node):
        return value
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
    copy.meta = {k: v for k, v in value.meta.items() if k in ("val", "tensor_meta")}
    return copy


def _named(gm: torch.fx.GraphModule, values: list[Any]) -> dict[str, Any]:
    """``values`` (UNKNOWN where not known) by the name of the placeholder of ``gm`` they feed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {p.name: v for p, v in zip(placeholders, values, strict=False) if v is not UNKNOWN}


def _holds(cond: torch.fx.GraphModule, values: list[Any]) -> bool | None:
    """The condition's value on inputs ``values``, or None where it is not known."""
    _, (out,) = _program.output_nodes(cond)
    value = evaluate(cond, out, _named(cond, values), {})
    return None if value is UNKNOWN else bool(value)


def _inlinable(body: torch.fx.GraphModule, known: dict[str, Any], memo: dict[torch.fx.Node, Any]) -> bool:
    """No node of ``body`` binds an unbacked size, or reads a scalar that is not known."""
    for n in body.graph.nodes:
        if n.meta.get("unbacked_bindings"):
            return False
        if isinstance(n.meta.get("val"), _SYMBOLIC) and evaluate(body, n, known, memo) is UNKNOWN:
            return False
    return True


def _inline(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    body: torch.fx.GraphModule,
    inputs: list[Any],
    known: dict[str, Any],
    memo: dict[torch.fx.Node, Any],
) -> list[Any] | None:
    """``body`` copied before ``node`` on ``inputs``; its results. A scalar it computes
    from the known counter is a Python constant in the copy (a symbol read from a tensor
    would have no binding there)."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None  # not a layout this pass knows: leave the node
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, inputs, strict=True))
    _program.copy_nodes(gm, node, body, [n for n in body.graph.nodes if n.op not in ("placeholder", "output")], env)
    for original, copy in env.items():
        if original.op != "placeholder" and isinstance(original.meta.get("val"), _SYMBOLIC):
            value = evaluate(body, original, known, memo)
            if isinstance(value, (bool, int, float)):
                _program.replace_uses(copy, value)
    _, outputs = _program.output_nodes(body)
    return [env[o] if isinstance(o, torch.fx.Node) else o for o in outputs]


def _unroll_scan(gm: torch.fx.GraphModule, node: torch.fx.Node, layout: Layout, constants: dict[str, Any]) -> bool:
    """A scan or map over ``xs`` of static length 0 or 1, replaced by what it computes."""
    assert layout.xs is not None and layout.inputs is not None and layout.body is not None
    args: tuple[Any, ...] = node.args
    body_attr, xs, additional = args[layout.body], args[layout.xs], args[layout.inputs]
    init = args[layout.carries] if layout.carries is not None else ()  # map: no carry
    vals: list[Any] = list(node.meta["val"]) if _tuple_valued(node) else [node.meta.get("val")]
    if node.meta.get("unbacked_bindings") or not xs or not all(isinstance(x, torch.fx.Node) for x in xs):
        return False
    if _tuple_valued(node) and any(u.target is not operator.getitem for u in node.users):
        return False
    length = xs[0].meta["val"].shape[0]
    if not isinstance(length, int):
        return False  # a length known at run time only (a loop's backward scans its trip count)
    if length == 0:
        ys = vals[len(init) :]
        if not all(isinstance(y, torch.Tensor) and all(isinstance(d, int) for d in y.shape) for y in ys):
            return False  # an empty output of symbolic shape: no constant shape to build it with
        results = [_copy(gm, node, c) for c in init] + [_empty(gm, node, y) for y in ys]
    elif length == 1:
        body = _program.subgraph(gm, body_attr)
        if not _inlinable(body, {}, {}):
            return False
        slices = [_call(gm, node, torch.ops.aten.select.int, x, 0, 0) for x in xs]
        inputs = [*init, *slices, *additional]
        inlined = _inline(gm, node, body, inputs, {}, {})
        if inlined is None:
            return False
        final = [_copy(gm, node, r) if r in inputs else r for r in inlined[: len(init)]]
        results = final + [_call(gm, node, torch.ops.aten.unsqueeze.default, y, 0) for y in inlined[len(init) :]]
    else:
        return False  # a longer or symbolic length: a real loop
    _program.replace_results(node, results, tuple_valued=_tuple_valued(node))
    return True


def _call(gm: torch.fx.GraphModule, node: torch.fx.Node, op: Any, value: torch.fx.Node, *args: Any) -> torch.fx.Node:
    """``op(value, *args)`` before ``node``, with its metadata."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, (value, *args))
    new.meta["val"] = op(value.meta["val"], *args)
    return new


def _empty(gm: torch.fx.GraphModule, node: torch.fx.Node, template: torch.Tensor) -> torch.fx.Node:
    """A new empty tensor of ``template``'s (static, zero-length) shape and dtype, before ``node``."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(
            torch.ops.aten.empty.memory_format,
            (list(template.shape),),
            {"dtype": template.dtype, "device": template.device},
        )
    new.meta["val"] = template
    return new
