"""``hop.while_loop`` and its raw op ``torch.ops.hop.while_loop``.

The raw op is ``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)``
(torch's layout): both functions take ``(*carried, *additional)``; additional
inputs are what the functions close over, lifted when traced. Rules in hop's
fixed order: dense, autograd, grad / jvp, vmap, functionalize, fake, proxy.

Note [loops run inline]
As for cond (Note [eager branches run inline]), a loop whose carries are real
tensors while nothing traces runs as plain Python at the current level:
autograd, grad, jvp see every iteration's ops (exact derivatives of any order,
O(iterations) memory, gradients to closed-over tensors). A condition batched by
an enclosing vmap is read element-wise: the loop runs while any element is
active and finished elements are frozen with ``torch.where`` (the masked loop),
so each element equals its own Python loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from hop import _observe, _observe_calls, _reference, _transforms
from hop import _validation as validation
from hop import subgraph as _subgraph
from hop._operator import HigherOrderOperator
from hop._unbacked import assert_ranges, assume_range, carry_ranges, generalize_carries, recording, trial_run
from hop.errors import HopError, HopTypeError, HopValueError, format_message, type_name
from hop.ops import _checkpoint, _graph_step, _loop_reverse
from hop.ops._branching import as_tuple, like, no_alias
from hop.ops._common import (
    check_effects,
    differentiable,
    refuse_legacy_onnx,
    runs_inline,
    save_operands,
    saved_operands,
)
from hop.ops._loop_checks import leaf_difference

__all__ = ["while_loop", "while_loop_op"]

Fn = Callable[..., Any]
_Tensor = torch.Tensor
_NAME = "while_loop"
_TRIPS = "how many times the body runs depends on cond_fn's result, a tensor"
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
            and traced; Note [reverse mode of a traced loop] in ``_loop_reverse``).

    Eager calls run the Python loop (the functions are checked once per
    signature on fake tensors). Autograd, torch.func and vmap (also with a
    batched condition: the loop runs while any element is active, finished
    elements are frozen) work; make_fx and torch.export keep one
    ``torch.ops.hop.while_loop`` node, int carries becoming unbacked SymInts.
    """
    if _reference.ACTIVE and _reference.here():  # hop.testing.reference()
        return _reference.reference_while_loop(cond_fn, body_fn, carried_inputs)
    if _transforms.is_dynamo_compiling():  # Note [public functions under Dynamo]
        dynamo_call = _transforms.DYNAMO_CALL
        return while_loop_op(dynamo_call, while_loop, cond_fn, body_fn, carried_inputs, checkpoint=checkpoint)
    if _SINKS and _observe.claim():  # hop.debug.trace(): Note [watching a call]
        return _observe_calls.watch(_NAME, while_loop, (cond_fn, body_fn, carried_inputs), {"checkpoint": checkpoint})
    _check_arguments(cond_fn, body_fn, carried_inputs)
    _checkpoint.check_flag(checkpoint)
    leaves, spec = _subgraph.flatten(tuple(carried_inputs))
    flat_cond, flat_body = _flat_functions(cond_fn, body_fn, spec)
    if _transforms.in_plain_eager() and all(map(_plain_leaf, leaves)):
        key = validation.signature(_NAME, (cond_fn, body_fn), tuple(carried_inputs), leaves, spec)
        if not validation.is_known(key):
            _validate(flat_cond, flat_body, leaves, (cond_fn, body_fn))
            validation.remember(key)
        if checkpoint:
            out = _checkpoint.run(flat_cond, flat_body, leaves, _subgraph.closure_tensors((cond_fn, body_fn)))
            return _subgraph.unflatten(list(out), spec)
        if _SINKS:  # count the trips
            cond_fn = _observe.counted(_NAME, cond_fn)
        return _run_eager(cond_fn, body_fn, carried_inputs, leaves)
    with _checkpointing(checkpoint):  # read by the autograd node (Note [reverse mode of a traced loop])
        out = while_loop_op(flat_cond, flat_body, tuple(leaves), ())
    return _subgraph.unflatten(list(as_tuple(out)) if len(leaves) != 1 else [out], spec)


