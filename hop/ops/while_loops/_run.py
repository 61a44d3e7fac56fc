"""The ways a while_loop runs as Python: eager, inline under a transform, a traced program's loop.

:func:`run_eager` is the public function's loop in plain eager, for a validated
signature: the user's functions on their pytrees, as is. :func:`run` is the dense
rule's loop on flat carries at the current level (Note [loops run inline] in
``hop.ops.while_loops.while_loop``), masked where an enclosing vmap batches the condition:
it runs while any element is active and freezes finished elements with
``torch.where``. :func:`run_graphs` is a traced loop outside every transform (an
exported program running), whose steps are the graphs' code alone
(Note [running a traced body per step] in ``_lean_body``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _observe, _transforms
from hop import subgraph as _subgraph
from hop.errors import HopValueError, format_message
from hop.ops import _lean_body
from hop.ops._common import as_tuple, refuse_legacy_onnx, reverse_tracked, select
from hop.ops.branching.cond import cond_op
from hop.ops.while_loops._checks import NAME, truth

Fn = Callable[..., Any]
_TRIPS = "how many times the body runs depends on cond_fn's result, a tensor"
_SINKS = _observe.SINKS


def run_eager(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], leaves: list[Any]) -> Any:
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
            refuse_legacy_onnx(NAME, _TRIPS)
        if not pred:
            break
        out = body_fn(*carry)
        carry = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(carry) != n:
            break
    _subgraph.check_same_outputs(
        NAME, ("carried_inputs", "body_fn"), (tuple(carried_inputs), carry), root="carry", fns=(None, body_fn)
    )
    flat, spec = _subgraph.flatten(carry)
    out_tree = _subgraph.unflatten(_subgraph.clone_aliases(flat, leaves), spec)
    return out_tree if type(carried_inputs) is tuple else list(out_tree)


def run(cond_fn: Fn, body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """Note [loops run inline]: the Python loop at the current level, masked where the
    condition is batched by an enclosing vmap."""
    carry = tuple(carry)
    if isinstance(body_fn, torch.fx.GraphModule):  # Note [traced bodies see contiguous values] (scanning._rules)
        if isinstance(cond_fn, torch.fx.GraphModule) and _transforms.functorch_level() is None:
            return run_graphs(cond_fn, body_fn, carry, additional)
        carry = _contiguous(carry)
        body = body_fn
        body_fn = lambda *a: _contiguous(as_tuple(body(*a)))  # noqa: E731
    if _SINKS:  # count the trips (under a transform, or the raw op in eager)
        cond_fn = _observe.counted(NAME, cond_fn)
    tracked: bool | None = None  # whether a derivative reaches the body: read once, at the first masked step
    while True:
        pred = truth(cond_fn(*carry, *additional))
        if type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx(NAME, _TRIPS)
        if type(pred) is bool or not _transforms.batched_inside(pred):
            if not pred:
                return carry
            carry = as_tuple(body_fn(*carry, *additional))
            continue
        if not _any_batch_element(pred):
            return carry
        if tracked is None:
            tracked = _differentiated(body_fn, carry, additional)
        if tracked:
            carry = active_step(pred, body_fn, carry, additional)
            continue
        new = as_tuple(body_fn(*carry, *additional))
        carry = tuple(_freeze(pred, n, o) for n, o in zip(new, carry, strict=True))


def run_graphs(
    cond_fn: torch.fx.GraphModule, body_fn: torch.fx.GraphModule, carry: Sequence[Any], additional: Sequence[Any]
) -> tuple[Any, ...]:
    """A traced loop outside every transform (an exported program running): the
    condition was checked when traced and no vmap batches it, so a step is the two
    graphs' code and nothing else (a reverse-mode backward runs three such loops)."""
    counted = _lean_body.counted_loop(cond_fn, body_fn, len(carry))  # Note [running a traced body per step]
    if counted is not None:
        out = _lean_body.run_counted(counted, carry, additional)
        if out is not None:
            return out
    # traced subgraphs have no module hooks to run
    cond = _lean_body.step_function(cond_fn) or cond_fn.forward
    body = _lean_body.step_function(body_fn, contiguous=True)
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


