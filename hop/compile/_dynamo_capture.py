"""How hop's Dynamo handlers capture a callable, and the handler base (see :mod:`hop.compile.dynamo`).

A handler works on Dynamo's ``VariableTracker``s. To check a call it reads their
example values (fake tensors, SymInts, constants) and hands them to hop's own
eager checks, so that a mistake gives the message eager gives. To capture a
callable it runs Dynamo's ``speculate_subgraph``, which traces the callable into
a subgraph and lifts what it closes over (module parameters and buffers, other
tensors, sizes) to extra inputs. The node's output metadata comes from hop's own
fake rule (the node is run on fake tensors), so unified unbacked sizes, growing
carries and cloned aliases are hop's. What a handler reads of Dynamo's values is in
``hop.compile._dynamo_values``, how hop's errors become graph breaks in
``hop.compile._dynamo_errors``.

Everything here imports torch._dynamo: it is loaded only once Dynamo is.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, cast

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.exc import Unsupported
from torch._dynamo.utils import get_fake_value
from torch._dynamo.variables import ConstantVariable, TupleVariable
from torch._dynamo.variables.builder import wrap_fx_proxy
from torch._dynamo.variables.higher_order_ops import (
    TorchHigherOrderOperatorVariable,
    make_attr,
    speculate_subgraph,
)
from torch._dynamo.variables.lazy import LazyVariableTracker
from torch._dynamo.variables.lists import BaseListVariable
from torch._dynamo.variables.tensor import SymNodeVariable

from hop import _decomposed, _effects, _observe
from hop._observe_traced import captured
from hop._transforms import DYNAMO_CALL, batched_inside
from hop.compile._dynamo_errors import hop_errors_break_graph, unsupported, untraceable
from hop.compile._dynamo_values import (
    BATCHED_EXAMPLE,
    VT,
    Spec,
    constant,
    example,
    flatten,
    flatten_plain,
    items,
    python_spec,
    rebuilds,
    unflatten,
)
from hop.compile._functorch_levels import current_level, levels_from_nesting
from hop.errors import HopError

__all__ = [
    "HopVariable",
    "Subgraph",
    "UnhandledVariable",
    "bare_single_output",
    "check_spec_order",
    "compiles_with_inductor",
    "drop_constant_inputs",
    "emit",
    "install",
    "output_items",
    "share_lifted",
    "speculate",
]


def compiles_with_inductor(tx: Any) -> bool:
    """Whether the graph being captured goes to Inductor (``backend="inductor"``, or its
    ``compile_fx``): the backend, unwrapped from Dynamo's debug wrappers, names itself."""
    fn = tx.output.compiler_fn
    for _ in range(16):  # a short chain of wrappers; never loop on a cyclic one
        if getattr(fn, "compiler_name", None) in ("inductor", "compile_fx"):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


@dataclasses.dataclass
class Subgraph:
    """One callable traced by Dynamo: its graph, what it lifted, its flat outputs."""

    graph: torch.fx.Graph
    lifted: dict[torch.fx.Proxy, torch.fx.Proxy]  # parent value -> placeholder
    outputs: list[VT]  # flat, in torch.utils._pytree's order
    spec: Spec  # the structure of what the callable returned

    def out_spec(self) -> pytree.TreeSpec:
        return python_spec(self.spec)


# Note [values a subgraph reads stay readable]
# Dynamo caches the variable it builds for what traced code reads, by source, for the
# rest of the frame. Under dynamic shapes a global float (``1 - EPS``) becomes a graph
# input and the float read is its ``.item()``, which torch before 2.15 emits in the
# graph being traced: when that is a subgraph (a branch, a loop body), the cached
# variable is a node of that subgraph, and the next read from anywhere else, the other
# branch of a cond (torch.cond fails alike there), a loop's cond_fn after its body_fn, or
# the second trace of a callable whose first one failed (Note [int carries in a traced
# condition], hop.ops.while_loops.while_loop), cannot lift it: ``lift_tracked_freevar_to_input
# should not be called on root SubgraphTracer``. torch 2.15 emits that ``.item()`` in
# the root graph; after each subgraph hop traces, a float it read first is read again
# so, in the root graph, where every later subgraph lifts it from. Any other variable
# the subgraph cached that lives in it is dropped, to be built again where it is read.