def _run_eager(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], leaves: list[Any]) -> Any:
    """Note [loops run inline], for a validated signature: the user's functions, as is.

    The signature was checked once on fake tensors; per iteration only the number
    of carries is (a body that changes it would otherwise fail inside Python's call
    or return another program's result), and the final carry is checked against
    ``carried_inputs`` (structure, dtype, device, rank) before it is returned. A
    body may return a bare value for a single carry.
    """
    carry = tuple(carried_inputs)
    n = len(carry)
    while True:
        pred = cond_fn(*carry)
        if type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx(_NAME, _TRIPS)
        if not pred:
            break
        out = body_fn(*carry)
        carry = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(carry) != n:
            break
    _subgraph.check_same_outputs(
        _NAME, ("carried_inputs", "body_fn"), (tuple(carried_inputs), carry), root="carry", fns=(None, body_fn)
    )
    flat, spec = _subgraph.flatten(carry)
    out_tree = _subgraph.unflatten(_subgraph.clone_aliases(flat, leaves), spec)
    return out_tree if type(carried_inputs) is tuple else list(out_tree)


def _check_arguments(cond_fn: Any, body_fn: Any, carried_inputs: Any) -> None:
    for role, fn in (("cond_fn", cond_fn), ("body_fn", body_fn)):
        if not callable(fn):
            raise HopTypeError(
                format_message(_NAME, f"{role} must be callable, got {type_name(fn)}"), op=_NAME, role=role
            )
    if not isinstance(carried_inputs, (tuple, list)):
        raise HopTypeError(
            format_message(
                _NAME,
                f"carried_inputs must be a tuple or list, got {type_name(carried_inputs)}",
                fix="Pass carried_inputs=(x,) for a single carry.",
            ),
            op=_NAME,
            role="carried_inputs",
        )
    for path, leaf in zip(
        _subgraph.leaf_paths(tuple(carried_inputs), "carried_inputs"),
        _subgraph.flatten(tuple(carried_inputs))[0],
        strict=True,
    ):
        if not isinstance(leaf, (torch.Tensor, int, torch.SymInt)) or isinstance(leaf, bool):
            raise HopTypeError(
                format_message(_NAME, f"{path} must be a tensor or an int, got {type_name(leaf)}"),
                op=_NAME,
                role="carried_inputs",
                path=path,
            )


def _plain_leaf(x: Any) -> bool:
    return _transforms.is_plain_tensor(x) or type(x) is int


def _flat_functions(cond_fn: Fn, body_fn: Fn, spec: Any) -> tuple[Fn, Fn]:
    """cond and body on flat carries; body checks its output against the carry."""

    def flat_cond(*leaves: Any) -> Any:
        return cond_fn(*_subgraph.unflatten(leaves, spec))

    def flat_body(*leaves: Any) -> tuple[Any, ...]:
        carry = _subgraph.unflatten(leaves, spec)
        out = body_fn(*carry)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        _subgraph.check_same_outputs(
            _NAME, ("carried_inputs", "body_fn"), (tuple(carry), tuple(out)), root="carry", fns=(None, body_fn)
        )
        return tuple(_subgraph.flatten(tuple(out))[0])

    flat_cond.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    flat_body.__wrapped__ = body_fn  # type: ignore[attr-defined]
    return flat_cond, flat_body


def _validate(flat_cond: Fn, flat_body: Fn, leaves: list[Any], fns: tuple[Fn, Fn]) -> None:
    """One iteration on fake tensors: cond returns one bool, body keeps the carry's kind."""
    if not validation.fakeable(leaves):
        return  # a quantized carry: the real iterations decide
    with validation.fake_inputs(leaves) as fake:
        try:
            validation.check_hooks(*fns)
            _truth(flat_cond(*fake), fns[0])
            flat_body(*fake)
        except validation.CANNOT_FAKE:
            return


# --- reading the condition --------------------------------------------------------------------


