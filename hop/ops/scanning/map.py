"""``hop.map`` and its raw op ``torch.ops.hop.map``.

The raw op is ``map(body, xs, additional_inputs)``: a scan without carry over
dim 0 of flat leaves (see ``scanning._rules``). Its rules are map's registrations of
the shared looping rules, in hop's fixed order: dense, autograd, grad / jvp,
vmap, functionalize, fake, proxy; its derivatives are scans.

Compiled: Dynamo ``hop.compile._dynamo_scans.MapVariable``; Inductor
``hop.compile._inductor_scans.rewrite_map`` (a while loop); ONNX
``hop.compile._onnx_ops.translate_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _effects, _observe, _observe_calls, _pytree, _reference, _spec
from hop._operator import HigherOrderOperator
from hop.ops._common import NOT_TAKEN, as_tuple, front
from hop.ops.scanning import _checks, _controls, _rules, _values
from hop.ops.scanning.scan import scan_op

__all__ = ["map", "map_op"]

Fn = Callable[..., Any]
_SINKS = _observe.SINKS


def map(f: Fn, xs: Any, *args: Any, batch_size: int | None = None) -> Any:
    """Stack ``f(x, *args)`` over dim 0 of every leaf of ``xs``.

    Equivalent Python::

        def reference_map(f, xs, *args):
            n = tree_leaves(xs)[0].shape[0]
            ys = [f(tree_map(lambda leaf: leaf[i], xs), *args) for i in range(n)]
            return tree_map(lambda *col: torch.stack(col), *ys)

    Args:
        f: ``(x, *args) -> y``, ``y`` a pytree of tensors of the same structure,
            dtypes and shapes for every slice.
        xs: a pytree of tensors, all of the same length along dim 0.
        args: pytrees of tensors and ints, passed unchanged to every call.
        batch_size: map ``torch.vmap(f)`` over chunks of ``batch_size`` slices, and
            once more over the slices left (``jax.lax.map``'s ``batch_size``): fewer,
            larger steps for an ``f`` that vmaps.

    A map over a dimension of length 0 returns empty tensors (their shapes found
    by running ``f`` once on fake tensors). Transforms as ``hop.scan``: eager runs
    the Python loop; autograd, ``torch.func`` and vmap (also ``vmap`` of ``map`` and
    ``map`` inside ``vmap``) differentiate and batch it; make_fx and torch.export
    keep one ``torch.ops.hop.map`` node.
    """
    if batch_size is not None:
        return _controls.map_batched(map, f, xs, args, batch_size)
    taken = front("map", map, map_op, _reference.reference_map, (f, xs, *args))
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    _checks.check_callable("map", "f", f)
    xs_leaves, xs_spec = _pytree.flatten_dropping_none(xs)
    arg_leaves, args_spec = _pytree.flatten_dropping_none(args)
    dims, n = _checks.check_xs("map", xs, xs_leaves, 0)
    _checks.check_leaves("map", "args", args, arg_leaves, ints=True)
    if _rules.runs_inline(n, xs_leaves, arg_leaves):
        if n == 0:
            return _empty_map(f, xs_leaves, xs_spec, arg_leaves, args_spec)
        items = _values.slices(xs, xs_leaves, xs_spec, dims)
        return _values.stack_ys(MAP, f, [f(x, *args) for x in items], 0, "output")
    body, y_spec, passed = _flat_body(f, xs_spec, args_spec, arg_leaves)
    body, lifted = _rules.lift_closures(body, lambda: _rules.examples((), xs_leaves, passed))
    out = map_op(body, tuple(xs_leaves), (*passed, *lifted))
    return _pytree.unflatten(as_tuple(out), y_spec[0])


def _empty_map(f: Fn, xs_leaves: list[Any], xs_spec: Any, arg_leaves: list[Any], args_spec: Any) -> Any:
    """Length 0: empty outputs, shaped by running ``f`` once on fake tensors."""
    body, y_spec, passed = _flat_body(f, xs_spec, args_spec, arg_leaves)

    def run(fake: list[Any]) -> list[Any]:
        out = body(*_values.empty_slices(xs_leaves, [0] * len(xs_leaves)), *fake)
        _checks.check_static(MAP, f, out, _pytree.leaf_paths_dropping_none(_pytree.unflatten(out, y_spec[0]), "output"))
        return [(y.shape, y.dtype, y.device) for y in out]

    metas = _checks.on_fake(MAP, f, passed, run)
    return _pytree.unflatten([torch.empty((0, *s), dtype=d, device=dev) for s, d, dev in metas], y_spec[0])


def _flat_body(f: Fn, xs_spec: Any, args_spec: Any, arg_leaves: list[Any]) -> tuple[Fn, list[Any], list[Any]]:
    """``f`` on flat leaves, checking what it returns; the structure of its output (filled
    by the first call) and the leaves of ``args`` it takes (Python ints are bound in it)."""
    nx = xs_spec.num_leaves
    y_spec: list[Any] = [None]
    const = [type(a) is int for a in arg_leaves]

    def body(*leaves: Any) -> tuple[Any, ...]:
        passed = iter(leaves[nx:])
        args = _pytree.unflatten([a if c else next(passed) for a, c in zip(arg_leaves, const, strict=True)], args_spec)
        out = f(_pytree.unflatten(leaves[:nx], xs_spec), *args)
        error = _checks.ys_error(MAP, f, [out], 0, "output")
        if error is not None:
            raise error
        y_leaves, y_spec[0] = _pytree.flatten_dropping_none(out)
        return tuple(y_leaves)

    body.__qualname__ = getattr(f, "__qualname__", type(f).__qualname__)
    body.__wrapped__ = f  # type: ignore[attr-defined]
    return body, y_spec, [a for a, c in zip(arg_leaves, const, strict=True) if not c]


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    frame.length = frame.trips = _observe_calls.static_length(args[1], 0)


SPEC = _spec.register(
    _spec.OpSpec(
        name="map",
        params=("f", "xs", "additional_inputs"),
        roles=("f",),
        layout=_spec.Layout(
            subgraphs=(0,), xs=1, inputs=2, body=0
        ),  # map(body, xs, additional): body(slices, additional)
        describe=_describe,
    )
)

map_op = HigherOrderOperator(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())


def _call(body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool) -> Any:
    assert not init, "map has no carry"
    return map_op(body, tuple(xs), tuple(additional))


MAP = _rules.Looping(name="map", op=map_op, role="f", call=_call, scan=scan_op)


@map_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def map_dense(body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.dense(MAP, body, (), xs, additional_inputs, False)


@map_op.py_autograd_impl
def map_autograd(body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.autograd(MAP, body, (), xs, additional_inputs, False)


@map_op.py_impl(TransformType.Grad)
def map_grad(interpreter: Any, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.transform(MAP, interpreter, body, (), xs, additional_inputs, False)


@map_op.py_impl(TransformType.Jvp)
def map_jvp(interpreter: Any, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.transform(MAP, interpreter, body, (), xs, additional_inputs, False)


@map_op.py_impl(TransformType.Vmap)
def map_vmap(interpreter: Any, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.vmap(MAP, interpreter, body, (), xs, additional_inputs, False)


@map_op.py_functionalize_impl
def map_functionalize(ctx: Any, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _effects.functionalize_rule(map_op, SPEC, ctx, (body, xs, additional_inputs), {})


@map_op.py_impl(FakeTensorMode)
def map_fake(mode: FakeTensorMode, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.fake(MAP, mode, body, (), xs, additional_inputs, False)


@map_op.py_impl(ProxyTorchDispatchMode)
def map_proxy(mode: ProxyTorchDispatchMode, body: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    return _rules.proxy(MAP, mode, body, (), xs, additional_inputs, False)
