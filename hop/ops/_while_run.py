"""The ways a while_loop runs as Python: eager, inline under a transform, a traced program's loop.

:func:`run_eager` is the public function's loop in plain eager, for a validated
signature: the user's functions on their pytrees, as is. :func:`run` is the dense
rule's loop on flat carries at the current level (Note [loops run inline] in
``hop.ops.while_loop``), masked where an enclosing vmap batches the condition:
it runs while any element is active and freezes finished elements with
``torch.where``. :func:`run_graphs` is a traced loop outside every transform (an
exported program running), whose steps are the graphs' code alone
(Note [running a traced body per step] in ``_graph_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _observe, _transforms
from hop import subgraph as _subgraph
from hop.errors import HopValueError, format_message
from hop.ops import _graph_step
from hop.ops._branching import as_tuple
from hop.ops._common import refuse_legacy_onnx
from hop.ops._while_checks import NAME, truth

Fn = Callable[..., Any]
_TRIPS = "how many times the body runs depends on cond_fn's result, a tensor"
_SINKS = _observe.SINKS


def run_eager(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], leaves: list[Any]) -> Any:
    """Note [loops run inline], for a validated signature: the user's functions, as is.

    The signature was checked once on fake tensors; per iteration only the number
    of carries is (a body that changes it would otherwise fail inside Python's call
    or return another program's result), and the final carry is checked against
    ``carried_inputs`` (structure, dtype, device, rank) before it is returned. A
    body may return a bare value for a single carry.
    """
    carry = tuple(carried_inputs)
    n = len(carry)
    while True:
        pred = cond_fn(*carry)
        if type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx(NAME, _TRIPS)
        if not pred:
            break
        out = body_fn(*carry)
        carry = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(carry) != n:
            break
    _subgraph.check_same_outputs(
        NAME, ("carried_inputs", "body_fn"), (tuple(carried_inputs), carry), root="carry", fns=(None, body_fn)
    )
    flat, spec = _subgraph.flatten(carry)
    out_tree = _subgraph.unflatten(_subgraph.clone_aliases(flat, leaves), spec)
    return out_tree if type(carried_inputs) is tuple else list(out_tree)


def run(cond_fn: Fn, body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """Note [loops run inline]: the Python loop at the current level, masked where the
    condition is batched by an enclosing vmap."""
    carry = tuple(carry)
    if isinstance(body_fn, torch.fx.GraphModule):  # Note [traced bodies see contiguous values] (_looping)
        if isinstance(cond_fn, torch.fx.GraphModule) and _transforms.functorch_level() is None:
            return run_graphs(cond_fn, body_fn, carry, additional)
        carry = _contiguous(carry)
        body = body_fn
        body_fn = lambda *a: _contiguous(as_tuple(body(*a)))  # noqa: E731
    if _SINKS:  # count the trips (under a transform, or the raw op in eager)
        cond_fn = _observe.counted(NAME, cond_fn)
    while True:
        pred = truth(cond_fn(*carry, *additional))
        if type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx(NAME, _TRIPS)
        if type(pred) is bool or not _is_batched(pred):
            if not pred:
                return carry
            carry = as_tuple(body_fn(*carry, *additional))
            continue
        if not _any_batch_element(pred):
            return carry
        new = as_tuple(body_fn(*carry, *additional))
        carry = tuple(_freeze(pred, n, o) for n, o in zip(new, carry, strict=True))


def run_graphs(
    cond_fn: torch.fx.GraphModule, body_fn: torch.fx.GraphModule, carry: Sequence[Any], additional: Sequence[Any]
) -> tuple[Any, ...]:
    """A traced loop outside every transform (an exported program running): the
    condition was checked when traced and no vmap batches it, so a step is the two
    graphs' code and nothing else (a reverse-mode backward runs three such loops)."""
    counted = _graph_step.counted_loop(cond_fn, body_fn, len(carry))  # Note [running a traced body per step]
    if counted is not None:
        out = _graph_step.run_counted(counted, carry, additional)
        if out is not None:
            return out
    # traced subgraphs have no module hooks to run
    cond = _graph_step.step_function(cond_fn) or cond_fn.forward
    body = _graph_step.step_function(body_fn, contiguous=True)
    values = _contiguous(carry)
    if body is None:
        while cond(*values, *additional):
            values = _contiguous(as_tuple(body_fn.forward(*values, *additional)))
        return values
    while cond(*values, *additional):
        values = body(*values, *additional)
    return values


def _contiguous(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in values)


def _is_batched(t: torch.Tensor) -> bool:
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return True
        t = torch._C._functorch.get_unwrapped(t)
    return False


def _any_batch_element(pred: torch.Tensor) -> bool:
    """Whether any batch element of a vmap-batched condition holds."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = pred
    while torch._C._functorch.is_functorch_wrapped_tensor(raw):
        raw = torch._C._functorch.get_unwrapped(raw)
    with temporarily_clear_interpreter_stack():
        return bool(raw.any())


def _freeze(pred: torch.Tensor, new: Any, old: Any) -> Any:
    if not isinstance(old, torch.Tensor):
        if new != old:
            raise HopValueError(
                format_message(
                    NAME,
                    "with a condition batched by vmap, int carries cannot change (each element would need its own)",
                    fix="Carry the counter as a tensor, e.g. torch.tensor(0).",
                ),
                op=NAME,
            )
        return old
    if new.shape != old.shape:
        raise HopValueError(
            format_message(
                NAME,
                f"with a condition batched by vmap, carries cannot change size ({tuple(old.shape)} -> "
                f"{tuple(new.shape)}): finished elements are frozen element-wise",
            ),
            op=NAME,
        )
    return torch.where(pred.reshape(()), new, old)