@contextmanager
def reads_kept_in_root(tx: Any) -> Iterator[None]:
    """Note [values a subgraph reads stay readable]."""
    out = tx.output
    cache, before = out.variable_tracker_cache, dict(out.variable_tracker_cache)
    try:
        yield
    finally:
        for source in [k for k in cache if k not in before]:
            vt = cache[source]
            if type(vt) is LazyVariableTracker and not vt.is_realized():
                continue  # never read (reading its attributes would build it, and guard it)
            proxy = getattr(vt, "proxy", None)  # tensors' and symbolic numbers' variables
            if not isinstance(proxy, torch.fx.Proxy) or proxy.tracer is out.root_tracer:
                continue
            read = out.unspec_variable_map.get(source.name)
            if isinstance(vt, SymNodeVariable) and read is not None:
                item = out.root_tracer.create_proxy("call_method", "item", (read.as_proxy(),), {})
                cache[source] = wrap_fx_proxy(tx, item)
            else:
                del cache[source]


class _Flat(VT):
    """``fn`` as hop has Dynamo trace it: taking the leaves of its arguments when
    ``in_spec`` gives their structure, and, when ``flat_out``, returning the leaves of
    its result, whose structure it keeps in ``out_spec`` (Note [pytrees read without
    tracing])."""

    def __init__(self, fn: VT, in_spec: Spec | None, flat_out: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fn = fn
        self.in_spec = in_spec
        self.flat_out = flat_out
        self.out_spec: pytree.TreeSpec | None = None

    def call_function(self, tx: Any, args: Sequence[VT], kwargs: dict[str, VT]) -> VT:
        if self.in_spec is not None:
            args = items(tx, unflatten(tx, args, self.in_spec))
        result: VT = self.fn.call_function(tx, list(args), kwargs)
        if not self.flat_out:
            return result
        leaves, spec = flatten(tx, result)
        self.out_spec = python_spec(spec)  # a variable made here dies with the subgraph's side effects
        flat: VT = TupleVariable(list(leaves))
        return flat


def speculate(tx: Any, op: Any, role: str, fn: VT, args: Sequence[VT]) -> Subgraph:
    """Trace ``fn(*args)`` into a subgraph taking the leaves of ``args`` then what it lifts."""
    sub = _speculate(tx, op, role, fn, args, flat_out=True)
    if not rebuilds(sub.spec):  # Note [pytrees read without tracing]: Dynamo's pytree code must rebuild it
        sub = _speculate(tx, op, role, fn, args, flat_out=False)
    return sub


def _speculate(tx: Any, op: Any, role: str, fn: VT, args: Sequence[VT], flat_out: bool) -> Subgraph:
    name = op.__name__
    sub_args = list(args)
    inputs: Literal["flatten_manual", "manual"] = "flatten_manual"
    plain = flatten_plain(args)
    if plain is not None:  # Note [pytrees read without tracing]: Dynamo need not flatten them
        sub_args, inputs = plain[0], "manual"
    flat = _Flat(fn, None if plain is None else plain[1], flat_out)
    base = current_level()  # Note [a captured graph finds its transform levels at run time]
    try:
        with reads_kept_in_root(tx):  # Note [values a subgraph reads stay readable]
            (out, out_spec), graph, lifted = speculate_subgraph(
                tx,
                flat,
                sub_args,
                {},
                f"hop.{name} {role}",
                source_target=op,
                set_subgraph_inputs=inputs,
                should_flatten_outputs=not flat_out,
                remove_consts_from_outputs=False,
                supports_input_mutation=True,
                supports_aliasing=True,
            )
    except Unsupported as e:
        if isinstance(e, HopError):  # a nested operator's own error
            raise
        raise untraceable(name, role, e) from e
    except RuntimeError as e:
        # Dynamo lifts a tensor that requires grad (a module parameter) into the subgraph
        # with requires_grad_(), which functorch forbids inside its transforms: strict
        # export of torch.vmap over the operator (torch's own cond fails alike)
        if "inside of a function being transformed by a functorch transform" not in str(e):
            raise
        raise unsupported(
            name,
            f"{role}, which reads a tensor that requires grad (a module parameter) under torch.vmap,",
            fix="Export without strict=True (non-strict export, the default, captures it), or pass the "
            "parameters to the operator as operands.",
        ) from e
    # a write to an input stays in the subgraph: the call's first hop frame makes it pure
    # when AOTAutograd traces the node (Note [state inside control flow] in hop._state)
    effect = _effects.untokened_effect(graph)
    if effect is not None:
        raise unsupported(
            name,
            f"{role} calling {effect}, an op with an ordered side effect that hop's subgraphs cannot order,",
            fix=f"Call {effect} outside the operator, or outside the compiled function.",
        )
    _unbatch_placeholders(graph)
    levels_from_nesting(graph, base)
    spec = flat.out_spec if flat_out else cast(VT, out_spec.treespec)  # a variable, despite its annotation
    assert spec is not None, "speculate_subgraph returned without calling the callable"
    return Subgraph(graph, dict(lifted), items(tx, out), spec)


def _unbatch_placeholders(graph: torch.fx.Graph) -> None:
    """Under vmap a placeholder's example value is a BatchedTensor (under ``vmap(grad)``, a
    grad wrapper of one), from which Dynamo's runtime-assert pass cannot read a symbolic
    size (no batching rule for sym_size): keep the tensor under the wrappers, whose sizes
    include the batch's. The wrapped value stays as ``BATCHED_EXAMPLE``: a callable that
    returns its input as it is returns that placeholder, which hop's checks read as the
    user sees it."""
    for node in graph.find_nodes(op="placeholder"):
        _unbatch_placeholder(node)


def _unbatch_placeholder(node: torch.fx.Node) -> None:
    """One placeholder of :func:`_unbatch_placeholders`."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor) and batched_inside(value):
        node.meta[BATCHED_EXAMPLE] = value
        while torch._C._functorch.is_functorch_wrapped_tensor(value):
            value = torch._C._functorch.get_unwrapped(value)
        node.meta["example_value"] = value


def drop_constant_inputs(graph: torch.fx.Graph, leaves: Sequence[VT]) -> list[VT]:
    """Remove the placeholders Dynamo made for Python constants among ``leaves`` (the
    constant is baked into the graph, as hop's own tracing binds ints), keeping the rest."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][: len(leaves)]
    kept = []
    for node, leaf in zip(placeholders, leaves, strict=True):
        if leaf.is_python_constant() and not node.users:
            graph.erase_node(node)
        else:
            kept.append(leaf)
    return kept


def share_lifted(subgraphs: Sequence[Subgraph], inputs: Sequence[torch.fx.Proxy] = ()) -> list[torch.fx.Proxy]:
    """Give every subgraph the same lifted inputs, in one order; their parent values.

    ``inputs``: the parent values of each subgraph's own inputs, when all take the same.
    A lifted value that is one of them (a branch returning a tensor it closes over that
    is also an operand) is read from that input instead: a node taking one value twice
    gets two subgraph inputs of one name from torch.export's placeholder naming."""
    own_of = {p.node: k for k, p in enumerate(inputs)}
    union: dict[torch.fx.Proxy, None] = {}
    for sub in subgraphs:
        _read_lifted_inputs(sub, own_of)
        union.update(dict.fromkeys(sub.lifted))
    for sub in subgraphs:
        graph = sub.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        own = placeholders[: len(placeholders) - len(sub.lifted)]
        ordered = []
        for parent in union:
            if parent in sub.lifted:
                ordered.append(sub.lifted[parent].node)
                continue
            with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
                node = graph.placeholder(_unused_input_name(graph, parent.node.name))
            # the parent's value under vmap is a BatchedTensor: unwrapped as the subgraph's
            # own placeholders were, or Dynamo's runtime-assert pass, binding a size symbol
            # only this input carries (one specialized before the subgraph was traced), reads
            # it with sym_size, which has no batching rule (a cond whose other branch closes
            # over the tensor, compiled with dynamic=True)
            node.meta = dict(parent.node.meta)
            _unbatch_placeholder(node)
            ordered.append(node)
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        for node in [*own, *ordered]:
            anchor.prepend(node)
        graph.lint()
    return list(union)


def _read_lifted_inputs(sub: Subgraph, own_of: dict[torch.fx.Node, int]) -> None:
    """Drop ``sub``'s lifted inputs whose parent value is one of its own inputs (``own_of``:
    parent node -> position), its uses reading that input instead."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    own = placeholders[: len(placeholders) - len(sub.lifted)]
    if len(own) != len(own_of):
        return
    for parent in [p for p in sub.lifted if p.node in own_of]:
        lifted = sub.lifted.pop(parent).node
        lifted.replace_all_uses_with(own[own_of[parent.node]])
        sub.graph.erase_node(lifted)


def _unused_input_name(graph: torch.fx.Graph, name: str) -> str:
    """``name``, or ``name_<k>`` if an input of ``graph`` has it: FX names a placeholder's
    argument by its target, so two equal targets make code that does not compile (a
    branch that returns a tensor it closes over which is also an operand)."""
    taken = {n.target for n in graph.nodes if n.op == "placeholder"}
    fresh, k = name, 0
    while fresh in taken:
        k += 1
        fresh = f"{name}_{k}"
    return fresh


def bare_single_output(graph: torch.fx.Graph, *, tensors_only: bool = True) -> None:
    """A subgraph with one output returns it bare: hop's raw-op convention for a
    branch's lone tensor (a 1-tuple does not survive torch.export's save/load), and
    what a loop condition returns."""
    out = next(n for n in graph.nodes if n.op == "output")
    (values,) = out.args
    if not isinstance(values, (tuple, list)) or len(values) != 1:
        return
    value = values[0]
    if not tensors_only or isinstance(getattr(value, "meta", {}).get("example_value"), torch.Tensor):
        out.args = (value,)


def install(tx: Any, name: str, graph: torch.fx.Graph) -> torch.fx.Proxy:
    """Register ``graph`` as a submodule of the graph being built; a get_attr to it."""
    graph.lint()
    gm = torch.fx.GraphModule(dict(tx.output.nn_modules), graph)
    return make_attr(tx, tx.output.install_subgraph(name, gm))


def emit(tx: Any, op: Any, args: tuple[Any, ...]) -> VT:
    """Record ``op(*args)`` and its output, whose metadata hop's own fake rule gives."""
    proxy = tx.output.create_proxy("call_function", op, args, {})
    with hop_errors_break_graph():
        value = get_fake_value(proxy.node, tx)
    if _observe.SINKS or _observe.structured_on():
        modules = tx.output.nn_modules
        graphs = [modules.get(a.node.target) for a in args if isinstance(a, torch.fx.Proxy) and a.node.op == "get_attr"]
        captured(op.name(), [g for g in graphs if isinstance(g, torch.fx.GraphModule)])
    return wrap_fx_proxy(tx, proxy, example_value=value)


def output_items(out: VT) -> list[VT]:
    """The flat outputs of a node that returns a bare value for one leaf, else a tuple."""
    return list(out.items) if isinstance(out, BaseListVariable) else [out]


def check_spec_order(op: str, specs: Sequence[pytree.TreeSpec], what: str) -> None:
    """Dynamo flattens a dict in insertion order (hop's eager checks sort keys): the same
    keys in another order would pair the wrong leaves, so that is refused."""
    if any(not _same_dict_order(specs[0], spec) for spec in specs[1:]):
        raise unsupported(
            op,
            f"{what} with dicts whose keys come in different orders",
            fix="Build the dicts with their keys in the same order.",
        )


def _same_dict_order(a: pytree.TreeSpec, b: pytree.TreeSpec) -> bool:
    if a.num_children != b.num_children:
        return True  # a different structure, which hop's own checks report
    if a.type is dict and b.type is dict and a.context != b.context:
        return False
    return all(_same_dict_order(x, y) for x, y in zip(a.children(), b.children(), strict=True))


class HopVariable(TorchHigherOrderOperatorVariable):
    """Dynamo's view of a call of one of hop's raw ops: as written in the program, or
    made by a public function (Note [public functions under Dynamo] in hop._transforms)."""

    _HOP_NAME = "hop"
    # Unlike torch's control-flow handlers: a graph break here is not an error, the call
    # then runs eagerly (with fullgraph=True, Dynamo raises it).
    _ALLOW_FALLBACK_TO_EAGER = True
    # the keywords raw_call takes (while_loop's checkpoint, Note [the checkpoint keyword])
    _RAW_KEYWORDS: frozenset[str] = frozenset()

    def _call_function(self, tx: Any, args: Sequence[VT], kwargs: dict[str, VT]) -> VT:
        args, kwargs = LazyVariableTracker.realize_all((list(args), dict(kwargs)))
        with hop_errors_break_graph():
            if args and isinstance(args[0], ConstantVariable) and args[0].value == DYNAMO_CALL:
                public = example(args[1])
                bound = inspect.signature(public).bind(*args[2:], **kwargs)
                bound.apply_defaults()
                params = {name: _as_variable(value) for name, value in bound.arguments.items()}
                return self.public_call(tx, public.__name__, params)
            if kwargs.keys() - self._RAW_KEYWORDS:
                name = self.value.__name__
                raise unsupported(name, "a raw operator call with keyword arguments", fix="Pass them positionally.")
            if kwargs:
                return self.raw_call(tx, list(args), **kwargs)
            return self.raw_call(tx, list(args))

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        """``hop.<public>(**params)`` (``public`` is ``fori_loop`` for the while_loop op)."""
        raise NotImplementedError

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        """``torch.ops.hop.<op>(*args)``, in the raw op's layout."""
        raise NotImplementedError


def _as_variable(value: Any) -> VT:
    """A bound argument as a variable: defaults are Python values, ``*args`` a tuple."""
    if isinstance(value, VT):
        return value
    if isinstance(value, tuple):
        return TupleVariable([_as_variable(v) for v in value])
    return constant(value)


class UnhandledVariable(HopVariable):
    """A hop operator with no handler (one a user defined): Dynamo breaks the graph."""

    _HOP_NAME = "hop (user-defined operator)"

    def _call_function(self, tx: Any, args: Sequence[VT], kwargs: dict[str, VT]) -> VT:
        name = self.value.__name__
        raise unsupported(
            name,
            "a hop.HigherOrderOperator with no Dynamo handler (every user-defined one)",
            fix="Without fullgraph=True, Dynamo breaks the graph at the call and the operator runs eagerly.",
        )


class DecomposedVariable(HopVariable):
    """A user's operator defined by a decomposition (Note [an operator from its
    decomposition] in hop._decomposed): Dynamo inlines the decomposition, so the graph
    holds hop's operators, which every backend takes. A recorded node's call (from an
    exported program's module) inlines it with the node's closures bound back."""

    _HOP_NAME = "hop (user-defined operator)"

    def _call_function(self, tx: Any, args: Sequence[VT], kwargs: dict[str, VT]) -> VT:
        from torch._dynamo.variables.functions import UserFunctionVariable

        fn = cast(Any, self.value)._hop_decomposition.fn
        if _decomposed.CLOSURES in kwargs:
            args = [UserFunctionVariable(fn), *args]
            fn = _decomposed.node_call
        called: VT = UserFunctionVariable(fn).call_function(tx, list(args), dict(kwargs))
        return called