def _truth(pred: Any, fn: Any = None) -> Any:
    """A Python bool, or a tensor that is batched (the masked loop) or cannot be read."""
    if type(pred) is bool:
        return pred
    if isinstance(pred, torch.SymBool):
        return pred
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool or pred.numel() != 1:
        what = (
            f"a tensor of dtype {str(pred.dtype).removeprefix('torch.')} and shape {tuple(pred.shape)}"
            if isinstance(pred, torch.Tensor)
            else type_name(pred)
        )
        where = f" ({_subgraph.describe_fn(fn)})" if fn is not None else ""
        raise HopTypeError(
            format_message(
                _NAME,
                f"cond_fn{where} must return a Python bool or a one-element bool tensor, got {what}",
                fix="Reduce it, e.g. return (err > tol).any().",
            ),
            op=_NAME,
            role="cond_fn",
        )
    return pred


def _run(cond_fn: Fn, body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """Note [loops run inline]: the Python loop at the current level, masked where the
    condition is batched by an enclosing vmap."""
    carry = tuple(carry)
    if isinstance(body_fn, torch.fx.GraphModule):  # Note [traced bodies see contiguous values] (_looping)
        if isinstance(cond_fn, torch.fx.GraphModule) and _transforms.functorch_level() is None:
            return _run_graphs(cond_fn, body_fn, carry, additional)
        carry = _contiguous(carry)
        body = body_fn
        body_fn = lambda *a: _contiguous(as_tuple(body(*a)))  # noqa: E731
    if _SINKS:  # count the trips (under a transform, or the raw op in eager)
        cond_fn = _observe.counted(_NAME, cond_fn)
    while True:
        pred = _truth(cond_fn(*carry, *additional))
        if type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx(_NAME, _TRIPS)
        if type(pred) is bool or not _is_batched(pred):
            if not pred:
                return carry
            carry = as_tuple(body_fn(*carry, *additional))
            continue
        if not _any(pred):
            return carry
        new = as_tuple(body_fn(*carry, *additional))
        carry = tuple(_freeze(pred, n, o) for n, o in zip(new, carry, strict=True))


def _run_graphs(
    cond_fn: torch.fx.GraphModule, body_fn: torch.fx.GraphModule, carry: Sequence[Any], additional: Sequence[Any]
) -> tuple[Any, ...]:
    """A traced loop outside every transform (an exported program running): the
    condition was checked when traced and no vmap batches it, so a step is the two
    graphs' code and nothing else (a reverse-mode backward runs three such loops)."""
    counted = _graph_step.counted_loop(cond_fn, body_fn, len(carry))  # Note [running a traced body per step]
    if counted is not None:
        out = _graph_step.run_counted(counted, carry, additional)
        if out is not None:
            return out
    # traced subgraphs have no module hooks to run
    cond = _graph_step.step_function(cond_fn) or cond_fn.forward
    body = _graph_step.step_function(body_fn, contiguous=True)
    values = _contiguous(carry)
    if body is None:
        while cond(*values, *additional):
            values = _contiguous(as_tuple(body_fn.forward(*values, *additional)))
        return values
    while cond(*values, *additional):
        values = body(*values, *additional)
    return values


def _contiguous(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in values)


def _is_batched(t: torch.Tensor) -> bool:
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return True
        t = torch._C._functorch.get_unwrapped(t)
    return False


def _any(pred: torch.Tensor) -> bool:
    """Whether any batch element of a vmap-batched condition holds."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = pred
    while torch._C._functorch.is_functorch_wrapped_tensor(raw):
        raw = torch._C._functorch.get_unwrapped(raw)
    with temporarily_clear_interpreter_stack():
        return bool(raw.any())


def _freeze(pred: torch.Tensor, new: Any, old: Any) -> Any:
    if not isinstance(old, torch.Tensor):
        if new != old:
            raise HopValueError(
                format_message(
                    _NAME,
                    "with a condition batched by vmap, int carries cannot change (each element would need its own)",
                    fix="Carry the counter as a tensor, e.g. torch.tensor(0).",
                ),
                op=_NAME,
            )
        return old
    if new.shape != old.shape:
        raise HopValueError(
            format_message(
                _NAME,
                f"with a condition batched by vmap, carries cannot change size ({tuple(old.shape)} -> "
                f"{tuple(new.shape)}): finished elements are frozen element-wise",
            ),
            op=_NAME,
        )
    return torch.where(pred.reshape(()), new, old)


def _inline_or_node(
    cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any], level: int | None = None
) -> Any:
    """Autograd, grad and jvp: Note [loops run inline] when concrete, else one autograd node
    (always one under ``checkpoint=True``: its backward keeps about sqrt(n) carries)."""
    if runs_inline(carried, additional) and not _CHECKPOINT.get():
        return while_loop_dense(cond_fn, body_fn, carried, additional)
    return _as_node(cond_fn, body_fn, carried, additional, level)


# --- the raw op and its rules -----------------------------------------------------------------

while_loop_op = HigherOrderOperator("while_loop", tuple_args={2: "carried_inputs", 3: "additional_inputs"})


@while_loop_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def while_loop_dense(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    out = _run(cond_fn, body_fn, carried_inputs, additional_inputs)
    return no_alias(like(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


@while_loop_op.py_autograd_impl
def while_loop_autograd(
    cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs)


@while_loop_op.py_impl(TransformType.Grad)
def while_loop_grad(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, interpreter.level())


@while_loop_op.py_impl(TransformType.Jvp)
def while_loop_jvp(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, interpreter.level())


@while_loop_op.py_impl(TransformType.Vmap)
def while_loop_vmap(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    """Concrete: the masked loop inline. Traced: one loop a level down that runs while
    any element is active and freezes finished ones."""
    if runs_inline(carried_inputs, additional_inputs):
        return while_loop_dense(cond_fn, body_fn, carried_inputs, additional_inputs)
    level, size = interpreter.level(), interpreter.batch_size()
    carried, c_dims = _transforms.unwrap_batched(carried_inputs, level)
    extra, e_dims = _transforms.unwrap_batched(additional_inputs, level)
    if any(not isinstance(c, torch.Tensor) for c in carried):
        raise HopValueError(
            format_message(_NAME, "under vmap, traced loops carry tensors only", fix="Carry counters as tensors."),
            op=_NAME,
        )
    carried = [
        c.movedim(d, 0) if d is not None else c.expand(size, *c.shape) for c, d in zip(carried, c_dims, strict=True)
    ]
    in_dims = (0,) * len(carried) + tuple(e_dims)
    randomness = interpreter.randomness()
    vcond = torch.vmap(cond_fn, in_dims=in_dims, randomness=randomness)
    vbody = torch.vmap(body_fn, in_dims=in_dims, randomness=randomness)

    def any_active(*args: Any) -> Any:
        return vcond(*args).reshape(size).any()

    def masked_body(*args: Any) -> tuple[Any, ...]:
        active = vcond(*args).reshape(size)
        new = as_tuple(vbody(*args))
        return tuple(
            torch.where(active.reshape(size, *[1] * (o.dim() - 1)), n, o)
            for n, o in zip(new, args[: len(new)], strict=True)
        )

    with interpreter.lower():
        out = while_loop_op(any_active, masked_body, tuple(carried), tuple(extra))
    return like(out, _transforms.add_batch_dims(as_tuple(out), level))


@while_loop_op.py_functionalize_impl
def while_loop_functionalize(
    ctx: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    carried, extra = ctx.unwrap_tensors(list(carried_inputs)), ctx.unwrap_tensors(list(additional_inputs))
    with ctx.redispatch_to_next():
        cond = _subgraph.functionalize_body(ctx, cond_fn, _NAME, "cond_fn")
        body = _subgraph.functionalize_body(ctx, body_fn, _NAME, "body_fn")
        out = while_loop_op(cond, body, tuple(carried), tuple(extra))
    return ctx.wrap_tensors(out)


@while_loop_op.py_impl(FakeTensorMode)
def while_loop_fake(
    mode: FakeTensorMode, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    """The final carry: what stays fixed across iterations keeps its size; what changes
    (int carries, growing dimensions) becomes a fresh unbacked size."""
    with mode:
        out = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), mode.shape_env, fresh=True
        )
    return no_alias(like(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


@while_loop_op.py_impl(ProxyTorchDispatchMode)
def while_loop_proxy(
    mode: ProxyTorchDispatchMode,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
) -> Any:
    """Trace cond and body on carries generalized to every iteration's sizes; one node."""
    fake_mode = torch._guards.detect_fake_mode([*carried_inputs, *additional_inputs])
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    if shape_env is not None and any(type(c) is int for c in carried_inputs):
        return _ints_as_tensors(mode, cond_fn, body_fn, carried_inputs, additional_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        templates = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), shape_env, fresh=False
        )
        # Note [bodies are traced on values they can see] (hop._tracing)
        templates = tuple(_subgraph.trace_example(t) for t in templates)
    (cond_graph, body_graph), lifted = _subgraph.trace_branches([cond_fn, body_fn], (*templates, *additional_inputs))
    _check_cond_graph(cond_graph, cond_fn)
    check_effects(
        _NAME,
        "body_fn",
        body_fn,
        body_graph,
        what="carry",
        updates="carries",
        fix="Return the new carry from body_fn instead of writing the old one.",
    )
    extra = (*additional_inputs, *lifted)
    with recording() as fresh:
        out = while_loop_op(cond_graph, body_graph, tuple(carried_inputs), extra)
    result = _subgraph.emit(mode, while_loop_op, (cond_graph, body_graph, tuple(carried_inputs), extra), out)
    assert_ranges(mode, _NAME, as_tuple(result), fresh, root="carry", why=_DERIVED)
    return result


