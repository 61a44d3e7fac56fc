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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from hop import _observe, _output_checks, _pytree, _tracing
from hop.errors import OutputMismatchError, format_message

__all__ = [
    "Fresh",
    "Unifier",
    "assert_ranges",
    "assume_range",
    "dense_order",
    "carry_ranges",
    "changed_dims",
    "generic_carry",
    "generalize_carries",
    "recording",
    "run_in_subgraph",
    "per_step_sizes",
    "rebind_sizes",
    "fresh_symint",
    "trial_run",
    "unrecorded_symbols",
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


def _bounds(shape_env: ShapeEnv, value: Any) -> tuple[Any, Any]:
    """The value range of an int or SymInt, as sympy numbers (int_oo when unbounded)."""
    if isinstance(value, int):
        return sympy.Integer(value), sympy.Integer(value)
    vr = shape_env.bound_sympy(value.node.expr)
    return vr.lower, vr.upper


def _expr(value: Any) -> sympy.Expr:
    return sympy.Integer(value) if isinstance(value, int) else value.node.expr


def _same(values: Sequence[Any]) -> bool:
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
            if not all(_same([t.shape[d] for t in leaves]) for d in range(first.dim())):
                self._need_shape_env(leaves, path)
                shape = [self.size(list(col), size=True) for col in zip(*(t.shape for t in leaves), strict=True)]
                return _empty_like(leaves, shape)
            if all(_same(list(col)) for col in zip(*(t.stride() for t in leaves), strict=True)):
                return first
            return _empty_like(leaves, list(first.shape))
        if isinstance(first, (int, torch.SymInt)) and not isinstance(first, bool):
            if _same(list(leaves)):
                return first
            self._need_shape_env(leaves, path)
            return self.size(list(leaves), size=False)
        return first

    def size(self, values: Sequence[Any], *, size: bool) -> Any:
        """One int or SymInt for ``values`` (one per branch)."""
        if _same(values):
            return values[0]
        assert self.shape_env is not None
        key = tuple(_expr(v) for v in values)
        found = self._made.get(key)
        if found is None:
            found = self._related(key)
        if found is None:
            lows, highs = zip(*(_bounds(self.shape_env, v) for v in values), strict=True)
            found = fresh_symint(self.shape_env, min(lows), max(highs), size=size)
            self._bases.append((key, found))
            if _observe.SINKS or _observe.structured_on():
                from hop._observe_traced import unified

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
                    from hop._observe_traced import runtime_assert

                    runtime_assert(op, msg)


# --- loops: carries that stand for every iteration ----------------------------------------------


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

    What the body changes (an int carry, a tensor dimension) becomes an unbacked
    SymInt; what it keeps is kept. With ``fresh``, they are new pending symbols for
    the operator's output, with the ranges :func:`_loop_ranges` derives; otherwise
    ignored placeholders, to trace the body and condition with.
    """
    generic, out, varying = _fixpoint(op, body_fn, carried, additional, shape_env)
    if not fresh or shape_env is None or not any(varying):
        return generic
    ranges = _loop_ranges(shape_env, carried, generic, out, varying)
    env = shape_env

    def make(k: int) -> Callable[[Any, int], Any]:
        def made(c: Any, d: int) -> Any:
            sym = fresh_symint(env, *ranges[k, d], size=isinstance(c, torch.Tensor))
            if _observe.SINKS or _observe.structured_on():
                from hop._observe_traced import unified

                where = f"carry[{k}].size({d})" if isinstance(c, torch.Tensor) else f"carry[{k}]"
                unified(op, (f"{where} on entry",), (_quantity(c, d),), sym, *ranges[k, d])
            return sym

        return made

    return tuple(_generalize(c, v, make(k)) for k, (c, v) in enumerate(zip(carried, varying, strict=True)))


def carry_ranges(
    op: str, body_fn: Callable[..., Any], carried: tuple[Any, ...], additional: tuple[Any, ...], shape_env: ShapeEnv
) -> list[tuple[Any, Any] | None]:
    """For each int carry the body changes, the range of its final value; else None."""
    generic, out, varying = _fixpoint(op, body_fn, carried, additional, shape_env)
    ranges = _loop_ranges(shape_env, carried, generic, out, varying)
    return [
        ranges[k, 0] if v and not isinstance(c, torch.Tensor) else None
        for k, (c, v) in enumerate(zip(carried, varying, strict=True))
    ]


def _fixpoint(
    op: str,
    body_fn: Callable[..., Any],
    carried: tuple[Any, ...],
    additional: tuple[Any, ...],
    shape_env: ShapeEnv | None,
) -> tuple[tuple[Any, ...], tuple[Any, ...], list[set[int]]]:
    """Runs ``body_fn`` (inside the caller's fake mode) until the set of changing
    quantities stops growing. Returns the generic carries (placeholders for what
    changes), the body's output on them, and what changes per carry (dims of a
    tensor, ``{0}`` for an int)."""
    varying: list[set[int]] = [set() for _ in carried]
    # a literal's value is the first step's only; a layout the body was not traced on, not even that
    carried = tuple(_tracing.traced_layout(_tracing.unknown_value(c)) for c in carried)
    current, out = carried, carried
    run = _tracing.per_element_sizes(body_fn)  # carries batched under pre-dispatch vmap
    for _ in range(8):
        ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else nullcontext()
        with ignore:
            out = as_tuple(run(*current, *additional))
        # the raw op's body is not checked by the user function: one output per carry, of its kind
        roles = ("carried_inputs", "body_fn")
        _output_checks.check_same_outputs(op, roles, (current, out), root="carry", fns=(None, body_fn))
        grew = False
        for k, (c, o) in enumerate(zip(current, out, strict=True)):
            new = changed_dims(c, o) - varying[k]
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
            current = tuple(generic_carry(shape_env, c, v) for c, v in zip(carried, varying, strict=True))
    return current, out, varying


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def changed_dims(c: Any, o: Any) -> set[int]:
    """What a step changes of carry ``c``, given the step's output ``o``: the dims of a
    tensor whose sizes differ, ``{0}`` for an int whose value does."""
    if isinstance(c, torch.Tensor):
        return {d for d in range(c.dim()) if not _same([c.shape[d], o.shape[d]])}
    return set() if _same([c, o]) else {0}


def _quantity(c: Any, d: int) -> Any:
    return c.shape[d] if isinstance(c, torch.Tensor) else c


def generic_carry(shape_env: ShapeEnv, c: Any, varying: set[int]) -> Any:
    """``c`` with a fresh unbacked symbol for each quantity in ``varying`` (dims of a
    tensor, ``{0}`` for an int): a size for a tensor, any value for an int."""
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    def placeholder(c: Any, d: int) -> Any:
        sym = shape_env.create_unbacked_symint()
        if isinstance(c, torch.Tensor):
            _constrain_range_for_size(sym)
        return sym

    return _generalize(c, varying, placeholder)


def _generalize(c: Any, varying: set[int], make: Callable[[Any, int], Any]) -> Any:
    if not varying:
        return c
    if not isinstance(c, torch.Tensor):
        return make(c, 0)
    shape: list[Any] = list(c.shape)
    for d in sorted(varying):
        shape[d] = make(c, d)
    return c.new_empty(shape)


def _loop_ranges(
    shape_env: ShapeEnv,
    carried: tuple[Any, ...],
    generic: tuple[Any, ...],
    out: tuple[Any, ...],
    varying: list[set[int]],
) -> dict[tuple[int, int], tuple[Any, Any]]:
    """The range of every changing quantity after any number of iterations.

    Interval analysis of ``R = init | step(R)``, where ``step`` bounds what one
    iteration makes (``out`` in terms of the ``generic`` placeholders): the bounds
    one iteration moves are widened to infinity (0 below, for sizes), everything if
    that is not yet closed under ``step``; then narrowed twice with
    ``R = init | step(R)``, which stays sound because interval bounds are monotone.
    """
    keys = [(k, d) for k, v in enumerate(varying) for d in sorted(v)]
    syms = {key: _quantity(generic[key[0]], key[1]).node.expr for key in keys}
    exprs = {key: _expr(_quantity(out[key[0]], key[1])) for key in keys}
    floor = {key: 0 if isinstance(carried[key[0]], torch.Tensor) else -int_oo for key in keys}
    init = {key: ValueRanges(*_bounds(shape_env, _quantity(carried[key[0]], key[1]))) for key in keys}

    def step(ranges: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
        env = {**shape_env.var_to_range, **{syms[key]: ranges[key] for key in keys}}
        return {key: bound_sympy(exprs[key], env) & ValueRanges(floor[key], int_oo) for key in keys}

    once = {key: r | init[key] for key, r in step(init).items()}
    ranges = {  # widen every bound one iteration moves
        key: ValueRanges(
            init[key].lower if once[key].lower == init[key].lower else floor[key],
            init[key].upper if once[key].upper == init[key].upper else int_oo,
        )
        for key in keys
    }
    if not all(r.issubset(ranges[key]) for key, r in step(ranges).items()):
        ranges = {key: ValueRanges(floor[key], int_oo) for key in keys}
    for _ in range(2):  # narrowing
        ranges = {key: r | init[key] for key, r in step(ranges).items()}
    return {key: (r.lower, r.upper) for key, r in ranges.items()}


# --- scans: sizes made inside the body ------------------------------------------------------------


def per_step_sizes(gm: torch.fx.GraphModule, n_stepped: int, outputs: range) -> list[tuple[int, int, Any]]:
    """``(output, dim, symbol)`` for every size of ``outputs`` (indices into ``gm``'s
    flat outputs) that mentions an unbacked symbol ``gm`` computes from one of its
    first ``n_stepped`` inputs (the carry and the slices, which change every step):
    such a size may differ between steps, so the outputs cannot be stacked."""
    tainted: set[torch.fx.Node] = set()
    stepped_syms: set[Any] = set()
    placeholders = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if placeholders < n_stepped:
                tainted.add(node)
            placeholders += 1
        elif any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
            stepped_syms |= set(node.meta.get("unbacked_bindings") or ())
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = _pytree.flatten(out_node.args[0])[0]
    found: list[tuple[int, int, Any]] = []
    for k in outputs:
        val = flat[k].meta.get("val") if isinstance(flat[k], torch.fx.Node) else None
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            syms: set[Any] = size.node.expr.free_symbols & stepped_syms if isinstance(size, torch.SymInt) else set()
            found.extend((k, d, sym) for sym in sorted(syms, key=str))
    return found


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
        fresh_symint(shape_env, *_bounds(shape_env, s), size=True)
        if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & local
        else s
        for s in t.shape
    ]
    return t.new_empty(shape)
