"""Dynamo's values as hop's handlers read them: ``VariableTracker``s, their examples and pytrees.

A handler checks a call on the example values behind Dynamo's variables (fake
tensors, SymInts, constants: :func:`example`, :func:`example_tree`,
:func:`callable_stand_in`), flattens and rebuilds their pytrees (:func:`flatten`,
:func:`unflatten`, the ``None`` helpers), and makes fresh inputs for a callable to
be traced on (:func:`fresh_input`, :func:`fresh`). Apart from
``hop.compile._dynamo_capture``, which traces callables into subgraphs: this module
only reads and builds values.

Everything here imports torch._dynamo: it is loaded only once Dynamo is.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.utils import _make_inlined
from torch._dynamo.variables import ConstantVariable, VariableTracker
from torch._dynamo.variables.builder import SourcelessBuilder, wrap_fx_proxy
from torch._dynamo.variables.higher_order_ops import discard_graph_changes
from torch._dynamo.variables.tensor import SymNodeVariable

__all__ = [
    "BATCHED_EXAMPLE",
    "VT",
    "Spec",
    "callable_stand_in",
    "constant",
    "drop_none_outputs",
    "example",
    "example_tree",
    "flatten",
    "flatten_plain",
    "fresh",
    "fresh_input",
    "is_none",
    "items",
    "method",
    "proxies",
    "python_spec",
    "rebuilds",
    "shown",
    "unbound_dims",
    "unflatten",
    "with_none",
    "without_none",
]


VT = VariableTracker


def constant(value: Any) -> VT:
    made: VT = ConstantVariable.create(value)
    return made


def items(tx: Any, vt: VT) -> list[VT]:
    """The elements of a tuple or list variable."""
    return list(vt.unpack_var_sequence(tx))


Spec = VT | pytree.TreeSpec
"""A pytree's structure: a variable (what Dynamo's inlined pytree code made) or the
:class:`~torch.utils._pytree.TreeSpec` itself (what :func:`flatten` read directly)."""


# Note [pytrees read without tracing]
# Dynamo turns what it traces into guards, checked before every call of the compiled
# code, and torch's pytree code reads the type of each leaf and torch's registry of node
# types (about thirty guards for a tuple of tensors). Most operands are tuples and lists
# of tensors and numbers: those are read here, in Python, at trace time, with no guard
# (the tuple's and list's lengths are already fixed by what made them). Any other
# node (a dict, a named tuple, a registered class, ``None``) goes through torch's
# pytree code, traced as before. What a traced callable returns is flattened the same
# way, inside its trace, and its structure kept as a TreeSpec; a tree is rebuilt from
# a TreeSpec by torch's pytree in Python, with the leaf variables as leaves, when its
# nodes are tuples, lists, dicts or named tuples, whose variables Dynamo then makes. A
# callable returning any other structure is traced again, with Dynamo flattening its
# result and keeping the structure as a variable.


def _plain(tree: VT) -> Any:
    """``tree`` as nested tuples and lists of its leaf variables, or ``None`` when it has
    any other node (Note [pytrees read without tracing])."""
    from torch._dynamo.variables import ListVariable, TupleVariable

    tree = tree.realize()
    # exactly a tuple or a list: a named tuple's variable is a TupleVariable too
    if isinstance(tree, (TupleVariable, ListVariable)) and type(tree) in (TupleVariable, ListVariable):
        children = [_plain(item) for item in tree.items]
        if any(child is None for child in children):
            return None
        return tuple(children) if type(tree) is TupleVariable else children
    if tree.is_tensor() or isinstance(tree, SymNodeVariable):
        return _Leaf(tree)
    if isinstance(tree, ConstantVariable) and type(tree.value) in (bool, int, float, complex, str):
        return _Leaf(tree)
    return None


class _Leaf:
    """A leaf variable held in a plain tree (torch's pytree takes any other object as a leaf)."""

    __slots__ = ("vt",)

    def __init__(self, vt: VT) -> None:
        self.vt = vt


def flatten(tx: Any, tree: VT) -> tuple[list[VT], Spec]:
    """Leaves and structure of a pytree of variables (torch.utils._pytree's order)."""
    plain = _plain(tree)
    if plain is not None:
        leaves, spec = pytree.tree_flatten(plain)
        return [leaf.vt for leaf in leaves], spec
    leaves_vt, spec_vt = items(tx, _make_inlined(tx, pytree.tree_flatten)(tree))
    return items(tx, leaves_vt), spec_vt


def flatten_plain(trees: Sequence[VT]) -> tuple[list[VT], pytree.TreeSpec] | None:
    """Leaves and structure of the list ``trees`` when every tree in it is plain (Note
    [pytrees read without tracing]), else ``None``."""
    plain = [_plain(tree) for tree in trees]
    if any(p is None for p in plain):
        return None
    leaves, spec = pytree.tree_flatten(plain)
    return [leaf.vt for leaf in leaves], spec


def python_spec(spec: Spec) -> pytree.TreeSpec:
    """The :class:`~torch.utils._pytree.TreeSpec` a :data:`Spec` stands for."""
    if isinstance(spec, pytree.TreeSpec):
        return spec
    made: pytree.TreeSpec = spec.as_python_constant()
    return made


def unflatten(tx: Any, leaves: Sequence[VT], spec: Spec) -> VT:
    """The pytree of variables with structure ``spec`` and these leaves."""
    if rebuilds(spec):
        made: VT = SourcelessBuilder.create(tx, pytree.tree_unflatten(list(leaves), spec))
        return made
    spec_vt = spec if isinstance(spec, VT) else SourcelessBuilder.create(tx, spec)
    return _make_inlined(tx, pytree.tree_unflatten)(SourcelessBuilder.create(tx, list(leaves)), spec_vt)


_REBUILT = (tuple, list, dict, collections.OrderedDict, collections.namedtuple)


def rebuilds(spec: Spec) -> TypeGuard[pytree.TreeSpec]:
    """Whether :func:`unflatten` builds ``spec``'s tree itself, from Python containers of
    variables: tuples, lists, dicts, ordered dicts and named tuples (whose variables
    Dynamo makes from such containers); any other structure stays a variable, for
    Dynamo's traced pytree code (Note [pytrees read without tracing])."""
    if not isinstance(spec, pytree.TreeSpec):
        return False
    return spec.is_leaf() or (spec.type in _REBUILT and all(rebuilds(c) for c in spec.children()))


def is_none(vt: VT) -> bool:
    return isinstance(vt, ConstantVariable) and vt.value is None


def without_none(leaves: Sequence[VT]) -> list[VT]:
    """``leaves`` less the ``None``s: Dynamo's pytree keeps ``None`` as a leaf, where hop's
    looping operators (and their checks) treat it as an empty subtree."""
    return [leaf for leaf in leaves if not is_none(leaf)]


def with_none(kept: Sequence[VT], pattern: Sequence[VT]) -> list[VT]:
    """``kept`` with a ``None`` put back wherever ``pattern`` has one (undoes :func:`without_none`)."""
    rest = iter(kept)
    out = [constant(None) if is_none(leaf) else next(rest) for leaf in pattern]
    if next(rest, None) is not None:
        raise AssertionError("more values than non-None leaves")
    return out


def drop_none_outputs(graph: torch.fx.Graph) -> None:
    """Remove the ``None``s a subgraph returns: hop's looping raw ops take only tensor and
    int outputs, and the handler puts the ``None``s back around the node's outputs."""
    out = next(n for n in graph.nodes if n.op == "output")
    (values,) = out.args
    if isinstance(values, (tuple, list)):
        out.args = (tuple(v for v in values if v is not None),)


BATCHED_EXAMPLE = "hop_batched_example"
"""The meta key of a subgraph placeholder's value under vmap, as the callable sees it
(``_dynamo_capture._unbatch_placeholders`` leaves the tensor under the batch wrappers
in ``example_value``)."""


def example(vt: VT) -> Any:
    """The value a leaf variable stands for: a fake tensor, a SymInt, a constant, or the object."""
    vt = vt.realize()
    if vt.is_tensor():
        meta = vt.as_proxy().node.meta
        return meta.get(BATCHED_EXAMPLE, meta["example_value"])
    if isinstance(vt, SymNodeVariable):
        return vt.sym_num
    if vt.is_python_constant():
        try:
            return vt.as_python_constant()
        except NotImplementedError:
            pass
    for attr in ("value", "fn"):
        if hasattr(vt, attr):
            return getattr(vt, attr)
    return vt


def shown(vt: VT) -> Any:
    """What a message saying ``got <type>`` names: a tensor is a ``Tensor`` (its example is
    a ``FakeTensor``)."""
    return torch.empty(0, device="meta") if vt.realize().is_tensor() else example(vt)


def example_tree(tx: Any, tree: VT) -> Any:
    """``tree`` with every leaf replaced by :func:`example`, for hop's eager checks."""
    leaves, spec = flatten(tx, tree)
    return pytree.tree_unflatten([example(leaf) for leaf in leaves], python_spec(spec))


def callable_stand_in(tx: Any, vt: VT) -> Any:
    """What hop's checks see for a function argument: the user's function (or a function
    with its code, so messages name it), or the value itself when it is not callable."""
    from torch._dynamo.variables.builtin import BuiltinVariable

    vt = vt.realize()
    if not BuiltinVariable(callable).call_function(tx, [vt], {}).as_python_constant():
        return example(vt)
    for attr in ("fn", "value"):
        obj = getattr(vt, attr, None)
        if callable(obj):
            return obj
    if hasattr(vt, "get_code"):  # a function made inside the compiled code
        code = vt.get_code()
        cells = tuple(types.CellType() for _ in code.co_freevars)
        return types.FunctionType(code, {}, code.co_name, None, cells)
    return _Traced()


class _Traced:
    """A callable Dynamo traces but whose Python object it does not have (a partial, ...)."""

    __qualname__ = "<callable traced by torch.compile>"

    def __call__(self, *args: Any) -> Any:
        raise AssertionError("a stand-in is never called")


def method(tx: Any, vt: VT, name: str, *args: Any) -> VT:
    """``vt.name(*args)`` recorded in the current graph (``args`` constants or variables)."""
    return vt.call_method(tx, name, [a if isinstance(a, VT) else constant(a) for a in args], {})


def fresh_input(tx: Any, value: Any) -> VT:
    """A variable whose example value is ``value`` (a fake tensor or SymInt), to trace a
    callable with: only its metadata is read, its graph input is discarded."""
    with discard_graph_changes(tx):
        tracer = tx.output.current_tracer
        for size in [value.shape[d] for d in unbound_dims(value)]:  # else Dynamo looks for them in the parent
            if size.node.expr not in tracer.bound_symbols:
                tracer.create_graph_input(str(size.node.expr), torch.SymInt, size)
        proxy = tracer.create_graph_input("hop_example", type(value), value)
        if isinstance(value, torch.SymInt):
            return SymNodeVariable.create(tx, proxy, value)
        return wrap_fx_proxy(tx, proxy, example_value=value)


def unbound_dims(value: Any) -> list[int]:
    """The dimensions of tensor ``value`` whose sizes are unbacked symbols of their own (a
    loop's generalized carry): no graph binds them, so a subgraph taking ``value`` must."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(value, torch.Tensor):
        return []
    return [
        d
        for d, s in enumerate(value.shape)
        if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol and free_unbacked_symbols(s)
    ]


def fresh(tx: Any, values: Sequence[Any]) -> list[VT]:
    """Variables standing for fresh copies of ``values`` (fake tensors, SymInts)."""
    with tx.fake_mode:
        copies = [v.clone() if isinstance(v, torch.Tensor) else v for v in values]
    return [fresh_input(tx, v) for v in copies]


def proxies(values: Sequence[VT]) -> list[Any]:
    return [v.as_proxy() for v in values]
