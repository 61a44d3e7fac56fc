"""Records and TORCH_TRACE artifacts of what tracing and torch.compile decided.

Each is both a record for the sinks (``hop.debug.trace()``, ``HOP_LOG=dispatch``)
and, when torch's structured trace is on, an artifact named ``hop_<what>_<op>...``
that ``tlparse`` lists under the compiled frame it belongs to (or, outside
torch.compile, among the trace's unattributed entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from hop import _observe, _spec
from hop._records import DispatchRecord

__all__ = ["traced_node", "captured", "unified", "runtime_assert", "graph_break"]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def traced_node(op: str, args: tuple[Any, ...]) -> None:
    """An operator node was put in a traced program (make_fx, torch.export, AOT
    autograd): each of its subgraphs, by role."""
    frame = _observe.current(op)
    if frame is not None:
        frame.traced = True
    graphs = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.fx.GraphModule)]
    _subgraphs(op, graphs, "trace", "hop_subgraph")


def captured(op: str, graphs: Sequence[torch.fx.GraphModule]) -> None:
    """torch.compile's Dynamo captured a call as one node of its graph, with ``graphs``."""
    record = DispatchRecord(op, "Dynamo", "captured", None, f"{len(graphs)} subgraphs", kind="call")
    _observe.emit(record)
    _subgraphs(op, graphs, "Dynamo", "hop_dynamo_subgraph")


def _subgraphs(op: str, graphs: Sequence[torch.fx.GraphModule], key: str, prefix: str) -> None:
    structured = _observe.structured_on()
    depth = _observe.depth(op)
    for k, gm in enumerate(graphs):
        role = _spec.role_of(op, k)
        nodes = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
        _observe.emit(
            DispatchRecord(op, key, "subgraph", None, f"{nodes} nodes", kind="subgraph", role=role, depth=depth)
        )
        if structured:
            code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
            header = f"# hop.{op}: {role}\n"
            _observe.artifact(f"{prefix}_{op}_{_slug(role)}", header + code)


def unified(op: str, roles: Sequence[str], values: Sequence[Any], result: Any, low: Any, high: Any) -> None:
    """Differing sizes of one output (one per branch) became the symbol ``result``."""
    sizes = {role: str(v) for role, v in zip(roles, values, strict=True)}
    where = f"{result} in [{low}, {high}]"
    text = ", ".join(f"{r}={v}" for r, v in sizes.items()) + f" -> {where}"
    _observe.emit(DispatchRecord(op, "trace", "unify", None, text, kind="unify", depth=_observe.depth(op)))
    if _observe.structured_on():
        payload = {"op": op, "sizes": sizes, "symbol": str(result), "range": [str(low), str(high)]}
        _observe.artifact(f"hop_unify_{op}", payload)


def runtime_assert(op: str, message: str) -> None:
    """A runtime assert was put after the operator's node of a traced program."""
    _observe.emit(DispatchRecord(op, "trace", "assert", None, message, kind="assert", depth=_observe.depth(op)))
    if _observe.structured_on():
        _observe.artifact(f"hop_assert_{op}", {"op": op, "assert": message})


def graph_break(error: BaseException) -> None:
    """torch.compile cannot capture a call of a hop operator: Dynamo breaks the graph
    (or, with ``fullgraph=True``, raises ``error``)."""
    op = getattr(error, "op", None) or "?"
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    _observe.emit(
        DispatchRecord(op, "Dynamo", "graph-break", None, f"{type(error).__name__}: {reason}", kind="graph-break")
    )
    if _observe.structured_on():
        payload = {"op": op, "error": type(error).__name__, "reason": str(error)}
        _observe.artifact(f"hop_graph_break_{op}", payload)