def _ints_as_tensors(
    mode: ProxyTorchDispatchMode, cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any]
) -> Any:
    """Python-int carries travel as 0-dim tensors through the node (an exported node
    cannot mix ints and tensors in one list); inside, ``.item()`` makes them SymInts."""
    n, slots = len(carried), [i for i, c in enumerate(carried) if type(c) is int]

    def as_ints(args: Sequence[Any]) -> list[Any]:
        return [a.item() if i in slots else a for i, a in enumerate(args)]

    fake_mode = torch._guards.detect_fake_mode([*carried, *additional])
    assert fake_mode is not None and fake_mode.shape_env is not None  # the caller checked
    fake_mode.allow_scalar_outputs = True  # for .item(): AOTAutograd's fake mode under torch.compile forbids it
    ints_in_cond = _reads_symints(cond_fn, carried, additional, slots, fake_mode)
    if not _reads_symints(body_fn, carried, additional, slots, fake_mode):
        _check_kinds_on_ints(body_fn, carried, additional, fake_mode)
        body_fn = functools.partial(body_on_tensors, tuple(slots), body_fn)

    def cond_t(*args: Any) -> Any:
        return cond_fn(*(as_ints(args[:n]) if ints_in_cond else args[:n]), *args[n:])

    def body_t(*args: Any) -> tuple[Any, ...]:
        out = as_tuple(body_fn(*as_ints(args[:n]), *args[n:]))
        return tuple(torch.scalar_tensor(o, dtype=torch.int64) if i in slots else o for i, o in enumerate(out))

    cond_t.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    body_t.__wrapped__ = body_fn  # type: ignore[attr-defined]
    with fake_mode:
        ranges = carry_ranges(_NAME, body_fn, tuple(carried), tuple(additional), fake_mode.shape_env)
    with mode:
        carried_t = [torch.scalar_tensor(c, dtype=torch.int64) if i in slots else c for i, c in enumerate(carried)]
        out = as_tuple(while_loop_op(cond_t, body_t, tuple(carried_t), tuple(additional)))
        result = as_ints(out)
    fresh = [assume_range(r, *rng, size=False) for r, rng in zip(result, ranges, strict=True) if rng and _symbolic(r)]
    assert_ranges(mode, _NAME, tuple(result), fresh, root="carry", why=_DERIVED)
    return result[0] if n == 1 else tuple(result)


