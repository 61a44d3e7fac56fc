"""The rewrites of hop's post-grad pass (:mod:`hop.compile.inductor`).

Each ``rewrite(node, inputs, *args)`` is traced by Inductor's pattern matcher
(``Match.replace_by_example``) in place of one ``torch.ops.hop`` node: ``args``
are the node's arguments with subgraphs as GraphModules and tensors as fake
values, ``inputs`` every traced value (including the nodes that define the
symbols of their sizes). The result uses torch's ``cond`` and ``while_loop``
(whose loop bodies may write their carries in place, which hop's ops refuse when
tracing) and plain aten ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from hop.compile._inductor_in_place import DONATED, write_carries_in_place
from hop.errors import CompileUnsupported, HopValueError, format_message
from hop.ops.associative_scan import associative_scan_dense, associative_scan_op
from hop.ops.map import map_op
from hop.ops.scan import scan_op
from hop.ops.switch import switch_op

__all__ = [
    "REWRITES",
    "INT_READS",
    "bound_int_outputs",
    "cond_needs_rewrite",
    "free_symbols",
    "growing_carries",
    "plain_symbols",
    "resized_carries",
    "rewrite_cond",
    "rewrite_switch",
]

Fn = Callable[..., Any]
_check: Callable[..., None] = torch._check  # untyped in torch


def free_symbols(values: Sequence[Any]) -> set[Any]:
    from torch.fx.experimental import symbolic_shapes

    return set().union(
        *(symbolic_shapes.free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt)))
    )


def plain_symbols(values: Sequence[Any]) -> dict[Any, Any]:
    """symbol -> SymInt, for each value that is a single-symbol SymInt or has such a size."""
    out: dict[Any, Any] = {}
    for v in values:
        for s in v.shape if isinstance(v, torch.Tensor) else (v,):
            if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                out.setdefault(s.node.expr, s)
    return out


def resized_carries(carried: Sequence[Any], outputs: Sequence[Any]) -> list[str]:
    """``"carry k, dim d"`` for each tensor carry dimension whose size the loop may change."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return [
        f"carry {k}, dim {d}"
        for k, (c, o) in enumerate(zip(carried, outputs, strict=True))
        if isinstance(c, torch.Tensor)
        for d in range(c.dim())
        if not statically_known_true(c.shape[d] == o.shape[d])
    ]


def growing_carries(op: str, resized: Sequence[str]) -> CompileUnsupported:
    """Inductor's while loop preallocates each carry once, at its initial size: a loop
    whose carries grow or shrink has no lowering there (aot_eager runs it)."""
    what = (
        f"loop carries that change size between iterations ({'; '.join(resized)}) do not compile with"
        " Inductor, whose while loop keeps every carry at its initial size"
    )
    fix = (
        'Compile with backend="aot_eager", or pad the carries to a fixed size (with a length or mask'
        " carry for the valid part)."
    )
    return CompileUnsupported(format_message(op, what, fix=fix), op=op)


def _outputs(node: torch.fx.Node) -> list[Any]:
    val = node.meta["val"]
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _like_node(node: torch.fx.Node, flat: Sequence[Any]) -> Any:
    """``flat`` in the node's output convention: a bare value for one output."""
    return tuple(flat) if isinstance(node.meta["val"], (tuple, list)) else flat[0]


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# Note [int outputs of branches]
# Inductor's conditional holds tensors only: a branch output that is an int (or a
# SymInt) leaves each branch as a 0-dim int64 CPU tensor and is read back after
# the cond with .item(). A value the branches agree on is known without the read:
# the node's int, or its symbolic size expressed in the inputs' sizes. A value
# they disagree on is an unbacked symbol the hop node defines; the read defines
# it instead (its node takes over the hop node's binding, see
# ``hop.compile.inductor._rebind_items``, which finds each read by the symbol it
# returned, recorded under INT_READS), so the code after the cond, which uses that
# symbol, is unchanged.


def cond_needs_rewrite(node: torch.fx.Node) -> bool:
    """Whether a cond node has int outputs, or None operands (a backward graph passes
    None as the cotangent of an int output): Inductor's conditional takes neither."""
    operands = node.args[3]
    assert isinstance(operands, (tuple, list))
    return any(not isinstance(v, torch.Tensor) for v in _outputs(node)) or any(o is None for o in operands)


def _drop_nones(operands: Sequence[Any], fns: Sequence[Fn]) -> tuple[tuple[Any, ...], list[Fn]]:
    """The operands that are not None, and ``fns`` taking those, passing None in place
    of the others (Inductor cannot hold a None as an operand)."""

    def full(kept: Sequence[Any]) -> list[Any]:
        it = iter(kept)
        return [None if o is None else next(it) for o in operands]

    return tuple(o for o in operands if o is not None), [lambda *kept, f=f: f(*full(kept)) for f in fns]


# meta key of a branching node being rewritten: output position -> the symbols its
# .item() reads got in the rewrite's traces (one per trace)
INT_READS = "hop_int_reads"


