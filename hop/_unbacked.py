"""Unification of output sizes across branches and iterations (docs/dynamic_shapes.md).

When a hop operator's branches (or loop bodies) return outputs whose sizes
differ, the operator's output needs one size that stands for all of them:

- a dimension that is the same expression in every branch keeps it;
- otherwise it gets a fresh unbacked SymInt whose value range is the union of the
  branches' ranges. The symbol is created outside the branches'
  ``ignore_fresh_unbacked_symbols`` block, so ``track_tensor_tree`` binds it to the
  operator's node (``unbacked_bindings``).

Note [relations are kept]: a :class:`Unifier` makes one fresh symbol per distinct
tuple of per-branch expressions, so outputs that have equal sizes in every branch
share it (``a + b`` after the operator needs no ``Eq`` assert). A tuple that is an
integer affine image ``a * t + b`` of an earlier one (``cat([m, m])`` next to
``m``) becomes ``a * s + b`` of that tuple's symbol. Both are exact (the branches
compute them), so neither is asserted at run time.

Note [hop asserts its ranges]: what is *assumed* about a fresh symbol is its
range. The range is given to the ShapeEnv without a deferred assert; instead the
proxy rule records :func:`assert_ranges` nodes after the operator's node, whose
messages name the operator and the output. torch's runtime-assert pass sees them
as user asserts and adds no generic duplicate.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.utils._sympy.numbers import int_oo

from hop import _observe, _pytree
from hop._observe_traced import runtime_assert, unified
from hop.errors import OutputMismatchError, format_message

__all__ = [
    "Fresh",
    "Unifier",
    "assert_ranges",
    "all_same",
    "as_expr",
    "assume_range",
    "dense_order",
    "recording",
    "fresh_symint",
    "trial_run",
    "unrecorded_symbols",
    "value_bounds",
]


def unrecorded_symbols(values: Sequence[Any]) -> Any:
    """Where fake tensors run with no tracer recording them (Dynamo computing the
    metadata of a node that runs a derivative, such as torch.func.grad's autograd.grad
    or torch.func.jvp), an unbacked symbol the derivative makes and does not return
    (a loop's trip count, an int a branch returns, whose tangent is None) is internal
    to that node: no output can bind it, so it is made as one the ShapeEnv does not
    expect to see in the node's outputs. A tracer records its own nodes, which bind it."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    fake_mode = torch._guards.detect_fake_mode(list(values))
    if fake_mode is None or fake_mode.shape_env is None or get_proxy_mode() is not None:
        return nullcontext()
    return fake_mode.shape_env.ignore_fresh_unbacked_symbols()


@contextmanager
def trial_run() -> Iterator[None]:
    """A run on symbols whose data-dependent failure the caller expects and handles (it
    then traces another way): torch's fake tensors log every meta function that fails
    at ERROR, with a traceback, which a user would read as a failed compile."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


# --- fresh symbols and their ranges -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A symbol hop made for an operator's output and the range assumed for it
    (``None``: unbounded on that side)."""

    expr: sympy.Symbol
    low: int | None
    high: int | None


_RECORDING: list[list[Fresh]] = []


@contextmanager
def recording() -> Iterator[list[Fresh]]:
    """Collect the symbols :func:`fresh_symint` makes inside the block (the proxy
    rule wraps its call of the fake rule in it, then asserts their ranges)."""
    made: list[Fresh] = []
    _RECORDING.append(made)
    try:
        yield made
    finally:
        _RECORDING.pop()


def _finite(v: Any) -> int | None:
    return None if v in (int_oo, -int_oo, sympy.oo, -sympy.oo) else int(v)


def fresh_symint(shape_env: ShapeEnv, low: Any, high: Any, *, size: bool) -> torch.SymInt:
    """A new unbacked SymInt assumed to lie in ``[low, high]`` (see :func:`assume_range`)."""
    sym = shape_env.create_unbacked_symint()
    assume_range(sym, low, high, size=size)
    return sym


def assume_range(sym: torch.SymInt, low: Any, high: Any, *, size: bool) -> Fresh:
    """Give the ShapeEnv the range ``[low, high]`` (sympy numbers, int_oo when
    unbounded) of the unbacked ``sym``, without a deferred assert: the caller asserts
    it with :func:`assert_ranges`. A ``size`` is at least 0 and size-like."""
    shape_env, expr = sym.node.shape_env, sym.node.expr
    lo, hi = _finite(low), _finite(high)
    if size:
        lo = max(lo or 0, 0)
        shape_env._constrain_range_for_size(expr, lo, int_oo if hi is None else hi)
    else:
        shape_env.constrain_symbol_range(expr, -int_oo if lo is None else lo, int_oo if hi is None else hi)
    fresh = Fresh(expr, lo, hi)
    if _RECORDING:
        _RECORDING[-1].append(fresh)
    return fresh


def value_bounds(shape_env: ShapeEnv, value: Any) -> tuple[Any, Any]:
    """The value range of an int or SymInt, as sympy numbers (int_oo when unbounded)."""
    if isinstance(value, int):
        return sympy.Integer(value), sympy.Integer(value)
    vr = shape_env.bound_sympy(value.node.expr)
    return vr.lower, vr.upper


def as_expr(value: Any) -> sympy.Expr:
    return sympy.Integer(value) if isinstance(value, int) else value.node.expr


def all_same(values: Sequence[Any]) -> bool:
    first = values[0]
    return all(v is first or statically_known_true(v == first) for v in values[1:])


# --- branches: one output for all of them -------------------------------------------------------


class Unifier:
    """Unifies the outputs of one operator call across its branches (Note [relations
    are kept]). Without a ShapeEnv, differing sizes raise :class:`OutputMismatchError`."""

    def __init__(self, op: str, roles: Sequence[str], shape_env: ShapeEnv | None) -> None:
        self.op, self.roles, self.shape_env = op, roles, shape_env
        self._made: dict[tuple[sympy.Expr, ...], Any] = {}
        self._bases: list[tuple[tuple[sympy.Expr, ...], torch.SymInt]] = []

    def outputs(self, outs: Sequence[Any], root: str = "output") -> Any:
        """One pytree standing for ``outs`` (one per branch, already checked to agree
        in structure, kinds, dtypes and ranks), shaped like ``outs[0]``."""
        flat = [_pytree.flatten(o)[0] for o in outs]
        paths = _pytree.leaf_paths(outs[0], root)
        merged = [self.leaf(list(col), path) for path, col in zip(paths, zip(*flat, strict=True), strict=True)]
        return _pytree.unflatten(merged, _pytree.flatten(outs[0])[1])

    def leaf(self, leaves: Sequence[Any], path: str) -> Any:
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if not all(all_same([t.shape[d] for t in leaves]) for d in range(first.dim())):
                self._need_shape_env(leaves, path)
                shape = [self.size(list(col), size=True) for col in zip(*(t.shape for t in leaves), strict=True)]
                return _empty_like(leaves, shape)
            if all(all_same(list(col)) for col in zip(*(t.stride() for t in leaves), strict=True)):
                return first
            return _empty_like(leaves, list(first.shape))
        if isinstance(first, (int, torch.SymInt)) and not isinstance(first, bool):
            if all_same(list(leaves)):
                return first
            self._need_shape_env(leaves, path)
            return self.size(list(leaves), size=False)
        return first

    def size(self, values: Sequence[Any], *, size: bool) -> Any:
        """One int or SymInt for ``values`` (one per branch)."""
        if all_same(values):
            return values[0]
        assert self.shape_env is not None
        key = tuple(as_expr(v) for v in values)
        found = self._made.get(key)
        if found is None:
            found = self._related(key)
        if found is None:
            lows, highs = zip(*(value_bounds(self.shape_env, v) for v in values), strict=True)
            found = fresh_symint(self.shape_env, min(lows), max(highs), size=size)
            self._bases.append((key, found))
            if _observe.SINKS or _observe.structured_on():
                unified(self.op, self.roles, values, found, min(lows), max(highs))
        self._made[key] = found
        return found

    def _related(self, key: tuple[sympy.Expr, ...]) -> Any:
        """``a * s + b`` when ``key`` is that image of an earlier fresh symbol's tuple."""
        for base, sym in self._bases:
            ab = _affine(key, base)
            if ab is not None:
                return ab[0] * sym + ab[1]
        return None

    def _need_shape_env(self, leaves: Sequence[Any], path: str) -> None:
        if self.shape_env is None:
            raise _cannot_merge(self.op, self.roles, leaves, path)


def _affine(key: tuple[Any, ...], base: tuple[Any, ...]) -> tuple[int, int] | None:
    """Integers ``(a, b)``, ``a != 0``, with ``key[i] == a * base[i] + b`` for every branch."""
    try:
        a: Any = sympy.cancel((key[0] - key[1]) / (base[0] - base[1]))
        if not (a.is_Integer and a != 0):
            return None
        b = sympy.expand(key[0] - a * base[0])
        if not b.is_Integer or any(sympy.expand(k - a * t - b) != 0 for k, t in zip(key, base, strict=True)):
            return None
        return int(a), int(b)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError):
        return None


