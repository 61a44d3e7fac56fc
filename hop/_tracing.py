"""Tracing a callable into an ``fx.GraphModule``, and recording a hop call in the active trace.

:func:`trace_subgraph` traces at the current make_fx level (re-entering the active
tracer, or under a fresh fake mode); :func:`trace_example` and
:func:`unknown_value` make the values a loop body is traced on; :func:`emit`
records a call of a hop operator in the active proxy tracer's graph, with its
subgraphs as get_attr submodules. What a traced branch closes over is lifted by
``hop._lifting``, on top of this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._functorch.predispatch
import torch.fx
import torch.fx.node
import torch.utils._pytree as py_pytree

from hop import _observe, _state
from hop._observe_traced import traced_node
from hop._transforms import is_plain_tensor
from hop.errors import MutationError, format_message

__all__ = ["emit", "keeping_node_meta", "per_element", "trace_example", "trace_subgraph", "unknown_value"]


# Note [functorch's levels survive dead-code elimination]
# A transform inside a callable, traced by torch.export's pre-dispatch trace, is
# recorded as calls that enter and leave functorch's levels (``_vmap_increment_nesting``
# ...), whose results nothing reads. fx's dead-code elimination keeps them in the top
# graph (export passes its own purity test) but applies the default test to the
# subgraphs it recurses into, and drops them there: the subgraph then adds a batch
# dimension at a level that is never entered, and fails when it runs. They are side
# effects on functorch's state, registered as such once, and given the ``val`` that
# export's verifier asks of every node (None, as export gives them in the top graph).
_LEVEL_CALLS = []
for _name in (
    "_vmap_increment_nesting",
    "_vmap_decrement_nesting",
    "_jvp_increment_nesting",
    "_jvp_decrement_nesting",
    "_enter_dual_level",
    "_exit_dual_level",
):
    _fn = getattr(torch._functorch.predispatch, _name, None)
    if _fn is not None:
        _LEVEL_CALLS.append(torch.fx.node.has_side_effect(_fn))


def trace_subgraph(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` into a GraphModule at the current level.

    Under make_fx (and so torch.export), the active tracer's sub-tracer is
    re-entered: it shares the fake mode, the ShapeEnv and the decomposition
    table. Otherwise ``fn`` is traced by a fresh make_fx under the inputs' fake
    mode (or a new one).
    """
    from torch.fx.experimental import proxy_tensor

    fn = _as_user_code(keeping_node_meta(fn))
    tracer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    if tracer is not None:
        gm: torch.fx.GraphModule = tracer.trace_subgraph(fn, *[per_element(a) for a in args])
        for node in gm.graph.find_nodes(op="placeholder"):
            if isinstance(node.meta.get("val"), torch.Generator):
                node.meta["val"] = object_val(node.name, node.meta["val"])
        for target in _LEVEL_CALLS:  # Note [functorch's levels survive dead-code elimination]
            for node in gm.graph.find_nodes(op="call_function", target=target):
                node.meta.setdefault("val", None)
        return gm
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(list(args))
    if fake_mode is None:
        return proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
    with fake_mode:
        return proxy_tensor.make_fx(fn, tracing_mode="real")(*args)


