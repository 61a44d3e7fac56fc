"""``hop.fori_loop``: a counted loop, built on ``hop.while_loop`` (no raw op of its own).

With Python-int bounds in eager it is a plain ``for`` loop (body checked once per
signature); otherwise it is the while_loop over ``(i, val)`` with ``i < upper``,
so it inherits every transform (vmap with batched bounds included) and appears in
traced programs as ``torch.ops.hop.while_loop``.

Compiled: a while_loop: Dynamo ``hop.compile._dynamo_while.WhileLoopVariable``; Inductor
``hop.compile.inductor._lower_while``; ONNX ``hop.compile._onnx_ops.translate_while_loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from hop import _observe, _output_checks, _reference, _spec, _transforms
from hop import _validation as validation
from hop import subgraph as _subgraph
from hop.errors import HopTypeError, HopValueError, OutputMismatchError, format_message, type_name
from hop.ops._common import NOT_TAKEN, front
from hop.ops.while_loops import _unroll
from hop.ops.while_loops._checks import NAME as WHILE_LOOP
from hop.ops.while_loops.while_loop import while_loop, while_loop_op

__all__ = ["fori_loop"]

_NAME = "fori_loop"
_SINKS = _observe.SINKS

# A public function with no operator of its own: a call that does not run inline
# makes a while_loop call (and node), observed as while_loop's record before this one.
SPEC = _spec.register(_spec.OpSpec(name=_NAME, over=WHILE_LOOP, validates=True))


def fori_loop(
    lower: int | torch.SymInt | torch.Tensor,
    upper: int | torch.SymInt | torch.Tensor,
    body_fn: Callable[[Any, Any], Any],
    init_val: Any,
    *,
    unroll: int | bool = 1,
) -> Any:
    """``for i in range(lower, upper): val = body_fn(i, val)``; returns ``val``.

    Equivalent Python::

        def reference_fori_loop(lower, upper, body_fn, init_val):
            val = init_val
            for i in range(lower, upper):
                val = body_fn(i, val)
            return val

    Args:
        lower, upper: Python ints, SymInts or one-element integer tensors. When
            either bound is a tensor ``i`` is a tensor, otherwise an int.
        body_fn: ``(i, val) -> val`` keeping the structure, dtype, device and rank
            of ``val``'s leaves.
        init_val: a pytree of tensors and ints.
        unroll: iterations of ``body_fn`` per iteration of the loop a traced or
            compiled program runs (``True``: the whole loop, no loop node; int bounds
            only). Values and gradients do not change.
    """
    if type(unroll) is not int or unroll != 1:  # True is a control too
        return _unroll.fori_unrolled(fori_loop, lower, upper, body_fn, init_val, unroll)
    taken = front(_NAME, fori_loop, while_loop_op, _reference.reference_fori_loop, (lower, upper, body_fn, init_val))
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    if not callable(body_fn):
        raise HopTypeError(
            format_message(_NAME, f"body_fn must be callable, got {type_name(body_fn)}"), op=_NAME, role="body_fn"
        )
    _output_checks.check_arity(_NAME, "body_fn", body_fn, 2, "(i, val)")
    check_bound("lower", lower)
    check_bound("upper", upper)
    leaves, spec = _subgraph.flatten(init_val)
    _check_init_val(init_val, leaves)
    if (
        type(lower) is int
        and type(upper) is int
        and _transforms.in_plain_eager()
        and all(_transforms.is_plain_tensor(x) or type(x) is int for x in leaves)
    ):
        _validate_once(lower, body_fn, init_val, leaves, spec)
        if _SINKS:
            _observe.note(_NAME, inline=True, trips=max(upper - lower, 0))
        val = init_val
        for i in range(lower, upper):
            val = body_fn(i, val)
        out, out_spec = _subgraph.flatten(val)
        return _subgraph.unflatten(_subgraph.clone_aliases(out, leaves), out_spec)
    if isinstance(upper, torch.Tensor) and not isinstance(lower, torch.Tensor):
        # the counter may be batched; not torch.tensor: that is a constant in a traced body;
        # made from upper, not torch.zeros: under a transform inside torch.export, a factory's
        # tensor is one the trace does not follow (exported as a fake constant, the loop wrong)
        lower = upper.new_zeros(()) + lower
    try:
        _, val = while_loop(lambda i, v: i < upper, _counted_body(body_fn), (lower, init_val))
    except OutputMismatchError as e:
        if type(lower) is int and e.op == WHILE_LOOP and e.path == "carry[0]":
            _counter_needs_symbols(e)
        raise
    return val


def _counter_needs_symbols(error: OutputMismatchError) -> NoReturn:
    """With int bounds ``i`` is an int; a trace without a ShapeEnv (``make_fx``'s default
    real mode) has no symbol to carry it in, and while_loop's own message would
    name its internal ``carry[0]``."""
    raise HopTypeError(
        format_message(
            _NAME,
            "with int bounds the counter i is a Python int, which a trace without a ShapeEnv cannot carry "
            "from one iteration to the next",
            fix="Trace with make_fx(..., tracing_mode='symbolic' or 'fake') or torch.export, or pass tensor bounds "
            "(then i is a tensor).",
        ),
        op=_NAME,
        role="lower",
    ) from error


def _counted_body(body_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """while_loop's body ``(i, v) -> (i + 1, body_fn(i, v))``. Its first call (the
    fake validation run, or the traced one) checks ``body_fn``'s output against
    ``v``, so that a mistake names fori_loop's ``val``, not while_loop's ``carry[1]``;
    later iterations go unchecked, as in while_loop's own eager loop."""
    checked = False

    def counted(i: Any, v: Any) -> Any:
        nonlocal checked
        out = body_fn(i, v)
        if not checked:
            _subgraph.check_same_outputs(_NAME, ("init_val", "body_fn"), (v, out), root="val", fns=(None, body_fn))
            checked = True
        return i + 1, out

    counted.__wrapped__ = body_fn  # type: ignore[attr-defined]  # errors name the user's body
    counted.__hop_counted__ = _NAME  # type: ignore[attr-defined]  # and its carries (hop._state)
    return counted


