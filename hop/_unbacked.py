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
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.utils._sympy.numbers import int_oo

from hop.errors import OutputMismatchError, format_message

__all__ = ["merge_leaves"]

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