def bound_int_outputs(node: torch.fx.Node) -> dict[int, Any]:
    """output position -> the unbacked symbol the node defines there, for int outputs."""
    bare = not isinstance(node.meta["val"], (tuple, list))
    out = {}
    for symbol, path in (node.meta.get("unbacked_bindings") or {}).items():
        if bare and not path:
            out[0] = symbol
        elif len(path) == 1 and isinstance(path[0], torch.utils._pytree.SequenceKey):
            out[path[0].idx] = symbol
    return out


def _refuse_resized(name: str, node: torch.fx.Node, what: str, fix: str) -> None:
    """torch's cond, which the rewrite builds, cannot unify data-dependent output sizes
    that differ between branches (hop's cond, lowered directly, can): refuse such a node.
    Its unbacked symbols at a tensor's size have paths longer than an output position."""
    if any(len(path) > 1 for path in (node.meta.get("unbacked_bindings") or {}).values()):
        what = f"{what} (a data-dependent size) do not compile with Inductor"
        raise CompileUnsupported(format_message(name, what, fix=fix), op=name)


def _tensor_outputs(fn: Fn, name: str, node: torch.fx.Node, inputs: Sequence[Any]) -> Fn:
    """``fn`` with its int outputs as 0-dim int64 tensors (Note [int outputs of branches])
    and its tensor outputs laid out as the node's (Note [branch outputs as the node's])."""
    metas = _outputs(node)

    def wrapped(*args: Any) -> tuple[Any, ...]:
        return tuple(
            _as_traced(name, v, meta, inputs)
            if isinstance(v, torch.Tensor)
            else v
            if v is None  # a branch that returns nothing (only writes state)
            else torch.full((), v, dtype=torch.int64, device="cpu")
            for v, meta in zip(_as_tuple(fn(*args)), metas, strict=True)
        )

    return wrapped


# Note [branch outputs as the node's]
# A branch graph retraced here may give an output a size that equals a plain size
# but is spelled otherwise ((s**2)//s for s: a reshape to a shape read from a tensor
# that was itself reshaped), in the node's meta too. torch's cond merges the
# branches' strides by matching their expressions, and fails on such a spelling
# ("output stride is not a simple accumulative multiplication of sizes"). A dense
# output is given the plain spelling: each such size is replaced by an input's size
# the shape environment knows it equals, and an output spelled otherwise is copied
# into a contiguous buffer of those sizes.


def _as_traced(name: str, value: torch.Tensor, meta: Any, inputs: Sequence[Any]) -> torch.Tensor:
    """Note [branch outputs as the node's]."""
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(meta, torch.Tensor) or value.dim() != meta.dim():
        return value
    plain = list(plain_symbols(inputs).values())

    def simplest(size: Any) -> Any:
        if not isinstance(size, torch.SymInt) or size.node.expr.is_Symbol:
            return size
        return next((p for p in plain if statically_known_true(size == p)), size)

    # decided on the meta's values, which the rewrite's tracer does not know
    with proxy_tensor.disable_proxy_modes_tracing():
        sizes = [simplest(d) for d in meta.shape]
        strides: list[Any] = []
        expected: Any = 1
        for size in reversed(sizes):
            strides.insert(0, expected)
            expected = expected * size
        dense = all(
            statically_known_true(d == 1) or statically_known_true(st == want)
            for d, st, want in zip(meta.shape, meta.stride(), strides, strict=True)
        )

    def spelled(values: Sequence[Any]) -> list[Any]:
        return [v.node.expr if isinstance(v, torch.SymInt) else v for v in values]

    if not dense or (spelled(value.shape) == spelled(sizes) and spelled(value.stride()) == spelled(strides)):
        return value
    try:
        target = _sizes(name, sizes, inputs)
    except HopValueError:  # a size no input holds (data-dependent): torch's lowering decides
        return value
    return torch.empty(target, dtype=value.dtype, device=value.device).copy_(value)


