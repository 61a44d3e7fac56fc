"""Dynamo's variable for hop's public functions (``hop.cond``, ...): a call of one is
its raw op's call, made without tracing the function's body.

Note [public functions, inlined]
Where Dynamo meets a call of a public function in the code it traces, it would trace
the function's body (its eager fast path, then ``front``) down to the line that calls
the raw op behind the marker (Note [public functions under Dynamo]). Whatever Dynamo
traces becomes a guard, checked before every call of the compiled code: the body adds
about twenty (the modules, functions and flags it reads). Each costs a few cache misses
once the compiled code has pushed them out of the CPU's caches: about 7 us per call of
a compiled ``cond`` of two Linear layers, 2.5% of its time, where torch.cond's guards
are fewer. So the public functions get :class:`PublicFunctionVariable`, which makes
the raw op's call straight away. The function itself is guarded as Dynamo guards any
function, and so is the flag of ``hop.testing.reference()``: while that is on, the body
is traced, as before, and runs the reference.

A public function's own frame, compiled (``torch.compile(hop.cond)``), still runs its
``is_dynamo_compiling()`` line.

Everything here imports torch._dynamo: it is loaded only once Dynamo is.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.guards import GuardBuilder, install_guard
from torch._dynamo.source import AttrSource
from torch._dynamo.variables import ConstantVariable
from torch._dynamo.variables.builder import VariableBuilder
from torch._dynamo.variables.functions import UserFunctionVariable
from torch._dynamo.variables.higher_order_ops import TorchHigherOrderOperatorVariable

from hop import _reference
from hop._transforms import DYNAMO_CALL
from hop.compile._dynamo_values import VT, example, flatten, without_none
from hop.ops.branching.cond import cond, cond_op
from hop.ops.branching.switch import switch, switch_op
from hop.ops.scanning._controls import check_count, check_unroll
from hop.ops.scanning.associative_scan import associative_scan, associative_scan_op
from hop.ops.scanning.map import map as hop_map
from hop.ops.scanning.map import map_op
from hop.ops.scanning.scan import scan, scan_op
from hop.ops.while_loops import _unroll
from hop.ops.while_loops.fori_loop import fori_loop
from hop.ops.while_loops.while_loop import while_loop, while_loop_op

__all__ = ["PublicFunctionVariable", "install", "public_functions"]


# a call with one of these is a program of calls without (traced as the function's body)
_LOOP_CONTROLS = frozenset(("length", "unroll", "batch_size"))


_CHUNKING = ("unroll", "batch_size")


def _dynamic_length(tx: Any, fn: Any, args: list[VT], kwargs: dict[str, VT]) -> bool:
    """Whether a scan's or map's length is symbolic. The control code cannot tell under
    Dynamo, where a symbolic size reads as an int (Note [a dynamic length runs one step
    per iteration]): asked here, of the traced values."""
    if fn is scan:
        xs, dim = (args[2] if len(args) > 2 else kwargs.get("xs")), kwargs.get("dim")
    elif fn is hop_map:
        xs, dim = (args[1] if len(args) > 1 else kwargs.get("xs")), None
    else:
        return False
    length = kwargs.get("length")
    if length is not None and isinstance(example(length), torch.SymInt):
        return True
    leaves = [example(leaf) for leaf in without_none(flatten(tx, xs)[0])] if xs is not None else []
    if not leaves or not isinstance(leaves[0], torch.Tensor):
        return False
    d = example(dim) if dim is not None else 0
    return type(d) is int and -leaves[0].dim() <= d < leaves[0].dim() and isinstance(leaves[0].shape[d], torch.SymInt)


def _symbolic_bounds(args: list[VT], kwargs: dict[str, VT]) -> bool:
    bounds = [*args[:2], *(kwargs[k] for k in ("lower", "upper") if k in kwargs)]
    return any(isinstance(example(b), torch.SymInt) for b in bounds)


class PublicFunctionVariable(UserFunctionVariable):
    """A public function, as Dynamo sees it: a function whose call is its raw op's
    (Note [public functions, inlined]); everything else about it is a function's."""

    def __init__(self, fn: types.FunctionType, op: Any, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self.op = op

    def call_function(self, tx: Any, args: list[VT], kwargs: dict[str, VT]) -> VT:
        if "unroll" in kwargs and self.fn is fori_loop and _symbolic_bounds(args, kwargs):
            chunked = UserFunctionVariable(_unroll.chunked)  # type: ignore[arg-type]  # a plain function
            rest = {k: v for k, v in kwargs.items() if k != "unroll"}
            return chunked.call_function(tx, [self, *args], {**rest, "unroll": kwargs["unroll"]})
        if not _LOOP_CONTROLS.isdisjoint(kwargs) and _dynamic_length(tx, self.fn, args, kwargs):
            if "unroll" in kwargs:  # refused as eager refuses it, before it is dropped
                check_unroll("scan" if self.fn is scan else "map", example(kwargs["unroll"]))
            if "batch_size" in kwargs:
                check_count("map", "batch_size", example(kwargs["batch_size"]), 1)
            kwargs = {k: v for k, v in kwargs.items() if k not in _CHUNKING or example(v) is True}
        # Note [loop controls are programs of the operators]: a call with one is traced through
        if _reference.ACTIVE or not _LOOP_CONTROLS.isdisjoint(kwargs):
            called: VT = super().call_function(tx, args, kwargs)
            return called
        install_guard(AttrSource(tx.import_source(_reference.__name__), "ACTIVE").make_guard(GuardBuilder.EQUALS_MATCH))
        op = TorchHigherOrderOperatorVariable.make(self.op)
        marked = [ConstantVariable.create(DYNAMO_CALL), UserFunctionVariable(self.fn), *args]
        made: VT = op.call_function(tx, marked, kwargs)
        return made


def public_functions() -> list[tuple[Callable[..., Any], Any]]:
    """Each public function with the raw op it calls (the one list of them the Dynamo
    bridge keeps)."""

    return [
        (cond, cond_op),
        (switch, switch_op),
        (while_loop, while_loop_op),
        (fori_loop, while_loop_op),
        (hop_map, map_op),
        (scan, scan_op),
        (associative_scan, associative_scan_op),
    ]


def install() -> None:
    """Give each public function :class:`PublicFunctionVariable` in Dynamo's table of
    variables built by object identity."""
    table = VariableBuilder._id_dispatch()
    for public, op in public_functions():
        table[id(public)] = _builder(op)


def _builder(op: Any) -> Callable[[Any, Any], VT]:
    def build(builder: Any, fn: types.FunctionType) -> VT:
        guards = builder.install_guards(GuardBuilder.CLOSURE_MATCH)
        return PublicFunctionVariable(fn, op, source=builder.source, **guards)

    return build
