"""JAX's loop controls for ``hop.scan`` and ``hop.map``: ``length=``, ``unroll=`` and
``batch_size=``, written with the operators themselves.

Note [loop controls are programs of the operators]
A control changes how a loop runs, never what it computes, so each is a program of
hop's own operators and torch ops, and inherits every mode they have (transforms,
tracing, export, compile, AOTInductor, ONNX, ExecuTorch) with no rule of its own:

- ``scan(f, init, None, length=n)`` scans over ``n`` ticks, a zero-width tensor
  ``(n, 0)``, and calls ``f(carry, None)`` (``f(carry, xs)`` with the empty ``xs``
  given);
- ``scan(..., unroll=k)`` scans over chunks of ``k`` slices, each running ``k`` steps
  as Python inside the body, then scans the ``n % k`` slices left (first, for a
  reverse scan, which takes them last); ``unroll=True``, or ``k >= n``, is the whole
  loop as Python: no node at all, as a ``for`` loop over ``range(n)`` would trace (a
  dynamic length is specialized as Python's ``range`` specializes it);
- ``map(f, xs, batch_size=b)`` maps ``torch.vmap(f)`` over chunks of ``b`` slices and
  vmaps ``f`` once more over the ``n % b`` left (``lax.map``'s semantics).

Note [a dynamic length runs one step per iteration]
Chunks are a reshape of the scanned tensors, whose symbolic sizes torch's reshape and
slicing guard on (the chunk count nonzero, the remainder's exact value): a program
exported or compiled with a dynamic length would lose it. Where the length is
symbolic, ``unroll=k`` and ``batch_size`` run the loop without them (the same values;
the control is a speed hint, as in JAX). ``unroll=True`` still unrolls, specializing
the length as ``range(n)`` would; ``fori_loop``'s unroll needs no reshape and keeps
symbolic bounds.

A traced program therefore shows the rewritten loop (a scan over chunks), not the
control. Dynamo inlines these functions (Note [public functions, inlined] makes the
raw op's call only for calls without controls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hop import _output_checks, _pytree, _reference, _transforms
from hop.errors import HopTypeError, HopValueError, format_message, type_name
from hop.ops.scanning import _checks, _values

__all__ = ["check_count", "check_unroll", "in_reference", "map_batched", "scan_controlled", "unaliased"]

Fn = Callable[..., Any]


class _Names(NamedTuple):
    name: str
    role: str


_SCAN = _Names("scan", "combine_fn")


def in_reference() -> bool:
    """Under ``hop.testing.reference()`` a control changes nothing: the operators are
    their plain Python meaning (a ``cond`` an ``if``, which ``torch.vmap`` cannot batch)."""
    return bool(_reference.ACTIVE) and _reference.here()


def check_unroll(name: str, unroll: Any) -> int | None:
    """``unroll`` as a number of steps per iteration (``None``: the whole loop)."""
    if unroll is True:
        return None
    if unroll is False:
        return 1
    if type(unroll) is not int:
        raise HopTypeError(
            format_message(name, f"unroll must be an int or a bool, got {type_name(unroll)}"), op=name, role="unroll"
        )
    if unroll < 1:
        raise HopValueError(
            format_message(
                name,
                f"unroll must be at least 1, got {unroll}",
                fix="Pass unroll=1 for one step per iteration, k > 1 for k, or True for the whole loop.",
            ),
            op=name,
            role="unroll",
        )
    return unroll


def check_count(name: str, role: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise HopTypeError(format_message(name, f"{role} must be an int, got {type_name(value)}"), op=name, role=role)
    if value < least:
        raise HopValueError(format_message(name, f"{role} must be at least {least}, got {value}"), op=name, role=role)


def scan_controlled(
    public: Fn, combine_fn: Fn, init: Any, xs: Any, *, dim: int, reverse: bool, length: Any, unroll: Any
) -> tuple[Any, Any]:
    """``public`` (hop.scan) with ``length`` and ``unroll`` (Note [loop controls are
    programs of the operators])."""
    _checks.check_callable("scan", "combine_fn", combine_fn)
    if not _transforms.is_dynamo_compiling():  # its cache is no program for Dynamo to trace
        _output_checks.check_arity("scan", "combine_fn", combine_fn, 2, "(carry, x)")
    steps = 1 if in_reference() else check_unroll("scan", unroll)
    if length is not None:
        check_count("scan", "length", length, 0)
    xs_leaves = _pytree.flatten_dropping_none(xs)[0]
    if not xs_leaves:
        if length is None:  # nothing to scan over, as without controls
            return public(combine_fn, init, xs, dim=dim, reverse=reverse)  # type: ignore[no-any-return]
        ticks = _ticks(init, length)
        carry, ys = _scan_dim0(public, _ignoring_x(combine_fn, xs), init, ticks, [ticks], reverse, steps)
        return carry, _moved_back(ys, dim)
    dims, n = _checks.check_xs("scan", xs, xs_leaves, dim)
    if length is not None and length != n:
        raise HopValueError(
            format_message(
                "scan",
                f"length={length} but xs has length {n} along dim {dim}",
                fix="Pass length only with no xs (xs=None), or equal to the length of xs.",
            ),
            op="scan",
            role="length",
        )
    if steps == 1:
        return public(combine_fn, init, xs, dim=dim, reverse=reverse)  # type: ignore[no-any-return]
    moved_leaves = [x.movedim(d, 0) if d else x for x, d in zip(xs_leaves, dims, strict=True)]
    moved = _pytree.unflatten(moved_leaves, _pytree.flatten_dropping_none(xs)[1])
    carry, ys = _scan_dim0(public, combine_fn, init, moved, moved_leaves, reverse, steps)
    return carry, _moved_back(ys, dim)


def _ticks(init: Any, n: Any) -> torch.Tensor:
    """What a scan with no xs scans over: ``n`` slices of nothing, beside the carry."""
    leaves = _pytree.flatten_dropping_none(init)[0]
    return leaves[0].new_empty((n, 0)) if leaves else torch.empty((n, 0))


def _ignoring_x(combine_fn: Fn, xs: Any) -> Fn:
    def step(carry: Any, _tick: Any) -> Any:
        return combine_fn(carry, xs)

    return _named_after(step, combine_fn)


def _named_after(wrapper: Fn, fn: Fn) -> Fn:
    wrapper.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]  # errors name the user's function
    return wrapper


def _tree_map(fn: Fn, *trees: Any) -> Any:
    """``fn`` over the tensor leaves of ``trees`` (``None`` an empty subtree)."""
    leaves = [_pytree.flatten_dropping_none(t)[0] for t in trees]
    spec = _pytree.flatten_dropping_none(trees[0])[1]
    return _pytree.unflatten([fn(*col) for col in zip(*leaves, strict=True)], spec)


def _slice(xs: Any, i: int) -> Any:
    return _tree_map(lambda x: x[i], xs)


def _moved_back(ys: Any, dim: int) -> Any:
    if not dim:
        return ys
    return _tree_map(lambda y: y.movedim(0, _values.stack_dim(dim, y.dim() - 1)), ys)


def _scan_dim0(
    public: Fn, fn: Fn, init: Any, xs: Any, leaves: Sequence[torch.Tensor], reverse: bool, steps: int | None
) -> tuple[Any, Any]:
    """The scan of ``fn`` over dim 0 of ``xs`` (its tensors ``leaves``), ``steps``
    slices per iteration (``None``: all)."""
    if steps == 1:
        return public(fn, init, xs, reverse=reverse)  # type: ignore[no-any-return]
    n = leaves[0].shape[0]
    if steps is None or (type(n) is int and steps >= n):
        if type(n) is int and n == 0:
            return public(fn, init, xs, reverse=reverse)  # type: ignore[no-any-return]
        return _unrolled(fn, init, xs, int(n), reverse)
    if type(n) is not int:  # Note [a dynamic length runs one step per iteration]
        return public(fn, init, xs, reverse=reverse)  # type: ignore[no-any-return]
    m = n // steps
    rest = n - m * steps
    cut = rest if reverse else m * steps  # the slices left over come last in the scan's order
    main = _tree_map(lambda x: x[rest:] if reverse else x[:cut], xs)
    chunks = _tree_map(lambda x: x.reshape(m, steps, *x.shape[1:]), main)
    carry, ys = public(_chunk_body(fn, steps, reverse), init, chunks, reverse=reverse)
    ys = _tree_map(lambda y: y.flatten(0, 1), ys)
    if rest == 0:
        return carry, ys
    left = _tree_map(lambda x: x[:rest] if reverse else x[cut:], xs)
    carry, ys_left = public(fn, carry, left, reverse=reverse)
    first, last = (ys_left, ys) if reverse else (ys, ys_left)
    return carry, _tree_map(lambda a, b: torch.cat((a, b)), first, last)


def _chunk_body(fn: Fn, steps: int, reverse: bool) -> Fn:
    """``steps`` iterations of ``fn`` over one chunk of slices, their ys stacked."""

    def chunk(carry: Any, xs: Any) -> tuple[Any, Any]:
        ys: list[Any] = [None] * steps
        for t in reversed(range(steps)) if reverse else range(steps):
            out = fn(carry, _slice(xs, t))
            carry, ys[t] = _pair(fn, out)
        return carry, _values.stack_ys(_SCAN, fn, ys, 0, "y")

    return _named_after(chunk, fn)


def _pair(fn: Fn, out: Any) -> tuple[Any, Any]:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise _checks.not_a_pair(_SCAN, _checks_target(fn), out)
    return out[0], out[1]


def _checks_target(fn: Fn) -> Fn:
    return getattr(fn, "__wrapped__", fn)


def _unrolled(fn: Fn, init: Any, xs: Any, n: int, reverse: bool) -> tuple[Any, Any]:
    """The whole scan as Python: what a ``for`` loop over ``range(n)`` traces."""
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        carry, ys[i] = _pair(fn, fn(carry, _slice(xs, i)))
        _checks.check_carry(_SCAN, _checks_target(fn), init, carry)
    leaves, spec = _pytree.flatten_dropping_none(carry)
    inputs = [*_pytree.flatten_dropping_none(init)[0], *_pytree.flatten_dropping_none(xs)[0]]
    return _pytree.unflatten(unaliased(leaves, inputs), spec), _values.stack_ys(_SCAN, fn, ys, 0, "y")


def unaliased(leaves: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``leaves``, none of them an input or a view of one (a loop's outputs never alias
    its inputs). Dynamo cannot ask what views what: there every tensor is copied, a
    copy the compiler fuses away where the value is fresh."""
    if _transforms.is_dynamo_compiling():
        return [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return _values.no_alias(leaves, inputs)


def map_batched(public: Fn, f: Fn, xs: Any, args: tuple[Any, ...], batch_size: Any) -> Any:
    """``public`` (hop.map) with ``batch_size`` (Note [loop controls are programs of the
    operators])."""
    _checks.check_callable("map", "f", f)
    check_count("map", "batch_size", batch_size, 1)
    if in_reference():
        return public(f, xs, *args)
    leaves = _pytree.flatten_dropping_none(xs)[0]
    _, n = _checks.check_xs("map", xs, leaves, 0)
    if batch_size == 1 or type(n) is not int or n == 0:  # Note [a dynamic length runs one step per iteration]
        return public(f, xs, *args)
    batched = _named_after(torch.vmap(f, in_dims=(0, *(None,) * len(args))), f)
    m = n // batch_size
    cut = m * batch_size
    rest = n - cut
    parts = []
    if cut:
        chunks = _tree_map(lambda x: x[:cut].reshape(m, batch_size, *x.shape[1:]), xs)
        parts.append(_tree_map(lambda y: y.flatten(0, 1), public(batched, chunks, *args)))
    if rest:
        parts.append(batched(_tree_map(lambda x: x[cut:], xs), *args))
    if len(parts) == 1:
        return parts[0]
    return _tree_map(lambda a, b: torch.cat((a, b)), *parts)
