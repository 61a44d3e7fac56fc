"""The rewrites of ``map``, ``scan`` and ``associative_scan`` for hop's post-grad pass
(:mod:`hop.compile._inductor_pass`): each becomes a while loop over a counter that
writes each step's outputs into preallocated buffers (Note [scans as while loops]),
or, for an associative scan of static length, hop's own O(log n) algorithm traced
into plain ops. Traced as ``hop.compile._inductor_rewrites`` says of every rewrite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from hop.compile._inductor_in_place import DONATED, write_carries_in_place
from hop.compile._inductor_rewrites import (
    flat_tuple,
    free_symbols,
    like_node,
    node_outputs,
    plain_symbols,
    sizes_from_inputs,
)
from hop.ops.scanning.associative_scan import associative_scan_dense

__all__ = ["rewrite_associative_scan", "rewrite_map", "rewrite_scan"]

Fn = Callable[..., Any]
_check: Callable[..., None] = torch._check  # untyped in torch


def rewrite_map(
    node: torch.fx.Node, inputs: Sequence[Any], body: Fn, xs: Sequence[Any], additional: Sequence[Any]
) -> Any:
    _, ys = _scan_loop("map", body, (), xs, additional, False, node_outputs(node), inputs)
    return like_node(node, ys)


def rewrite_scan(
    node: torch.fx.Node,
    inputs: Sequence[Any],
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    if isinstance(body, torch.fx.GraphModule):  # Note [a written carry is written in place]
        # decided (and the body rewritten) by the pass before this trace, on the node's values
        written = write_carries_in_place(body, list(node.args[1]))  # type: ignore[arg-type]
        donated = node.meta.get(DONATED, frozenset())  # Note [a written graph input is the loop's own carry]
        init = [x.clone() if k in written and k not in donated else x for k, x in enumerate(init)]
    carry, ys = _scan_loop("scan", body, init, xs, additional, reverse, node_outputs(node)[len(init) :], inputs)
    return like_node(node, [*carry, *ys])


def rewrite_associative_scan(
    node: torch.fx.Node, inputs: Sequence[Any], combine: Fn, xs: Sequence[Any], additional: Sequence[Any], mode: str
) -> Any:
    """Static length: hop's parallel prefix, unrolled; symbolic: the sequential scan."""
    n = xs[0].shape[0]
    if isinstance(n, int):
        return like_node(node, flat_tuple(associative_scan_dense(combine, xs, additional, mode)))
    # ys[0] = xs[0] by a loop of at most one step (a slice [:1] would need n >= 1),
    # then ys[k] = combine(ys[k - 1], xs[k]).
    nx = len(xs)
    ys = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]

    def first(k: Any, *state: Any) -> tuple[Any, ...]:
        for y, x in zip(state[:nx], state[nx:], strict=True):
            y.select(0, k).copy_(x.select(0, k))
        return state[:nx]

    def step(k: Any, *state: Any) -> tuple[Any, ...]:
        ys_, xs_, add = state[:nx], state[nx : 2 * nx], state[2 * nx :]
        out = flat_tuple(combine(*(y.select(0, k - 1) for y in ys_), *(x.select(0, k) for x in xs_), *add))
        for y, o in zip(ys_, out, strict=True):
            y.select(0, k).copy_(o)
        return ys_

    ys = _counted_loop(0, n, first, ys, xs, inputs, last=0)
    return like_node(node, _counted_loop(1, n, step, ys, (*xs, *additional), inputs))


# Note [scans as while loops]
# scan(body, init, xs, additional, reverse) becomes
#
#     ys = [empty(n, *y.shape) for each y]             sizes from the node's meta["val"]
#     k, ys, carry = while_loop(k < n, body', (0, ys, init), (xs, additional))
#     body'(k, ys, carry, xs, additional):
#         carry, y = body(carry, xs[k], additional);  ys[k].copy_(y)
#         return k + 1, ys, carry
#
# (reverse: k counts down from n - 1 while k >= 0). The counter is a 0-dim int64
# CPU tensor read with .item(), as torch's own scan lowering does, so a CUDA loop
# does not synchronize on its condition. Writing into ys in place keeps one
# buffer per output instead of a copy per step.
#
# The body checks the unbacked int against the bounds the tracer needs, but
# never against a symbolic length n: a check k < n (or n - 1 - k >= 0) with k >= 0
# makes the ShapeEnv refine n >= 1 for the whole program, and Inductor asserts
# that where n is bound, so a data-dependent length that is 0 (x[mask] with no
# element) failed before the loop (which runs no step) was reached.