# Note [int carries in a traced condition]
# A traced loop gives its int carries to cond_fn as unbacked SymInts. A condition that
# mixes one with a tensor (``(~done).any() & (t < n)``) makes torch read ``t < n`` as a
# Python bool, which a data-dependent value cannot be: the trace fails where eager,
# which has a real int, works. Such a condition gets the carries as the 0-dim int64
# tensors they travel as instead, so that ``t < n`` is a tensor too; the value it
# computes is the same. Conditions that work on SymInts keep getting SymInts. make_fx
# and torch.export decide by a run of cond_fn on fake values (_reads_symints);
# Dynamo, whose stand-ins for a callable cannot always run, by tracing it again
# (hop.compile._dynamo_while.WhileLoopVariable.trace_cond).
#
# body_fn mixes them alike (``stop = done | (t + 1 >= n)``, an ACT RNN's forced last
# step). It is decided the same way, and a body that cannot take SymInts is called by
# body_on_tensors: the int carries in as 0-dim int64 tensors, its int outputs read back
# with ``.item()``, so that the loop around it still carries SymInts. Under Dynamo,
# which traces ``.item()`` only when told to capture scalar outputs, the body is traced
# so (hop.compile._dynamo_while.WhileLoopVariable.trace_body).


def body_on_tensors(slots: tuple[int, ...], body_fn: Fn, *args: Any) -> tuple[Any, ...]:
    """Note [int carries in a traced condition]: ``body_fn`` given its int carries as tensors."""
    out = body_fn(*(torch.scalar_tensor(a, dtype=torch.int64) if k in slots else a for k, a in enumerate(args)))
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o.item() if k in slots and isinstance(o, torch.Tensor) else o for k, o in enumerate(out))


