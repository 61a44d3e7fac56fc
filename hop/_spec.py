"""One spec per operator: what the framework knows of an operator, declared beside it.

The framework (drawing, observation, the operator class, validation, the passes) names
no operator: it asks :func:`spec_of` for the spec an operator module registered beside
its public function (``hop/ops/branching/cond.py`` registers cond's). A new operator is its module
and its spec. Imports nothing of hop: every layer may read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Layout", "OpSpec", "register", "role_of", "spec_of", "specs"]

# (frame, the public function's args, its kwargs): completes the frame of an eager call
# from its arguments (Note [watching a call] in hop._observe)
Describe = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]


_FREE = object()  # a node argument the layout does not name (a constant: scan's reverse)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a node of the operator holds what: positions in ``node.args``.

    A subgraph is a ``get_attr`` argument (a branch, a loop's condition or body); each
    reads its placeholders in this order: the carries, the slices of ``xs``, then the
    ``inputs``.
    """

    subgraphs: tuple[int, ...]  # in role order
    variadic: bool = False  # the last subgraph position starts a run to the end (switch's branches)
    selector: int | None = None  # what picks the one subgraph that runs (a branching op)
    carries: int | None = None  # a loop's initial carries
    xs: int | None = None  # the tensors a loop slices, one slice per step
    inputs: int | None = None  # what every subgraph reads unchanged: operands, a loop's additional inputs
    body: int | None = None  # a loop's step: its outputs are the node's (final carries, then stacked ys)
    condition: int | None = None  # a loop's condition: runs before every step, so at least once

    def subgraph_positions(self, args: Sequence[Any]) -> tuple[int, ...]:
        if not self.variadic:
            return self.subgraphs
        return (*self.subgraphs[:-1], *range(self.subgraphs[-1], len(args)))

    def arrange(
        self,
        size: int,
        *,
        selector: Any = None,
        subgraphs: Sequence[Any] = (),
        carries: Any = None,
        xs: Any = None,
        inputs: Any = None,
        rest: Sequence[Any] = (),
    ) -> tuple[Any, ...]:
        """A node's ``size`` fixed arguments (a variadic run of subgraphs after them), each
        part at its position; the positions the layout does not name take ``rest``, in order."""
        slots: list[Any] = [_FREE] * size
        fixed = self.subgraphs[:-1] if self.variadic else self.subgraphs
        for position, graph in zip(fixed, subgraphs, strict=False):
            slots[position] = graph
        for named, part in (
            (self.selector, selector),
            (self.carries, carries),
            (self.xs, xs),
            (self.inputs, inputs),
        ):
            if named is not None:
                slots[named] = part
        others = iter(rest)
        arranged = tuple(next(others) if slot is _FREE else slot for slot in slots)
        return (*arranged, *subgraphs[len(fixed) :]) if self.variadic else arranged

    def leading(self, args: Sequence[Any]) -> int:
        """How many placeholders of a subgraph come before the ``inputs``."""
        return sum(len(args[p]) for p in (self.carries, self.xs) if p is not None)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One operator, as the framework sees it."""

    name: str  # torch.ops.hop.<name>, and the name in messages and observation records
    # the raw op's parameters in node order (a variadic run of subgraphs last, one name):
    # the names of its tuple arguments in messages
    params: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()  # the subgraphs' role names, in layout order
    role_pattern: str | None = None  # the role of the k-th subgraph of a variadic run: "branches[{k}]"
    layout: Layout | None = None  # None: a public function with no node of its own
    over: str | None = None  # then, the operator whose call (and node) its calls make, unless inline
    validates: bool = False  # eager calls validate once per signature
    inline_cache: bool = False  # the public function has the eager inline cache (a fast path)
    branch: Callable[[Any], int] | None = None  # the subgraph a selector's value picks
    describe: Describe | None = None

    def role(self, k: int) -> str | None:
        """The role name of subgraph ``k`` (in layout order); None if it has none."""
        if k < len(self.roles):
            return self.roles[k]
        return self.role_pattern.format(k=k) if self.role_pattern is not None else None

    def tuple_args(self) -> dict[int, str]:
        """The positions of the node arguments that are tuples (carries, xs, inputs), by name."""
        layout = self.layout
        if layout is None:
            return {}
        return {p: self.params[p] for p in (layout.carries, layout.xs, layout.inputs) if p is not None}

    def node_args(self, **parts: Any) -> tuple[Any, ...]:
        """A node's arguments from its parts by role in the layout (``selector``,
        ``subgraphs``, ``carries``, ``xs``, ``inputs``) and the rest in order (``rest``)."""
        assert self.layout is not None, f"{self.name} has no node of its own"
        size = len(self.params) - (1 if self.layout.variadic else 0)
        return self.layout.arrange(size, **parts)

    def role_names(self, n: int) -> tuple[str, ...]:
        """The role names of ``n`` subgraphs."""
        return tuple(self.role(k) or f"subgraph {k}" for k in range(n))


_SPECS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Make ``spec`` the one of operator ``spec.name``; returns it."""
    _SPECS[spec.name] = spec
    return spec


def spec_of(name: str) -> OpSpec | None:
    """The spec of the operator or public function ``name``; None for one hop does not define."""
    return _SPECS.get(name)


def role_of(name: str, k: int) -> str:
    """The role of the k-th subgraph of a node of operator ``name`` (in argument order), for
    drawings and records; by name, so torch's HOPs of hop's layout (its cond) read as hop's."""
    spec = _SPECS.get(name)
    role = spec.role(k) if spec is not None else None
    return role if role is not None else f"subgraph {k}"


def specs() -> tuple[OpSpec, ...]:
    return tuple(_SPECS.values())