def _scan_loop(
    name: str,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
    ys_meta: Sequence[Any],
    inputs: Sequence[Any],
) -> tuple[list[Any], list[Any]]:
    """Note [scans as while loops]: the final carry and the stacked outputs."""
    nc, ny, nx = len(init), len(ys_meta), len(xs)
    ys = [
        torch.empty_strided(
            sizes_from_inputs(name, y.shape, inputs),
            sizes_from_inputs(name, y.stride(), inputs),
            dtype=y.dtype,
            device=y.device,
        )
        for y in ys_meta
    ]

    dense = _traced_contiguous(body)

    def step(t: Any, *state: Any) -> tuple[Any, ...]:
        ys_, carry, rest = state[:ny], state[ny : ny + nc], state[ny + nc :]
        args = (*carry, *(x.select(0, t) for x in rest[:nx]), *rest[nx:])
        out = flat_tuple(body(*(_dense_like(name, a, inputs) if j in dense else a for j, a in enumerate(args))))
        for y, o in zip(ys_, out[nc:], strict=True):
            y.select(0, t).copy_(o)
        return (*ys_, *map(_dense, out[:nc]))

    n = xs[0].shape[0]
    out = _counted_loop(0, n, step, (*ys, *map(_dense, init)), (*xs, *additional), inputs, descending=reverse)
    return list(out[ny:]), list(out[:ny])


def _traced_contiguous(body: Fn) -> set[int]:
    """The inputs of a body graph that it was traced with as contiguous tensors.

    A body runs in the loop on what the rewrite gives it: a slice of a scanned
    tensor laid out otherwise (a scan over dim 1 sees slices of stride (n,)) would
    reach a loop nested in the body with strides its carries do not keep, which
    torch's while_loop refuses. Such an input is made contiguous, as traced.
    """
    if not isinstance(body, torch.fx.GraphModule):
        return set()
    traced = [p.meta.get("val") for p in body.graph.find_nodes(op="placeholder")]
    return {j for j, v in enumerate(traced) if isinstance(v, torch.Tensor) and _is_dense(v)}


def _buffer(name: str, template: torch.Tensor, inputs: Sequence[Any]) -> torch.Tensor:
    """An empty tensor with the (maybe symbolic) sizes and strides of ``template``."""
    sizes, strides = sizes_from_inputs(name, template.shape, inputs), sizes_from_inputs(name, template.stride(), inputs)
    return torch.empty_strided(sizes, strides, dtype=template.dtype, device=template.device)


