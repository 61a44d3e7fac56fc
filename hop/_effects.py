"""What a subgraph does to its inputs: writes, aliases, and effects that need a token.

:func:`find_mutations_and_aliases` reports the inputs a traced subgraph writes and
the outputs that alias its inputs; :func:`clone_aliases`, :func:`may_alias` and
:func:`hidden_alias` find and remove aliases of operands among real or fake
outputs; :func:`functionalize_body` functionalizes a callable for a functionalize
rule, keeping torch's effect tokens out of it (Note [effect tokens stay outside
bodies]), and :func:`functionalize_rule` is every operator's functionalize rule.
Separate from tracing: it reads graphs and tensors' storage after the fact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as py_pytree

from hop import _spec, _state
from hop._output_checks import describe_fn, storage_id
from hop._tracing import keeping_node_meta
from hop.errors import CompileUnsupported, MutationError, format_message

__all__ = [
    "CHECK_EFFECTS",
    "Effects",
    "clone_aliased_outputs",
    "clone_aliases",
    "effect_name",
    "find_mutations_and_aliases",
    "functionalize_body",
    "functionalize_rule",
    "hidden_alias",
    "may_alias",
    "same_memory",
    "untokened_effect",
]


@dataclasses.dataclass(frozen=True)
class Effects:
    """What a traced subgraph does to its inputs.

    Attributes:
        mutated: indices of placeholders written in place.
        aliased: (output index, input index) pairs sharing storage.
    """

    mutated: tuple[int, ...]
    aliased: tuple[tuple[int, int], ...]


def same_memory(o: torch.Tensor, x: Any) -> bool:
    """Whether tensor ``o`` starts where tensor ``x`` does in memory: an alias that is
    not a view (``x.detach()``, ``x.data``) shows only so. Cheap; False where there
    is no memory to compare (empty, meta, fake, functional or batched tensors)."""
    if not isinstance(x, torch.Tensor) or o.layout is not torch.strided or x.layout is not torch.strided:
        return False
    try:
        p = o.data_ptr()
        return p != 0 and p == x.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage to point at
        return False


def may_alias(o: Any, operands: Sequence[Any]) -> bool:
    """A cheap test that a leaf of an output may share memory with an operand (then
    :func:`clone_aliases` decides exactly): one of them, a view, or :func:`same_memory`."""
    if not isinstance(o, torch.Tensor):
        return False
    if o._is_view():
        return True
    return any(o is x or same_memory(o, x) for x in operands)


def hidden_alias(outputs: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether a tensor of ``outputs`` shares storage with one of ``inputs`` (fake
    included) while being neither an input nor a view: ``x.detach()``, ``x.data``,
    aliases that the cheap checks (identity, ``_is_view``) do not see."""
    seen = {s for s in map(storage_id, inputs) if s is not None}
    for o in outputs:
        s = storage_id(o)
        if s is not None and s in seen and not o._is_view() and not any(o is x for x in inputs):
            return True
    return False


