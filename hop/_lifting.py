"""Tracing branches with what they close over lifted to extra inputs (Note [closure lifting]).

:func:`trace_branches` traces each callable with ``hop._tracing.trace_subgraph``
while the sub-tracer's trackers ask the parent tracer for values they miss, adds a
placeholder for each (tensors, SymInts, tensor constants the branch made) and
aligns every branch's placeholders on one list of lifted values. Separate from
``hop._tracing`` because it swaps the sub-tracer's trackers for its own while a
branch is traced; plain tracing leaves the tracer as it finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from hop import _observe
from hop._tracing import keeping_node_meta, object_val, per_element, trace_subgraph

__all__ = ["distinct_inputs", "trace_branches", "trace_each"]


# Note [closure lifting]
# A branch may use tensors and SymInts it closes over (a module's parameters, a
# size read from another input). Traced by a sub-tracer they are unknown there:
# torch would bake a tensor into the subgraph as a get_attr constant (holding a
# FakeTensor under export, which breaks save/load) and fail on a SymInt. While a
# branch is traced, hop swaps the sub-tracer's tensor and SymInt trackers for
# ones that, on a miss, ask the parent tracer: if the parent knows the value, a
# new placeholder is added to the subgraph and the value becomes an extra operand
# of the operator. Only what the branch uses is lifted; nested operators lift
# through every level on the way up.


class _LiftingTracker:
    """A tracker that lifts values known to ``parent`` into new placeholders."""

    def __init__(self, inner: Any, parent: Any, lift: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._parent = parent
        self._lift = lift

    def get(self, key: Any, default: Any = None) -> Any:
        value = self._inner.get(key)
        if value is None and self._parent.get(key) is not None:
            value = self._lift(key)
            self._inner[key] = value
        return default if value is None else value

    def __getitem__(self, key: Any) -> Any:  # torch's functionalization indexes the tracker directly
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._inner[key] = value

    def __contains__(self, key: Any) -> bool:
        return key in self._inner

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Any:
        return iter(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _install_lifting(sub: Any, parent: Any, lifted: list[Any], nodes: list[torch.fx.Node]) -> None:
    from torch.fx.experimental import proxy_tensor

    def placeholder(value: Any) -> torch.fx.Proxy:
        graph = sub.graph
        anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
        with graph.inserting_before(anchor):
            node = graph.placeholder(f"lifted_{len(lifted)}")
        lifted.append(value)
        nodes.append(node)
        return torch.fx.Proxy(node, sub)

    def lift_tensor(t: torch.Tensor) -> Any:
        proxy = placeholder(t)
        proxy_tensor.set_meta(proxy, per_element(t))  # Note [pre-dispatch subgraphs see per-element values]
        return proxy_tensor._ProxyTensor(proxy, None)

    def lift_sym(s: Any) -> Any:
        proxy = placeholder(s)
        proxy.node.meta["val"] = s
        return proxy_tensor.thunkify(sub, lambda: proxy)

    sub.tensor_tracker = _LiftingTracker(sub.tensor_tracker, parent.tensor_tracker, lift_tensor)
    sub.symnode_tracker = _LiftingTracker(sub.symnode_tracker, parent.symnode_tracker, lift_sym)


def trace_branches(
    fns: Sequence[Callable[..., Any]], args: Sequence[Any]
) -> tuple[list[torch.fx.GraphModule], list[Any]]:
    """Trace each of ``fns`` on ``args``, lifting what they close over.

    Returns the graphs and the lifted values (tensors, SymInts of the parent
    trace, in first-use order). Every graph takes ``(*args, *lifted)``: a graph
    that does not use a lifted value has an unused placeholder for it. See
    Note [closure lifting]. Outside make_fx nothing is lifted.
    """
    return trace_each(fns, [args] * len(fns))


def trace_each(
    fns: Sequence[Callable[..., Any]], args: Sequence[Sequence[Any]]
) -> tuple[list[torch.fx.GraphModule], list[Any]]:
    """:func:`trace_branches` with arguments of its own for each callable: graph ``k``
    takes ``(*args[k], *lifted)``."""
    from torch.fx.experimental import proxy_tensor

    outer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    parent = outer.fx_tracer if outer is not None else None
    traced: list[tuple[torch.fx.GraphModule, list[Any], list[torch.fx.Node]]] = []
    for fn, fn_args in zip(fns, args, strict=True):
        fn = keeping_node_meta(fn)
        lifted: list[Any] = []
        nodes: list[torch.fx.Node] = []

        def lifting(*a: Any, fn: Callable[..., Any] = fn, lifted: list[Any] = lifted, nodes: list[Any] = nodes) -> Any:
            current = proxy_tensor._CURRENT_MAKE_FX_TRACER
            if parent is not None and current is not None and current.fx_tracer is not parent:
                _install_lifting(current.fx_tracer, parent, lifted, nodes)
            return fn(*a)

        gm = trace_subgraph(lifting, fn_args)
        if outer is not None:
            _lift_constants(gm, outer, lifted, nodes)
        traced.append((gm, lifted, nodes))
    union: list[Any] = []
    for _, lifted, _ in traced:
        union.extend(v for v in lifted if not any(_same_value(v, u) for u in union))
    for gm, lifted, nodes in traced:
        _align_placeholders(gm, lifted, nodes, union)
    _observe.closures(union)
    return [gm for gm, _, _ in traced], union


def _lift_constants(gm: torch.fx.GraphModule, outer: Any, lifted: list[Any], nodes: list[torch.fx.Node]) -> None:
    """Tensor constants a branch made (``torch.tensor(2.0)``) become constants of the
    parent graph, passed in as lifted values: torch.export lifts and saves a
    top-level constant, not one inside a subgraph.

    The placeholder's example is a fake of a *copy* of the constant: ``from_tensor``
    memoizes, and the branch's own ``lift_fresh_copy`` of the constant already holds
    the fake of the constant itself; sharing its storage would make the in-place
    ``detach_`` that ``torch.tensor`` records read as a write to this input. The
    attribute is deleted from the subgraph: torch.export turns every tensor
    attribute of a submodule into a buffer of the program."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    parent, fake_mode = outer.fx_tracer, outer.fake_tensor_mode
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = _attr(gm, str(node.target))
        if isinstance(value, torch.Generator):
            # torch.export's verifier admits no generator attribute in a subgraph, and
            # lifts one the top-level graph reads into an input, as for a plain call
            _to_placeholder(gm, node, "lifted_object", value, lifted, nodes)
            continue
        if not isinstance(value, torch.Tensor):
            continue
        example = value
        if fake_mode is not None and not isinstance(value, FakeTensor):
            with unset_fake_temporarily():
                copy = value.clone()
            example = fake_mode.from_tensor(copy, static_shapes=True)
        # A value the parent tracks already (one constant read twice, without a fake mode
        # to copy it into) reuses its node: a second get_attr would be left unused, which
        # torch.export's constant lifting fails on (a bare StopIteration).
        if parent.tensor_tracker.get(example) is None:
            name = parent.get_fresh_qualname("_tensor_constant")
            setattr(parent.root, name, value)
            track_tensor_tree(example, parent.create_proxy("get_attr", name, (), {}), constant=value, tracer=parent)
        _to_placeholder(gm, node, "lifted_const", example, lifted, nodes)
    gm.recompile()


