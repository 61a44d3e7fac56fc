"""A loop body's writes to its carries, made in place for Inductor (the cost of the slice written).

Note [a written carry is written in place]
A body that writes one row of a carried buffer (a KV cache, a ring buffer: the state
of docs/state.md, or a carry written out of place with ``index_copy``) reaches
Inductor functionalized: its output is ``index_put(buffer, [i], row)``, a new
buffer. Inductor's while loop then allocates and fills a whole new buffer every
step, so a step costs the buffer, not the row. Its generated loop hands each step's
outputs to the next step by reference, and a body that writes a carried input in
place is lowered as a mutation of that input (hop's scan rewrite writes its stacked
outputs so). So before lowering, a carry whose body output is a chain of scatters
(``index_put``, ``index_copy``, ``scatter``, ``select_scatter``, ``slice_scatter``)
into that same carry's placeholder becomes the in-place chain, returning the
placeholder, when no read of the carry's old value (the placeholder, or a view of it)
comes after the first scatter; reads of the written value (attention over the KV
cache the step appended to) then read the placeholder, written by then. Only a
contiguous carry whose initial value has the body's traced layout qualifies:
Inductor writes a strided input through a copy of its own. The loop's initial
value of such a carry is copied once before the loop (the caller's tensor, a graph
input, keeps its value for every other reader): one copy per call, a row per step.

Note [a written graph input is the loop's own carry]
The copy before the loop is not needed where nobody else reads the caller's tensor:
a buffer the loop's callables write in place (docs/state.md) reaches Inductor as a
graph input ``P`` carried by the loop and written back after it, ``P.copy_(out_k)``.
When that write-back is the only other use of ``P`` (no read before or after the
loop, no other carry or additional input a callable reads: an alias would see the
writes early), the loop carries ``P`` itself and the write-back goes: the body writes
each row straight into the caller's buffer, so a call costs the rows written, not
two copies of the buffer. Inductor's scheduler keeps a loop that mutates a graph
input even when no output of it is read. A loop that runs no step returns a clone
of ``P``, which nobody reads: ``P`` keeps its value, as in Python.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["DONATED", "donate_written_inputs", "write_carries_in_place"]

# node.meta key: the carries of a loop node that are graph inputs it writes directly
DONATED = "hop_donated_carries"
# GraphModule.meta key: the carries write_carries_in_place made in place (it runs once
# per body: a second call, a later lowering of the same subgraph, gets the same answer)
_WRITTEN = "hop_carries_in_place"

aten = torch.ops.aten

# functional scatter -> how to do it in place on its first argument
_IN_PLACE: dict[Any, Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]] = {}


def _same_args(in_place: Any) -> Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]:
    def emit(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        return graph.call_function(in_place, node.args, node.kwargs)

    return emit


def _view_then_copy(view: Any) -> Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]:
    """``select_scatter(x, src, dim, i)`` is ``x.select(dim, i).copy_(src)`` (the slice
    form alike); the chain goes on from ``x``."""

    def emit(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
        target, src, *where = node.args
        part = graph.call_function(view, (target, *where))
        graph.call_function(aten.copy_.default, (part, src))
        return target  # type: ignore[return-value]

    return emit


_IN_PLACE.update(
    {
        aten.index_put.default: _same_args(aten.index_put_.default),
        aten.index_copy.default: _same_args(aten.index_copy_.default),
        aten.scatter.src: _same_args(aten.scatter_.src),
        aten.scatter.value: _same_args(aten.scatter_.value),
        aten.scatter_add.default: _same_args(aten.scatter_add_.default),
        aten.select_scatter.default: _view_then_copy(aten.select.int),
        aten.slice_scatter.default: _view_then_copy(aten.slice.Tensor),
    }
)


def write_carries_in_place(body: torch.fx.GraphModule, carried: Sequence[Any]) -> list[int]:
    """Note [a written carry is written in place]: rewrite ``body`` (its first
    ``len(carried)`` placeholders and outputs are the carries; ``carried`` holds the
    loop's initial values, fx nodes or tensors) and return the carries now written in
    place. A second call (the same body lowered again) returns the first's answer, or
    fails loudly where a carry it wrote in place now comes in another layout."""
    n_carries = len(carried)
    if _WRITTEN in body.meta:
        done = list(body.meta[_WRITTEN])
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        if not all(_fits(placeholders[k], carried[k]) for k in done):
            raise AssertionError("hop: a loop body written in place is shared by a loop whose carries differ in layout")
        return done
    graph = body.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    order = {n: k for k, n in enumerate(graph.nodes)}
    done = []
    for k in range(min(n_carries, len(outs), len(placeholders))):
        if not _fits(placeholders[k], carried[k]):
            # Inductor writes a scatter into a strided input through a contiguous copy it
            # then returns as a new buffer, while the loop would hand on the input (and the
            # loop passes its carries in their callers' layouts, which the body's trace
            # need not share): the caller's tensor would keep its initial rows, silently
            continue
        chain = _chain(outs[k], placeholders[k])
        if chain is None or _old_value_read_after(placeholders[k], chain[0], order):
            continue
        # the written value may be read in the step (attention over the cache this step
        # appended to): those reads now read the carry, written in place by then
        target: Any = placeholders[k]
        for node in chain:
            with graph.inserting_before(node):
                new = _IN_PLACE[node.target](graph, node)
            node.replace_all_uses_with(target)
            graph.erase_node(node)
            del new
        done.append(k)
    if done:
        graph.lint()
        body.recompile()
    body.meta[_WRITTEN] = tuple(done)
    return done


def donate_written_inputs(
    node: torch.fx.Node,
    carries: list[Any],
    additional: list[Any],
    subgraphs: list[tuple[torch.fx.GraphModule, int]],
    written: list[int],
) -> set[int]:
    """Note [a written graph input is the loop's own carry]: for each carry in
    ``written`` that is a graph input read by nothing but ``node`` and its
    write-back, drop the write-back and record the carry in ``node.meta[DONATED]``.
    ``subgraphs`` pairs each callable with the index of its first placeholder for
    ``additional``."""
    donated: set[int] = set()
    for k in written:
        p = carries[k]
        if not (isinstance(p, torch.fx.Node) and p.op == "placeholder"):
            continue
        spare = [j for j, a in enumerate(additional) if a is p]
        if sum(a is p for a in pytree.tree_leaves(node.args)) != 1 + len(spare):
            continue  # another carry, or a scanned input
        if any(_read(subgraphs, j) for j in spare):
            continue
        others = [u for u in p.users if u is not node]
        if len(others) != 1 or not _is_write_back(others[0], p, node, k, len(carries)):
            continue
        copy = others[0]
        src = copy.args[1]
        node.graph.erase_node(copy)
        if isinstance(src, torch.fx.Node) and src is not node and not src.users:
            node.graph.erase_node(src)
        donated.add(k)
    if donated:
        node.meta[DONATED] = frozenset(donated)
    return donated


def _read(subgraphs: list[tuple[torch.fx.GraphModule, int]], j: int) -> bool:
    """Whether some callable reads its ``j``-th additional input."""
    for gm, first in subgraphs:
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        if first + j >= len(placeholders) or placeholders[first + j].users:
            return True
    return False


def _is_write_back(copy: torch.fx.Node, p: torch.fx.Node, node: torch.fx.Node, k: int, n: int) -> bool:
    """``copy`` is ``p.copy_(out_k)``, out_k the loop's k-th output read by nothing else,
    of ``p``'s exact layout."""
    if copy.op != "call_function" or copy.target is not aten.copy_.default or copy.kwargs or copy.users:
        return False
    if len(copy.args) != 2 or copy.args[0] is not p:
        return False
    src = copy.args[1]
    if not isinstance(src, torch.fx.Node) or set(src.users) != {copy}:
        return False
    if n == 1:
        if src is not node:
            return False
    elif not (src.op == "call_function" and src.target is operator.getitem and src.args == (node, k)):
        return False
    a, b = p.meta.get("val"), src.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_layout(a, b)


_METADATA_READS = frozenset(
    (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default)
)


def _old_value_read_after(placeholder: torch.fx.Node, first: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Whether the carry's value before ``first`` writes it is read after that, directly
    or through a view of it (``r = buf[0]`` before the write, read after it, must see
    the old row)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None  # type: ignore[no-untyped-call]

    mine = storage(placeholder)
    seen: set[torch.fx.Node] = set()
    stack = [placeholder]
    while stack:
        for user in stack.pop().users:
            if user is first or user in seen or user.target in _METADATA_READS:
                continue  # a size the write does not change
            if order[user] > order[first]:
                return True
            seen.add(user)
            view = getattr(user.target, "is_view", False) or user.target is operator.getitem
            theirs = storage(user)  # None for a size read or any non-tensor value
            if view or (mine is not None and theirs is not None and theirs == mine):
                stack.append(user)  # a view (or a part of one): its readers read the carry too
    return False


def _fits(placeholder: torch.fx.Node, initial: Any) -> bool:
    """The body's carry and the loop's initial value are both contiguous, of one layout.
    (Asked inside a rewrite's trace too: the symbolic sizes' arithmetic stays out of it.)"""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    traced = placeholder.meta.get("val")
    given = initial.meta.get("val") if isinstance(initial, torch.fx.Node) else initial
    if not (isinstance(traced, torch.Tensor) and isinstance(given, torch.Tensor)):
        return False
    with disable_proxy_modes_tracing():
        return (
            statically_known_true(traced.is_contiguous())
            and statically_known_true(given.is_contiguous())
            and _same_layout(traced, given)
        )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    same = sym_eq(tuple(a.shape), tuple(b.shape)) & sym_eq(a.stride(), b.stride())  # type: ignore[operator]
    return a.dtype == b.dtype and a.device == b.device and statically_known_true(same)


def _chain(out: Any, placeholder: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The scatters from ``placeholder`` to ``out``, first first; None when ``out`` is not
    such a chain (or an intermediate has another reader)."""
    chain: list[torch.fx.Node] = []
    node = out
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _IN_PLACE:
        chain.append(node)
        first = node.args[0]
        if first is placeholder:
            chain.reverse()
            return chain
        if not isinstance(first, torch.fx.Node) or len(first.users) != 1:
            return None
        node = first
    return None
