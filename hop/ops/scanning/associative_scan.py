"""``hop.associative_scan`` and its raw op ``torch.ops.hop.associative_scan``.

The raw op is ``associative_scan(combine_fn, xs, additional_inputs, combine_mode)``:
the inclusive scan along dim 0 of the flat leaves ``xs``, where
``combine_fn(*lhs, *rhs, *additional_inputs) -> (*out)`` combines one slice of
each leaf (``"generic"``: the op vmaps it over a batch of pairs) or a batch of
pairs at once (``"pointwise"``: called on the batch directly). Rules in hop's
fixed order: dense, autograd, grad / jvp, vmap, functionalize, fake, proxy.

Note [parallel prefix]
The dense rule computes the scan in O(log n) depth with the odd/even recursion
(Ladner and Fischer 1980; Blelloch 1990), every step one batched call of
``combine_fn`` on slices of the inputs::

    x      = [a, b, c, d, e]
    pairs  = [a.b, c.d]                      combine x[0::2] with x[1::2] (n // 2 pairs)
    odds   = scan(pairs) = [a.b, a.b.c.d]    the results at positions 1, 3, ...
    evens  = [a] + [a.b.c, a.b.c.d.e]        odds[j - 1] combined with x[2j] for j >= 1
    result = interleave(evens, odds) = [a, a.b, a.b.c, a.b.c.d, a.b.c.d.e]

Each level halves the length and makes at most two calls, so there are at most
2 ceil(log2 n) calls and fewer than 2n combinations: the same result as the
sequential scan for an associative ``combine_fn``. Every transform runs this
algorithm at its own level (autograd and torch.func differentiate the slices,
calls and concatenations; vmap batches them), so only tracing keeps one node.

Compiled: Dynamo ``hop.compile._dynamo_scans.AssociativeScanVariable``; Inductor
``hop.compile._inductor_scans.rewrite_associative_scan``; ONNX
``hop.compile._onnx_ops.translate_associative_scan``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import (
    _closures,
    _effects,
    _observe,
    _observe_calls,
    _pytree,
    _reference,
    _spec,
    _transforms,
)
from hop._operator import HigherOrderOperator
from hop.errors import HopError, HopTypeError, HopValueError, OutputMismatchError, format_message, type_name
from hop.ops import _common
from hop.ops._common import NOT_TAKEN, as_tuple, differentiable, front, save_operands, saved_operands
from hop.ops.scanning import _checks, _derivatives, _parallel_derivatives, _rules, _values
from hop.ops.scanning.scan import SCAN, scan_op

__all__ = ["associative_scan", "associative_scan_op"]

Fn = Callable[..., Any]
_NAME = "associative_scan"
_SINKS = _observe.SINKS
_MODES = ("pointwise", "generic")


def associative_scan(combine_fn: Fn, xs: Any, dim: int, reverse: bool = False, combine_mode: str = "pointwise") -> Any:
    """Inclusive scan of ``xs`` along ``dim`` with an associative ``combine_fn``.

    Equivalent Python (for an associative ``combine_fn``)::

        def reference_associative_scan(combine_fn, xs, dim, reverse=False, combine_mode="pointwise"):
            n = tree_leaves(xs)[0].shape[dim]
            out = [None] * n
            for k, i in enumerate(reversed(range(n)) if reverse else range(n)):
                x = tree_map(lambda leaf: leaf.select(dim, i), xs)
                out[i] = x if k == 0 else combine_fn(out[i + 1 if reverse else i - 1], x)
            return tree_map(lambda *col: torch.stack(col, dim), *out)

    Args:
        combine_fn: ``(lhs, rhs) -> out``, three pytrees of the structure of ``xs``
            (and the dtypes and shapes of ``lhs``); must be associative.
        xs: a pytree of tensors, all of the same length along ``dim``.
        dim: the dimension to scan along.
        reverse: scan from the last slice to the first (``combine_fn`` still gets
            the running result first), as ``torch.flip``, scan, ``torch.flip``.
        combine_mode: ``"pointwise"``: ``combine_fn`` uses only elementwise ops and
            is called on batches of slices at once (fast, any device);
            ``"generic"``: any function of one slice each, vmapped over the batch.

    The scan runs in O(log n) steps (Note [parallel prefix]) in eager and under
    every transform (autograd, ``torch.func``, vmap); make_fx and torch.export keep
    one ``torch.ops.hop.associative_scan`` node.
    """
    taken = front(
        _NAME,
        associative_scan,
        associative_scan_op,
        _reference.reference_associative_scan,
        (combine_fn, xs, dim, reverse, combine_mode),
    )
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    check_options(combine_fn, reverse, combine_mode)
    leaves, spec = _pytree.flatten_dropping_none(xs)
    dims, n = _checks.check_xs(_NAME, xs, leaves, dim)
    moved = [x.movedim(d, 0) if d else x for x, d in zip(leaves, dims, strict=True)]
    moved = [x.flip(0) for x in moved] if reverse else moved
    body = _flat_body(combine_fn, spec, xs, combine_mode)
    if _rules.runs_inline(n, leaves):
        out = associative_scan_dense(body, moved, (), combine_mode)
    else:
        body, lifted = _rules.lift_closures(
            body, lambda: [*_rules.examples((), moved, ()), *_rules.examples((), moved, ())]
        )
        out = associative_scan_op(body, tuple(moved), tuple(lifted), combine_mode)
    out = [o.flip(0) for o in as_tuple(out)] if reverse else as_tuple(out)
    return _pytree.unflatten([o.movedim(0, d) if d else o for o, d in zip(out, dims, strict=True)], spec)


def check_options(combine_fn: Any, reverse: Any, combine_mode: Any) -> None:
    """The arguments besides ``xs`` and ``dim`` (also checked by the Dynamo handler)."""
    _checks.check_callable(_NAME, "combine_fn", combine_fn)
    if combine_mode not in _MODES:
        raise HopValueError(
            format_message(_NAME, f'combine_mode must be "pointwise" or "generic", got {combine_mode!r}'),
            op=_NAME,
            role="combine_mode",
        )
    if type(reverse) is not bool:
        raise HopTypeError(
            format_message(_NAME, f"reverse must be a bool, got {type_name(reverse)}"), op=_NAME, role="reverse"
        )


_POINTWISE_FIX = (
    'With combine_mode="pointwise" combine_fn receives whole runs of slices at once and must be '
    'elementwise; one that reshapes, reduces or multiplies matrices needs combine_mode="generic".'
)


def _flat_body(combine_fn: Fn, spec: Any, xs: Any, combine_mode: str) -> Fn:
    """``combine_fn`` on flat leaves, checking that it returns what it was given; in
    pointwise mode, a failure says that the mode may be the cause."""
    n = spec.num_leaves
    fix = _POINTWISE_FIX if combine_mode == "pointwise" else ""

    def body(*leaves: Any) -> tuple[Any, ...]:
        lhs = _pytree.unflatten(leaves[:n], spec)
        try:
            out = combine_fn(lhs, _pytree.unflatten(leaves[n : 2 * n], spec))
        except RuntimeError as e:
            if not fix or isinstance(e, HopError):
                raise
            raise HopValueError(
                format_message(_NAME, f"combine_fn raised {type(e).__name__}: {e}", fix=fix),
                op=_NAME,
                role="combine_fn",
            ) from e
        try:
            checked = _checks.check_like(_NAME, "combine_fn", combine_fn, lhs, out, "output", "xs and the output")
        except OutputMismatchError as e:
            if not fix or not re.search(r"differ: (rank|shape|size)", str(e)):
                raise
            raise OutputMismatchError(f"{e} {fix}", op=e.op, role=e.role, path=e.path) from None
        return tuple(checked)

    body.__qualname__ = getattr(combine_fn, "__qualname__", type(combine_fn).__qualname__)
    body.__wrapped__ = combine_fn  # type: ignore[attr-defined]
    return body


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    frame.length = _observe_calls.static_length(args[1], args[2])


SPEC = _spec.register(
    _spec.OpSpec(
        name=_NAME,
        params=("combine_fn", "xs", "additional_inputs", "combine_mode"),
        roles=("combine_fn",),
        # associative_scan(combine_gm, xs, additional, mode): combine(lhs slices, rhs slices,
        # additional) is no step of a loop (no body): the passes leave the node alone
        layout=_spec.Layout(subgraphs=(0,), xs=1, inputs=2),
        describe=_describe,
    )
)

associative_scan_op = HigherOrderOperator(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())


def _prefix_scan(combine: Fn, elems: Sequence[torch.Tensor], additional: Sequence[Any], n: int) -> list[torch.Tensor]:
    """Note [parallel prefix]: the inclusive scan of ``elems`` (of length ``n``) along dim 0.
    The lengths are passed down, not read from the slices: under torch.jit.trace a read
    size is a tensor (Note [sizes under jit.trace] in ``_common``)."""
    if n < 2:
        return list(elems)
    pairs = as_tuple(combine(*[e[0 : n - 1 : 2] for e in elems], *[e[1::2] for e in elems], *additional))
    odds = _prefix_scan(combine, pairs, additional, n // 2)
    if n > 2:
        rest = as_tuple(combine(*[o[: (n - 1) // 2] for o in odds], *[e[2::2] for e in elems], *additional))
        evens = [torch.cat([e[:1], r]) for e, r in zip(elems, rest, strict=True)]
    else:
        evens = [e[:1] for e in elems]
    return [_interleave(ev, od, n) for ev, od in zip(evens, odds, strict=True)]


def _interleave(evens: torch.Tensor, odds: torch.Tensor, n: int) -> torch.Tensor:
    """``[e0, o0, e1, o1, ...]``, ``n`` elements in all (``evens`` has one more when ``n`` is odd)."""
    m = n // 2
    both = torch.stack([evens[:m], odds], dim=1).flatten(0, 1)
    return torch.cat([both, evens[m:]]) if n % 2 else both


@associative_scan_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def associative_scan_dense(
    combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    combine = _batched(combine_fn, combine_mode, len(xs), len(additional_inputs))
    n = xs[0].shape[0]
    if type(n) is not int:
        _common.refuse_legacy_onnx(_NAME, _checks.LENGTH)
        n = _common.static_size(n)  # Note [sizes under jit.trace]
    out = _prefix_scan(combine, xs, additional_inputs, n)
    return _values.raw_output(_values.no_alias(out, [*xs, *additional_inputs]))


@associative_scan_op.py_autograd_impl
def associative_scan_autograd(
    combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    """Real tensors: autograd records the algorithm's own ops (Note [parallel prefix]).
    Traced ones: one node, differentiated as the sequential scan it equals; what
    ``combine_fn`` closes over and needs grad for becomes additional inputs of the
    node (Note [closure conversion] in hop._closures: a node differentiates its inputs only)."""
    n = xs[0].shape[0]
    if type(n) is int and n == 0:  # an empty scan is its input, under every transform
        return _values.raw_output([x.clone() for x in xs])
    if _rules.runs_inline(n, xs, additional_inputs):
        return associative_scan_dense(combine_fn, xs, additional_inputs, combine_mode)
    (combine_fn,), captured = _closures.convert_closures([combine_fn], [*xs, *additional_inputs])
    args = (*xs, *additional_inputs, *captured)
    return _Function.apply(combine_fn, combine_mode, len(xs), *args)  # type: ignore[no-untyped-call]


@associative_scan_op.py_impl(TransformType.Grad)
def associative_scan_grad(
    interpreter: Any, combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    return _transform(interpreter, combine_fn, xs, additional_inputs, combine_mode)


@associative_scan_op.py_impl(TransformType.Jvp)
def associative_scan_jvp(
    interpreter: Any, combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    return _transform(interpreter, combine_fn, xs, additional_inputs, combine_mode)


def _transform(interpreter: Any, combine_fn: Fn, xs: Sequence[Any], additional: Sequence[Any], mode: str) -> Any:
    """As autograd, with the closed-over tensors the transform tracks made explicit inputs."""
    if not _rules.runs_inline(xs[0].shape[0], xs, additional):
        combine_fn, extra = _rules.lift_transform_closures(combine_fn, interpreter.level())
        additional = (*additional, *extra)
    return associative_scan_autograd(combine_fn, xs, additional, mode)


@associative_scan_op.py_impl(TransformType.Vmap)
def associative_scan_vmap(
    interpreter: Any, combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    """Inline for real tensors; else the op one level down on the vmapped (generic) ``combine_fn``,
    every leaf of ``xs`` batched at dim 1."""
    if _rules.runs_inline(xs[0].shape[0], xs, additional_inputs):
        return associative_scan_dense(combine_fn, xs, additional_inputs, combine_mode)

    def batched(values: list[list[Any]], dims: list[list[int | None]], size: int, vmapped: _common.Vmapped) -> Any:
        (xs_u, add_u), (xs_d, add_d) = values, dims
        xs_b = [
            v.unsqueeze(1).expand(v.shape[0], size, *v.shape[1:]) if d is None else v.movedim(d, 1)
            for v, d in zip(xs_u, xs_d, strict=True)
        ]
        combine_b = vmapped(combine_fn, (*[0] * (2 * len(xs)), *add_d))
        return lambda: associative_scan_op(combine_b, tuple(xs_b), tuple(add_u), "generic"), lambda k: 1

    return _common.lower_vmap(
        interpreter,
        [xs, additional_inputs],
        lambda x, a: associative_scan_op(combine_fn, x, a, combine_mode),
        batched,
    )


@associative_scan_op.py_functionalize_impl
def associative_scan_functionalize(
    ctx: Any, combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    args = (combine_fn, xs, additional_inputs, combine_mode)
    return _effects.functionalize_rule(associative_scan_op, SPEC, ctx, args, {})


@associative_scan_op.py_impl(FakeTensorMode)
def associative_scan_fake(
    mode: FakeTensorMode, combine_fn: Fn, xs: Sequence[Any], additional_inputs: Sequence[Any], combine_mode: str
) -> Any:
    """Outputs shaped like ``xs``, after checking ``combine_fn`` on one pair of fake slices."""
    with mode:
        slices = _values.empty_slices(xs, [0] * len(xs))
        out = as_tuple(combine_fn(*slices, *_values.empty_slices(xs, [0] * len(xs)), *additional_inputs))
        _checks.check_like(_NAME, "combine_fn", combine_fn, slices, list(out), "output", "xs and the output")
        return _values.raw_output([torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs])


@associative_scan_op.py_impl(ProxyTorchDispatchMode)
def associative_scan_proxy(
    mode: ProxyTorchDispatchMode,
    combine_fn: Fn,
    xs: Sequence[Any],
    additional_inputs: Sequence[Any],
    combine_mode: str,
) -> Any:
    examples = [
        *_values.empty_slices(xs, [0] * len(xs)),
        *_values.empty_slices(xs, [0] * len(xs)),
        *additional_inputs,
    ]
    (gm,), lifted = _common.trace_callables(_NAME, ["combine_fn"], [combine_fn], examples, _rules.BODY_WRITES)
    all_additional = (*additional_inputs, *lifted)
    return _common.record_node(
        mode,
        _NAME,
        associative_scan_op,
        (gm, tuple(xs), all_additional, combine_mode),
        lambda: associative_scan_op(gm, tuple(xs), all_additional, combine_mode),
    )


def _batched(combine_fn: Fn, combine_mode: str, nx: int, nadd: int) -> Fn:
    """``combine_fn`` on a batch of pairs: itself when pointwise, else vmapped."""
    if combine_mode == "pointwise":
        return combine_fn
    return torch.vmap(combine_fn, in_dims=(*[0] * (2 * nx), *[None] * nadd))


def _sequential(combine_fn: Fn) -> Fn:
    """The step of the sequential scan that equals the associative one: ``(*carry, *x, *additional)
    -> (*out, *out)`` with ``out = combine_fn(carry, x)``."""

    def step(*args: Any) -> tuple[Any, ...]:
        out = as_tuple(combine_fn(*args))
        return (*out, *(o.clone() for o in out))

    return step


class _Function(torch.autograd.Function):
    """An associative scan of traced values as one autograd node. Its derivatives are those of
    the sequential scan ``out[0] = xs[0]``, ``out[t] = combine_fn(out[t - 1], xs[t])``: the
    backward in log depth when ``combine_fn`` is elementwise in its carry (Note [a parallel
    backward for an elementwise combine]), else a reverse ``hop.scan`` of the vjp of
    ``combine_fn``; forward mode a ``hop.scan`` of its jvp (``scanning._derivatives``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(combine_fn: Fn, combine_mode: str, nx: int, *operands: Any) -> Any:
        return associative_scan_op(combine_fn, tuple(operands[:nx]), tuple(operands[nx:]), combine_mode)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.combine_fn, ctx.combine_mode, ctx.nx, *operands = inputs
        ctx.set_materialize_grads(False)  # None, not zeros: the derivatives leave them out
        # the operands only, not the outputs: a program may write an output in place
        # before its backward, as it may in eager (the backward recomputes them)
        save_operands(ctx, operands)

    @staticmethod
    def _split(ctx: Any) -> tuple[list[Any], list[Any], list[Any], list[bool]]:
        operands = saved_operands(ctx)
        xs, additional = operands[: ctx.nx], operands[ctx.nx :]
        return xs, [x.select(0, 0) for x in xs], additional, [differentiable(x) for x in xs]

    @staticmethod
    def _parallel(ctx: Any) -> tuple[Fn, _parallel_derivatives.Pattern, list[Any], list[Any], list[Any]] | None:
        """The batched combine_fn, xs, outputs (recomputed, in log depth) and additional
        inputs, where Note [a parallel backward for an elementwise combine] applies; else None."""
        saved = saved_operands(ctx)
        xs, additional = saved[: ctx.nx], saved[ctx.nx :]
        n = xs[0].shape[0]
        if isinstance(n, int) and n < 2:
            return None
        pattern = _parallel_derivatives.carry_pattern(ctx.combine_fn, ctx.combine_mode == "pointwise", xs, additional)
        if pattern is None:
            return None
        ys = list(as_tuple(associative_scan_op(ctx.combine_fn, tuple(xs), tuple(additional), ctx.combine_mode)))
        return _batched(ctx.combine_fn, ctx.combine_mode, ctx.nx, len(additional)), pattern, xs, ys, additional

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        parallel = _Function._parallel(ctx)
        if parallel is not None:
            with _transforms.torch_ops_without_rules(_NAME, "combine_fn"):
                g = _parallel_derivatives.parallel_vjp(
                    associative_scan_op, *parallel, grads, ctx.needs_input_grad[3 + ctx.nx :]
                )
            return (None, None, None, *g)
        xs, init, additional, diff = _Function._split(ctx)
        nx = len(xs)
        g_ys = [g[1:] if d and g is not None else None for g, d in zip(grads, diff, strict=True)]
        zeros = [torch.zeros_like(i) if d else None for i, d in zip(init, diff, strict=True)]
        rest = [x[1:] for x in xs]
        g = _derivatives.scan_vjp(
            scan_op,
            _sequential(ctx.combine_fn),
            init,
            rest,
            additional,
            False,
            (*zeros, *g_ys),
            diff * 2,
            named=(_NAME, "combine_fn"),
            wanted=[True] * (2 * nx) + list(ctx.needs_input_grad[3 + nx :]),  # additional inputs autograd asks for
        )
        g_xs = [
            None if gi is None else torch.cat([(gi if g0 is None else gi + g0[0]).unsqueeze(0), gr])
            for gi, gr, g0 in zip(g[:nx], g[nx : 2 * nx], grads, strict=True)
        ]
        return (None, None, None, *g_xs, *g[2 * nx :])

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        xs, init, additional, diff = _Function._split(ctx)
        nx = len(xs)
        t_xs = [torch.zeros_like(x) if t is None else t for x, t in zip(xs, tangents[3 : 3 + nx], strict=True)]
        t_in = [*(t.select(0, 0) for t in t_xs), *(t[1:] for t in t_xs), *tangents[3 + nx :]]
        rest = [x[1:] for x in xs]
        out = as_tuple(
            _derivatives.scan_jvp(SCAN.call, _sequential(ctx.combine_fn), init, rest, additional, False, t_in, diff * 2)
        )
        return _values.raw_output(
            [None if t is None else torch.cat([t0[:1], t]) for t0, t in zip(t_xs, out[nx:], strict=True)]
        )