def _to_placeholder(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    prefix: str,
    value: Any,
    lifted: list[Any],
    nodes: list[torch.fx.Node],
) -> None:
    """The get_attr ``node`` replaced by a new placeholder for the lifted ``value``; the
    attribute goes once nothing else reads it."""
    anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(anchor):
        placeholder = gm.graph.placeholder(f"{prefix}_{len(lifted)}")
    placeholder.meta = dict(node.meta)
    placeholder.meta["val"] = _placeholder_val(placeholder.name, value)
    node.replace_all_uses_with(placeholder)
    gm.graph.erase_node(node)
    if not any(n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes):
        _delete_attr(gm, str(node.target))
    lifted.append(value)
    nodes.append(placeholder)


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _delete_attr(root: torch.nn.Module, target: str) -> None:
    *path, last = target.split(".")
    owner = _attr(root, ".".join(path)) if path else root
    delattr(owner, last)


def _same_value(a: Any, b: Any) -> bool:
    """Lifted values that stand for the same thing: one tensor, or one symbolic expression."""
    if a is b:
        return True
    sym = (torch.SymInt, torch.SymBool, torch.SymFloat)
    return isinstance(a, sym) and isinstance(b, sym) and a.node.expr == b.node.expr


def _align_placeholders(
    gm: torch.fx.GraphModule, lifted: list[Any], nodes: list[torch.fx.Node], union: list[Any]
) -> None:
    """Make ``gm``'s lifted placeholders follow ``union``'s order, adding unused ones."""
    if not union:
        return
    graph = gm.graph
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for i, value in enumerate(union):
        with graph.inserting_before(anchor):
            new = graph.placeholder(f"lifted_arg_{i}")
        # one branch may have lifted the same value twice (two SymInts of one expression)
        olds = [n for v, n in zip(lifted, nodes, strict=True) if _same_value(v, value)]
        new.meta = dict(olds[0].meta) if olds else {"val": _placeholder_val(new.name, value)}
        for old in olds:
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    gm.recompile()


