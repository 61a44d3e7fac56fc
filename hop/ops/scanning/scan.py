"""``hop.scan`` and its raw op ``torch.ops.hop.scan``.

The raw op is ``scan(body, init, xs, additional_inputs, reverse)`` over dim 0 of
flat leaves (see ``scanning._rules``); rules are scan's registrations of the shared
looping rules, in hop's fixed order: dense, autograd, grad / jvp, vmap,
functionalize, fake, proxy.

Compiled: Dynamo ``hop.compile._dynamo_scans.ScanVariable``; Inductor
``hop.compile._inductor_scans.rewrite_scan`` (a while loop); ONNX
``hop.compile._onnx_ops.translate_scan``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _effects, _observe, _observe_calls, _output_checks, _pytree, _reference, _spec
from hop._operator import HigherOrderOperator
from hop.errors import HopTypeError, format_message, type_name
from hop.ops._common import NOT_TAKEN, as_tuple, front
from hop.ops.scanning import _checks, _controls, _rules, _values

__all__ = ["scan", "scan_op"]

Fn = Callable[..., Any]
_SINKS = _observe.SINKS
_PAIR = (tuple, list)


def scan(
    combine_fn: Fn,
    init: Any,
    xs: Any,
    *,
    dim: int = 0,
    reverse: bool = False,
    length: int | torch.SymInt | None = None,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
    """Scan ``combine_fn`` over slices of ``xs`` along ``dim``, threading a carry.

    Equivalent Python::

        def reference_scan(combine_fn, init, xs, *, dim=0, reverse=False):
            n = tree_leaves(xs)[0].shape[dim]
            carry, ys = init, [None] * n
            for i in reversed(range(n)) if reverse else range(n):
                x = tree_map(lambda leaf: leaf.select(dim, i), xs)
                carry, ys[i] = combine_fn(carry, x)
            return carry, tree_map(lambda *col: torch.stack(col, dim), *ys)

    Args:
        combine_fn: ``(carry, x) -> (next_carry, y)``; ``next_carry`` has the
            structure, dtypes, devices and shapes of ``init``; ``y`` is a pytree
            of tensors (or ``None``) of the same structure, dtypes and shapes in
            every iteration.
        init: a pytree of tensors (``()`` or ``None`` for no carry).
        xs: a pytree of tensors, all of the same length along ``dim``.
        dim: the dimension of ``xs`` to scan over, and of ``ys`` to stack along
            (negative values count from the end of each tensor).
        reverse: scan from the last slice to the first; ``ys[i]`` still comes from
            ``xs[i]``.
        length: the number of steps when ``xs`` is ``None`` (or an empty pytree):
            ``combine_fn(carry, xs)`` runs ``length`` times, as ``jax.lax.scan``'s
            ``length``; with xs it must equal their length.
        unroll: steps per iteration of the loop a traced or compiled program runs
            (``True``: the whole loop, no loop node; a dynamic length is then
            specialized, as a Python ``for`` over ``range(n)`` would be). Values and
            gradients do not change.

    Returns:
        ``(final_carry, ys)``. A scan over a dimension of length 0 returns ``init``
        (cloned) and empty ``ys`` (their shapes found by running ``combine_fn``
        once on fake tensors); with no xs at all (``xs=[]``) it returns ``init``
        (cloned) and ``xs``'s empty structure, as torch's scan does. Outputs never
        alias the inputs.

    Eager calls run the Python loop directly (checked on the first iteration).
    Autograd, ``torch.func`` (grad, vjp, jvp, jacrev, jacfwd) and vmap differentiate
    and batch that loop; make_fx and torch.export keep one ``torch.ops.hop.scan``
    node (the scanned length may be dynamic), differentiated by scans of the
    vjp / jvp of ``combine_fn``.
    """
    if length is not None or type(unroll) is not int or unroll != 1:  # True is a control too
        return _controls.scan_controlled(
            scan, combine_fn, init, xs, dim=dim, reverse=reverse, length=length, unroll=unroll
        )
    taken: tuple[Any, Any] = front(
        "scan", scan, scan_op, _reference.reference_scan, (combine_fn, init, xs), dim=dim, reverse=reverse
    )
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    _checks.check_callable("scan", "combine_fn", combine_fn)
    _output_checks.check_arity("scan", "combine_fn", combine_fn, 2, "(carry, x)")
    if type(reverse) is not bool:
        raise HopTypeError(
            format_message("scan", f"reverse must be a bool, got {type_name(reverse)}"), op="scan", role="reverse"
        )
    init_leaves, init_spec = _pytree.flatten_dropping_none(init)
    xs_leaves, xs_spec = _pytree.flatten_dropping_none(xs)
    _checks.check_leaves("scan", "init", init, init_leaves)
    if not xs_leaves and type(dim) is int:  # nothing to scan over: a Python loop over nothing
        return no_steps(init, xs)
    dims, n = _checks.check_xs("scan", xs, xs_leaves, dim)
    if _rules.runs_inline(n, init_leaves, xs_leaves):
        try:
            return _scan_inline(combine_fn, init, xs, xs_leaves, xs_spec, dims, dim, n, reverse)
        except TypeError as e:
            _a_list_of_slices(xs, e)
            raise
    body, y_spec = _flat_body(combine_fn, init_spec, xs_spec, dim)
    moved = tuple(x.movedim(d, 0) if d else x for x, d in zip(xs_leaves, dims, strict=True))
    body, lifted = _rules.lift_closures(body, lambda: _rules.examples(init_leaves, moved, ()))
    out = as_tuple(scan_op(body, tuple(init_leaves), moved, tuple(lifted), reverse))
    k = len(init_leaves)
    ys = [y.movedim(0, _values.stack_dim(dim, y.dim() - 1)) if dim else y for y in out[k:]]
    return _pytree.unflatten(out[:k], init_spec), _pytree.unflatten(ys, y_spec[0])


def _a_list_of_slices(xs: Any, error: TypeError) -> None:
    """A TypeError from ``combine_fn`` when ``xs`` is a list of same-shaped tensors: the
    user likely meant one tensor of stacked slices (a list is a pytree of several xs,
    each scanned, and combine_fn receives a list)."""
    if not isinstance(xs, (list, tuple)) or len(xs) < 2:
        return
    if not all(isinstance(x, torch.Tensor) and x.shape == xs[0].shape for x in xs):
        return
    raise HopTypeError(
        format_message(
            "scan",
            f"combine_fn raised TypeError ({error}) on xs, a {type(xs).__name__} of {len(xs)} tensors: a "
            f"{type(xs).__name__} is a pytree of {len(xs)} xs, each scanned along dim, and combine_fn receives a "
            f"{type(xs).__name__} of their slices",
            fix="To scan over the items, pass one tensor: torch.stack(xs).",
        ),
        op="scan",
        role="xs",
    ) from error


def no_steps(init: Any, xs: Any) -> tuple[Any, Any]:
    """A scan with no xs: ``init`` (a fresh copy: outputs never alias inputs) and no ys,
    ``xs``'s empty structure, as a Python loop over nothing and torch's scan return."""
    carry = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, init)
    return carry, pytree.tree_map(lambda leaf: leaf, xs)


def _scan_inline(
    combine_fn: Fn, init: Any, xs: Any, xs_leaves: list[Any], xs_spec: Any, dims: list[int], dim: int, n: int, r: bool
) -> tuple[Any, Any]:
    """The Python loop (Note [scans run inline]); the first iteration is checked."""
    if n == 0:
        return _empty_scan(combine_fn, init, xs_leaves, xs_spec, dims, dim)
    items = _values.slices(xs, xs_leaves, xs_spec, dims)
    order = iter(range(n - 1, -1, -1) if r else range(n))
    ys: list[Any] = [None] * n
    i = next(order)
    out = combine_fn(init, items[i])
    if type(out) not in _PAIR or len(out) != 2:
        raise _checks.not_a_pair(SCAN, combine_fn, out)
    carry, ys[i] = out
    leaves = _checks.check_carry(SCAN, combine_fn, init, carry)
    for i in order:
        out = combine_fn(carry, items[i])
        if type(out) not in _PAIR or len(out) != 2:
            raise _checks.not_a_pair(SCAN, combine_fn, out)
        carry, ys[i] = out
    if n > 1:  # the first iteration was checked; a later one may change the carry's structure
        leaves = _checks.check_carry(SCAN, combine_fn, init, carry)
    init_leaves, init_spec = _pytree.flatten_dropping_none(init)
    final = _pytree.unflatten(_values.no_alias(leaves, [*init_leaves, *xs_leaves]), init_spec)
    return final, _values.stack_ys(SCAN, combine_fn, ys, dim, "y")


def _empty_scan(
    combine_fn: Fn, init: Any, xs_leaves: list[Any], xs_spec: Any, dims: list[int], dim: int
) -> tuple[Any, Any]:
    """Length 0: ``init`` (cloned) and empty ``ys``, shaped by running ``combine_fn`` once on fake tensors."""
    init_leaves, init_spec = _pytree.flatten_dropping_none(init)

    def run(fake: list[Any]) -> Any:
        out = _flat_body(combine_fn, init_spec, xs_spec, dim)
        flat = out[0](*fake, *_values.empty_slices(xs_leaves, dims))
        ys = flat[len(fake) :]
        _checks.check_static(
            SCAN, combine_fn, ys, _pytree.leaf_paths_dropping_none(_pytree.unflatten(ys, out[1][0]), "y")
        )
        return [(y.shape, y.dtype, y.device) for y in ys], out[1][0]

    metas, spec = _checks.on_fake(SCAN, combine_fn, init_leaves, run)
    ys = []
    for shape, dtype, device in metas:
        at = _values.stack_dim(dim, len(shape))
        ys.append(torch.empty((*shape[:at], 0, *shape[at:]), dtype=dtype, device=device))
    return _pytree.unflatten([t.clone() for t in init_leaves], init_spec), _pytree.unflatten(ys, spec)


def _flat_body(combine_fn: Fn, init_spec: Any, xs_spec: Any, dim: int) -> tuple[Fn, list[Any]]:
    """``combine_fn`` on flat leaves, checking what it returns; the list receives the structure of y."""
    nc = init_spec.num_leaves
    y_spec: list[Any] = [None]

    def body(*leaves: Any) -> tuple[Any, ...]:
        carry = _pytree.unflatten(leaves[:nc], init_spec)
        out = combine_fn(carry, _pytree.unflatten(leaves[nc:], xs_spec))
        if type(out) not in _PAIR or len(out) != 2:
            raise _checks.not_a_pair(SCAN, combine_fn, out)
        carry_leaves = _checks.check_carry(SCAN, combine_fn, carry, out[0])
        error = _checks.ys_error(SCAN, combine_fn, [out[1]], dim, "y")
        if error is not None:
            raise error
        y_leaves, y_spec[0] = _pytree.flatten_dropping_none(out[1])
        return (*carry_leaves, *y_leaves)

    body.__qualname__ = getattr(combine_fn, "__qualname__", type(combine_fn).__qualname__)
    body.__wrapped__ = combine_fn  # type: ignore[attr-defined]
    return body, y_spec


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    frame.length = frame.trips = _observe_calls.static_length(args[2], kwargs.get("dim", 0))


SPEC = _spec.register(
    _spec.OpSpec(
        name="scan",
        params=("combine_fn", "init", "xs", "additional_inputs", "reverse"),
        roles=("combine_fn",),
        # scan(body, init, xs, additional, reverse): body(carries, slices, additional)
        layout=_spec.Layout(subgraphs=(0,), carries=1, xs=2, inputs=3, body=0),
        describe=_describe,
    )
)

scan_op = HigherOrderOperator(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())


def _call(body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool) -> Any:
    return scan_op(body, tuple(init), tuple(xs), tuple(additional), reverse)


SCAN = _rules.Looping(name="scan", op=scan_op, role="combine_fn", call=_call, scan=scan_op)


@scan_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def scan_dense(
    body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _rules.dense(SCAN, body, init, xs, additional_inputs, reverse)


@scan_op.py_autograd_impl
def scan_autograd(
    body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _rules.autograd(SCAN, body, init, xs, additional_inputs, reverse)


@scan_op.py_impl(TransformType.Grad)
def scan_grad(
    interpreter: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _rules.transform(SCAN, interpreter, body, init, xs, additional_inputs, reverse)


@scan_op.py_impl(TransformType.Jvp)
def scan_jvp(
    interpreter: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _rules.transform(SCAN, interpreter, body, init, xs, additional_inputs, reverse)


@scan_op.py_impl(TransformType.Vmap)
def scan_vmap(
    interpreter: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _rules.vmap(SCAN, interpreter, body, init, xs, additional_inputs, reverse)


@scan_op.py_functionalize_impl
def scan_functionalize(
    ctx: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], reverse: bool
) -> Any:
    return _effects.functionalize_rule(scan_op, SPEC, ctx, (body, init, xs, additional_inputs, reverse), {})


@scan_op.py_impl(FakeTensorMode)
def scan_fake(
    mode: FakeTensorMode, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional_inputs: Sequence[Any], r: bool
) -> Any:
    return _rules.fake(SCAN, mode, body, init, xs, additional_inputs, r)


@scan_op.py_impl(ProxyTorchDispatchMode)
def scan_proxy(
    mode: ProxyTorchDispatchMode,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional_inputs: Sequence[Any],
    reverse: bool,
) -> Any:
    return _rules.proxy(SCAN, mode, body, init, xs, additional_inputs, reverse)
