"""Control-flow programs as data: small trees that print as Python source and run.

A :class:`Program` is a tree of :class:`Expr` nodes. Every node is an
expression of one tensor whose shape it keeps (a map or scan body works on
slices), so that nodes compose freely: pointwise ops, reductions, matmul,
reshapes and views, indexing and data-dependent ops (boolean masks,
``nonzero``) are written as templates applied to their operand, and the
control-flow nodes (:class:`Cond`, :class:`Switch`, :class:`WhileLoop`,
:class:`ForiLoop`, :class:`Map`, :class:`Scan`, :class:`AssociativeScan`) call
the hop operators with :class:`Lambda` bodies. ``Program.to_source()`` is the
Python text; ``Program.compile()`` executes that text, so what is printed is
exactly what runs.

:mod:`hop.testing.strategies` draws these trees with hypothesis, and shrinks a
failing one to a small program whose source is the failure report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

import hop

__all__ = [
    "Template",
    "UNARY",
    "BINARY",
    "SIDES",
    "PREDICATES",
    "INDICES",
    "COMBINES",
    "CONSTANTS",
    "Expr",
    "Var",
    "Apply",
    "Binary",
    "Lambda",
    "Cond",
    "Switch",
    "WhileLoop",
    "ForiLoop",
    "Map",
    "Scan",
    "AssociativeScan",
    "Program",
]


@dataclasses.dataclass(frozen=True)
class Template:
    """A source template: ``{}`` stands for the operand (``t`` in a one-argument lambda).

    Attributes:
        text: the template, e.g. ``"{}.sin()"``.
        min_rank: the smallest operand rank it applies to.
        data_dependent: it uses an op whose result's size depends on data.
    """

    text: str
    min_rank: int = 0
    data_dependent: bool = False

    def __call__(self, *operands: str) -> str:
        return self.text.format(*operands)


_T = Template
# Shape-keeping ops on one tensor, by kind.
UNARY: dict[str, tuple[Template, ...]] = {
    "pointwise": (
        _T("{}.sin()"),
        _T("{}.cos()"),
        _T("torch.tanh({})"),
        _T("torch.sigmoid({})"),
        _T("({} * 0.5)"),
        _T("({} + 1.0)"),
        _T("(-{})"),
        _T("(lambda t: torch.where(t > 0, t, t * 0.1))({})"),
    ),
    "reduction": (
        _T("(lambda t: t + t.sum() * 0.1)({})"),
        _T("(lambda t: t - t.sum(-1, keepdim=True) * 0.5)({})", min_rank=1),
        _T("(lambda t: t * t.reshape(-1).amax() if t.numel() else t)({})"),
    ),
    "matmul": (
        _T("(lambda t: t + (t.reshape(1, -1) @ t.reshape(-1, 1)).reshape(()) * 0.1)({})"),
        _T("(lambda t: (t.reshape(-1, 1) @ torch.full((1, 1), 0.5, dtype=t.dtype)).reshape(t.shape))({})"),
        _T("(lambda t: t @ torch.eye(t.shape[-1], dtype=t.dtype) * 0.5)({})", min_rank=1),
    ),
    "view": (
        _T("(lambda t: t.reshape(-1).view(t.shape))({})"),
        _T("{}.unsqueeze(0).squeeze(0)"),
        _T("(lambda t: t.mT.contiguous().mT * 2.0)({})", min_rank=2),
        _T("(lambda t: t.flatten().flip(0).reshape(t.shape))({})"),
    ),
    "indexing": (
        _T("(lambda t: t.reshape(-1)[torch.arange(t.numel() - 1, -1, -1)].reshape(t.shape))({})"),
        _T("(lambda t: t[..., :1].expand(t.shape) + t)({})", min_rank=1),
        # rows repeated (0, 0, 1, 1, ...: the gradient accumulates); not a constant index,
        # whose gradient torch 2.13's Inductor cannot vectorize (an assertion, torch's
        # cond too: tests/compile/test_inductor_edges.py)
        _T("(lambda t: t.index_select(0, torch.arange(t.shape[0]).div(2, rounding_mode='floor')))({})", 1),
    ),
    # plain tensors the program closes over (not inputs, parameters or buffers): CONSTANTS
    "constant": (
        _T("({} * SCALE)"),
        _T("({} + SHIFT)"),
    ),
    "data_dependent": (
        _T("(lambda t: t + t[t > 0].sum())({})", min_rank=1, data_dependent=True),
        _T("(lambda t: t * (t > 0).nonzero().shape[0])({})", data_dependent=True),
        _T("(lambda t: t.masked_fill(t < -0.5, 0.25))({})"),
    ),
}
# The module-level tensors "constant" templates read, by name: their source.
CONSTANTS: dict[str, str] = {"SCALE": "torch.tensor(0.75)", "SHIFT": "torch.tensor(-0.25)"}
# Two tensors of one shape.
BINARY: tuple[Template, ...] = (_T("({} + {})"), _T("({} * {})"), _T("torch.maximum({}, {})"), _T("({} - {})"))
# One-dimensional outputs of sizes that differ between branches (or depend on data).
SIDES: tuple[Template, ...] = (
    _T("{}.reshape(-1)"),
    _T("{}.reshape(-1)[:2]"),
    _T("{}.reshape(-1)[1:]"),
    _T("(lambda t: t[t > 0])({}.reshape(-1))", data_dependent=True),
    _T("(lambda t: t.reshape(-1).nonzero().reshape(-1).to(t.dtype))({})", data_dependent=True),
)
# Predicates (a bool tensor, or a Python bool from a size) and indices of a tensor.
PREDICATES: tuple[Template, ...] = (
    _T("{}.sum() > 0"),
    _T("{}.reshape(-1)[:1].sum() < 0.5"),
    _T("{}.numel() > 2"),
    _T("torch.tensor(True)"),
)
INDICES: tuple[Template, ...] = (
    _T("(({}.sum().abs() * 3).long() % {n})"),
    _T("({}.numel() % {n})"),
    _T("((({}.reshape(-1)[:1].sum() > 0).long() + 1) % {n})"),
)
# Associative combine functions of two tensors. The maximum and minimum keep the
# left operand on ties: torch.maximum splits a tie's gradient between its operands,
# so a parallel prefix (which meets ties in another bracketing than the sequential
# reference) gives another valid subgradient; keeping the left one selects the
# first extremum in every bracketing, and the derivatives agree.
COMBINES: tuple[str, ...] = (
    "a + b",
    "torch.where(a >= b, a, b)",
    "torch.where(a <= b, a, b)",
    "torch.logaddexp(a, b)",
)


class Expr:
    """A node: an expression of one tensor, keeping its shape."""

    def source(self) -> str:
        raise NotImplementedError

    def children(self) -> Iterator[Expr]:
        return iter(())

    def walk(self) -> Iterator[Expr]:
        yield self
        for child in self.children():
            yield from child.walk()


@dataclasses.dataclass(frozen=True)
class Var(Expr):
    name: str

    def source(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Apply(Expr):
    """``template(arg)``: a shape-keeping op."""

    template: Template
    arg: Expr

    def source(self) -> str:
        return self.template(self.arg.source())

    def children(self) -> Iterator[Expr]:
        yield self.arg


@dataclasses.dataclass(frozen=True)
class Binary(Expr):
    template: Template
    lhs: Expr
    rhs: Expr

    def source(self) -> str:
        return self.template(self.lhs.source(), self.rhs.source())

    def children(self) -> Iterator[Expr]:
        yield from (self.lhs, self.rhs)


@dataclasses.dataclass(frozen=True)
class Lambda:
    """``lambda *params: body`` (the body may close over outer variables)."""

    params: tuple[str, ...]
    body: Expr

    def source(self, result: Callable[[str], str] = str) -> str:
        return f"lambda {', '.join(self.params)}: {result(self.body.source())}"


def _let(name: str, value: Expr, body: str) -> str:
    """``body`` with ``name`` bound to ``value`` (an immediately applied lambda)."""
    return f"(lambda {name}: {body})({value.source()})"


@dataclasses.dataclass(frozen=True)
class Cond(Expr):
    """``hop.cond(pred(o), true_fn, false_fn, (o,))``; with ``sides``, the branches also
    return a 1-d tensor each (sizes may differ) and the node is a pair. With ``layout``,
    the operand also feeds a ``torch.cat`` (a compiler may then lay it out inside the
    cat's buffer: a strided operand of the cond). With ``extra``, the branches take a
    second operand: ``"twice"`` the operand again (unread), ``"int"`` the Python int 2
    (the result scaled by it)."""

    name: str
    pred: Template
    true_fn: Lambda
    false_fn: Lambda
    operand: Expr
    sides: tuple[Template, Template] | None = None
    layout: bool = False
    extra: Literal["twice", "int"] | None = None

    def source(self) -> str:
        t, f = self.true_fn, self.false_fn
        if self.sides is not None:
            t_src = t.source(lambda body: f"({body}, {self.sides[0](t.params[0])})")  # type: ignore[index]
            f_src = f.source(lambda body: f"({body}, {self.sides[1](f.params[0])})")  # type: ignore[index]
        elif self.extra is not None:
            t_src, f_src = (self._taking_extra(fn) for fn in (t, f))
        else:
            t_src, f_src = t.source(), f.source()
        operands = {None: f"{self.name},", "twice": f"{self.name}, {self.name}", "int": f"{self.name}, 2"}[self.extra]
        call = f"hop.cond({self.pred(self.name)}, {t_src}, {f_src}, ({operands}))"
        if self.layout:
            n = self.name
            call = f"({call} + torch.cat([{n}.unsqueeze(-1), {n}.unsqueeze(-1) * 2.0], -1)[..., 1])"
        return _let(self.name, self.operand, call)

    def _taking_extra(self, fn: Lambda) -> str:
        extra = f"{fn.params[0]}_extra"
        body = fn.body.source() if self.extra == "twice" else f"({fn.body.source()}) * {extra}"
        return f"lambda {fn.params[0]}, {extra}: {body}"

    def children(self) -> Iterator[Expr]:
        yield from (self.true_fn.body, self.false_fn.body, self.operand)


@dataclasses.dataclass(frozen=True)
class Switch(Expr):
    name: str
    index: Template
    branches: tuple[Lambda, ...]
    operand: Expr

    def source(self) -> str:
        index = self.index.text.replace("{n}", str(len(self.branches))).format(self.name)
        branches = ", ".join(b.source() for b in self.branches)
        return _let(self.name, self.operand, f"hop.switch({index}, [{branches}], ({self.name},))")

    def children(self) -> Iterator[Expr]:
        yield from (*(b.body for b in self.branches), self.operand)


@dataclasses.dataclass(frozen=True)
class WhileLoop(Expr):
    """At most ``trips`` iterations of ``body``, also stopped by ``pred`` (if any).

    The counter is a Python int (an unbacked SymInt when traced) or a tensor.
    """

    body: Lambda  # params: (counter, value)
    init: Expr
    trips: int
    tensor_counter: bool
    pred: Template | None = None

    def source(self) -> str:
        i, a = self.body.params
        stop = f"({i} < {self.trips}) & ({self.pred(a)})" if self.pred else f"{i} < {self.trips}"
        start = "torch.tensor(0)" if self.tensor_counter else "0"
        body = self.body.source(lambda b: f"({i} + 1, {b})")
        return f"hop.while_loop(lambda {i}, {a}: {stop}, {body}, ({start}, {self.init.source()}))[1]"

    def children(self) -> Iterator[Expr]:
        yield from (self.body.body, self.init)


@dataclasses.dataclass(frozen=True)
class ForiLoop(Expr):
    """``hop.fori_loop(lower, upper, lambda i, a: body + 0.1 * i, init)``."""

    body: Lambda  # params: (i, value)
    init: Expr
    lower: int
    upper: int
    tensor_bound: bool

    def source(self) -> str:
        upper = f"torch.tensor({self.upper})" if self.tensor_bound else str(self.upper)
        body = self.body.source(lambda b: f"{b} + 0.1 * {self.body.params[0]}")
        return f"hop.fori_loop({self.lower}, {upper}, {body}, {self.init.source()})"

    def children(self) -> Iterator[Expr]:
        yield from (self.body.body, self.init)


@dataclasses.dataclass(frozen=True)
class Map(Expr):
    """``hop.map(f, xs)`` over dim 0 (``xs`` of rank 1 or more)."""

    f: Lambda
    xs: Expr

    def source(self) -> str:
        return f"hop.map({self.f.source()}, {self.xs.source()})"

    def children(self) -> Iterator[Expr]:
        yield from (self.f.body, self.xs)


@dataclasses.dataclass(frozen=True)
class Scan(Expr):
    """``carry, ys = hop.scan(combine, o.sum(dim), o, dim=dim)``; the node is ``ys + carry``.

    ``combine(c, r) = (carry_fn(c + r), y_fn(r * c))``.
    """

    name: str
    carry_fn: Lambda
    y_fn: Lambda
    xs: Expr
    dim: int
    reverse: bool

    def source(self) -> str:
        c, r = "c_" + self.name, "r_" + self.name
        combine = f"lambda {c}, {r}: (({self.carry_fn.source()})({c} + {r}), ({self.y_fn.source()})({r} * {c}))"
        scan = f"hop.scan({combine}, {self.name}.sum({self.dim}), {self.name}, dim={self.dim}, reverse={self.reverse})"
        return _let(self.name, self.xs, f"(lambda out: out[1] + out[0].unsqueeze({self.dim}))({scan})")

    def children(self) -> Iterator[Expr]:
        yield from (self.carry_fn.body, self.y_fn.body, self.xs)


@dataclasses.dataclass(frozen=True)
class AssociativeScan(Expr):
    combine: str
    xs: Expr
    dim: int
    reverse: bool
    generic: bool

    def source(self) -> str:
        mode = "generic" if self.generic else "pointwise"
        return (
            f"hop.associative_scan(lambda a, b: {self.combine}, {self.xs.source()}, dim={self.dim}, "
            f"reverse={self.reverse}, combine_mode={mode!r})"
        )

    def children(self) -> Iterator[Expr]:
        yield self.xs


def _lambdas(node: Expr) -> list[Lambda]:
    fields = [getattr(node, f.name) for f in dataclasses.fields(node)]  # type: ignore[arg-type]
    return [v for f in fields for v in (f if isinstance(f, tuple) else (f,)) if isinstance(v, Lambda)]


def _free(lam: Lambda) -> set[str]:
    """The variables ``lam`` reads without binding them (names are unique, so no shadowing)."""
    nodes = list(lam.body.walk())
    bound = set(lam.params)
    for node in nodes:
        bound |= {p for inner in _lambdas(node) for p in inner.params}
        if not isinstance(node, Var):
            bound.add(getattr(node, "name", ""))
    return {n.name for n in nodes if isinstance(n, Var)} - bound


@dataclasses.dataclass(frozen=True)
class Program:
    """``def program(*params): return outputs`` (a tuple, or a dict when ``names`` are given)."""

    params: tuple[str, ...]
    outputs: tuple[Expr, ...]
    names: tuple[str, ...] | None = None

    def to_source(self) -> str:
        outs = [o.source() for o in self.outputs]
        if self.names is not None:
            body = "{" + ", ".join(f"{n!r}: {o}" for n, o in zip(self.names, outs, strict=True)) + "}"
        else:
            body = "(" + "".join(f"{o}, " for o in outs) + ")"
        constants = "".join(f"{name} = {value}\n" for name, value in CONSTANTS.items() if name in body)
        return f"{constants}def program({', '.join(self.params)}):\n    return {body}\n"

    def __repr__(self) -> str:
        return self.to_source()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what hypothesis prints
        printer.text(self.to_source())

    def compile(self) -> Callable[..., Any]:
        """The program as a function (its source is registered with linecache for tracebacks)."""
        source = self.to_source()
        # Named by its source: hypothesis tells failures apart by where they were
        # raised, so a replay of the same program must raise at the same name (a
        # counter made every replay look like a new failure: "FlakyFailure").
        filename = f"<hop.testing program {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace: dict[str, Any] = {"torch": torch, "hop": hop}
        exec(compile(source, filename, "exec"), namespace)
        fn: Callable[..., Any] = namespace["program"]
        return fn

    def nodes(self) -> Iterator[Expr]:
        for out in self.outputs:
            yield from out.walk()

    @property
    def closures(self) -> bool:
        """Whether a body reads a variable it does not bind (closed over, lifted when traced)."""
        return any(_free(lam) for node in self.nodes() for lam in _lambdas(node))

    @property
    def data_dependent(self) -> bool:
        """Whether an op's result size depends on data (torch.vmap cannot batch those)."""
        for node in self.nodes():
            templates = [getattr(node, "template", None), *(getattr(node, "sides", None) or ())]
            if any(t is not None and t.data_dependent for t in templates):
                return True
        return False
