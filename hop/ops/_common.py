"""What every operator family shares: cond/switch (``_branching``), scan/map
(``_looping``), while_loop and associative_scan.

Each helper here was once written in several families; it lives here once, so a
fix reaches them all. Nothing here knows an operator by name: the differences
are arguments (the words of a message, the values to look at).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from hop import _subgraph, _transforms
from hop.errors import MutationError, format_message

__all__ = ["check_effects", "differentiable", "differentiable_at", "runs_inline", "save_operands", "saved_operands"]

_Tensor = torch.Tensor


def differentiable(x: Any) -> bool:
    """A floating or complex tensor: what autograd, vjp and jvp give a gradient or tangent."""
    return isinstance(x, _Tensor) and (x.is_floating_point() or x.is_complex())


def differentiable_at(values: Sequence[Any]) -> list[int]:
    """The positions of the :func:`differentiable` values."""
    return [i for i, v in enumerate(values) if differentiable(v)]


def runs_inline(*groups: Sequence[Any]) -> bool:
    """Real values under every functorch wrapper and nothing tracing: the rules of
    every family then run the callables as plain Python at the current level (Note
    [eager branches run inline], Note [scans run inline], Note [loops run inline])."""
    return _transforms.no_modes() and all(_transforms.is_real(v) for group in groups for v in group)


def save_operands(ctx: Any, operands: Sequence[Any]) -> None:
    """Keep ``operands`` (tensors, ints, SymInts, None) on an autograd ``ctx`` for
    backward and jvp: tensors through autograd, so that torch.func transforms hand
    them back at the right level; the rest as they are."""
    tensors = [x for x in operands if isinstance(x, _Tensor)]
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)
    ctx.layout = [isinstance(x, _Tensor) for x in operands]
    ctx.others = [x for x in operands if not isinstance(x, _Tensor)]


def saved_operands(ctx: Any) -> list[Any]:
    """What :func:`save_operands` kept, in its order."""
    tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
    return [next(tensors) if is_tensor else next(others) for is_tensor in ctx.layout]


def check_effects(
    op: str, role: str, fn: Callable[..., Any], gm: torch.fx.GraphModule, *, what: str, updates: str, fix: str
) -> None:
    """Refuse a traced callable that writes one of its inputs in place (``what``:
    how the family calls that input; ``updates``: what such writes update), and make
    outputs that alias an input fresh tensors, as eager's outputs are."""
    effects = _subgraph.find_mutations_and_aliases(gm)
    if effects.mutated:
        raise MutationError(
            format_message(
                op,
                f"{role} ({_subgraph.describe_fn(fn)}) writes {what} {effects.mutated[0]} in place; in-place "
                f"updates of {updates} run in eager but cannot be traced (make_fx, torch.export)",
                fix=fix,
            ),
            op=op,
            role=role,
        )
    if effects.aliased:
        _subgraph.clone_aliased_outputs(gm, effects)
