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

from hop.errors import CompileUnsupported, HopValueError, format_message

__all__ = [
    "INT_READS",
    "bound_int_outputs",
    "cond_needs_rewrite",
    "flat_tuple",
    "free_symbols",
    "growing_carries",
    "like_node",
    "node_outputs",
    "plain_symbols",
    "resized_carries",
    "rewrite_cond",
    "rewrite_switch",
    "sizes_from_inputs",
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


def node_outputs(node: torch.fx.Node) -> list[Any]:
    val = node.meta["val"]
    return list(val) if isinstance(val, (tuple, list)) else [val]


def like_node(node: torch.fx.Node, flat: Sequence[Any]) -> Any:
    """``flat`` in the node's output convention: a bare value for one output."""
    return tuple(flat) if isinstance(node.meta["val"], (tuple, list)) else flat[0]


def flat_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# Note [int outputs of branches]
# Inductor's conditional holds tensors only: a branch output that is an int (or a
# SymInt) leaves each branch as a 0-dim int64 CPU tensor and is read back after
# the cond with .item(). A value the branches agree on is known without the read:
# the node's int, or its symbolic size expressed in the inputs' sizes. A value
# they disagree on is an unbacked symbol the hop node defines; the read defines
# it instead (its node takes over the hop node's binding, see
# ``hop.compile._inductor_pass._rebind_items``, which finds each read by the symbol it
# returned, recorded under INT_READS), so the code after the cond, which uses that
# symbol, is unchanged.


def cond_needs_rewrite(node: torch.fx.Node) -> bool:
    """Whether a cond node has int outputs, or None operands (a backward graph passes
    None as the cotangent of an int output): Inductor's conditional takes neither."""
    operands = node.args[3]
    assert isinstance(operands, (tuple, list))
    return any(not isinstance(v, torch.Tensor) for v in node_outputs(node)) or any(o is None for o in operands)


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
    metas = node_outputs(node)

    def wrapped(*args: Any) -> tuple[Any, ...]:
        return tuple(
            _as_traced(name, v, meta, inputs)
            if isinstance(v, torch.Tensor)
            else v
            if v is None  # a branch that returns nothing (only writes state)
            else torch.full((), v, dtype=torch.int64, device="cpu")
            for v, meta in zip(flat_tuple(fn(*args)), metas, strict=True)
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
# into a contiguous buffer of those sizes. So is an empty output, whose strides torch
# may have left free (a symbol for the stride of a dimension of size 0), which torch's
# check cannot prove dense.


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
        # an empty output has no element a stride could misplace: any strides are dense
        empty = any(statically_known_true(d == 0) for d in meta.shape)
        dense = empty or all(
            statically_known_true(d == 1) or statically_known_true(st == want)
            for d, st, want in zip(meta.shape, meta.stride(), strides, strict=True)
        )

    def spelled(values: Sequence[Any]) -> list[Any]:
        return [v.node.expr if isinstance(v, torch.SymInt) else v for v in values]

    if not dense or (spelled(value.shape) == spelled(sizes) and spelled(value.stride()) == spelled(strides)):
        return value
    try:
        target = sizes_from_inputs(name, sizes, inputs)
    except HopValueError:  # a size no input holds (data-dependent): torch's lowering decides
        return value
    return torch.empty(target, dtype=value.dtype, device=value.device).copy_(value)


def _int_outputs(name: str, node: torch.fx.Node, out: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """The outputs of a cond whose branches were ``_tensor_outputs``, with the node's ints back."""
    bound = bound_int_outputs(node)
    result = []
    for k, (v, meta) in enumerate(zip(out, node_outputs(node), strict=True)):
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
            result.append(sizes_from_inputs(name, [meta], inputs)[0])
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
    return like_node(node, _int_outputs("cond", node, out, inputs))


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

    return like_node(node, _int_outputs("switch", node, list(pick(0, index, *operands)), inputs))


def sizes_from_inputs(name: str, sizes: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
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
