"""Reference semantics of hop's operators, switched on by ``hop.testing.reference()``.

Each user-facing function starts with one check, ``if _reference.ACTIVE and
_reference.here():``, and then runs its plain-Python meaning from this module
instead of the operator. ``ACTIVE`` counts the threads inside ``reference()``,
so outside it the check is a single module-attribute read; ``here()`` says
whether the calling thread is one of them.

These functions are the oracle of ``hop.testing.check``: they use nothing of
hop's machinery (no validation, no tracing, no dispatch), only Python control
flow and ``torch.stack``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "ACTIVE",
    "here",
    "enabled",
    "reference_cond",
    "reference_switch",
    "reference_while_loop",
    "reference_fori_loop",
    "reference_map",
    "reference_scan",
    "reference_associative_scan",
]

Fn = Callable[..., Any]

ACTIVE = 0  # threads inside enabled(); 0 keeps each operator's check to one read
_lock = threading.Lock()
_local = threading.local()


def here() -> bool:
    """Whether the calling thread is inside :func:`enabled`."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def enabled() -> Iterator[None]:
    """Run every hop operator as its reference semantics in this thread; nests."""
    global ACTIVE
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth == 0:
        with _lock:
            ACTIVE += 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            with _lock:
                ACTIVE -= 1


def reference_cond(pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any] = ()) -> Any:
    """``true_fn(*operands) if pred else false_fn(*operands)``."""
    return true_fn(*operands) if pred else false_fn(*operands)


def reference_switch(index: Any, branches: Sequence[Fn], operands: Sequence[Any] = ()) -> Any:
    """``branches[index](*operands)``; an index out of range raises ``IndexError``."""
    i = int(index)
    if not 0 <= i < len(branches):
        raise IndexError(f"switch index {i} out of range for {len(branches)} branches")
    return branches[i](*operands)


def reference_while_loop(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], *, checkpoint: bool = False) -> Any:
    """``while cond_fn(*carry): carry = body_fn(*carry)``; the final carry."""
    carry = tuple(carried_inputs)
    while cond_fn(*carry):
        out = body_fn(*carry)
        carry = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return carry if type(carried_inputs) is tuple else list(carry)


def reference_fori_loop(lower: Any, upper: Any, body_fn: Fn, init_val: Any) -> Any:
    """``for i in range(lower, upper): val = body_fn(i, val)``.

    ``i`` is an int for int bounds; with a tensor bound it is a tensor like the
    lower bound (or a 0-dim tensor of the upper bound's dtype).
    """
    bound = None
    if isinstance(lower, torch.Tensor):
        bound = lower
    elif isinstance(upper, torch.Tensor):
        bound = torch.tensor(lower, dtype=upper.dtype, device=upper.device)
    val = init_val
    for i in range(int(lower), int(upper)):
        val = body_fn(i if bound is None else torch.full_like(bound, i), val)
    return val


def _length(xs: Any, dim: int) -> int:
    return int(pytree.tree_leaves(xs)[0].shape[dim])


def _select(xs: Any, dim: int, i: int) -> Any:
    return pytree.tree_map(lambda leaf: leaf.select(dim, i), xs)


def _stack(rows: Sequence[Any], dim: int) -> Any:
    return pytree.tree_map(lambda *col: torch.stack(col, dim), *rows)


def _empty_like_rows(row: Any, dim: int) -> Any:
    """What stacking zero rows shaped like ``row`` along ``dim`` gives."""

    def empty(y: torch.Tensor) -> torch.Tensor:
        d = dim if dim >= 0 else dim + y.dim() + 1
        return y.new_empty((*y.shape[:d], 0, *y.shape[d:]))

    return pytree.tree_map(empty, row)


def _zero_slice(xs: Any, dim: int) -> Any:
    """A slice of zeros, for the output shapes of a function over zero slices."""

    def zeros(leaf: torch.Tensor) -> torch.Tensor:
        shape = list(leaf.shape)
        del shape[dim]
        return leaf.new_zeros(shape)

    return pytree.tree_map(zeros, xs)


def reference_map(f: Fn, xs: Any, *args: Any) -> Any:
    """``torch.stack([f(x, *args) for x in xs])`` over dim 0 of every leaf.

    Over zero rows: empty outputs shaped by ``f`` on a slice of zeros.
    """
    n = _length(xs, 0)
    if n == 0:
        return _empty_like_rows(f(_zero_slice(xs, 0), *args), 0)
    return _stack([f(_select(xs, 0, i), *args) for i in range(n)], 0)


def reference_scan(combine_fn: Fn, init: Any, xs: Any, *, dim: int = 0, reverse: bool = False) -> tuple[Any, Any]:
    """A carry threaded through the slices of ``xs`` along ``dim``; ``(carry, ys)``.

    Over zero slices: ``init`` (cloned) and empty ``ys`` shaped by ``combine_fn``
    on a slice of zeros.
    """
    n = _length(xs, dim)
    if n == 0:
        _, y = combine_fn(init, _zero_slice(xs, dim))
        return pytree.tree_map(torch.clone, init), _empty_like_rows(y, dim)
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        carry, ys[i] = combine_fn(carry, _select(xs, dim, i))
    return carry, _stack(ys, dim)


def reference_associative_scan(
    combine_fn: Fn, xs: Any, dim: int, reverse: bool = False, combine_mode: str = "pointwise"
) -> Any:
    """The inclusive scan, one slice at a time (``combine_fn(running, next)``)."""
    n = _length(xs, dim)
    if n == 0:
        return pytree.tree_map(torch.clone, xs)
    out: list[Any] = [None] * n
    order = list(reversed(range(n))) if reverse else list(range(n))
    for k, i in enumerate(order):
        x = _select(xs, dim, i)
        out[i] = x if k == 0 else combine_fn(out[order[k - 1]], x)
    return _stack(out, dim)
