"""``hop.while_loop`` and its raw op ``torch.ops.hop.while_loop``.

The raw op is ``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)``
(torch's layout): both functions take ``(*carried, *additional)``; additional
inputs are what the functions close over, lifted when traced. Rules in hop's
fixed order: dense, autograd, grad / jvp, vmap, functionalize, fake, proxy. The
mechanisms they call are modules of their own below this one: the checks
(``while_loops._checks``), the loops that run as Python (``while_loops._run``), int carries
when traced (``while_loops._int_carries``) and the autograd node (``while_loops._node``).

Note [loops run inline]
As for cond (Note [eager branches run inline]), a loop whose carries are real
tensors while nothing traces runs as plain Python at the current level:
autograd, grad, jvp see every iteration's ops (exact derivatives of any order,
O(iterations) memory, gradients to closed-over tensors). A condition batched by
an enclosing vmap is read element-wise: the loop runs while any element is
active and finished elements are frozen with ``torch.where`` (the masked loop),
so each element equals its own Python loop.

Compiled: Dynamo ``hop.compile._dynamo_while.WhileLoopVariable``; Inductor
``hop.compile.inductor._lower_while``; ONNX ``hop.compile._onnx_ops.translate_while_loop``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _effects, _observe, _reference, _spec, _tracing, _transforms
from hop import _validation as validation
from hop import subgraph as _subgraph
from hop._operator import HigherOrderOperator
from hop._unbacked_loops import generalize_carries
from hop.ops._common import (
    NOT_TAKEN,
    Vmapped,
    Writes,
    as_tuple,
    dense_carries,
    front,
    lower_vmap,
    no_alias,
    record_node,
    runs_inline,
    same_form,
    trace_callables,
)
from hop.ops.while_loops import _checkpoint, _node, _run
from hop.ops.while_loops import _checks as checks
from hop.ops.while_loops._checks import NAME as _NAME
from hop.ops.while_loops._int_carries import DERIVED, ints_as_tensors

__all__ = ["while_loop", "while_loop_op"]

Fn = Callable[..., Any]
_SINKS = _observe.SINKS


def while_loop(
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: tuple[Any, ...] | list[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    """Run ``body_fn`` while ``cond_fn`` holds; return the final carries.

    Equivalent Python::

        def reference_while_loop(cond_fn, body_fn, carried_inputs):
            carry = carried_inputs
            while cond_fn(*carry):
                carry = body_fn(*carry)
            return carry

    Args:
        cond_fn: ``(*carry) -> `` a Python bool or a one-element bool tensor.
        body_fn: ``(*carry) -> `` the next carry: the same pytree structure,
            with the same dtype, device and rank per tensor leaf (sizes may change
            between iterations: growing carries).
        carried_inputs: a tuple or list of pytrees of tensors, ints and SymInts.
        checkpoint: reverse mode with bounded memory: keep about sqrt(n) carries
            and recompute the iterations between them in the backward pass,
            instead of every iteration's carry or intermediates (eager, torch.func
            and traced; Note [reverse mode of a traced loop] in ``while_loops._reverse``).

    Eager calls run the Python loop (the functions are checked once per
    signature on fake tensors). Autograd, torch.func and vmap (also with a
    batched condition: the loop runs while any element is active, finished
    elements are frozen) work; make_fx and torch.export keep one
    ``torch.ops.hop.while_loop`` node, int carries becoming unbacked SymInts.
    """
    taken = front(
        _NAME,
        while_loop,
        while_loop_op,
        _reference.reference_while_loop,
        (cond_fn, body_fn, carried_inputs),
        checkpoint=checkpoint,
    )
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    checks.check_arguments(cond_fn, body_fn, carried_inputs)
    checks.check_arities(cond_fn, body_fn, carried_inputs)
    _checkpoint.check_flag(checkpoint)
    leaves, spec = _subgraph.flatten(tuple(carried_inputs))
    flat_cond, flat_body = checks.flat_functions(cond_fn, body_fn, spec)
    if _transforms.in_plain_eager() and all(map(_transforms.is_plain_leaf, leaves)):
        key = validation.signature(_NAME, (cond_fn, body_fn), tuple(carried_inputs), leaves, spec)
        if not validation.is_known(key):
            checks.validate(flat_cond, flat_body, leaves, (cond_fn, body_fn))
            validation.remember(key)
        if checkpoint:
            out = _checkpoint.run(flat_cond, flat_body, leaves, _subgraph.closure_tensors((cond_fn, body_fn)))
            return _subgraph.unflatten(list(out), spec)
        if _SINKS:  # count the trips
            cond_fn = _observe.counted(_NAME, cond_fn)
        return _run.run_eager(cond_fn, body_fn, carried_inputs, leaves)
    out = while_loop_op(flat_cond, flat_body, tuple(leaves), (), **_node.flag(checkpoint))
    return _subgraph.unflatten(list(as_tuple(out)) if len(leaves) != 1 else [out], spec)


def _inline_or_node(
    cond_fn: Fn,
    body_fn: Fn,
    carried: Sequence[Any],
    additional: Sequence[Any],
    checkpoint: bool,
    level: int | None = None,
) -> Any:
    """Autograd, grad and jvp: Note [loops run inline] when concrete, else one autograd node
    (always one under ``checkpoint=True``: its backward keeps about sqrt(n) carries)."""
    if checkpoint is not False:  # the raw op called directly: checkpoint="no" would read as true
        _checkpoint.check_flag(checkpoint)
    if runs_inline(carried, additional) and not checkpoint:
        return while_loop_dense(cond_fn, body_fn, carried, additional)
    return _node.as_node(while_loop_op, cond_fn, body_fn, carried, additional, checkpoint, level)


# --- the raw op and its rules -----------------------------------------------------------------


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if kwargs.get("checkpoint"):
        frame.detail = "checkpointed"


SPEC = _spec.register(
    _spec.OpSpec(
        name=_NAME,
        params=("cond_fn", "body_fn", "carried_inputs", "additional_inputs"),
        roles=("cond_fn", "body_fn"),
        # while_loop(cond_gm, body_gm, carries, additional): both read carries then additional
        layout=_spec.Layout(subgraphs=(0, 1), carries=2, inputs=3, body=1, condition=0),
        validates=True,
        describe=_describe,
    )
)

while_loop_op = HigherOrderOperator(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())


@while_loop_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def while_loop_dense(
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    out = _run.run(cond_fn, body_fn, carried_inputs, additional_inputs)
    return no_alias(same_form(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


@while_loop_op.py_autograd_impl
def while_loop_autograd(
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, checkpoint)


@while_loop_op.py_impl(TransformType.Grad)
def while_loop_grad(
    interpreter: Any,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, checkpoint, interpreter.level())


@while_loop_op.py_impl(TransformType.Jvp)
def while_loop_jvp(
    interpreter: Any,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, checkpoint, interpreter.level())


@while_loop_op.py_impl(TransformType.Vmap)
def while_loop_vmap(
    interpreter: Any,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    """Concrete: the masked loop inline. Traced: one loop a level down that runs while
    any element is active and freezes finished ones."""
    # Note [size reads in a vmapped graph]: both paths below run the callables on batched tensors
    cond_b, body_b = _tracing.per_element_sizes(cond_fn), _tracing.per_element_sizes(body_fn)
    if runs_inline(carried_inputs, additional_inputs):
        return while_loop_dense(cond_b, body_b, carried_inputs, additional_inputs)
    flag = _node.flag(checkpoint)

    def batched(values: list[list[Any]], dims: list[list[int | None]], size: int, vmapped: Vmapped) -> Any:
        (carried, extra), (c_dims, e_dims) = values, dims
        # an int carry (a fori_loop's counter) stays one int for the whole batch
        tensor = [isinstance(c, torch.Tensor) for c in carried]
        carried = [
            c if not t else c.movedim(d, 0) if d is not None else c.expand(size, *c.shape)
            for c, d, t in zip(carried, c_dims, tensor, strict=True)
        ]
        in_dims = tuple(0 if t else None for t in tensor) + tuple(e_dims)
        plain: list[Any] = []

        def tensor_cond(*args: Any) -> Any:
            pred = cond_b(*args)
            if isinstance(pred, torch.Tensor):
                return pred
            plain[:] = [pred]  # a bool of int carries: unbatched, the same for every element
            return torch.ones((), dtype=torch.bool)

        vcond = vmapped(tensor_cond, in_dims)

        def any_active(*args: Any) -> Any:
            pred = vcond(*args)
            return plain.pop() if plain else pred.reshape(size).any()

        def step(*args: Any) -> tuple[Any, ...]:
            active = cond_b(*args)
            if not _run.batched_here(active):  # every element steps: no mask
                return _run.checked_step(body_b, args[:n], args[n:])
            # Note [finished elements are not differentiated]; an int carry must not change
            return _run.active_step(active, body_b, args[:n], args[n:])

        n = len(carried)
        masked_body = vmapped(step, in_dims, tuple(0 if t else None for t in tensor))

        return lambda: while_loop_op(any_active, masked_body, tuple(carried), tuple(extra), **flag), lambda k: 0

    return lower_vmap(
        interpreter,
        [carried_inputs, additional_inputs],
        lambda c, a: while_loop_op(cond_fn, body_fn, tuple(c), tuple(a), **flag),
        batched,
    )


@while_loop_op.py_functionalize_impl
def while_loop_functionalize(
    ctx: Any,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    args = (cond_fn, body_fn, carried_inputs, additional_inputs)
    return _effects.functionalize_rule(while_loop_op, SPEC, ctx, args, _node.flag(checkpoint))


@while_loop_op.py_impl(FakeTensorMode)
def while_loop_fake(
    mode: FakeTensorMode,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    """The final carry: what stays fixed across iterations keeps its size; what changes
    (int carries, growing dimensions) becomes a fresh unbacked size."""
    with mode:
        out = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), mode.shape_env, fresh=True
        )
    return no_alias(same_form(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


_WRITES = Writes("carry", "carries", "Return the new carry from body_fn instead of writing the old one.")


@while_loop_op.py_impl(ProxyTorchDispatchMode)
def while_loop_proxy(
    mode: ProxyTorchDispatchMode,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    """Trace cond and body on carries generalized to every iteration's sizes; one node
    (with ``checkpoint=True`` only where it was asked for: other graphs stay as they were)."""
    dense = dense_carries(mode, carried_inputs)  # Note [a traced loop's carries are dense]
    if dense is not None:
        with mode:
            return while_loop_op(cond_fn, body_fn, dense, tuple(additional_inputs), **_node.flag(checkpoint))
    fake_mode = torch._guards.detect_fake_mode([*carried_inputs, *additional_inputs])
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    if shape_env is not None and any(type(c) is int for c in carried_inputs):
        return ints_as_tensors(
            functools.partial(while_loop_op, **_node.flag(checkpoint)),
            mode,
            cond_fn,
            body_fn,
            carried_inputs,
            additional_inputs,
        )
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        templates = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), shape_env, fresh=False
        )
        # Note [bodies are traced on values they can see] (hop._tracing)
        templates = tuple(_subgraph.trace_example(t) for t in templates)
    (cond_graph, body_graph), lifted = trace_callables(
        _NAME,
        ["cond_fn", "body_fn"],
        [cond_fn, body_fn],
        (*templates, *additional_inputs),
        _WRITES,
        checked=[False, True],  # cond_fn has its own check
    )
    checks.check_cond_graph(cond_graph, cond_fn)
    extra = (*additional_inputs, *lifted)
    flag = _node.flag(checkpoint)
    return record_node(
        mode,
        _NAME,
        while_loop_op,
        (cond_graph, body_graph, tuple(carried_inputs), extra),
        lambda: while_loop_op(cond_graph, body_graph, tuple(carried_inputs), extra, **flag),
        kwargs=flag,
        root="carry",
        why=DERIVED,
        tupled=True,
    )
