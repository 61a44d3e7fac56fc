"""``hop.fori_loop(..., unroll=k)``: ``k`` iterations of ``body_fn`` per iteration of
the loop, written with ``fori_loop`` itself (Note [loop controls are programs of the
operators]).

``n = max(upper - lower, 0)`` iterations run as ``n // k`` chunks of ``k`` (the body
called ``k`` times in Python, ``i = lower + j * k + t``), then the ``n % k`` left by a
second loop; ``unroll=True`` is the whole loop as Python (Python-int bounds only: a
tensor bound has no static length). In plain eager with int bounds fori_loop already
runs as a Python ``for`` loop, so the control changes nothing there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hop import _output_checks, _transforms
from hop import subgraph as _subgraph
from hop.errors import HopTypeError, HopValueError, format_message, type_name
from hop.ops.scanning._controls import check_unroll, in_reference, unaliased

__all__ = ["chunked", "fori_unrolled"]

_NAME = "fori_loop"
Fn = Callable[..., Any]


def fori_unrolled(public: Fn, lower: Any, upper: Any, body_fn: Fn, init_val: Any, unroll: Any) -> Any:
    """``public`` (hop.fori_loop) with ``unroll``."""
    steps = check_unroll(_NAME, unroll)
    if in_reference():
        return public(lower, upper, body_fn, init_val)
    static = type(lower) is int and type(upper) is int
    if steps == 1 or (static and not _transforms.is_dynamo_compiling() and _transforms.in_plain_eager()):
        return public(lower, upper, body_fn, init_val)
    if not callable(body_fn):
        raise HopTypeError(
            format_message(_NAME, f"body_fn must be callable, got {type_name(body_fn)}"), op=_NAME, role="body_fn"
        )
    if not _transforms.is_dynamo_compiling():  # its cache is no program for Dynamo to trace
        _output_checks.check_arity(_NAME, "body_fn", body_fn, 2, "(i, val)")
    if steps is None:
        return _whole(lower, upper, body_fn, init_val)
    if not static:
        return chunked(public, lower, upper, body_fn, init_val, steps)
    n = max(upper - lower, 0)
    if steps >= n:
        return _whole(lower, upper, body_fn, init_val)
    val = public(0, n // steps, _chunk_body(body_fn, lower, steps), init_val)
    if n % steps == 0:  # no iteration left
        return val
    return public(lower + n // steps * steps, upper, body_fn, val)


def chunked(public: Fn, lower: Any, upper: Any, body_fn: Fn, init_val: Any, unroll: Any) -> Any:
    """The loop in chunks of ``unroll`` iterations and a loop of the rest, for bounds
    whose values are not known (tensors, SymInts): no test of them, which would guard.
    Dynamo calls it directly where a bound is symbolic (under Dynamo a SymInt reads as
    an int)."""
    steps = check_unroll(_NAME, unroll)
    if steps is None:
        return _whole(lower, upper, body_fn, init_val)
    if steps == 1:
        return public(lower, upper, body_fn, init_val)
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        chunks: Any = torch.div(torch.clamp(upper - lower, min=0), steps, rounding_mode="floor")
    else:
        chunks = torch.sym_max(upper - lower, 0) // steps  # type: ignore[no-untyped-call]
    val = public(0, chunks, _chunk_body(body_fn, lower, steps), init_val)
    return public(lower + chunks * steps, upper, body_fn, val)


def _chunk_body(body_fn: Fn, lower: Any, steps: int) -> Fn:
    def chunk(j: Any, val: Any) -> Any:
        first = lower + j * steps
        for t in range(steps):
            val = body_fn(first + t, val)
        return val

    chunk.__qualname__ = getattr(body_fn, "__qualname__", type(body_fn).__qualname__)
    chunk.__wrapped__ = body_fn  # type: ignore[attr-defined]  # errors name the user's body
    return chunk


def _whole(lower: Any, upper: Any, body_fn: Fn, init_val: Any) -> Any:
    """Every iteration as Python: what a ``for`` loop over ``range(lower, upper)`` traces."""
    if isinstance(lower, torch.Tensor) or isinstance(upper, torch.Tensor):
        raise HopValueError(
            format_message(
                _NAME,
                "unroll=True runs the whole loop as Python, which needs Python-int bounds, got a tensor bound",
                fix="Pass int bounds, or unroll=k for k iterations per step of the loop.",
            ),
            op=_NAME,
            role="unroll",
        )
    leaves = _subgraph.flatten(init_val)[0]
    val = init_val
    for i in range(int(lower), int(upper)):  # a SymInt bound is specialized, as range() would
        out = body_fn(i, val)
        _subgraph.check_same_outputs(_NAME, ("init_val", "body_fn"), (val, out), root="val", fns=(None, body_fn))
        val = out
    out_leaves, spec = _subgraph.flatten(val)
    return _subgraph.unflatten(unaliased(out_leaves, leaves), spec)
