"""``associative_scan``'s backward in log depth, for a combine_fn elementwise in its carry.

Note [a parallel backward for an elementwise combine]
The traced associative scan is differentiated as the sequential scan it equals,
``y[0] = x[0]``, ``y[t] = c(y[t - 1], x[t])``. Its adjoint ``lam[t]`` (the gradient
reaching ``y[t]`` from every later step) satisfies

    lam[n - 1] = g[n - 1]
    lam[t]     = g[t] + J[t + 1]^T lam[t + 1]       J[t] = dc/dy at (y[t - 1], x[t])

and the input gradients are ``g_x[0] = lam[0]``, ``g_x[t] = (dc/dx at step t)^T lam[t]``
(one batched vjp of ``c`` over every step at once, which also sums the gradients
of the additional inputs). The recurrence is linear, so it is itself an associative
scan of affine maps ``lam -> b + A lam``, composed by ``(A2 A1, b2 + A2 b1)``: log
depth instead of n dependent steps. Materializing ``A`` costs one k x k matrix per
element when ``c`` is elementwise in its carry, i.e. element p of every output
depends on element p of the k carry leaves only (any mixing of ``x``, of the
additional inputs, and of the carry leaves with one another is allowed): then row i
of ``A^T`` is the vjp of a cotangent of ones on output i, and the entries no output
reads are left out (the linear recurrence's ``A`` is diagonal: two independent
scalar recurrences, not a 2 x 2 one).

Forward mode keeps the sequential scan of the jvp: the same recurrence run forwards
needs torch.func.jvp over every step at once, and torch traces the zero tangents of
an operand without one at one example's sizes, which a symbolic length breaks.

Whether ``c`` is elementwise in its carry is decided by running it once on fake
slices under :class:`_CarryFlow`, which follows every value computed from the carry
and accepts only pointwise operators (and copies) that keep the carry's shape. A
``c`` it cannot prove so (a reduction, a view, an index, a matmul on the carry, carry
leaves of different shapes or dtypes, complex values) keeps the sequential
derivatives, which are right for any ``c``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hop import _fake_run, _transforms
from hop._operator import HigherOrderOperator
from hop.ops._common import as_tuple

__all__ = ["carry_pattern", "parallel_vjp"]

Fn = Callable[..., Any]
_aten = torch.ops.aten
# operators that copy a value: element p of the result is element p of the input
_COPIES = frozenset({_aten.clone.default, _aten.alias.default, _aten.detach.default, _aten._to_copy.default})


Pattern = tuple[tuple[bool, ...], ...]  # p[i][j]: entry (i, j) may be nonzero
Matrix = list[list[torch.Tensor | None]]  # m[i][j]: one k x k matrix per element; None: zero


class _CarryFlow(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Follows every value an operator makes from the given ones, with the carry leaves each
    depends on; ``elementwise`` turns False at the first operator that could move a carry
    element to another position. A value it never saw made (one a wrapper or an operator
    hidden from this mode made) depends on what it cannot know: :meth:`leaves_of` is None."""

    def __init__(self, carry: Sequence[torch.Tensor], others: Sequence[Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.shape = carry[0].shape
        # the values themselves are kept, so that ids stay unique
        self.known: dict[int, tuple[torch.Tensor, frozenset[int]]] = {
            id(t): (t, frozenset()) for t in others if isinstance(t, torch.Tensor)
        }
        self.known.update((id(t), (t, frozenset({j}))) for j, t in enumerate(carry))
        self.elementwise = True

    def leaves_of(self, t: Any) -> frozenset[int] | None:
        found = self.known.get(id(t))
        return None if found is None else found[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads = [self.leaves_of(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        leaves = frozenset().union(*(r for r in reads if r is not None))
        results = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if leaves:
            pointwise = torch.Tag.pointwise in getattr(func, "tags", ()) or func in _COPIES
            if not pointwise or any(o.shape != self.shape for o in results):
                self.elementwise = False
        for o in results:
            self.known[id(o)] = (o, leaves | (self.leaves_of(o) or frozenset()))  # in place: keeps what it had
        return out


def carry_pattern(combine: Fn, pointwise: bool, xs: Sequence[Any], additional: Sequence[Any]) -> Pattern | None:
    """Note [a parallel backward for an elementwise combine]: where ``combine`` (the
    user's, called on one pair of slices, or on a batch of pairs when ``pointwise``) is
    proven elementwise in its carry by one run on fake values, which output reads which
    carry leaf (``p[i][j]``: output i reads leaf j); else None."""
    if not xs or any(not isinstance(x, torch.Tensor) or not x.is_floating_point() for x in xs):
        return None
    if not _fake_run.fakeable([*xs, *additional]):
        return None
    try:
        shapes = [_hinted(x.shape[1:]) for x in xs]
        kinds = {(x.dtype, x.device, s) for x, s in zip(xs, shapes, strict=True)}
        if len(kinds) != 1:
            return None
        # fresh values of the sizes the trace was made for (its symbols' hints): the
        # structure is all that is read, and a traced value's symbolic sizes cannot be copied
        # C++ functionalization (a functional wrapper of each value) would hide the values
        # from the mode: it is off for this run, which only reads structure
        no_wrappers = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with _fake_run.fake_inputs([]), no_wrappers:
            n = 2 if pointwise else None
            pairs = [_empty_like(x, (n, *shapes[0]) if n else shapes[0]) for x in xs]
            carry = [_empty_like(x, (n, *shapes[0]) if n else shapes[0]) for x in xs]
            add = [_empty_like(a, _hinted(a.shape)) if isinstance(a, torch.Tensor) else a for a in additional]
            flow = _CarryFlow(carry, [*pairs, *add])
            with flow:
                out = as_tuple(combine(*carry, *pairs, *add))
            reads = [flow.leaves_of(o) if isinstance(o, torch.Tensor) and o.shape == flow.shape else None for o in out]
            if not flow.elementwise or len(out) != len(xs) or any(r is None for r in reads):
                return None  # something moved elements, or made an output out of the mode's sight
            return tuple(tuple(j in r for j in range(len(xs))) for r in reads if r is not None)
    except Exception:  # the sequential derivatives are right for any combine_fn
        return None


def _hinted(shape: Sequence[Any]) -> tuple[int, ...]:
    """``shape`` with each symbolic size replaced by the value the trace was made for."""
    return tuple(d if isinstance(d, int) else _hint(d) for d in shape)


def _hint(d: Any) -> int:
    hint = getattr(getattr(d, "node", None), "hint", None)
    if not isinstance(hint, int):
        raise _NoHint
    return hint


class _NoHint(Exception):
    """An unbacked size: no value to try the combine_fn on (the sequential derivatives run)."""


def _empty_like(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=x.dtype, device=x.device)


def _matrices(
    batched: Fn, ys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], add: Sequence[Any], pattern: Pattern
) -> Matrix:
    """``J[i][j] = d out_i / d y_j`` elementwise, for ``out = batched(ys, xs, add)``, where
    ``pattern`` says it may be nonzero: row i is the vjp of a cotangent of ones on output i
    (reverse mode: forward mode would trace torch's zero tangents of the other operands
    at the sizes of one example, not symbolic ones)."""
    k = len(ys)
    vjp = torch.func.vjp(lambda *y: as_tuple(batched(*y, *xs, *add)), *ys)
    out, pull = vjp[0], vjp[1]
    j_: Matrix = [[None] * k for _ in range(k)]
    for i in range(k):
        if not any(pattern[i]):
            continue
        row = pull(tuple(torch.ones_like(o) if m == i else torch.zeros_like(o) for m, o in enumerate(out)))
        for j in range(k):
            j_[i][j] = row[j] if pattern[i][j] else None
    return j_


def _closed(pattern: Pattern) -> Pattern:
    """The smallest pattern holding ``pattern`` and closed under products: every product of
    matrices of that pattern has it."""
    k = len(pattern)
    c = [list(row) for row in pattern]
    for m in range(k):
        for i in range(k):
            for j in range(k):
                c[i][j] = c[i][j] or (c[i][m] and c[m][j])
    return tuple(tuple(row) for row in c)


def _composer(pattern: Pattern) -> Fn:
    """The combine of affine maps: ``v -> b1 + a1 v`` then ``v -> b2 + a2 v`` is
    ``(a2 a1, b2 + a2 b1)``, each matrix given by its entries at ``pattern`` (closed under
    products), then the k entries of b. Pointwise ops only: a pointwise combine_fn is
    traced on one slice and run on batches."""
    k = len(pattern)
    at = [(i, j) for i in range(k) for j in range(k) if pattern[i][j]]
    width = len(at) + k

    def compose(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a1 = dict(zip(at, leaves[: len(at)], strict=True))
        a2 = dict(zip(at, leaves[width : width + len(at)], strict=True))
        b1, b2 = leaves[len(at) : width], leaves[width + len(at) :]

        def total(terms: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
            return functools.reduce(operator.add, terms) if terms else torch.zeros_like(like)

        a = [total([a2[i, m] * a1[m, j] for m in range(k) if (i, m) in a2 and (m, j) in a1], b2[0]) for i, j in at]
        b = [b2[i] + total([a2[i, m] * b1[m] for m in range(k) if (i, m) in a2], b2[i]) for i in range(k)]
        return (*a, *b)

    return compose


def _affine_scan(scan_op: HigherOrderOperator, a: Matrix, b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``v[0] = b[0]``, ``v[t] = b[t] + a[t] v[t - 1]``, in log depth."""
    k = len(b)
    pattern = _closed(tuple(tuple(a_ij is not None for a_ij in row) for row in a))
    entries = [
        torch.zeros_like(b[0]) if a[i][j] is None else a[i][j] for i in range(k) for j in range(k) if pattern[i][j]
    ]
    return list(as_tuple(scan_op(_composer(pattern), (*entries, *b), (), "pointwise"))[len(entries) :])


def _steps(ys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's carry and x: ``y[t - 1]`` and ``x[t]`` for t >= 1."""
    return [y[:-1] for y in ys], [x[1:] for x in xs]


def _later_reversed(entry: torch.Tensor | None) -> torch.Tensor | None:
    """A step's entry moved one step later (a zero first), in reverse order."""
    return None if entry is None else torch.cat([entry, torch.zeros_like(entry[:1])]).flip(0)


def parallel_vjp(
    scan_op: HigherOrderOperator,
    batched: Fn,
    pattern: Pattern,
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    additional: Sequence[Any],
    grads: Sequence[Any],
    wanted_add: Sequence[bool],
) -> list[Any]:
    """Gradients of ``xs`` and of the additional inputs ``wanted_add`` marks (None for the
    others), by Note [a parallel backward for an elementwise combine]. ``batched`` takes
    batches of pairs; ``ys`` are the scan's outputs; ``grads`` their cotangents (None: zero)."""
    nx = len(xs)
    g = [torch.zeros_like(y) if gi is None else gi for y, gi in zip(ys, grads, strict=True)]
    prev, nxt = _steps(ys, xs)
    j = _matrices(batched, prev, nxt, additional, pattern)
    # the transposed matrices, one step later, reversed: a reverse scan as a forward one
    a = [[_later_reversed(j[m][i]) for m in range(nx)] for i in range(nx)]
    lam = [v.flip(0) for v in _affine_scan(scan_op, a, [v.flip(0) for v in g])]
    diff_add = [i for i, a in enumerate(additional) if wanted_add[i] and isinstance(a, torch.Tensor)]

    def on_step(*d: Any) -> tuple[Any, ...]:
        add = _transforms.place(list(additional), diff_add, d[nx:])
        return as_tuple(batched(*prev, *d[:nx], *add))

    pull = torch.func.vjp(on_step, *nxt, *[additional[i] for i in diff_add])[1]
    pulled = pull(tuple(v[1:] for v in lam))
    g_xs = [torch.cat([lam[i][:1], pulled[i]]) for i in range(nx)]
    return [*g_xs, *_transforms.place([None] * len(additional), diff_add, pulled[nx:])]
