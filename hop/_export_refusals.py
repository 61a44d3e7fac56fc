"""What torch.export's pre-dispatch tracer cannot record around a hop operator,
refused with the operator's name and the way out before a wrong program is exported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._functorch import TransformType

from hop._kernels import Operator
from hop._pytree import tensors_in
from hop.errors import HopRuntimeError, format_message

__all__ = ["refuse_grad_level", "refuse_lost_tensors"]


def refuse_grad_level(op: Operator) -> None:
    """``torch.func.grad`` (or ``vjp``) inside a function torch.export traces: its
    pre-dispatch tracer meets the operator above the transform, so the operator's
    operands are the transform's wrappers, which the tracer records as constants (the
    exported program returned FakeTensors). torch cannot export ``torch.func.grad``
    of a plain Python program either, so this is refused, naming the operator."""
    stack = torch._C._functorch.get_interpreter_stack() or ()
    if any(interpreter.key() == TransformType.Grad for interpreter in stack):  # grad(vmap(f)) too
        raise HopRuntimeError(
            format_message(
                op.name(),
                "torch.func.grad inside a function torch.export traces cannot be exported (torch.export "
                "cannot record the transform's steps, for a plain Python program either)",
                fix="Export the function without the transform and take torch.func.grad of ep.module(), "
                "or trace the gradient with make_fx(torch.func.grad(f), tracing_mode='symbolic').",
            ),
            op=op.name(),
        )


def refuse_lost_tensors(op: Operator, mode: Any, args: tuple[Any, ...]) -> None:
    """A tensor made by a factory function (``torch.zeros``) under ``torch.func.jvp``
    inside a function torch.export traces is a transform wrapper of a FakeTensor that
    export's pre-dispatch tracer never sees: it would be recorded as a constant fake (a
    loop counter made so ran the wrong number of steps, silently; a plain program
    returns FakeTensors). Refused, naming the way out."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    for t in tensors_in(args):
        if not torch._C._functorch.is_functorch_wrapped_tensor(t) or get_proxy_slot(t, mode.tracer, None) is not None:
            continue
        inner = t
        while torch._C._functorch.is_functorch_wrapped_tensor(inner):
            inner = torch._C._functorch.get_unwrapped(inner)
        if isinstance(inner, FakeTensor):
            raise HopRuntimeError(
                format_message(
                    op.name(),
                    f"an operand of shape {tuple(t.shape)} was made by a factory function (torch.zeros, "
                    "torch.ones, ...) inside a torch.func transform in a function torch.export traces; export's "
                    "tracer never sees such a tensor (in a plain program either) and would bake in a fake value",
                    fix="Make it from an input with a tensor method (x.new_zeros(()), x.new_ones(3)) or outside the "
                    "transform and pass it in.",
                ),
                op=op.name(),
            )