def _int_outputs(name: str, node: torch.fx.Node, out: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """The outputs of a cond whose branches were ``_tensor_outputs``, with the node's ints back."""
    bound = bound_int_outputs(node)
    result = []
    for k, (v, meta) in enumerate(zip(out, _outputs(node), strict=True)):
        if isinstance(meta, torch.Tensor):
            result.append(v)
        elif k in bound:
            read = v.item()
            # which read defines which symbol, for _rebind_items: by the read's own
            # symbol, not by its place among the reads the rewrite traced
            if isinstance(read, torch.SymInt) and read.node.expr.is_Symbol:
                node.meta.setdefault(INT_READS, {}).setdefault(k, set()).add(read.node.expr)
            result.append(read)
        elif isinstance(meta, torch.SymInt):
            result.append(_sizes(name, [meta], inputs)[0])
        else:
            result.append(meta)
    return result


def rewrite_cond(
    node: torch.fx.Node, inputs: Sequence[Any], pred: Any, true_fn: Fn, false_fn: Fn, operands: Any
) -> Any:
    """A cond with int outputs (Note [int outputs of branches]) or None operands; others
    go to Inductor's lowering as they are."""
    _refuse_resized(
        "cond",
        node,
        "branches returning ints beside outputs whose sizes differ between the branches",
        'Return such an int as a 0-dim tensor (torch.tensor(n)), or compile with backend="aot_eager".',
    )
    operands, (true_fn, false_fn) = _drop_nones(operands, (true_fn, false_fn))
    branches = (_tensor_outputs(fn, "cond", node, inputs) for fn in (true_fn, false_fn))
    out = torch.ops.higher_order.cond(pred, *branches, operands)
    return _like_node(node, _int_outputs("cond", node, out, inputs))


def rewrite_switch(
    node: torch.fx.Node, inputs: Sequence[Any], index: Any, operands: Sequence[Any], *branches: Fn
) -> Any:
    """``branches[index](*operands)`` as nested conds; an index out of range fails an assert."""
    _refuse_resized(
        "switch",
        node,
        "branches whose output sizes differ",
        'Pad the branches\' outputs to one size, nest hop.cond calls, or compile with backend="aot_eager".',
    )
    n = len(branches)
    if isinstance(index, torch.Tensor):
        torch._assert_async((index >= 0) & (index < n), f"hop.switch: index out of range for {n} branches")
    else:
        _check(index >= 0)
        _check(index < n)
    operands, kept = _drop_nones(operands, branches)
    wrapped = [_tensor_outputs(b, "switch", node, inputs) for b in kept]
    flat = [lambda i, *ops, b=b: b(*ops) for b in wrapped]

    def pick(k: int, i: Any, *ops: Any) -> Any:
        if k == n - 1:
            return flat[k](i, *ops)
        return torch.ops.higher_order.cond(i == k, flat[k], lambda *a: pick(k + 1, *a), (i, *ops))

    return _like_node(node, _int_outputs("switch", node, list(pick(0, index, *operands)), inputs))


def rewrite_map(
    node: torch.fx.Node, inputs: Sequence[Any], body: Fn, xs: Sequence[Any], additional: Sequence[Any]
) -> Any:
    _, ys = _scan_loop("map", body, (), xs, additional, False, _outputs(node), inputs)
    return _like_node(node, ys)


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
    carry, ys = _scan_loop("scan", body, init, xs, additional, reverse, _outputs(node)[len(init) :], inputs)
    return _like_node(node, [*carry, *ys])


def rewrite_associative_scan(
    node: torch.fx.Node, inputs: Sequence[Any], combine: Fn, xs: Sequence[Any], additional: Sequence[Any], mode: str
) -> Any:
    """Static length: hop's parallel prefix, unrolled; symbolic: the sequential scan."""
    n = xs[0].shape[0]
    if isinstance(n, int):
        return _like_node(node, _as_tuple(associative_scan_dense(combine, xs, additional, mode)))
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
        out = _as_tuple(combine(*(y.select(0, k - 1) for y in ys_), *(x.select(0, k) for x in xs_), *add))
        for y, o in zip(ys_, out, strict=True):
            y.select(0, k).copy_(o)
        return ys_

    ys = _counted_loop(0, n, first, ys, xs, inputs, last=0)
    return _like_node(node, _counted_loop(1, n, step, ys, (*xs, *additional), inputs))


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
            _sizes(name, y.shape, inputs), _sizes(name, y.stride(), inputs), dtype=y.dtype, device=y.device
        )
        for y in ys_meta
    ]

    dense = _traced_contiguous(body)

    def step(t: Any, *state: Any) -> tuple[Any, ...]:
        ys_, carry, rest = state[:ny], state[ny : ny + nc], state[ny + nc :]
        args = (*carry, *(x.select(0, t) for x in rest[:nx]), *rest[nx:])
        out = _as_tuple(body(*(_dense_like(name, a, inputs) if j in dense else a for j, a in enumerate(args))))
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
    sizes, strides = _sizes(name, template.shape, inputs), _sizes(name, template.stride(), inputs)
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
    return torch.empty(_sizes(name, t.shape, inputs), dtype=t.dtype, device=t.device).copy_(t)


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


def _sizes(name: str, sizes: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """Symbolic sizes (of a meta value) as expressions of the traced inputs' sizes:
    an input's size that is the same expression, else one built from input sizes
    that are single symbols."""
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    same: dict[Any, Any] = {}
    for x in inputs:
        for s in x.shape if isinstance(x, torch.Tensor) else (x,):
            if isinstance(s, torch.SymInt):
                same.setdefault(s.node.expr, s)
    symbols = plain_symbols(inputs)
    out = []
    for s in sizes:
        if not isinstance(s, torch.SymInt):
            out.append(s)
        elif s.node.expr in same:
            out.append(same[s.node.expr])
        elif s.node.expr.free_symbols <= symbols.keys():
            out.append(sympy_interp(PythonReferenceAnalysis, symbols, s.node.expr))
        else:
            raise HopValueError(
                format_message(name, f"Inductor: an output size {s} cannot be computed from the sizes of the inputs"),
                op=name,
            )
    return out


REWRITES: dict[Any, Fn] = {
    switch_op: rewrite_switch,
    map_op: rewrite_map,
    scan_op: rewrite_scan,
    associative_scan_op: rewrite_associative_scan,
}
