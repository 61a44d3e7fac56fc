"""Unification of output sizes across branches (DESIGN.md section 4).

When a hop operator's branches (or loop bodies) return outputs whose sizes
differ, the operator's output needs one size that stands for all of them:

- a dimension that is the same expression in every branch keeps it;
- otherwise it gets a fresh unbacked SymInt whose value range is the union of the
  branches' ranges. The symbol is created here, outside the branches'
  ``ignore_fresh_unbacked_symbols`` block, so ``track_tensor_tree`` binds it to the
  operator's node (``unbacked_bindings``); its range is stated with
  ``torch._check`` so the exported program asserts it at run time.

Int / SymInt leaves are unified the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.utils._sympy.numbers import int_oo

from hop.errors import OutputMismatchError, format_message

__all__ = ["merge_leaves", "generalize_carries", "run_in_subgraph", "rebind_sizes"]

_check: Callable[[Any], None] = torch._check  # untyped in torch


def _same(values: Sequence[Any]) -> bool:
    first = values[0]
    return all(v is first or statically_known_true(v == first) for v in values[1:])


def _bounds(shape_env: ShapeEnv, value: Any) -> tuple[Any, Any]:
    """The value range of an int or SymInt, as sympy numbers (int_oo when unbounded)."""
    if isinstance(value, int):
        return sympy.Integer(value), sympy.Integer(value)
    vr = shape_env.bound_sympy(value.node.expr)
    return vr.lower, vr.upper


def _fresh(shape_env: ShapeEnv, values: Sequence[Any], *, size: bool) -> torch.SymInt:
    """A new unbacked SymInt whose range is the union of the ranges of ``values``."""
    lows, highs = zip(*(_bounds(shape_env, v) for v in values), strict=True)
    low, high = min(lows), max(highs)
    sym = shape_env.create_unbacked_symint()
    # torch's int_oo claims is_finite; compare against it instead
    if size:
        _check(sym >= (max(int(low), 0) if low != -int_oo else 0))
    elif low != -int_oo:
        _check(sym >= int(low))
    if high != int_oo:
        _check(sym <= int(high))
    return sym


def merge_leaves(op: str, roles: Sequence[str], leaves: Sequence[Any], path: str, shape_env: ShapeEnv | None) -> Any:
    """One leaf that stands for ``leaves`` (one per branch, same kind/dtype/rank).

    Tensors keep every dimension that agrees across branches and get a fresh
    unbacked symbol for every one that does not; ints likewise. Without a
    ShapeEnv (plain fake or meta tensors) differing sizes cannot be represented
    and raise :class:`OutputMismatchError`.
    """
    first = leaves[0]
    if isinstance(first, torch.Tensor):
        sizes = [t.shape for t in leaves]
        if all(_same([s[d] for s in sizes]) for d in range(first.dim())):
            return first
        if shape_env is None:
            raise _cannot_merge(op, roles, leaves, path)
        shape = [
            s0 if _same(col) else _fresh(shape_env, list(col), size=True)
            for s0, col in zip(first.shape, zip(*sizes, strict=True), strict=True)
        ]
        return first.new_empty(shape)
    if isinstance(first, (int, torch.SymInt)) and not isinstance(first, bool):
        if _same(list(leaves)):
            return first
        if shape_env is None:
            raise _cannot_merge(op, roles, leaves, path)
        return _fresh(shape_env, list(leaves), size=False)
    return first


def _cannot_merge(op: str, roles: Sequence[str], leaves: Sequence[Any], path: str) -> OutputMismatchError:
    shapes = " vs ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)
    return OutputMismatchError(
        format_message(
            op,
            f"{' and '.join(roles)} return different sizes at {path} ({shapes}), which needs a data-dependent "
            "size, and this trace has no ShapeEnv",
            fix="Trace with make_fx(..., tracing_mode='symbolic') or torch.export, or make the sizes agree.",
        ),
        op=op,
        path=path,
    )


def generalize_carries(
    op: str,
    body_fn: Callable[..., Any],
    carried: tuple[Any, ...],
    additional: tuple[Any, ...],
    shape_env: ShapeEnv | None,
    *,
    fresh: bool,
) -> tuple[Any, ...]:
    """Carries that stand for every iteration of a loop.

    Runs ``body_fn`` on the carries (inside the caller's fake mode) until the set of
    changing quantities stops growing: an int carry the body changes, a tensor
    dimension whose size the body changes. Each becomes an unbacked SymInt (a size:
    at least 0); what the body keeps is kept. With ``fresh``, the symbols are new
    pending ones with their ranges asserted, for the operator's output; otherwise
    they are made as ignored placeholders, to trace the body and condition with.
    """
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    varying: list[set[int]] = [set() for _ in carried]  # dims (tensors) or {0} (ints)
    current = carried
    for _ in range(8):
        ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else nullcontext()
        with ignore:
            out = body_fn(*current, *additional)
        out = out if isinstance(out, tuple) else (out,)
        grew = False
        for k, (c, o) in enumerate(zip(current, out, strict=True)):
            new = _changes(c, o) - varying[k]
            if new:
                varying[k] |= new
                grew = True
        if not grew:
            break
        if shape_env is None:
            k = next(i for i, v in enumerate(varying) if v)
            raise OutputMismatchError(
                format_message(
                    op,
                    f"body_fn changes carry[{k}] between iterations, which needs a data-dependent size or value, "
                    "and this trace has no ShapeEnv",
                    fix="Trace with make_fx(..., tracing_mode='symbolic') or torch.export.",
                ),
                op=op,
                path=f"carry[{k}]",
            )
        with shape_env.ignore_fresh_unbacked_symbols():
            current = tuple(
                _generalize(c, v, shape_env, _constrain_range_for_size) for c, v in zip(carried, varying, strict=True)
            )
    if not fresh or shape_env is None or not any(varying):
        return current
    return tuple(_generalize(c, v, shape_env, _check_size) for c, v in zip(carried, varying, strict=True))


def _changes(c: Any, o: Any) -> set[int]:
    if isinstance(c, torch.Tensor):
        return {d for d in range(c.dim()) if not _same([c.shape[d], o.shape[d]])}
    return set() if _same([c, o]) else {0}


def _generalize(c: Any, varying: set[int], shape_env: ShapeEnv, constrain: Callable[[Any], None]) -> Any:
    if not varying:
        return c
    if not isinstance(c, torch.Tensor):
        return shape_env.create_unbacked_symint()
    shape: list[Any] = list(c.shape)
    for d in varying:
        shape[d] = shape_env.create_unbacked_symint()
        constrain(shape[d])
    return c.new_empty(shape)


def _check_size(sym: Any) -> None:
    _check(sym >= 0)


def run_in_subgraph(shape_env: ShapeEnv | None, fn: Callable[[], Any]) -> tuple[Any, set[Any]]:
    """``fn()`` (a subgraph's body run for its output metadata) and the unbacked symbols it
    made. They are left unpending: the subgraph that computes them binds them."""
    if shape_env is None:
        return fn(), set()
    before = set(shape_env.var_to_range)
    with shape_env.ignore_fresh_unbacked_symbols():
        out = fn()
    return out, {s for s in shape_env.var_to_range if s not in before}


def rebind_sizes(t: torch.Tensor, shape_env: ShapeEnv | None, local: set[Any]) -> torch.Tensor:
    """``t``, or an empty tensor like it in which every size that mentions a symbol of
    ``local`` (bound inside a subgraph) is a fresh unbacked symbol of the same range,
    to be bound to the operator's output."""
    if shape_env is None or not local:
        return t
    shape = [
        _fresh(shape_env, [s], size=True) if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & local else s
        for s in t.shape
    ]
    return t.new_empty(shape)
