"""Hypothesis strategies: tensors, and control-flow programs with their inputs.

- :func:`tensors`: tensors of the given dtypes (float64 included) and shapes
  (zero-size and 0-dim included);
- :func:`programs`: a :class:`~hop.testing.programs.Program` of a given input
  shape, nesting the chosen operators up to ``depth``;
- :func:`cases`: a program together with inputs for it, printed as source
  and values, ready for :func:`hop.testing.check`; each input in one of
  ``LAYOUTS`` (:func:`with_layout`: expanded with stride 0, as vmap broadcasts,
  transposed, a slice at an offset, channels-last, or contiguous).

Draws shrink toward plain variables, so a failure reduces to a short program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from hypothesis import strategies as st

from hop.testing import programs as P

__all__ = ["OPERATORS", "KINDS", "LAYOUTS", "Case", "tensors", "shapes", "programs", "cases", "with_layout"]

OPERATORS = ("cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan")
KINDS = tuple(P.UNARY)  # pointwise, reduction, matmul, view, indexing, constant, data_dependent
FLOATS = (torch.float32, torch.float64)
Shape = tuple[int, ...]
COUNTER: Shape = (-1,)  # the shape of a loop counter in scope: no tensor expression uses it


LAYOUTS = ("contiguous", "expanded", "transposed", "offset", "channels_last")


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s shape in ``layout`` (one of ``LAYOUTS``); a layout a tensor cannot have
    (a transposed vector, an expanded 0-dim tensor) gives ``t`` as it is.

    ``expanded`` repeats the first slice along dim 0 with stride 0 (overlapping
    elements, as vmap broadcasts an unbatched value): the values change to that
    slice's; the other layouts keep the values."""
    if layout == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        return t[:1].expand(t.shape)
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "offset":
        return torch.cat([torch.zeros_like(t).reshape(-1)[:1], t.reshape(-1)])[1:].view(t.shape)
    if layout == "channels_last" and t.dim() == 3:
        return t.unsqueeze(0).contiguous(memory_format=torch.channels_last)[0]
    return t


