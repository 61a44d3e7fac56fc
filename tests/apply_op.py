"""A test-only HOP, ``apply(fn, *tensors) -> fn(*tensors)``, with a rule at every route.

``fn`` returns a tensor or a tuple of tensors. It is the smallest operator that
exercises each path of hop's dispatcher, and doubles as the worked example of
docs/writing_a_hop.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType, _add_batch_dim, _unwrap_batched
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

import hop
from hop import subgraph

apply = hop.HigherOrderOperator("test_apply")


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _like(out: Any, flat: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> Any:
    return tuple(flat) if isinstance(out, tuple) else flat[0]


@apply.py_impl(DispatchKey.CompositeExplicitAutograd)
def apply_dense(fn: Any, *tensors: torch.Tensor) -> Any:
    out = fn(*tensors)
    return _like(out, subgraph.clone_aliases(_as_tuple(out), tensors))


class _ApplyFunction(torch.autograd.Function):
    """Reverse and forward mode of apply, for autograd, grad and jvp alike."""

    generate_vmap_rule = True

    @staticmethod
    def forward(fn: Any, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        return apply(fn, *tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        fn, *tensors = inputs
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        tensors = ctx.saved_tensors
        out, vjp_fn = torch.func.vjp(ctx.fn, *tensors)
        cotangents = _like(
            out, [torch.zeros_like(o) if g is None else g for o, g in zip(_as_tuple(out), grads, strict=True)]
        )
        return (None, *vjp_fn(cotangents))

    @staticmethod
    def jvp(ctx: Any, _fn_tangent: Any, *tangents: torch.Tensor | None) -> Any:
        tensors = ctx.saved_tensors
        tangents = tuple(torch.zeros_like(t) if d is None else d for t, d in zip(tensors, tangents, strict=True))
        return torch.func.jvp(ctx.fn, tuple(tensors), tangents)[1]


@apply.py_autograd_impl
def apply_autograd(fn: Any, *tensors: torch.Tensor) -> Any:
    return _ApplyFunction.apply(fn, *tensors)


@apply.py_impl(TransformType.Grad)
def apply_grad(interpreter: Any, fn: Any, *tensors: torch.Tensor) -> Any:
    return _ApplyFunction.apply(fn, *tensors)


@apply.py_impl(TransformType.Jvp)
def apply_jvp(interpreter: Any, fn: Any, *tensors: torch.Tensor) -> Any:
    return _ApplyFunction.apply(fn, *tensors)


@apply.py_impl(TransformType.Vmap)
def apply_vmap(interpreter: Any, fn: Any, *tensors: torch.Tensor) -> Any:
    level = interpreter.level()
    unwrapped, in_dims = zip(*(_unwrap_batched(t, level) for t in tensors), strict=True)
    if all(d is None for d in in_dims):  # nothing batched at this level
        with interpreter.lower():
            return apply(fn, *unwrapped)
    batched = torch.vmap(fn, in_dims=in_dims, randomness=interpreter.randomness())
    with interpreter.lower():
        out = apply(batched, *unwrapped)
    return _like(out, [_add_batch_dim(o, 0, level) for o in _as_tuple(out)])


@apply.py_functionalize_impl
def apply_functionalize(ctx: Any, fn: Any, *tensors: torch.Tensor) -> Any:
    unwrapped = ctx.unwrap_tensors(tensors)
    with ctx.redispatch_to_next():
        out = apply(ctx.functionalize(fn), *unwrapped)
    return ctx.wrap_tensors(out)


@apply.py_impl(FakeTensorMode)
def apply_fake(mode: FakeTensorMode, fn: Any, *tensors: torch.Tensor) -> Any:
    with mode:
        return apply_dense(fn, *tensors)


@apply.py_impl(ProxyTorchDispatchMode)
def apply_proxy(mode: ProxyTorchDispatchMode, fn: Any, *tensors: torch.Tensor) -> Any:
    gm = subgraph.trace_subgraph(fn, tensors)
    out = apply(gm, *tensors)  # the proxy mode is popped: this reaches the fake rule
    return subgraph.emit(mode, apply, (gm, *tensors), out)