def _reads_symints(
    fn: Fn, carried: Sequence[Any], additional: Sequence[Any], slots: Sequence[int], fake_mode: FakeTensorMode
) -> bool:
    """Note [int carries in a traced condition]: whether cond_fn (or body_fn) can be traced on SymInts."""
    shape_env = fake_mode.shape_env
    assert shape_env is not None
    with fake_mode, shape_env.ignore_fresh_unbacked_symbols(), trial_run():
        values = [shape_env.create_unbacked_symint() if i in slots else c for i, c in enumerate(carried)]
        try:
            fn(*values, *additional)
        except GuardOnDataDependentSymNode:
            return False
        except Exception:  # any other mistake is reported by the real trace
            return True
    return True


def _check_kinds_on_ints(fn: Fn, carried: Sequence[Any], additional: Sequence[Any], fake_mode: FakeTensorMode) -> None:
    """Note [int carries in a traced condition]: a body given its int carries as
    tensors returns tensors for them, so what it returns on real ints is checked
    first, as eager checks it: a tensor returned for an int carry is refused."""
    shape_env = fake_mode.shape_env
    assert shape_env is not None
    with fake_mode, shape_env.ignore_fresh_unbacked_symbols(), trial_run():
        try:
            out = as_tuple(fn(*carried, *additional))
        except HopError:
            raise
        except Exception:  # any other mistake is reported by the real trace
            return
    roles = ("carried_inputs", "body_fn")
    _subgraph.check_same_outputs(_NAME, roles, (tuple(carried), out), root="carry", fns=(None, fn))


_DERIVED = "the range derived from the initial value and body_fn"


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and value.node.expr.is_Symbol


def _check_cond_graph(gm: torch.fx.GraphModule, cond_fn: Fn) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
    _truth(val, cond_fn)


# --- reverse mode when traced -------------------------------------------------------------------