def shapes(*, min_rank: int = 0, max_rank: int = 3, max_side: int = 4) -> st.SearchStrategy[Shape]:
    """Shapes of rank ``min_rank`` to ``max_rank``, sizes 0 to ``max_side`` (0-dim and zero-size included)."""
    return st.lists(st.integers(0, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


@st.composite
def tensors(
    draw: st.DrawFn,
    /,
    *,
    dtypes: Sequence[torch.dtype] = FLOATS,
    shape: Shape | st.SearchStrategy[Shape] | None = None,
    bound: float = 2.0,
) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (float, int or bool) and ``shape`` (drawn by :func:`shapes` if None)."""
    dtype = draw(st.sampled_from(list(dtypes)))
    size: Any = shape if shape is not None else shapes()
    size = draw(size) if isinstance(size, st.SearchStrategy) else tuple(size)
    numel = 1
    for s in size:
        numel *= s
    if dtype == torch.bool:
        values: st.SearchStrategy[Any] = st.booleans()
    elif dtype.is_floating_point:
        values = st.floats(-bound, bound, allow_nan=False, width=32)
    else:
        values = st.integers(-int(bound) - 3, int(bound) + 3)
    data = draw(st.lists(values, min_size=numel, max_size=numel))
    return torch.tensor(data, dtype=dtype).reshape(size)


def _applicable(ops: Sequence[str], shape: Shape) -> list[str]:
    """The ops that apply to a value of ``shape`` (map and the scans need a dimension)."""
    return [op for op in ops if len(shape) >= 1 or op not in ("map", "scan", "associative_scan")]


class _Draw:
    """One program's draw: fresh names and a node budget that bounds its size."""

    def __init__(self, draw: st.DrawFn, ops: Sequence[str], kinds: Sequence[str], budget: int, closures: bool) -> None:
        self.draw = draw
        self.closures = closures
        self.ops = list(ops)
        self.templates = [t for k in kinds for t in P.UNARY[k]]
        self.budget = budget
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def pick(self, options: Sequence[Any]) -> Any:
        return self.draw(st.sampled_from(list(options)))

    def expr(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        """An expression of ``shape``: a variable, an op of a smaller one, or a control-flow node."""
        names = [n for n, s in scope if s == shape]
        self.budget -= 1
        kinds = ["var", "apply", "binary"] if self.budget > 0 else ["var"]
        ops = [op for op in _applicable(self.ops, shape) if depth > 0 and self.budget > 0]
        kind = self.pick(kinds + ops)
        if kind == "var":
            return P.Var(self.pick(names))
        if kind == "apply":
            templates = [t for t in self.templates if len(shape) >= t.min_rank]
            return P.Apply(self.pick(templates), self.expr(scope, shape, depth))
        if kind == "binary":
            return P.Binary(self.pick(P.BINARY), self.expr(scope, shape, depth), self.expr(scope, shape, depth))
        node: P.Expr = getattr(self, kind)(scope, shape, depth - 1)
        return node

    def body(self, scope: list[tuple[str, Shape]], params: Sequence[tuple[str, Shape]], depth: int) -> P.Lambda:
        shape = params[-1][1]
        inner = [*scope, *params] if self.closures else list(params)
        return P.Lambda(tuple(n for n, _ in params), self.expr(inner, shape, depth))

    def one(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int, prefix: str = "a") -> P.Lambda:
        return self.body(scope, [(self.fresh(prefix), shape)], depth)

    def cond(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        name = self.fresh("o")
        operand = self.expr(scope, shape, depth)
        t, f = self.one(scope, shape, depth), self.one(scope, shape, depth)
        extra: Literal["twice", "int"] | None = self.draw(st.sampled_from([None, None, "twice", "int"]))
        return P.Cond(name, self.pick(P.PREDICATES), t, f, operand, layout=self.draw(st.booleans()), extra=extra)

    def switch(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        name = self.fresh("o")
        operand = self.expr(scope, shape, depth)
        n = self.draw(st.integers(1, 3))
        return P.Switch(name, self.pick(P.INDICES), tuple(self.one(scope, shape, depth) for _ in range(n)), operand)

    def while_loop(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        init = self.expr(scope, shape, depth)
        tensor_counter = self.draw(st.booleans())
        pred = self.pick([None, *P.PREDICATES[:2]])  # a tensor condition meets an int counter too
        body = self.body(scope, [(self.fresh("i"), COUNTER), (self.fresh("a"), shape)], depth)
        return P.WhileLoop(body, init, self.draw(st.integers(0, 3)), tensor_counter, pred)

    def fori_loop(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        init = self.expr(scope, shape, depth)
        lower = self.draw(st.integers(0, 2))
        upper = lower + self.draw(st.integers(0, 3))
        body = self.body(scope, [(self.fresh("i"), COUNTER), (self.fresh("a"), shape)], depth)
        return P.ForiLoop(body, init, lower, upper, self.draw(st.booleans()))

    def map(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        xs = self.expr(scope, shape, depth)
        return P.Map(self.one(scope, shape[1:], depth, "r"), xs)

    def scan(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        dim = self.pick([0, -1])
        part = list(shape)
        del part[dim]
        xs = self.expr(scope, shape, depth)
        carry, y = self.one(scope, tuple(part), depth, "c"), self.one(scope, tuple(part), depth, "y")
        return P.Scan(self.fresh("s"), carry, y, xs, dim, self.draw(st.booleans()))

    def associative_scan(self, scope: list[tuple[str, Shape]], shape: Shape, depth: int) -> P.Expr:
        xs = self.expr(scope, shape, depth)
        dim, reverse, generic = self.pick([0, -1]), self.draw(st.booleans()), self.draw(st.booleans())
        return P.AssociativeScan(self.pick(P.COMBINES), xs, dim, reverse, generic)


@st.composite
def programs(
    draw: st.DrawFn,
    shape: Shape,
    /,
    *,
    ops: Sequence[str] = OPERATORS,
    kinds: Sequence[str] = KINDS,
    depth: int = 2,
    params: Sequence[str] = ("x", "y"),
    max_outputs: int = 2,
    sides: bool = True,
    budget: int = 12,
    closures: bool | None = None,
) -> P.Program:
    """A program taking ``params`` (tensors of ``shape``), using ``ops`` nested up to ``depth``.

    Args:
        shape: the shape of every input.
        ops: the hop operators to use (see ``OPERATORS``).
        kinds: the kinds of tensor ops in bodies (see ``KINDS``).
        depth: how deep control-flow nodes nest.
        params: the input names.
        max_outputs: the most outputs, besides a cond whose branches return sizes that differ.
        sides: allow that cond (``"cond"`` must be in ``ops``).
        budget: about the most nodes.
        closures: whether bodies may read outer variables (drawn if None).
    """
    gen = _Draw(draw, ops, kinds, budget, draw(st.booleans()) if closures is None else closures)
    scope = [(p, shape) for p in params]
    n = draw(st.integers(1, max_outputs))
    outputs: list[P.Expr] = []
    for _ in range(n):
        # each output starts with a control-flow node of one of the ops, when there are any
        applicable = _applicable(gen.ops, shape)
        if applicable and depth > 0:
            outputs.append(getattr(gen, gen.pick(applicable))(scope, shape, depth - 1))
        else:
            outputs.append(gen.expr(scope, shape, depth))
    if sides and "cond" in ops and draw(st.booleans()):
        name = gen.fresh("o")
        side = (gen.pick(P.SIDES), gen.pick(P.SIDES))
        t, f = gen.one(scope, shape, depth - 1), gen.one(scope, shape, depth - 1)
        outputs.append(P.Cond(name, gen.pick(P.PREDICATES), t, f, P.Var(params[0]), side))
    names = tuple(f"out{i}" for i in range(len(outputs))) if draw(st.booleans()) else None
    return P.Program(tuple(params), tuple(outputs), names)


class Case:
    """A program and its inputs; prints as both, so a failure shows what to rerun."""

    def __init__(
        self, program: P.Program, args: tuple[torch.Tensor, ...], layouts: Sequence[str] | None = None
    ) -> None:
        self.program = program
        self.layouts = tuple(layouts) if layouts is not None else ("contiguous",) * len(args)
        self.args = tuple(with_layout(a, k) for a, k in zip(args, self.layouts, strict=True))

    def skips(self) -> dict[str, str]:
        """Transforms not to check for this case, with why (for ``check(skip=...)``).

        Empty today. A known hop bug that a program triggers goes here, with the
        regression test in tests/property/test_regressions.py that holds it, so
        the property tests keep running the rest while it is open.
        """
        return {}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what hypothesis prints
        printer.text(repr(self))

    def __repr__(self) -> str:
        values = ""
        for n, a, layout in zip(self.program.params, self.args, self.layouts, strict=True):
            value = f"torch.tensor({a.tolist()!r}, dtype={a.dtype}).reshape({tuple(a.shape)})"
            values += f"{n} = {value}\n" if layout == "contiguous" else f"{n} = with_layout({value}, {layout!r})\n"
        if any(layout != "contiguous" for layout in self.layouts):
            values = "from hop.testing.strategies import with_layout\n" + values
        return self.program.to_source() + values


@st.composite
def cases(
    draw: st.DrawFn,
    /,
    *,
    ops: Sequence[str] = OPERATORS,
    dtypes: Sequence[torch.dtype] = FLOATS,
    depth: int = 2,
    min_rank: int = 0,
    layouts: Sequence[str] = LAYOUTS,
    **program_options: Any,
) -> Case:
    """A :class:`Case`: inputs ``x`` and ``y`` of one drawn shape and dtype, each in one of
    ``layouts`` (contiguous drawn first, so failures shrink toward it), and a program of them."""
    shape = draw(shapes(min_rank=min_rank))
    dtype = draw(st.sampled_from(list(dtypes)))
    program = draw(programs(shape, ops=ops, depth=depth, **program_options))
    args = tuple(draw(tensors(dtypes=[dtype], shape=shape)) for _ in program.params)
    drawn = tuple(draw(st.sampled_from(list(layouts))) for _ in program.params)
    return Case(program, args, drawn)
