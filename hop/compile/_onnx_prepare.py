"""What hop changes in the copy of a program torch's ONNX exporter translates.

Its branches' int outputs become tensors, its float64 constants stay exact. The
program the user passed is left alone.

Note [constant outputs of subgraphs]
torch's exporter translates each subgraph into an ONNX function whose outputs must
be values; a branch that returns a Python int (``lambda a: (a * 2, 3)``) leaves the
int itself in the subgraph's output node, which the exporter cannot translate. It
represents a program's ints as 0-dim INT64 tensors, so hop makes each such output a
0-dim INT64 constant, in the decomposed copy of the program the exporter translates
(after its own preparation). A cond whose branches return 3 and 4 then
gives the If an INT64 output that the rest of the graph reads as the int it is.

Note [float64 constants in ONNX subgraphs]
torch's exporter writes a Python float in a graph (``y + 1e-10`` on a float64 ``y``,
decomposed to ``aten.scalar_tensor(1e-10, dtype=float64)``) as a FLOAT constant
cast to DOUBLE: the value is rounded to float32 on the way. Its optimizer then
drops ``y + 1e-8`` as ``y + 0`` (its no-op rules compare a 0-dim constant with 0
and 1 within a float32 tolerance). An adaptive
solver's tolerance so becomes 0 and its first step NaN, and the loop runs to its
cap with values far off, without an error. In the subgraphs of hop's operators,
the copy the exporter translates gets each such constant as a float64 tensor
instead (a ``get_attr`` the exporter writes as a DOUBLE ``Constant``): exact; and
one of add, sub, mul, div gets it with at least one dimension, which the optimizer's
no-op rules leave alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from hop._operator import HigherOrderOperator

_F64 = torch.float64


def constant_outputs_as_tensors(gm: torch.fx.GraphModule) -> int:
    """Make each Python int a hop operator's subgraph returns a 0-dim int64 tensor, in
    ``gm`` and the subgraphs below it (Note [constant outputs of subgraphs]); the count."""
    return sum(_tensor_outputs(sub) for sub in hop_subgraphs(gm))


def hop_subgraphs(gm: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    """The branches and bodies of ``gm``'s hop nodes, and theirs, each once, outermost first."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, HigherOrderOperator):
            continue
        for arg in node.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                sub = getattr(gm, str(arg.target))
                if isinstance(sub, torch.fx.GraphModule):
                    yield sub
                    yield from hop_subgraphs(sub)


def _tensor_outputs(sub: torch.fx.GraphModule) -> int:
    out = next(n for n in sub.graph.nodes if n.op == "output")
    changed = 0

    def as_tensor(a: Any) -> Any:
        nonlocal changed
        if type(a) is not int:  # branches return tensors and ints (hop.cond's contract)
            return a
        with sub.graph.inserting_before(out):
            node = sub.graph.call_function(torch.ops.aten.full.default, ([], a), {"dtype": torch.int64})
        node.meta["val"] = torch.full([], a, dtype=torch.int64)  # the exporter reads shape, dtype
        changed += 1
        return node

    out.args = (torch.fx.node.map_aggregate(out.args[0], as_tensor),)
    if changed:
        sub.recompile()
    return changed


def exact_float64_constants(gm: torch.fx.GraphModule) -> int:
    """Note [float64 constants in ONNX subgraphs]: in the subgraphs of ``gm``'s hop nodes
    (and theirs, recursively), Python floats feeding float64 tensors become 0-dim
    float64 constants; the count."""
    return sum(_in_graph(sub) for sub in hop_subgraphs(gm))


# The arithmetic whose constant operand onnxscript's rewriter drops when it is within
# its tolerance of 0 or 1 (``x * 1``, ``x + 0``, ``x - 0``, ``x / 1``): it matches 0-dim
# constants only, so these get theirs with one dimension per output dimension (at
# least one), which broadcasts to the same result.
_ARITHMETIC = (
    torch.ops.aten.add.Tensor,
    torch.ops.aten.sub.Tensor,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor,
)


def _in_graph(sub: torch.fx.GraphModule) -> int:
    changed = 0
    made: set[torch.fx.Node] = set()
    for node in list(sub.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten.scalar_tensor.default and _is_f64(node) and _is_float(node.args[0]):
            constant = _constant(sub, node, node.args[0], 0)
            made.add(constant)
            node.replace_all_uses_with(constant)
            sub.graph.erase_node(node)
            changed += 1
            continue
        if not _is_f64(node):
            continue
        if node.target in _ARITHMETIC:
            changed += _unfoldable(sub, node, made)
            continue
        schema_args = node.target._schema.arguments
        args = list(node.args)
        for k, (a, formal) in enumerate(zip(args, schema_args, strict=False)):
            if _is_float(a) and isinstance(formal.type, torch._C.TensorType):
                args[k] = _constant(sub, node, a, 0)
                changed += 1
        node.args = tuple(args)
    if changed:
        sub.graph.eliminate_dead_code()
        sub.graph.lint()
        sub.recompile()
    return changed


def _unfoldable(sub: torch.fx.GraphModule, node: torch.fx.Node, made: set[torch.fx.Node]) -> int:
    """``node`` (float64 arithmetic) with its constant operands as float64 tensors of one
    dimension per output dimension; a 0-dim output is computed at shape [1] and viewed back."""
    rank = node.meta["val"].dim()
    args, changed = list(node.args), 0
    for k, a in enumerate(args[:2]):
        value: float | None = None
        if type(a) is float:
            value = a
        elif isinstance(a, torch.fx.Node) and a in made:
            value = float(getattr(sub, str(a.target)).item())
        if value is not None:
            args[k] = _constant(sub, node, value, max(rank, 1))
            changed += 1
    if not changed:
        return 0
    node.args = tuple(args)
    if rank == 0:
        val = node.meta["val"]
        node.meta["val"] = val.reshape(1)
        with sub.graph.inserting_after(node):
            back = sub.graph.call_function(torch.ops.aten.view.default, (node, []))
        back.meta["val"] = val
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return changed


def _is_float(a: Any) -> bool:
    return type(a) is float


def _is_f64(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == _F64


def _constant(sub: torch.fx.GraphModule, user: torch.fx.Node, value: float, rank: int) -> torch.fx.Node:
    """A float64 tensor attribute of ``sub`` of ``rank`` dimensions of size 1, read by a
    get_attr before ``user``."""
    k = 0
    while hasattr(sub, f"_hop_f64_{k}"):
        k += 1
    name = f"_hop_f64_{k}"
    tensor = torch.full([1] * rank, value, dtype=_F64)
    sub.register_buffer(name, tensor)
    with sub.graph.inserting_before(user):
        node = sub.graph.get_attr(name)
    node.meta["val"] = tensor  # the exporter reads the value from here
    return node
