"""``hop.bounded_while``: a while loop with a step budget, declared by its decomposition.

``bounded_while(cond_fn, body_fn, carries, max_steps)`` is the plain Python program::

    steps = 0
    while steps < max_steps and cond_fn(*carries):
        carries = body_fn(*carries)
        steps += 1
    return carries

A step budget is what solvers and decoders write around their loops (an ODE solver's
``max_steps``, a generation loop's ``max_new_tokens``, an iterative refinement that must
stop), and what a deployment target without a data-dependent loop needs to bound one.

hop's eighth operator is declared the way a user declares theirs (docs/writing_a_hop.md,
Note [an operator from its decomposition]): ``hop.HigherOrderOperator(name,
decomposition=fn)`` with ``fn`` written with ``hop.while_loop``. Every rule (autograd,
vmap, jvp, functionalization, fake tensors, tracing, export, torch.compile, Inductor,
AOTInductor, ONNX) is derived from it; this module only checks the arguments, so that a
misuse names ``hop.bounded_while`` and the argument at fault.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop._operator import HigherOrderOperator, declare_own
from hop.errors import HopTypeError, HopValueError, format_message, type_name
from hop.ops.while_loops.while_loop import while_loop

__all__ = ["bounded_while", "bounded_while_op"]

_NAME = "bounded_while"


def _decomposition(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carries: tuple[torch.Tensor, ...], max_steps: Any
) -> tuple[torch.Tensor, ...]:
    counter = carries[0].new_zeros((), dtype=torch.int64)

    def cond(i: torch.Tensor, *c: torch.Tensor) -> Any:
        return (i < max_steps) & cond_fn(*c)

    def body(i: torch.Tensor, *c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = body_fn(*c)
        return (i + 1, *(out if isinstance(out, (tuple, list)) else (out,)))

    cond.__wrapped__ = cond_fn  # type: ignore[attr-defined]  # errors name the user's callables
    body.__wrapped__ = body_fn  # type: ignore[attr-defined]
    return tuple(while_loop(cond, body, (counter, *carries))[1:])


bounded_while_op = declare_own(HigherOrderOperator(_NAME, decomposition=_decomposition))


def bounded_while(
    cond_fn: Callable[..., Any],
    body_fn: Callable[..., Any],
    carries: Sequence[torch.Tensor],
    max_steps: int | torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Run ``carries = body_fn(*carries)`` while ``cond_fn(*carries)`` holds, at most
    ``max_steps`` times; return the final carries, a tuple.

    ``cond_fn`` returns a one-element bool tensor; ``body_fn`` returns as many tensors as
    it takes, each of its input's size and dtype (a tuple, or one tensor for one carry).
    ``max_steps``: a non-negative int, or a one-element integer tensor.
    """
    for role, fn in (("cond_fn", cond_fn), ("body_fn", body_fn)):
        if not callable(fn):
            raise HopTypeError(
                format_message(_NAME, f"{role} must be callable, got {type_name(fn)}"), op=_NAME, role=role
            )
    if not isinstance(carries, (tuple, list)) or not carries:
        raise HopTypeError(
            format_message(
                _NAME,
                f"carries must be a non-empty tuple of tensors, got {type_name(carries)}",
                fix="Pass the loop's state as a tuple, e.g. (x,) for one tensor.",
            ),
            op=_NAME,
            role="carries",
        )
    for k, c in enumerate(carries):
        if not isinstance(c, torch.Tensor):
            raise HopTypeError(
                format_message(
                    _NAME,
                    f"carries[{k}] must be a tensor, got {type_name(c)}",
                    fix="Carry numbers as tensors (torch.tensor(n)).",
                ),
                op=_NAME,
                role="carries",
                path=f"carries[{k}]",
            )
    _check_max_steps(max_steps)
    return tuple(bounded_while_op(cond_fn, body_fn, tuple(carries), max_steps))


def _check_max_steps(max_steps: Any) -> None:
    if isinstance(max_steps, torch.Tensor):
        dtype = max_steps.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or max_steps.numel() != 1:
            raise HopTypeError(
                format_message(
                    _NAME,
                    f"max_steps must be a one-element integer tensor, got dtype "
                    f"{str(dtype).removeprefix('torch.')} and shape {tuple(max_steps.shape)}",
                    fix="Pass a Python int, or a tensor such as torch.tensor(n).",
                ),
                op=_NAME,
                role="max_steps",
            )
        return
    if not isinstance(max_steps, (int, torch.SymInt)) or isinstance(max_steps, bool):
        raise HopTypeError(
            format_message(
                _NAME,
                f"max_steps must be an int or an integer tensor, got {type_name(max_steps)}",
                fix="Pass a Python int (e.g. int(n)).",
            ),
            op=_NAME,
            role="max_steps",
        )
    if isinstance(max_steps, int) and max_steps < 0:
        raise HopValueError(
            format_message(_NAME, f"max_steps must be at least 0, got {max_steps}", fix="Pass 0 to run no step."),
            op=_NAME,
            role="max_steps",
        )
