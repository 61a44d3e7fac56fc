"""``hop.fori_loop``: a counted loop, built on ``hop.while_loop`` (no raw op of its own).

With Python-int bounds in eager it is a plain ``for`` loop (body checked once per
signature); otherwise it is the while_loop over ``(i, val)`` with ``i < upper``,
so it inherits every transform (vmap with batched bounds included) and appears in
traced programs as ``torch.ops.hop.while_loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hop import _reference, _subgraph, _transforms
from hop import _validation as validation
from hop.errors import HopTypeError, format_message
from hop.ops.while_loop import while_loop

__all__ = ["fori_loop"]

_NAME = "fori_loop"


def fori_loop(
    lower: int | torch.SymInt | torch.Tensor,
    upper: int | torch.SymInt | torch.Tensor,
    body_fn: Callable[[Any, Any], Any],
    init_val: Any,
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
    """
    if _reference.ACTIVE and _reference.here():  # hop.testing.reference()
        return _reference.reference_fori_loop(lower, upper, body_fn, init_val)
    if _transforms.is_dynamo_compiling():
        return _transforms.outside_dynamo(fori_loop, lower, upper, body_fn, init_val)
    if not callable(body_fn):
        raise HopTypeError(
            format_message(_NAME, f"body_fn must be callable, got {type(body_fn).__name__}"), op=_NAME, role="body_fn"
        )
    for role, bound in (("lower", lower), ("upper", upper)):
        if not isinstance(bound, (int, torch.SymInt, torch.Tensor)) or isinstance(bound, bool):
            raise HopTypeError(
                format_message(
                    _NAME, f"{role} must be an int, a SymInt or an integer tensor, got {type(bound).__name__}"
                ),
                op=_NAME,
                role=role,
            )
    if type(lower) is int and type(upper) is int and _transforms.in_plain_eager():
        leaves, spec = _subgraph.flatten(init_val)
        if all(_transforms.is_plain_tensor(x) or type(x) is int for x in leaves):
            _validate_once(lower, body_fn, init_val, leaves, spec)
            val = init_val
            for i in range(lower, upper):
                val = body_fn(i, val)
            out, out_spec = _subgraph.flatten(val)
            return _subgraph.unflatten(_subgraph.clone_aliases(out, leaves), out_spec)
    if isinstance(upper, torch.Tensor) and not isinstance(lower, torch.Tensor):
        # the counter may be batched; not torch.tensor: that is a constant in a traced body
        lower = torch.zeros((), dtype=upper.dtype, device=upper.device) + lower
    _, val = while_loop(lambda i, v: i < upper, lambda i, v: (i + 1, body_fn(i, v)), (lower, init_val))
    return val


def _validate_once(lower: int, body_fn: Callable[[Any, Any], Any], init_val: Any, leaves: list[Any], spec: Any) -> None:
    key = validation.signature(_NAME, (body_fn,), (), leaves, spec)
    if validation.is_known(key):
        return
    with validation.fake_inputs(leaves) as fake:
        val = _subgraph.unflatten(fake, spec)
        try:
            out = body_fn(lower, val)
        except validation.CANNOT_FAKE:
            return
        _subgraph.check_same_outputs(_NAME, ("init_val", "body_fn"), (val, out), root="val", fns=(None, body_fn))
    validation.remember(key)