def _empty_like(leaves: Sequence[torch.Tensor], shape: list[Any]) -> torch.Tensor:
    """An empty tensor of ``shape`` laid out as the branches are: contiguous unless
    every branch is dense in one other dimension order."""
    first = leaves[0]
    orders = {dense_order(t) for t in leaves}
    order = orders.pop() if len(orders) == 1 else None
    if order is None or order == tuple(range(first.dim())):
        return first.new_empty(shape)
    return torch.empty_permuted(shape, order, dtype=first.dtype, device=first.device)


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order (outermost first) in which ``t`` is dense, if provably one."""
    dims = list(range(t.dim()))
    stride, shape = t.stride(), t.shape
    for i in range(1, len(dims)):  # an insertion sort: only provable comparisons move a dim
        j = i
        while j > 0 and statically_known_true(stride[dims[j]] > stride[dims[j - 1]]):
            dims[j - 1], dims[j] = dims[j], dims[j - 1]
            j -= 1
    expected: Any = 1
    for d in reversed(dims):
        if not (statically_known_true(shape[d] == 1) or statically_known_true(stride[d] == expected)):
            return None
        # torch's contiguous strides step over a size-0 dim as over a size-1 one
        expected = expected * (1 if statically_known_true(shape[d] == 0) else shape[d])
    return tuple(dims)


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


# --- runtime asserts ---------------------------------------------------------------------------


def assert_ranges(
    mode: Any,
    op: str,
    out: Any,
    fresh: Sequence[Fresh],
    *,
    root: str = "output",
    why: str = "the union of the branches' ranges",
) -> None:
    """Record, after the operator's node, an ``aten._assert_scalar`` for each bound of
    each fresh symbol, read from the first output that carries it plainly (Note [hop
    asserts its ranges])."""
    if not fresh:
        return
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    tracer, pending = mode.tracer, {f.expr: f for f in fresh}
    leaves = _pytree.flatten(out)[0]
    for path, leaf in zip(_pytree.leaf_paths(out, root), leaves, strict=True):
        sizes = (
            [(f"{path}.size({d})", s) for d, s in enumerate(leaf.shape)]
            if isinstance(leaf, torch.Tensor)
            else [(path, leaf)]
        )
        for where, s in sizes:
            f = pending.pop(s.node.expr, None) if isinstance(s, torch.SymInt) else None
            if f is None:
                continue
            sym: Any = s
            value = get_proxy_slot(sym, tracer).force()
            for bound, cmp, rel, word in ((f.low, operator.ge, sympy.Ge, ">="), (f.high, operator.le, sympy.Le, "<=")):
                if bound is None:
                    continue
                test = tracer.create_proxy("call_function", cmp, (value, bound), {})
                test.node.meta["val"] = sym.node.shape_env.create_symboolnode(rel(f.expr, bound))
                msg = f"hop.{op}: {where} must be {word} {bound} ({why})"
                check = tracer.create_proxy("call_function", torch.ops.aten._assert_scalar.default, (test, msg), {})
                check.node.meta["_fx_runtime_assert_preserve"] = True
                if _observe.SINKS or _observe.structured_on():
                    runtime_assert(op, msg)
