"""``hop.deploy.for_executorch``: an exported program's hop nodes rewritten as torch's
``cond`` and ``scan``, the control flow ExecuTorch runs.

Note [a program re-exported for ExecuTorch]: each ``torch.ops.hop.*`` node of
``ep.module()`` (its subgraphs too) is made a call of its translation
(hop.deploy._executorch_ops), and the module is exported again, non-strict, with the
program's own example inputs and dynamic dims. torch's tracer then records torch's
control flow with everything ExecuTorch's emitter asks of it (the values' metadata,
flat subgraph outputs, no aliasing, the signature), where a hand edit of the graph
would have to rebuild each. Checks hop's exported programs make with asserts, which
``to_executorch`` removes, are dropped here and made as data where ExecuTorch must
keep them (Note [checks that survive to_executorch]).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from hop import _decomposed
from hop._operator import HigherOrderOperator
from hop.deploy import _executorch_ops as ops
from hop.errors import CompileUnsupported, HopTypeError, HopValueError, format_message, type_name

aten = torch.ops.aten
# a node's new target and arguments
Translation = tuple[Callable[..., Any], tuple[Any, ...]]
_OWN = ("cond", "switch", "while_loop", "scan", "map", "associative_scan")


def rewrite(ep: ExportedProgram, *, max_steps: int | None = None) -> ExportedProgram:
    if not isinstance(ep, ExportedProgram):
        raise HopTypeError(
            format_message("deploy.for_executorch", f"ep must be a torch.export.ExportedProgram, got {type_name(ep)}"),
            role="ep",
        )
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise HopValueError(
            format_message("deploy.for_executorch", f"max_steps must be a positive int or None, got {max_steps!r}"),
            role="max_steps",
        )
    if _has_transforms(ep):  # vmap recorded as a region (training IR): applied to hop's nodes first
        ep = ep.run_decompositions({})
    if _has_users_ops(ep):  # a user's operator becomes the trace of its decomposition first
        with _decomposed.inlined():
            ep = _reexport(ep.module(), ep)
    gm = ep.module()
    _rewrite(gm, max_steps)
    out = _reexport(gm, ep)
    left = sorted({_hop_name(n) for n in _all_nodes(out.graph_module) if _is_hop(n.target)})
    if left:  # an operator translated by none of the rules above
        raise CompileUnsupported(
            format_message("deploy.for_executorch", f"cannot write torch.ops.hop.{left[0]} for ExecuTorch")
        )
    return out


def _is_hop(target: Any) -> bool:
    return isinstance(target, HigherOrderOperator)


def _all_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def _has_users_ops(ep: ExportedProgram) -> bool:
    return any(_is_hop(n.target) and _hop_name(n) not in _OWN for n in _all_nodes(ep.graph_module))


def _has_transforms(ep: ExportedProgram) -> bool:
    return any(
        getattr(n.target, "__module__", "") == "torch._functorch.predispatch" for n in _all_nodes(ep.graph_module)
    )


def _hop_name(node: torch.fx.Node) -> str:
    target: Any = node.target
    return str(target.name())


def _rewrite(gm: torch.fx.GraphModule, max_steps: int | None) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _is_hop(node.target):
            name = _hop_name(node)
            try:
                _refuse_unsupported(node, name)
                node.target, node.args = _TRANSLATIONS[name](gm, node, max_steps)
            except CompileUnsupported as e:
                where = _source_line(node)
                if where is None:
                    raise
                raise CompileUnsupported(f"{e} (the call at {where})") from None
            node.kwargs = {}
            for a in node.all_input_nodes:
                sub = _attr(gm, a.target) if a.op == "get_attr" else None
                if isinstance(sub, torch.fx.GraphModule):
                    sub = ops.prepare(sub)
                    _rewrite(sub, max_steps)  # the operators nested in it
                    owner, _, leaf = str(a.target).rpartition(".")
                    setattr(_attr(gm, owner) if owner else gm, leaf, sub)
        elif _is_hops_assert(node):
            _erase_with_inputs(gm.graph, node)
    gm.graph.lint()
    gm.recompile()


def _attr(gm: torch.nn.Module, target: Any) -> Any:
    """What a get_attr node reads (a subgraph, or a parameter at a dotted path)."""
    value: Any = gm
    for part in str(target).split("."):
        value = getattr(value, part)
    return value


def _source_line(node: torch.fx.Node) -> str | None:
    """The user's line that made ``node`` (``model.py:17``), from the export's stack trace."""
    import re

    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]}" if found else None


def _args(node: torch.fx.Node) -> Any:
    return node.args


def _single(node: torch.fx.Node) -> bool:
    return not isinstance(node.meta.get("val"), (tuple, list))


def _refuse_unsupported(node: torch.fx.Node, name: str) -> None:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for k, val in enumerate(pytree.tree_leaves(node.meta.get("val"))):
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            what = f"output {k} is a Python number"
        elif isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            what = f"output {k} has sizes that depend on data ({tuple(val.shape)})"
        else:
            continue
        raise CompileUnsupported(
            format_message(
                name,
                f"{what}; ExecuTorch's control flow takes tensors of sizes known from the inputs",
                fix="Return tensors whose sizes follow from the inputs' sizes, or deploy with AOTInductor.",
            )
        )


def _cond(gm: torch.fx.GraphModule, node: torch.fx.Node, _max: int | None) -> Translation:
    pred, t, f, operands = _args(node)
    return ops.as_cond, (pred, t, f, operands, _single(node))


def _switch(gm: torch.fx.GraphModule, node: torch.fx.Node, _max: int | None) -> Translation:
    index, operands, *branches = _args(node)
    if not isinstance(index, torch.fx.Node) or not isinstance(index.meta.get("val"), torch.Tensor):
        raise CompileUnsupported(
            format_message("switch", f"the index is {type_name(index)}; ExecuTorch chooses a branch by a tensor")
        )
    return ops.as_switch, (index, operands, branches, _single(node))


def _while(gm: torch.fx.GraphModule, node: torch.fx.Node, max_steps: int | None) -> Translation:
    cond_node, body_node, carries, additional = _args(node)
    cond_gm, body_gm = _attr(gm, cond_node.target), _attr(gm, body_node.target)
    for c, out in zip(carries, pytree.tree_leaves(node.meta["val"]), strict=True):
        before = c.meta.get("val") if isinstance(c, torch.fx.Node) else c
        if isinstance(before, torch.Tensor) and isinstance(out, torch.Tensor) and before.shape != out.shape:
            raise CompileUnsupported(
                format_message(
                    "while_loop",
                    f"a carry changes shape ({tuple(before.shape)} to {tuple(out.shape)}); "
                    "ExecuTorch's loops keep their carries' shapes",
                )
            )
    _refuse_dynamic_carries("while_loop", [_val(c) for c in carries])
    trips = _constant_trips(cond_gm, body_gm, carries)
    if trips is not None:
        return ops.as_while_loop, (cond_node, body_node, carries, additional, trips, True)
    bound = max_steps
    if bound is None:
        raise CompileUnsupported(
            format_message(
                "while_loop",
                "its trip count depends on data; ExecuTorch runs loops of a bounded length",
                fix="Pass max_steps=N to hop.deploy.for_executorch: the loop runs at most N steps, "
                "and a run that would take more fails.",
            )
        )
    return ops.as_while_loop, (cond_node, body_node, carries, additional, bound, False)


def _scan(gm: torch.fx.GraphModule, node: torch.fx.Node, _max: int | None) -> Translation:
    body, init, xs, additional, reverse = _args(node)
    _refuse_empty("scan", xs)
    _refuse_dynamic_carries("scan", [_val(c) for c in init])
    return ops.as_scan, (body, init, xs, additional, reverse)


def _map(gm: torch.fx.GraphModule, node: torch.fx.Node, _max: int | None) -> Translation:
    body, xs, additional = _args(node)
    _refuse_empty("map", xs)
    return ops.as_map, (body, xs, additional, _single(node))


def _associative_scan(gm: torch.fx.GraphModule, node: torch.fx.Node, _max: int | None) -> Translation:
    combine, xs, additional, _mode = _args(node)
    _refuse_empty("associative_scan", xs)
    _refuse_dynamic_carries("associative_scan", [_val(x)[0] for x in xs])
    return ops.as_associative_scan, (combine, xs, additional, _single(node))


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _refuse_dynamic_carries(name: str, carries: list[Any]) -> None:
    """ExecuTorch 1.5's scan copies each step's carries into buffers of the exported
    size, and fails on any other (torch's own scan alike): a carry's size must not vary."""
    for val in carries:  # named by its shape: a loop's carries are numbered after hop's own
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            raise CompileUnsupported(
                format_message(
                    name,
                    f"a carry of shape {tuple(val.shape)} varies in size between calls; "
                    "ExecuTorch's loops take carries of one size",
                    fix="Export with that size static (no Dim on the inputs it comes from), or carry a "
                    "buffer of the largest size.",
                )
            )


def _refuse_empty(name: str, xs: Any) -> None:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    length = xs[0].meta["val"].shape[0]
    if not statically_known_true(length >= 1):
        raise CompileUnsupported(
            format_message(
                name,
                f"xs may have length 0 (length {length}); ExecuTorch's scan runs at least one step",
                fix="Export with a length of at least 1 (torch.export.Dim(..., min=1)).",
            )
        )


_TRANSLATIONS: dict[str, Callable[..., Translation]] = {
    "cond": _cond,
    "switch": _switch,
    "while_loop": _while,
    "scan": _scan,
    "map": _map,
    "associative_scan": _associative_scan,
}


def _constant_trips(cond_gm: torch.fx.GraphModule, body_gm: torch.fx.GraphModule, carries: Any) -> int | None:
    """The trip count of a counted loop with constant bounds (what ``hop.fori_loop(lo, hi,
    ...)`` with ints exports: carry 0 starts at ``lo``, the condition is ``carry 0 < hi``,
    the body adds 1 to it), else None."""
    lower = _constant(carries[0]) if carries else None
    first = next(iter(cond_gm.graph.find_nodes(op="placeholder")), None)
    out = _output(cond_gm)
    if lower is None or first is None or not isinstance(out, torch.fx.Node):
        return None
    upper = None
    if out.target in (operator.lt, aten.lt.Scalar) and _int_of(out.args[0], first) and isinstance(out.args[1], int):
        upper = out.args[1]
    if upper is None or not _counts_by_one(body_gm):
        return None
    return max(0, upper - lower)


def _output(gm: torch.fx.GraphModule) -> Any:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]


def _constant(node: Any) -> int | None:
    if isinstance(node, torch.fx.Node) and node.target is aten.scalar_tensor.default and isinstance(node.args[0], int):
        return node.args[0]
    return None


def _int_of(node: Any, placeholder: torch.fx.Node) -> bool:
    """``node`` is ``placeholder``'s value (the tensor, or its ``item()``)."""
    if node is placeholder:
        return True
    return isinstance(node, torch.fx.Node) and node.target is aten.item.default and node.args[0] is placeholder


def _counts_by_one(body_gm: torch.fx.GraphModule) -> bool:
    first = next(iter(body_gm.graph.find_nodes(op="placeholder")), None)
    outs = _output(body_gm)
    out = outs[0] if isinstance(outs, (tuple, list)) and outs else None
    if first is None or not isinstance(out, torch.fx.Node):
        return False
    if out.target is aten.scalar_tensor.default:  # scalar_tensor(item(i) + 1)
        out = out.args[0]
    if not isinstance(out, torch.fx.Node) or out.target not in (operator.add, aten.add.Tensor, aten.add.Scalar):
        return False
    return _int_of(out.args[0], first) and len(out.args) == 2 and isinstance(out.args[1], int) and out.args[1] == 1


_ASSERTS = (aten._assert_async.msg, aten._assert_scalar.default)


def _is_hops_assert(node: torch.fx.Node) -> bool:
    """A check hop's exported program makes with an assert (a switch's index range, a
    counter's range): ExecuTorch drops asserts, and the translations check what must be."""
    return (
        node.op == "call_function"
        and node.target in _ASSERTS
        and len(node.args) > 1
        and isinstance(node.args[1], str)
        and node.args[1].startswith("hop.")
    )


def _erase_with_inputs(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and what computed only its inputs (pure: sizes, comparisons, item)."""
    inputs = [a for a in node.all_input_nodes]
    graph.erase_node(node)
    for a in inputs:
        pure = a.op == "call_function" and not _mutates(a.target)
        if pure and not a.users:
            _erase_with_inputs(graph, a)


def _mutates(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.is_mutable)


def _reexport(gm: torch.nn.Module, ep: ExportedProgram) -> ExportedProgram:
    """Note [a program re-exported for ExecuTorch]."""
    args, kwargs = _example_inputs(ep)
    # an inference program: torch's scan traces a backward where a parameter requires grad
    for sub in gm.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.requires_grad:
                sub._parameters[name] = torch.nn.Parameter(p.detach(), requires_grad=False)
    with torch.no_grad():
        return torch.export.export(gm, args, kwargs, dynamic_shapes=_dynamic_shapes(ep), strict=False)


def _user_inputs(ep: ExportedProgram) -> list[Any]:
    from torch.export.graph_signature import InputKind

    names = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    return [n.meta.get("val") for n in ep.graph.find_nodes(op="placeholder") if n.name in names]


def _example_inputs(ep: ExportedProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    given = getattr(ep, "example_inputs", None)
    if given is not None:
        return tuple(given[0]), dict(given[1])
    from torch.fx.experimental.symbolic_shapes import guard_int

    def real(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros([guard_int(d) for d in v.shape], dtype=v.dtype, device=v.device)
        return v

    args, kwargs = pytree.tree_unflatten([real(v) for v in _user_inputs(ep)], ep.call_spec.in_spec)
    return tuple(args), dict(kwargs)


def _dynamic_shapes(ep: ExportedProgram) -> Any:
    """The dims the program was exported with: one ``Dim`` per symbol, of its range."""
    import sympy

    dims: dict[Any, Any] = {}

    def dim(size: Any) -> Any:
        if not isinstance(size, torch.SymInt):
            return None
        expr = size.node.expr
        if not isinstance(expr, sympy.Symbol):
            return torch.export.Dim.AUTO
        if expr not in dims:
            vr = ep.range_constraints.get(expr)
            bounds: dict[str, int] = {}
            if vr is not None and vr.lower.is_finite:
                bounds["min"] = int(vr.lower)
            if vr is not None and vr.upper.is_finite:
                bounds["max"] = int(vr.upper)
            dims[expr] = torch.export.Dim(str(expr), **bounds)
        return dims[expr]

    flat = [
        ({k: d for k, d in enumerate(map(dim, v.shape)) if d is not None} or None)
        if isinstance(v, torch.Tensor)
        else None
        for v in _user_inputs(ep)
    ]
    args, kwargs = pytree.tree_unflatten(flat, ep.call_spec.in_spec)
    return (*args, *kwargs.values()) if kwargs else tuple(args)