class _LoopFunction(torch.autograd.Function):
    """A traced loop as one autograd node: forward mode is a loop over (carry,
    tangent); reverse mode is Note [reverse mode of a traced loop] (_loop_reverse).
    Its outputs are ``(trips, *final_carry)``: the backward starts from the trip count."""

    generate_vmap_rule = True

    @staticmethod
    def forward(cond_fn: Fn, body_fn: Fn, n: int, checkpoint: bool, *args: Any) -> Any:
        return _loop_reverse.count_trips(while_loop_op, cond_fn, body_fn, args[:n], args[n:])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.cond_fn, ctx.body_fn, ctx.n, ctx.checkpoint = inputs[:4]
        ctx.args = inputs[4:]
        ctx.mark_non_differentiable(output[0])
        ctx.final_shapes = [o.shape if isinstance(o, torch.Tensor) else None for o in output[1:]]
        # a size the body changes is a fresh unbacked one in the fake rule's final carry
        ctx.fixed_sizes = all(
            not isinstance(a, torch.Tensor) or leaf_difference(a, o) is None
            for a, o in zip(ctx.args[: ctx.n], output[1:], strict=True)
        )
        save_operands(ctx, (output[0], *ctx.args))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        trips, *args = saved_operands(ctx)
        n = ctx.n
        carried, extra = list(args[:n]), list(args[n:])
        g_carry = [
            None if not differentiable(x) else (x.new_zeros(s) if g is None else g)
            for x, s, g in zip(carried, ctx.final_shapes, grads[1:], strict=True)
        ]
        g_c, g_e = _loop_reverse.gradients(
            while_loop_op,
            ctx.body_fn,
            carried,
            extra,
            trips,
            g_carry,
            fixed_sizes=ctx.fixed_sizes,
            checkpoint=ctx.checkpoint,
        )
        return (None, None, None, None, *g_c, *g_e)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        n, args = ctx.n, ctx.args
        carried, extra = args[:n], args[n:]
        diff = [i for i, x in enumerate(carried) if differentiable(x)]
        t_carry = [torch.zeros_like(carried[i]) if tangents[4 + i] is None else tangents[4 + i] for i in diff]
        t_extra = [
            torch.zeros_like(x) if t is None else t
            for x, t in zip(extra, tangents[4 + n :], strict=True)
            if differentiable(x)
        ]
        cond_fn, body_fn = ctx.cond_fn, ctx.body_fn
        k = len(diff)

        def jvp_cond(*a: Any) -> Any:
            return cond_fn(*a[:n], *a[n + k : n + k + len(extra)])

        def jvp_body(*a: Any) -> tuple[Any, ...]:
            primal, tan, ex, ex_t = a[:n], a[n : n + k], a[n + k : n + k + len(extra)], a[n + k + len(extra) :]
            d_extra = [i for i, x in enumerate(ex) if differentiable(x)]

            def on_diff(*d: Any) -> tuple[Any, ...]:
                full, ext = list(primal), list(ex)
                for i, v in zip(diff, d[:k], strict=True):
                    full[i] = v
                for i, v in zip(d_extra, d[k:], strict=True):
                    ext[i] = v
                return as_tuple(body_fn(*full, *ext))

            out, t_out = _transforms.jvp(
                on_diff, (*[primal[i] for i in diff], *[ex[i] for i in d_extra]), (*tan, *ex_t)
            )
            return (*out, *[t_out[i] for i in diff])

        res = as_tuple(while_loop_op(jvp_cond, jvp_body, (*carried, *t_carry), (*extra, *t_extra)))
        t_full = [torch.zeros_like(x) if differentiable(x) else None for x in res[:n]]
        for j, i in enumerate(diff):
            t_full[i] = res[n + j]
        return (None, *t_full)


# Whether the loop being called asked for checkpoint=True. Set by while_loop() around
# the raw op (whose signature is torch's and has no such flag), read by the autograd
# node the call reaches; every while_loop() call sets its own, nested ones included.
_CHECKPOINT: contextvars.ContextVar[bool] = contextvars.ContextVar("hop_while_loop_checkpoint", default=False)


@contextlib.contextmanager
def _checkpointing(checkpoint: bool) -> Iterator[None]:
    token = _CHECKPOINT.set(checkpoint)
    try:
        yield
    finally:
        _CHECKPOINT.reset(token)


def _as_node(
    cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any], level: int | None = None
) -> Any:
    """One autograd node; what the functions close over and need grad for becomes
    additional inputs (Note [closure conversion] in hop._closures)."""
    (cond_fn, body_fn), captured = _subgraph.convert_closures([cond_fn, body_fn], [*carried, *additional], level)
    additional = (*additional, *captured)
    apply: Callable[..., Any] = _LoopFunction.apply
    out = apply(cond_fn, body_fn, len(carried), _CHECKPOINT.get(), *carried, *additional)[1:]
    return out[0] if len(out) == 1 else out