def _placeholder_val(name: str, value: Any) -> Any:
    return object_val(name, value) if isinstance(value, torch.Generator) else value


# Note [one placeholder per value]
# torch's export names a cond subgraph's placeholders after the node's operands.
# Two operands of one value (``cond(p, f, g, (x, x))``, or an operand the branch
# also closes over, lifted beside it) give two placeholders one name, and the
# subgraph's code fails to compile ("duplicate argument"); a Python number among
# the operands has no name at all. Branches read their operands and never write
# them (the effect check refuses it), so the copies are one input: each graph
# keeps the first placeholder of a value and the node passes the value once. A
# Python number was traced as a constant of each graph: its placeholder is unused
# and the node does not pass it. Loops cannot do this: two carries that start
# equal evolve apart, and a number carried changes.


def distinct_inputs(
    graphs: Sequence[torch.fx.GraphModule], args: Sequence[Any]
) -> tuple[list[torch.fx.GraphModule], tuple[Any, ...]]:
    """``graphs`` (each taking ``args``) taking each tensor or symbol of ``args`` once and
    no Python number they do not read, and the args left (Note [one placeholder per value])."""
    placeholders = [[n for n in gm.graph.nodes if n.op == "placeholder"] for gm in graphs]
    keep: list[int] = []
    first: dict[int, int | None] = {}  # a dropped position -> the kept one it repeats (None: a constant)
    for j, a in enumerate(args):
        if isinstance(a, bool | int | float) and all(not p[j].users for p in placeholders):
            first[j] = None
            continue
        i = next((i for i in keep if _repeats(args[i], a)), None)
        if i is None:
            keep.append(j)
        else:
            first[j] = i
    if not first:
        return list(graphs), tuple(args)
    for gm, nodes in zip(graphs, placeholders, strict=True):
        for j, i in first.items():
            if i is not None:
                nodes[j].replace_all_uses_with(nodes[i])
            gm.graph.erase_node(nodes[j])
        gm.recompile()
    return list(graphs), tuple(args[j] for j in keep)


def _repeats(a: Any, b: Any) -> bool:
    """``b`` is a second copy of ``a``: one tensor, or one symbolic expression."""
    return isinstance(a, torch.Tensor | torch.SymInt | torch.SymBool | torch.SymFloat) and _same_value(a, b)