def _as_user_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run as a user's code: an operator it calls starts a call of its own
    (Note [state inside control flow] in ``hop._state``), and ``self.count += 1``
    writes the buffer in place without torch.export taking the write for a new
    buffer of the top graph (:func:`_buffer_writes_in_place`)."""

    def user(*args: Any) -> Any:
        with _state.user_code(), _buffer_writes_in_place(), _one_pre_dispatch_mode():
            return fn(*args)

    user.__wrapped__ = fn  # type: ignore[attr-defined]
    return user


@contextlib.contextmanager
def _one_pre_dispatch_mode() -> Iterator[None]:
    """Note [a subgraph's pre-dispatch mode]: under torch.export's pre-dispatch trace,
    the sub-tracer of a subgraph pushes a torch-function mode of its own that records
    what must survive pre-dispatch (grad mode, vmap's levels) in the subgraph; the
    export's mode, still below it, would record the same calls in the outer graph, and
    ``torch.vmap`` inside a callable fails torch's check that there is one such mode.
    While the callable runs, the stack keeps only the innermost."""
    from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode

    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    pre = [m for m in stack if isinstance(m, PreDispatchTorchFunctionMode)]
    if len(pre) < 2:
        yield
        return
    for _ in stack:
        torch._C._pop_torch_function_stack()
    kept = [m for m in stack if m is pre[-1] or not isinstance(m, PreDispatchTorchFunctionMode)]
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _buffer_writes_in_place() -> Iterator[None]:
    """While a subgraph is traced, module buffer registration hooks (torch.export's, which
    map a buffer assigned in ``forward`` to the node it must be copied from) see no
    assignment of a buffer's own tensor, as an augmented assignment (``self.count += 1``)
    makes: the in-place write is the subgraph's, made pure by its operator. Assigning
    another tensor to a buffer inside a callable would lose it once traced: refused."""
    import torch.nn.modules.module as nn_module

    hooks = nn_module._global_buffer_registration_hooks
    if not hooks:
        yield
        return
    saved = dict(hooks)

    def in_place_only(module: torch.nn.Module, name: str, buffer: Any) -> Any:
        if name not in module._buffers:  # a new buffer (a tracer's constant): as before
            for hook in saved.values():
                out = hook(module, name, buffer)
                buffer = buffer if out is None else out
            return buffer
        if module._buffers[name] is not buffer:
            raise MutationError(
                format_message(
                    "subgraph",
                    f"a callable assigns a new tensor to the buffer {name!r} of a {type(module).__name__}; "
                    "an assignment inside an operator's callable cannot be traced",
                    fix=f"Write the buffer in place instead (self.{name}.copy_(value)).",
                )
            )
        return None

    hooks.clear()
    hooks[-1] = in_place_only
    try:
        yield
    finally:
        hooks.clear()
        hooks.update(saved)


def object_val(name: str, value: Any) -> Any:
    """A subgraph placeholder's ``val`` for a ``torch.Generator`` operand: what torch.export
    gives a generator input of a program (its verifier and serializer read it)."""
    from torch.export.graph_signature import CustomObjArgument

    kind = type(value)
    return CustomObjArgument(name, f"{kind.__module__}.{kind.__qualname__}")


# Note [pre-dispatch subgraphs see per-element values]
# Under torch.export's pre-dispatch trace (non-strict export, and strict export's
# re-trace of Dynamo's graph) a hop call inside ``torch.vmap`` is recorded before
# vmap's rule runs: the operands are batched tensors, and the subgraph records the
# program of one element (vmap applies again when the program runs). A batched value
# cannot be a subgraph's placeholder: binding one of its symbolic sizes needs
# ``sym_size`` of it, which has no batching rule. The callable is traced on fresh
# plain fake tensors of the operand's per-element metadata instead, and a batched
# value it closes over gets such a tensor as its placeholder's example.


def per_element(value: Any) -> Any:
    """A plain fake tensor of one element's metadata for a vmap-batched fake ``value``
    (Note [pre-dispatch subgraphs see per-element values]); anything else as it is."""
    from torch._subclasses.fake_tensor import FakeTensor

    if (
        not isinstance(value, torch.Tensor)
        or not torch._C._functorch.is_batchedtensor(value)
        or value.requires_grad  # a functorch transform refuses requires_grad_: leave it be
    ):
        return value
    inner = value
    while torch._C._functorch.is_functorch_wrapped_tensor(inner):
        inner = torch._C._functorch.get_unwrapped(inner)
    if not isinstance(inner, FakeTensor):
        return value
    with inner.fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


# Note [re-traced subgraphs keep their node meta]
# Re-tracing a captured program under torch.fx.traceback.preserve_node_meta() (as
# AOTAutograd does, and users who re-run make_fx) copies each node's stack_trace,
# source_fn_stack and nn_module_stack from the node being run to the nodes it
# produces; that needs the graph run node by node by an fx.Interpreter. A body that
# is already a GraphModule (an operator's argument in the program) is run that way,
# or its nodes would point at hop's rule instead of the user's line.


def keeping_node_meta(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run by an fx.Interpreter if it is a GraphModule and node meta is preserved."""
    if not isinstance(fn, torch.fx.GraphModule) or not torch.fx.traceback.has_preserved_node_meta():
        return fn
    graph_module = fn

    def interpreted(*args: Any) -> Any:
        with torch.fx.traceback.preserve_node_meta():
            return torch.fx.Interpreter(graph_module).run(*args)

    interpreted.__wrapped__ = graph_module  # type: ignore[attr-defined]  # names it in errors
    return interpreted


# Note [size reads in a vmapped graph]
# A graph Dynamo captured reads its inputs' sizes with ``aten.sym_size.int``: it binds
# each size symbol of an input that way, whether the graph uses it or not (the fresh
# unbacked size of a while_loop carry generalized across iterations), and hop's own
# captures bind sizes alike. Under vmap such a graph runs on batched tensors (in a vmap
# rule, and in a loop's fixpoint under export's pre-dispatch trace), where that op has
# no batching rule ("Batching rule not implemented for aten::sym_size.int"). The graph
# reads the value it sees, one element's, whose sizes a batched tensor reports without
# a dispatch: such a graph is run as a copy whose reads call ``Tensor.size(d)`` (the
# same value on any other tensor).
def _size(t: torch.Tensor, d: int) -> Any:
    return t.size(d)


def _stride(t: torch.Tensor, d: int) -> Any:
    return t.stride(d)


def _numel(t: torch.Tensor) -> Any:
    return t.numel()


_SIZE_READS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.sym_size.int: _size,
    torch.ops.aten.sym_stride.int: _stride,
    torch.ops.aten.sym_numel.default: _numel,
}


def per_element_sizes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or for a graph that reads sizes with ``sym_size`` and the like, a copy of
    it whose reads are valid on batched tensors (Note [size reads in a vmapped graph])."""
    if not isinstance(fn, torch.fx.GraphModule) or not any(
        n.op == "call_function" and n.target in _SIZE_READS for n in fn.graph.nodes
    ):
        return fn
    graph = torch.fx.Graph(owning_module=None, tracer_cls=fn.graph._tracer_cls)
    graph._codegen = fn.graph._codegen
    graph.output(graph.graph_copy(fn.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SIZE_READS:
            node.target = _SIZE_READS[node.target]
    copy = torch.fx.GraphModule(fn, graph, class_name=type(fn).__name__)
    copy.meta = fn.meta
    if "__wrapped__" in fn.__dict__:  # the function it names in errors
        copy.__wrapped__ = fn.__dict__["__wrapped__"]
    return copy


# Note [bodies are traced on values they can see]
# A loop body is traced on fresh tensors, never on the carries themselves (a body
# may also read the loop's initial tensor through a closure, and two carries must
# not alias). Fake and meta values carry no data: an empty tensor serves. Under
# make_fx(tracing_mode="real") the body's ops run for real while it is traced, and
# so does a loop nested in it: on uninitialized memory its trip count would be
# arbitrary (tracing could hang). A real value is therefore copied: the carry the
# loop starts from (the first slice, for a scan) is what the first iteration sees.


def trace_example(value: Any) -> Any:
    """A fresh contiguous tensor standing for ``value`` while a loop body is traced
    (Note [bodies are traced on values they can see]); non-tensors are returned as is."""
    if not isinstance(value, torch.Tensor):
        return value

    if is_plain_tensor(value):  # real data
        return value.detach().clone(memory_format=torch.contiguous_format)
    return unknown_value(value.new_empty(value.shape))


def traced_layout(value: Any) -> Any:
    """``value``, or for a tensor whose strides are not contiguous ones (transposed,
    channels-last, a (n, 1) slice of stride (1, n)) a fresh contiguous one of its
    metadata: what a traced body is run on for its output metadata.

    Bodies are traced on contiguous values, and a traced body is run on contiguous
    ones (Note [traced bodies see contiguous values] in hop.ops.scanning._rules): the graph
    bakes the layout in (``reshape`` became ``view``, which another layout cannot
    take). Size-1 dims with other strides count too: run on them, a body whose
    branches return a carry beside a new tensor would give torch's cond (which
    Inductor's rewrite of a switch or cond makes) branch outputs whose stride orders
    differ, which it refuses."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided or value.dim() == 0:
        return value
    expected: Any = 1
    for size, stride in reversed(list(zip(value.shape, value.stride(), strict=True))):
        if not statically_known_true(stride == expected):
            return value.new_empty(value.shape)
        expected = expected * size
    return value


def unknown_value(value: Any) -> Any:
    """``value``, or for a fake tensor whose value FakeTensorMode knows (a one-element
    literal's, such as a counter's ``torch.tensor(0)``, or what such a value propagated
    to) a fresh one of its metadata that knows none.

    A loop's carries change between iterations: a body run or traced on a known value
    would bake that value in (``w[i]`` with the counter read as 0 every step), and
    FakeTensorMode propagates a known value through ``new_empty``/``empty_like`` as
    uninitialized memory, an arbitrary number."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(value, FakeTensor) or value.constant is None:
        return value
    fresh = value.new_empty(value.shape)
    assert isinstance(fresh, FakeTensor)  # made in value's fake mode
    fresh.constant = None
    return fresh


def emit(mode: Any, op: Any, args: Sequence[Any], out: Any, kwargs: dict[str, Any] | None = None) -> Any:
    """Record ``op(*args, **kwargs)`` in ``mode``'s graph and bind ``out`` to the new node.

    GraphModules in ``args`` (also inside lists and tuples) are registered as
    submodules of the tracer's root, so they appear as get_attr arguments.
    ``out`` is the value the call produces (from the fake rule).
    """
    tracer = mode.tracer

    def to_arg(a: Any) -> Any:
        if isinstance(a, torch.fx.GraphModule):
            name = tracer.get_fresh_qualname(f"{op.name()}_graph_")
            tracer.root.register_module(name, a)
            return a
        return tracer.unwrap_proxy(a)

    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    proxy_args = py_pytree.tree_map(to_arg, tuple(args))
    proxy_kwargs = py_pytree.tree_map(to_arg, dict(kwargs or {}))
    out_proxy = tracer.create_proxy("call_function", op, proxy_args, proxy_kwargs)
    if _observe.SINKS or _observe.structured_on():
        traced_node(op.name(), tuple(args))
    return track_tensor_tree(out, out_proxy, constant=None, tracer=tracer)