def _check_init_val(init_val: Any, leaves: list[Any]) -> None:
    for path, leaf in zip(_subgraph.leaf_paths(init_val, "init_val"), leaves, strict=True):
        if not isinstance(leaf, (torch.Tensor, int, torch.SymInt)) or isinstance(leaf, bool):
            raise HopTypeError(
                format_message(
                    _NAME,
                    f"{path} must be a tensor or an int, got {type_name(leaf)}",
                    fix="Close over other values in body_fn instead of carrying them.",
                ),
                op=_NAME,
                role="init_val",
                path=path,
            )


def check_bound(role: str, bound: Any) -> None:
    """``lower`` / ``upper``: an int, a SymInt or a one-element integer tensor (checked
    here, where fori_loop can name it, not as while_loop's internal condition; also run
    by its Dynamo handler, on the traced value)."""
    if isinstance(bound, torch.Tensor):
        dtype = bound.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise HopTypeError(
                format_message(
                    _NAME,
                    f"{role} must be an integer tensor, got dtype {str(dtype).removeprefix('torch.')}",
                    fix=f"Convert it, e.g. {role}.long(), or pass a Python int.",
                ),
                op=_NAME,
                role=role,
            )
        if bound.numel() != 1:
            raise HopValueError(
                format_message(
                    _NAME,
                    f"{role} must have exactly one element, got shape {tuple(bound.shape)}",
                    fix=f"Pass one bound per loop; to run loops of several lengths, vmap over {role}.",
                ),
                op=_NAME,
                role=role,
            )
    elif not isinstance(bound, (int, torch.SymInt)) or isinstance(bound, bool):
        raise HopTypeError(
            format_message(
                _NAME,
                f"{role} must be an int, a SymInt or an integer tensor, got {type_name(bound)}",
                fix="Pass a Python int (e.g. int(n)) or an integer tensor.",
            ),
            op=_NAME,
            role=role,
        )


def _validate_once(lower: int, body_fn: Callable[[Any, Any], Any], init_val: Any, leaves: list[Any], spec: Any) -> None:
    key = validation.signature(_NAME, (body_fn,), (), leaves, spec)
    if validation.is_known(key) or not validation.fakeable(leaves):
        return
    with validation.fake_inputs(leaves) as fake:
        val = _subgraph.unflatten(fake, spec)
        try:
            validation.check_hooks(body_fn)
            out = body_fn(lower, val)
        except validation.CANNOT_FAKE:
            return
        _subgraph.check_same_outputs(_NAME, ("init_val", "body_fn"), (val, out), root="val", fns=(None, body_fn))
    validation.remember(key)