def find_mutations_and_aliases(gm: torch.fx.GraphModule) -> Effects:
    """Inputs written in place and outputs aliasing inputs, from ``meta["val"]``.

    Writes are found on aten ops whose schema marks the argument as written
    (``add_``, ``copy_``, ``out=``); the graph must come from make_fx, so every
    placeholder and output carries ``meta["val"]``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    storages = [storage_id(n.meta.get("val")) for n in placeholders]
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg_schema, arg in zip(node.target._schema.arguments, node.args, strict=False):
            if arg_schema.is_write and isinstance(arg, torch.fx.Node):
                written = storage_id(arg.meta.get("val"))
                for i, s in enumerate(storages):
                    if s is not None and s == written:
                        mutated.add(i)
        for name, arg in node.kwargs.items():
            if isinstance(arg, torch.fx.Node) and arg in index and _is_written_kwarg(node.target, name):
                mutated.add(index[arg])
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = py_pytree.tree_leaves(out_node.args[0])
    aliased = []
    for j, o in enumerate(outs):
        so = storage_id(o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
        found = [(j, i) for i, s in enumerate(storages) if so is not None and s == so]
        if not found and isinstance(o, torch.fx.Node) and o.op == "call_function":
            # storages that do not say (a real-mode trace): the schema's aliases of a tensor input
            root = _written_root(o)
            found = [(j, index[root])] if root in index and isinstance(root.meta.get("val"), torch.Tensor) else []
        aliased.extend(found)
    return Effects(tuple(sorted(mutated)), tuple(aliased))


def _written_root(node: Any) -> Any:
    """The node ``node`` returns its first argument of: through ops whose schema says
    their output aliases it (``add_``, ``view``), back to where that chain starts."""
    seen = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and seen < 64:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
            return node
        returns, arguments = target._schema.returns, target._schema.arguments
        if returns[0].alias_info is None or not arguments or arguments[0].alias_info is None:
            return node
        node, seen = node.args[0], seen + 1
    return node


def _is_written_kwarg(target: torch._ops.OpOverload, name: str) -> bool:
    return any(a.name == name and a.is_write for a in target._schema.arguments)


def clone_aliased_outputs(gm: torch.fx.GraphModule, effects: Effects) -> None:
    """Clone, inside ``gm``, the outputs that alias its inputs (``effects.aliased``)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat, spec = py_pytree.tree_flatten(out_node.args[0])
    for j in {j for j, _ in effects.aliased}:
        with gm.graph.inserting_before(out_node):
            clone = gm.graph.call_function(torch.ops.aten.clone.default, (flat[j],))
        clone.meta["val"] = flat[j].meta["val"].clone()
        flat[j] = clone
    out_node.args = (py_pytree.tree_unflatten(flat, spec),)
    gm.recompile()


