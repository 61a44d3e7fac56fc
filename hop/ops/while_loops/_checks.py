"""The checks while_loop makes of its arguments and of what its functions return.

:func:`check_arguments` (callables, a tuple or list of tensor and int carries),
:func:`flat_functions` (cond and body on flat carries, the body checking its next
carry against the carry), :func:`validate` (one iteration on fake tensors, eager's
validate-once run), :func:`truth` and :func:`check_cond_graph` (cond_fn returns a
Python bool or a one-element bool tensor). The public function, the rules and the
Dynamo handler (``hop.compile._dynamo_while``) all call them, so each mistake reads
the same wherever it is caught.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _validation as validation
from hop import subgraph as _subgraph
from hop._output_checks import check_arity
from hop.errors import HopTypeError, format_message, not_a_sequence, type_name

Fn = Callable[..., Any]
NAME = "while_loop"  # the family's one raw op: its spec (while_loop.SPEC) takes this name


def check_arities(cond_fn: Any, body_fn: Any, carried_inputs: Sequence[Any]) -> None:
    """Each function takes one argument per carry (the public function's check: Dynamo's
    handler sees a method as its function, without ``self``)."""
    n = len(carried_inputs)
    for role, fn in (("cond_fn", cond_fn), ("body_fn", body_fn)):
        check_arity(NAME, role, fn, n, f"one argument per carry ({n})")


def check_arguments(cond_fn: Any, body_fn: Any, carried_inputs: Any) -> None:
    for role, fn in (("cond_fn", cond_fn), ("body_fn", body_fn)):
        if not callable(fn):
            raise HopTypeError(
                format_message(NAME, f"{role} must be callable, got {type_name(fn)}"), op=NAME, role=role
            )
    if not isinstance(carried_inputs, (tuple, list)):
        raise not_a_sequence(NAME, "carried_inputs", type_name(carried_inputs))
    for path, leaf in zip(
        _subgraph.leaf_paths(tuple(carried_inputs), "carried_inputs"),
        _subgraph.flatten(tuple(carried_inputs))[0],
        strict=True,
    ):
        if not isinstance(leaf, (torch.Tensor, int, torch.SymInt)) or isinstance(leaf, bool):
            raise HopTypeError(
                format_message(NAME, f"{path} must be a tensor or an int, got {type_name(leaf)}"),
                op=NAME,
                role="carried_inputs",
                path=path,
            )


def flat_functions(cond_fn: Fn, body_fn: Fn, spec: Any) -> tuple[Fn, Fn]:
    """cond and body on flat carries; body checks its output against the carry."""

    def flat_cond(*leaves: Any) -> Any:
        return cond_fn(*_subgraph.unflatten(leaves, spec))

    def flat_body(*leaves: Any) -> tuple[Any, ...]:
        carry = _subgraph.unflatten(leaves, spec)
        out = body_fn(*carry)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        _subgraph.check_same_outputs(
            NAME, ("carried_inputs", "body_fn"), (tuple(carry), tuple(out)), root="carry", fns=(None, body_fn)
        )
        return tuple(_subgraph.flatten(tuple(out))[0])

    flat_cond.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    flat_body.__wrapped__ = body_fn  # type: ignore[attr-defined]
    return flat_cond, flat_body


def validate(flat_cond: Fn, flat_body: Fn, leaves: list[Any], fns: tuple[Fn, Fn]) -> None:
    """One iteration on fake tensors: cond returns one bool, body keeps the carry's kind."""
    if not validation.fakeable(leaves):
        return  # a quantized carry: the real iterations decide
    with validation.fake_inputs(leaves) as fake:
        try:
            validation.check_hooks(*fns)
            truth(flat_cond(*fake), fns[0])
            flat_body(*fake)
        except validation.CANNOT_FAKE:
            return


def truth(pred: Any, fn: Any = None) -> Any:
    """A Python bool, or a tensor that is batched (the masked loop) or cannot be read."""
    if type(pred) is bool:
        return pred
    if isinstance(pred, torch.SymBool):
        return pred
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool or pred.numel() != 1:
        what = (
            f"a tensor of dtype {str(pred.dtype).removeprefix('torch.')} and shape {tuple(pred.shape)}"
            if isinstance(pred, torch.Tensor)
            else type_name(pred)
        )
        where = f" ({_subgraph.describe_fn(fn)})" if fn is not None else ""
        raise HopTypeError(
            format_message(
                NAME,
                f"cond_fn{where} must return a Python bool or a one-element bool tensor, got {what}",
                fix="Reduce it, e.g. return (err > tol).any().",
            ),
            op=NAME,
            role="cond_fn",
        )
    return pred


def check_cond_graph(gm: torch.fx.GraphModule, cond_fn: Fn) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
    truth(val, cond_fn)