def _dense(t: Any) -> Any:
    """``t``, or a contiguous copy if its strides may differ from contiguous ones.

    A loop carry keeps its strides across iterations (torch's while_loop checks
    it), and a gradient carry is often an expanded (stride-0) tensor.
    """
    if not isinstance(t, torch.Tensor) or _is_dense(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _dense_like(name: str, t: Any, inputs: Sequence[Any]) -> Any:
    """``t``, or a contiguous copy whose sizes are built from the traced inputs' (a
    size the meta holds as an expression, ``(s**3)//(s**2)``, is no value the rewrite's
    tracer knows)."""
    if not isinstance(t, torch.Tensor) or _is_dense(t):
        return t
    return torch.empty(sizes_from_inputs(name, t.shape, inputs), dtype=t.dtype, device=t.device).copy_(t)


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are known to be contiguous ones, size-1 dims included:
    a (n, 1) slice of stride (1, n) is copied too, since a body traced on stride
    (1, 1) that returns it beside a new tensor from a cond's branches would give
    torch's cond branch outputs whose stride orders differ, which it refuses.
    Decided on the sizes' expressions: no guard is added, and no SymInt arithmetic
    is traced (a size a meta holds may be no value the rewrite's tracer knows)."""
    import sympy

    def expr(v: Any) -> Any:
        return v.node.expr if isinstance(v, torch.SymInt) else sympy.Integer(v)

    expected: Any = sympy.Integer(1)
    for size, stride in reversed(list(zip(map(expr, t.shape), map(expr, t.stride()), strict=True))):
        if sympy.expand(stride - expected) != 0:
            return False
        # torch's contiguous strides step over a size-0 dim as over a size-1 one: an
        # empty (n, 0, 0) is (1, 1, 1), and a stride-0 one is copied
        expected = expected * (sympy.Integer(1) if size == 0 else size)
    return True


def _counted_loop(
    start: int,
    stop: Any,
    step: Fn,
    carried: Sequence[Any],
    additional: Sequence[Any],
    inputs: Sequence[Any],
    last: int | None = None,
    descending: bool = False,
) -> list[Any]:
    """``for k in range(start, min(stop, last + 1)): carried = step(k, *carried, *additional)``
    as torch's while_loop (with ``descending``, ``k`` runs from ``stop - 1`` down to
    ``start``; ``last`` is then not given).

    A symbolic ``stop`` travels as an input of the loop (a size closed over would not
    be known to the tracers of the loop's functions), and so does each symbol of the
    loop's sizes that no tensor of the loop holds as a size (Inductor binds a
    subgraph's symbols from its inputs). ``last`` caps the counter in the condition
    (a ``sym_min`` in ``stop`` would be resolved at trace time).
    """
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(stop <= start):
        # No step runs: the body must not be traced, its checks (start <= k < stop)
        # would fail at trace time. The outputs are copies, as the loop's would be.
        return [c.clone() if isinstance(c, torch.Tensor) else c for c in carried]
    symbolic = isinstance(stop, torch.SymInt)
    # a float among the inputs (one Dynamo lifted, which Inductor made a constant;
    # torch 2.13 leaves it a SymFloat of a number) is closed over: torch's while_loop
    # takes tensors and ints only
    floats = {j: f for j, a in enumerate(additional) if (f := _constant_float(a)) is not None}
    passed = [a for j, a in enumerate(additional) if j not in floats]
    values = [*carried, *passed, *([stop] if symbolic else [])]
    known = plain_symbols(inputs)
    lifted = [known[s] for s in sorted(free_symbols(values) - plain_symbols(values).keys(), key=str) if s in known]
    extra = (*passed, *lifted, *([stop] if symbolic else []))
    nc, own = len(carried), len(passed) + len(carried)

    def with_floats(rest: tuple[Any, ...]) -> tuple[Any, ...]:
        given = iter(rest[nc:own])
        return (*rest[:nc], *(floats[j] if j in floats else next(given) for j in range(len(additional))))

    counter = torch.full((), stop - 1 if descending else start, dtype=torch.int64, device="cpu")

    def bound(rest: tuple[Any, ...]) -> Any:
        return rest[-1] if symbolic else stop

    def cond_fn(i: Any, *rest: Any) -> Any:
        if descending:
            return i >= start
        n = bound(rest)
        return (i < n) if last is None else (i < n) & (i <= last)

    def body_fn(i: Any, *rest: Any) -> tuple[Any, ...]:
        k = i.item()
        _check(k >= start)
        if not symbolic:  # Note [scans as while loops]: never checked against a symbolic length
            _check(k < stop)
        return (i - 1 if descending else i + 1, *step(k, *with_floats(rest)))

    out = torch.ops.higher_order.while_loop(cond_fn, body_fn, (counter, *carried), extra)
    return list(out[1:])


def _constant_float(value: Any) -> float | None:
    """``value`` as a Python float if it is a float or a SymFloat of a number."""
    if isinstance(value, float):
        return value
    if isinstance(value, torch.SymFloat) and value.node.expr.is_number:
        return float(value.node.expr)
    return None