def clone_aliases(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``outputs`` with every tensor that shares storage with an input (or an
    earlier output) cloned, so a HOP never returns an alias of its operands."""
    seen = {s for s in (storage_id(i) for i in inputs) if s is not None}
    result = []
    for o in outputs:
        s = storage_id(o)
        if s is not None and s in seen:
            o = o.clone()
            s = storage_id(o)
        if s is not None:
            seen.add(s)
        result.append(o)
    return result


# Note [effect tokens stay outside bodies]
# torch registers some ops as having an ordered side effect (``aten::_print``,
# ``aten::_linalg_check_errors``, which ``torch.linalg.solve``/``inv``/``cholesky``
# call). Once functionalized (AOTAutograd, ``run_decompositions``), torch threads
# them on an effect token held by the FunctionalTensorMode: the op becomes
# ``with_effects(token, op, ...)``, and the new token replaces the mode's. Run in a
# hop body, that token belongs to no graph: the outer token is read inside the
# subgraph (lifted as an operand), the body's new token is read outside it (a
# constant made in the subgraph: "lifted_tensor_0 is not in the constants
# dictionary"), and a token first met in a backward body becomes a
# ``tangents_token`` placeholder of the subgraph, which hop never passes.
#
# hop's nodes take no token, so inside a body an effectful op is recorded as the
# plain op, past the FunctionalTensorMode. That is right only for an effect that
# is a check: ``_linalg_check_errors`` returns nothing, writes nothing and raises
# on a failed factorization; the graph keeps it (fx and Inductor treat an op with
# a registered effect as impure) after the op whose ``info`` it reads, so it
# raises as in eager. Without the token, only its order relative to effects
# outside the body is free: at most, which of two failing checks reports first, or
# whether a print placed after the operator runs before the check raises. Any
# other effect (a print, a call on a script object) would lose its order
# silently: it is refused with a message instead, by Dynamo's capture of a body
# (hop.compile._dynamo_capture.speculate) and by functionalization.
#
# An op reaches this mode as the caller wrote it (``linalg_inv``); the check is
# called by its composite kernel. The mode decomposes what the FunctionalTensorMode
# would (asking that mode's ``_can_decompose``), so the check meets it too.

CHECK_EFFECTS: frozenset[str] = frozenset({"aten::_linalg_check_errors"})

"""Ops whose registered effect only raises on bad input: inside a body, they need no token."""


def effect_name(func: Any) -> str | None:
    """``"aten::_print"`` for an op with a registered effect (an overload, a packet
    one of whose overloads has it, or a higher-order operator), else None."""
    from torch._higher_order_ops.effects import has_effects

    if isinstance(func, torch._ops.OpOverloadPacket):
        overloads = (getattr(func, name) for name in func.overloads())  # type: ignore[no-untyped-call]
        return next((n for n in map(effect_name, overloads) if n is not None), None)
    if not has_effects(func):
        return None
    if isinstance(func, torch._ops.OpOverload):
        return str(func._schema.name)
    return f"{func.namespace}::{func.name()}"


def untokened_effect(graph: torch.fx.Graph) -> str | None:
    """The first effectful op of ``graph`` that a body cannot run without its token
    (Note [effect tokens stay outside bodies]), or None."""
    for node in graph.nodes:
        if node.op == "call_function":
            name = effect_name(node.target)
            if name is not None and name not in CHECK_EFFECTS:
                return name
    return None


class _UntokenedChecks(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs above a body's FunctionalTensorMode: Note [effect tokens stay outside bodies]."""

    supports_higher_order_operators = True  # nested operators pass through, to their own rules

    def __init__(self, ctx: Any, op: str, role: str, fn: Callable[..., Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._ctx, self._op, self._role, self._fn = ctx, op, role, fn

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = effect_name(func)
        if name is None:
            out = self._decomposed(func, args, kwargs)
            return func(*args, **kwargs) if out is NotImplemented else out
        if name not in CHECK_EFFECTS:
            raise self._refused(name)
        from torch.utils._python_dispatch import _pop_mode_temporarily

        plain_args, plain_kwargs = self._ctx.unwrap_tensors((args, kwargs))
        with _pop_mode_temporarily(torch._C._TorchDispatchModeKey.FUNCTIONAL):  # type: ignore[arg-type]
            out = func(*plain_args, **plain_kwargs)
        return self._ctx.wrap_tensors(out)

    def _decomposed(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` decomposed here where the FunctionalTensorMode would decompose it:
        a composite's own effectful calls (``linalg_inv`` checks ``linalg_inv_ex``'s
        ``info``) then pass this mode too, not only the FunctionalTensorMode."""
        from torch._subclasses.functional_tensor import FunctionalTensor

        if (
            not isinstance(func, torch._ops.OpOverload)
            or func in FunctionalTensor.metadata_fns
            or not torch._C._dispatch_has_kernel(func.name())  # type: ignore[no-untyped-call]
            or not self._ctx.mode._can_decompose(func, args, kwargs)
        ):
            return NotImplemented
        with self:
            return func.decompose(*args, **kwargs)

    def _where(self) -> str:
        """`` (file.py:12)`` of the user's callable; nothing for one Dynamo traced, whose source is lost."""
        fn = self._fn
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return "" if isinstance(fn, torch.fx.GraphModule) else f" ({describe_fn(fn)})"

    def _refused(self, name: str) -> Exception:
        return CompileUnsupported(
            format_message(
                self._op,
                f"{self._role}{self._where()} calls {name}, an op with an ordered side effect; "
                "hop's subgraphs carry no effect token, so its order could not be kept once functionalized "
                "(torch.compile, run_decompositions)",
                fix="Call it outside the operator, or run the program eagerly.",
            ),
            op=self._op,
            role=self._role,
        )


def functionalize_body(
    ctx: Any, fn: Callable[..., Any], op: str, role: str, sink: list[Any] | None = None
) -> Callable[..., Any]:
    """``ctx.functionalize(fn)`` for the functionalize rule of ``op``, whose callable
    ``role`` is ``fn``: under torch's Python functionalization (the one that threads
    effect tokens), effectful ops inside ``fn`` take no token (Note [effect tokens
    stay outside bodies]); C++ functionalization threads none."""
    from torch._subclasses.functional_tensor import PythonFunctionalizeAPI

    fn = keeping_node_meta(fn)
    body = fn
    if isinstance(ctx, PythonFunctionalizeAPI):

        def body(*args: Any, **kwargs: Any) -> Any:
            with _UntokenedChecks(ctx, op, role, fn):
                return fn(*args, **kwargs)

        body.__wrapped__ = fn  # type: ignore[attr-defined]
        return _functionalized_writing_back(ctx, body, role, [] if sink is None else sink)
    functionalized: Callable[..., Any] = ctx.functionalize(body)
    return functionalized


def _functionalized_writing_back(ctx: Any, fn: Callable[..., Any], role: str, sink: list[Any]) -> Callable[..., Any]:
    """``fn`` under ``ctx``'s FunctionalTensorMode, as torch's ``ctx.functionalize``
    runs it, but a write to an input is not dropped: it is written back to the input
    (a ``copy_`` that a tracer below records, so the proxy rule sees it) and reported
    in ``sink`` (for a run that traces nothing: AOTAutograd's first pass), so that
    the call is made pure (Note [state inside control flow] in ``hop._state``)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    def from_fun(t: Any) -> Any:
        if not isinstance(t, FunctionalTensor):
            return t
        torch._sync(t)  # type: ignore[attr-defined, no-untyped-call]
        return torch._from_functional_tensor(t.elem)

    def inner(*args: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            with ctx.mode:
                wrapped = py_pytree.tree_map_only(torch.Tensor, FunctionalTensor.to_functional, args)
                with _state.user_code():
                    result = fn(*wrapped)
                leaves = py_pytree.tree_leaves(wrapped)
                mutated = tuple(
                    i
                    for i, w in enumerate(leaves)
                    if isinstance(w, FunctionalTensor) and torch._functionalize_has_data_mutation(w.elem)  # type: ignore[attr-defined]
                )
                if not mutated:
                    return py_pytree.tree_map_only(FunctionalTensor, from_fun, result)
                outs, spec = py_pytree.tree_flatten(result)
                aliased = tuple((j, i) for j, o in enumerate(outs) for i in mutated if o is leaves[i])
                sink.append(_state.Written(role, fn, mutated, aliased, {i: leaves[i] for i in mutated}))
                plain = py_pytree.tree_leaves(args)
                written = [(plain[i], from_fun(leaves[i])) for i in mutated]
                outs = [from_fun(o) for o in outs]
            for a, new in written:
                a.copy_(new)
            for j, i in aliased:  # the written input itself, as Python returns it
                outs[j] = plain[i]
        return py_pytree.tree_unflatten(outs, spec)

    inner.__wrapped__ = fn  # type: ignore[attr-defined]
    return inner


def functionalize_rule(
    op: Callable[..., Any], spec: _spec.OpSpec, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The functionalize rule of every operator, read from its spec: the callables at
    the layout's subgraph positions functionalized (:func:`functionalize_body`, each
    named by its role), the tensors of every other argument unwrapped (sequences
    become the tuples raw ops take), and ``op(*args, **kwargs)`` called one level down."""
    assert spec.layout is not None, f"{spec.name} has no node of its own"
    positions = spec.layout.subgraph_positions(args)
    roles = dict(zip(positions, spec.role_names(len(positions)), strict=True))
    unwrapped = [a if k in roles else _tuple_if_list(ctx.unwrap_tensors(a)) for k, a in enumerate(args)]
    sink: list[_state.Written] = []
    with ctx.redispatch_to_next():
        call = [
            functionalize_body(ctx, a, spec.name, roles[k], sink) if k in roles else a for k, a in enumerate(unwrapped)
        ]
        out = op(*call, **kwargs)
    if sink:  # a run that traced nothing (the proxy rule raises this itself)
        refusal = MutationError(
            format_message(spec.name, f"{sink[0].role} writes one of its inputs in place", role=None),
            op=spec.name,
            role=sink[0].role,
        )
        layout = spec.layout
        n = sum(len(args[p]) for p in (layout.carries, layout.xs, layout.inputs) if p is not None)
        if not _state.catching():  # called past hop's dispatcher: no frame above can rewrite it
            raise refusal
        raise _state.StateWrites(spec.name, _first_per_role(sink), [], refusal, n)
    return ctx.wrap_tensors(out)


def _first_per_role(sink: list[_state.Written]) -> list[_state.Written]:
    """One record per callable (a loop's body runs several times)."""
    seen: dict[str, _state.Written] = {}
    for w in sink:
        if w.role in seen:
            prior = seen[w.role]
            w = _state.Written(w.role, w.fn, tuple(sorted({*prior.mutated, *w.mutated})), prior.aliased, prior.value_of)
        seen[w.role] = w
    return list(seen.values())


def _tuple_if_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
