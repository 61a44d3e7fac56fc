"""Transform levels in a captured callable's graph, read from its own nesting calls.

Note [a captured graph finds its transform levels at run time]
Dynamo records ``torch.func.grad`` and ``torch.vmap`` inside a callable as calls that
enter a transform level (``_grad_increment_nesting()``), wrap tensors for it
(``_wrap_for_grad(x, 1)``, ``_add_batch_dim(x, 0, 1)``), unwrap them and leave it; the
level is written into the graph as the number it had while Dynamo traced. hop runs
the graph of a loop body or branch again under transforms of its own: the reverse
loop takes ``torch.func.vjp`` of the body (a Hamiltonian sampler's leapfrog step takes
the potential's gradient inside a ``while_loop``: a compiled training step failed on
functorch's internal assert ``wrapped->level() < level``), and a vmapped operator
vmaps it. There the level the graph enters is another number. So a level the graph
entered itself is read from the call that entered it (each nesting call returns its
level), not written as a number; a level the graph did not enter is left as it is.

``torch.func.grad`` also turns grad mode on for the function it differentiates; Dynamo
traced with grad mode on and recorded no switch. hop runs the graph where grad mode
may be off (the forward of its autograd node, under a compiled training step): the
gradient came out as zeros, silently. So a grad level the graph enters turns grad
mode on until it leaves, as ``torch.func.grad`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._C import _functorch as _C
from torch._functorch import predispatch

__all__ = ["current_level", "levels_from_nesting"]

_ENTER = {
    _C._grad_increment_nesting,
    _C._vmap_increment_nesting,
    _C._jvp_increment_nesting,
    predispatch._vmap_increment_nesting,
    predispatch._jvp_increment_nesting,
}
_LEAVE = {
    _C._grad_decrement_nesting,
    _C._vmap_decrement_nesting,
    _C._jvp_decrement_nesting,
    predispatch._vmap_decrement_nesting,
    predispatch._jvp_decrement_nesting,
}
# Where each call that takes a level has it among its arguments.
_LEVEL_AT = {
    _C._wrap_for_grad: 1,
    _C._unwrap_for_grad: 1,
    predispatch._unwrap_for_grad: 1,
    _C._add_batch_dim: 2,
    predispatch._add_batch_dim: 2,
    _C._remove_batch_dim: 1,
    predispatch._remove_batch_dim: 1,
}


def levels_from_nesting(graph: torch.fx.Graph, base: int) -> None:
    """Make each level ``graph`` entered an argument read from the call that entered it.

    ``base``: the innermost transform level while Dynamo traced the graph (0: none); the
    k-th level the graph has open was ``base + k`` then."""
    open_: list[torch.fx.Node] = []
    modes: list[torch.fx.Node | None] = []  # of each open level: grad mode before it (a grad level)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target: Any = node.target
        if target in _ENTER:
            open_.append(node)
            modes.append(_grad_mode_on(graph, node) if target is _C._grad_increment_nesting else None)
        elif target in _LEAVE:
            if open_:
                open_.pop()
                before = modes.pop()
                if before is not None:
                    with graph.inserting_before(node):
                        graph.call_function(torch._C._set_grad_enabled, (before,))
        elif target in _LEVEL_AT:
            at = _LEVEL_AT[target]
            level = node.args[at] if len(node.args) > at else None
            if type(level) is int and base < level <= base + len(open_):
                args = list(node.args)
                args[at] = open_[level - base - 1]
                node.args = tuple(args)


def _grad_mode_on(graph: torch.fx.Graph, entered: torch.fx.Node) -> torch.fx.Node:
    """After ``entered``: read grad mode, then turn it on; the node that read it."""
    with graph.inserting_after(entered):
        before = graph.call_function(torch.is_grad_enabled, ())
    with graph.inserting_after(before):
        graph.call_function(torch._C._set_grad_enabled, (True,))
    return before


def current_level() -> int:
    """The innermost functorch transform level now (0 when none)."""
    level = torch._C._functorch.maybe_current_level()
    return 0 if level is None else int(level)
