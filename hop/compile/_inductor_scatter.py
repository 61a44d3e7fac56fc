"""Scatters into overlapping tensors get a dense copy before Inductor reinplaces them.

Note [a scatter's base is dense]
A functional scatter (``index_put``, a ``*_scatter``) returns a new tensor; Inductor's
reinplacing pass turns it into the in-place op on its base when nothing reads the
base later, without asking whether the base's elements overlap. A base of stride 0
(``zeros(3, 2).expand(4, 3, 2)``: what vmap makes of an unbatched ``zeros`` that a
batched gradient is added into, as in the backward of an ``index_select`` computed
under vmap) then has every batch row's writes land in one row, and each row of the
result reads their sum, silently: ``vmap(vjp(index_select))`` compiled by torch's
Inductor, with no hop operator. hop's rules hit it where a plain program does not
(a vmapped cond's or loop's backward is the vmap of its callables' vjp), so the
pass gives such a base a contiguous copy first: the scatter then writes into that.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from hop.ops._common import overlapping

aten = torch.ops.aten

# the functional scatters Inductor reinplaces (before or after canonicalizing the
# ``*_scatter`` ops into its own generalized scatter), the base first
SCATTERS = (
    aten.index_put.default,
    aten._unsafe_index_put.default,
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.diagonal_scatter.default,
    aten.as_strided_scatter.default,
)


def dense_bases(graph: torch.fx.Graph) -> bool:
    """Note [a scatter's base is dense]: a contiguous copy of every overlapping base of
    a scatter in ``graph``. Whether it changed anything."""
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SCATTERS or not node.args:
            continue
        base = node.args[0]
        val = base.meta.get("val") if isinstance(base, torch.fx.Node) else None
        if not overlapping(val):
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(aten.clone.default, (base,), {"memory_format": torch.contiguous_format})
        copy.meta = {**base.meta, "val": _dense(val)}
        node.args = (copy, *node.args[1:])
        changed = True
    return changed


def _dense(val: Any) -> Any:
    return val.clone(memory_format=torch.contiguous_format)