def _any_batch_element(pred: torch.Tensor) -> bool:
    """Whether any batch element of a vmap-batched condition holds."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = pred
    while torch._C._functorch.is_functorch_wrapped_tensor(raw):
        raw = torch._C._functorch.get_unwrapped(raw)
    with temporarily_clear_interpreter_stack():
        return bool(raw.any())


# Note [finished elements are not differentiated]
# A loop batched by vmap runs the body on every element while any is active and
# keeps a finished element's carry. With ``torch.where(active, body(c), c)`` the
# values and tangents are right, but reverse mode is not: where's backward gives
# the body a zero cotangent at the frozen carry, and the body's local derivative
# there may be infinite (the norm of a zero step: ``sqrt(0)``), so ``0 * inf`` is
# NaN in the element's gradient, from a step its own Python loop never took. A
# masked step is ``cond(active, body, keep)`` instead (:func:`active_step`): with a
# batched selector and a derivative to take, cond's node differentiates each
# element's taken branch only and selects the branches' gradients (not their
# cotangents) per element, so a step an element did not take contributes nothing.
# Where nothing is differentiated, that cond is the same torch.where. The eager
# masked loop, the traced one (``while_loop_vmap``) and the reverse of a loop with a
# batched trip count (``while_loops._reverse``) all step so.


def _differentiated(body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> bool:
    return reverse_tracked([*carry, *additional, *_subgraph.closure_tensors((body_fn,))])


def batched_here(t: Any) -> bool:
    """Whether ``t`` is batched by the innermost vmap level (a loop condition's value
    inside a vmapped step)."""
    return (
        isinstance(t, torch.Tensor)
        and torch._C._functorch.is_batchedtensor(t)
        and torch._C._functorch.maybe_get_level(t) == _transforms.functorch_level()
    )


def checked_step(body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """``body_fn(*carry, *additional)`` as a tuple of as many carries as it was given."""
    new = as_tuple(body_fn(*carry, *additional))
    if len(new) != len(carry):
        raise _carry_count(len(carry), len(new))
    return new


def active_step(active: Any, body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """``body_fn(*carry, *additional)`` where ``active`` holds, ``carry`` elsewhere, as a
    cond (Note [finished elements are not differentiated]); an int carry must not change."""

    carry = tuple(carry)
    n = len(carry)
    tensors = [i for i, c in enumerate(carry) if isinstance(c, torch.Tensor)]
    returned: list[tuple[Any, ...]] = []

    def step(*args: Any) -> tuple[Any, ...]:
        new = checked_step(body_fn, args[:n], args[n:])
        returned[:] = [new]
        return tuple(new[i] for i in tensors)

    def keep(*args: Any) -> tuple[Any, ...]:
        return tuple(args[i] for i in tensors)

    step.__qualname__ = getattr(body_fn, "__qualname__", "body_fn")
    stepped = iter(as_tuple(cond_op(active.reshape(()), step, keep, (*carry, *additional))))
    return tuple(
        next(stepped) if i in tensors else _freeze(active, new, c)
        for i, (new, c) in enumerate(zip(returned[0], carry, strict=True))
    )


def _carry_count(n: int, got: int) -> HopValueError:
    return HopValueError(
        format_message(
            NAME, f"body_fn returned {got} carries for the {n} it was given", fix="Return one value per carry."
        ),
        op=NAME,
        role="body_fn",
    )


def _freeze(pred: torch.Tensor, new: Any, old: Any) -> Any:
    if not isinstance(old, torch.Tensor):
        if new != old:
            raise HopValueError(
                format_message(
                    NAME,
                    "with a condition batched by vmap, int carries cannot change (each element would need its own)",
                    fix="Carry the counter as a tensor, e.g. torch.tensor(0).",
                ),
                op=NAME,
            )
        return old
    if new.shape != old.shape:
        raise HopValueError(
            format_message(
                NAME,
                f"with a condition batched by vmap, carries cannot change size ({tuple(old.shape)} -> "
                f"{tuple(new.shape)}): finished elements are frozen element-wise",
            ),
            op=NAME,
        )
    return select(pred.reshape(()), new, old)
