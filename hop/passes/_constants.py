"""Values known before a program runs: the constant subexpressions of a graph.

Shared by the passes that decide something ahead of time (which branch a constant
selector picks, how many times a loop runs).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

UNKNOWN = object()  # a value only known at run time


def evaluate(gm: torch.fx.GraphModule, arg: Any, constants: dict[str, Any], memo: dict[torch.fx.Node, Any]) -> Any:
    """The value of ``arg`` (a node of ``gm`` or a Python value) if it depends on constants
    only, else :data:`UNKNOWN`; ``constants`` maps placeholder names to known values."""
    if arg is UNKNOWN or not isinstance(arg, torch.fx.Node):
        return arg if isinstance(arg, (bool, int, float)) or arg is None else UNKNOWN
    if arg not in memo:
        memo[arg] = _evaluate_node(gm, arg, constants, memo)
    return memo[arg]


def _evaluate_node(
    gm: torch.fx.GraphModule, node: torch.fx.Node, constants: dict[str, Any], memo: dict[torch.fx.Node, Any]
) -> Any:
    if node.op == "placeholder":
        return constants.get(node.name, UNKNOWN)
    if node.op == "get_attr":
        value = attr(gm, str(node.target))
        # A parameter is state a user trains, not a constant, even where make_fx stores it
        # as an attribute; a fake tensor has no value to fold.
        constant = isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
        return value if constant and not value.requires_grad else UNKNOWN
    if node.op != "call_function" or not pure(node.target):
        return UNKNOWN
    known = True

    def value_of(a: torch.fx.Node) -> Any:
        nonlocal known
        v = evaluate(gm, a, constants, memo)
        known &= v is not UNKNOWN
        return v

    args, kwargs = map_arg((node.args, node.kwargs), value_of)
    if not known:
        return UNKNOWN
    try:
        with torch.no_grad():
            return node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception:  # an op that cannot run ahead of time (a device missing here): keep the node
        return UNKNOWN


def pure(target: Any) -> bool:
    """Whether running ``target`` ahead of time gives the value it has at run time."""
    if target is torch.ops.aten.detach_.default:  # export detaches a lifted constant in place: values unchanged
        return True
    if isinstance(target, torch._ops.OpOverload):
        tags = target.tags
        return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in tags
    # Python's operators on scalars (``i < n`` on a SymInt): ``operator.lt`` is defined in ``_operator``.
    return getattr(target, "__module__", None) in (operator.__name__, "_operator")


def attr(gm: torch.nn.Module, target: str) -> Any:
    """The attribute a get_attr node of ``gm`` reads (``target`` may be dotted)."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def lifted_constants(program: torch.fx.GraphModule | torch.export.ExportedProgram) -> dict[str, Any]:
    """The top-level placeholders of ``program`` that hold constants, by name: the tensor
    constants ``torch.export`` lifts into inputs (a GraphModule has none)."""
    if not isinstance(program, torch.export.ExportedProgram):
        return {}
    lifted = program.graph_signature.inputs_to_lifted_tensor_constants
    return {name: program.constants[target] for name, target in lifted.items()}
