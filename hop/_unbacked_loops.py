"""Sizes that stand for every iteration of a loop (docs/dynamic_shapes.md).

A loop whose carries change size between iterations is traced once, on carries
whose changing dimensions are fresh unbacked symbols (:func:`generalize_carries`,
a fixpoint over the body's outputs) with the ranges the iterations can reach
(:func:`carry_ranges`); a scan or map body that makes sizes of its own per step has
them read back per step (:func:`per_step_sizes`). Built on ``hop._unbacked``'s
fresh symbols and ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from hop import _observe, _output_checks, _pytree, _tracing
from hop._observe_traced import unified
from hop._unbacked import all_same, as_expr, fresh_symint, value_bounds
from hop.errors import OutputMismatchError, format_message

__all__ = [
    "carry_ranges",
    "changed_dims",
    "generalize_carries",
    "generic_carry",
    "per_step_sizes",
    "rebind_sizes",
    "run_in_subgraph",
]


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
        return {d for d in range(c.dim()) if not all_same([c.shape[d], o.shape[d]])}
    return set() if all_same([c, o]) else {0}


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
    exprs = {key: as_expr(_quantity(out[key[0]], key[1])) for key in keys}
    floor = {key: 0 if isinstance(carried[key[0]], torch.Tensor) else -int_oo for key in keys}
    init = {key: ValueRanges(*value_bounds(shape_env, _quantity(carried[key[0]], key[1]))) for key in keys}

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
        fresh_symint(shape_env, *value_bounds(shape_env, s), size=True)
        if isinstance(s, torch.SymInt) and s.node.expr.free_symbols & local
        else s
        for s in t.shape
    ]
    return t.new_empty(shape)
