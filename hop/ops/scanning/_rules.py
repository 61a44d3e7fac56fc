"""What scan and map share: the body convention, the looping's record and its rules
(functionalize: ``hop._effects.functionalize_rule``, every operator's).

The raw ops take flat leaves::

    torch.ops.hop.scan(body, init, xs, additional_inputs, reverse)
    torch.ops.hop.map(body, xs, additional_inputs)          # a scan without carry

``body(*carry, *x, *additional_inputs) -> (*next_carry, *y)`` (a bare tensor
for one leaf), where ``x`` holds one slice along dim 0 of every leaf of ``xs``.
The output is ``(*final_carry, *ys)``, a bare tensor for one leaf, with ``ys``
stacked along dim 0 in the order of ``xs`` (also when ``reverse``). Each rule
is written once against a :class:`Looping` and registered on both raw ops by
``scan.py`` and ``map.py``; both ops differentiate through ``scan``. The checks
(``scanning._checks``), the layout of slices and outputs (``scanning._values``) and scan's
derivatives (``scanning._derivatives``) are modules of their own below this one.

Note [scans run inline]
As for cond (Note [eager branches run inline]), a scan over real tensors (real
under every functorch wrapper, nothing tracing) runs as the plain Python loop at
the current level: autograd, grad, jvp and vmap see each iteration's ops, which
gives exact derivatives of every order, gradients to what the body closes over,
and no compile step. Only a scan over fake, functional or symbolic values keeps
the operator as one node, whose derivatives are scans again (:class:`_ScanFunction`)
and whose batched version is a scan of the vmapped body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _closures, _lifting, _spec, _tracing, _transforms
from hop._operator import HigherOrderOperator
from hop._unbacked_loops import per_step_sizes, rebind_sizes, run_in_subgraph
from hop.errors import (
    HopValueError,
    format_message,
)
from hop.ops import _common, _lean_body
from hop.ops._common import (
    Vmapped,
    Writes,
    as_tuple,
    differentiable,
    lower_vmap,
    record_node,
    save_operands,
    saved_operands,
    trace_callables,
)
from hop.ops.scanning._checks import LENGTH, check_carry, check_static, on_fake
from hop.ops.scanning._derivatives import scan_jvp, scan_vjp
from hop.ops.scanning._values import empty_slices, no_alias, raw_output

Fn = Callable[..., Any]
_Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Looping:
    """How one looping operator (scan or map) names its parts and calls its raw op."""

    name: str
    op: HigherOrderOperator
    role: str  # the callable's parameter name: "combine_fn" or "f"
    # the raw op from (body, init, xs, additional, reverse)
    call: Callable[[Fn, Sequence[Any], Sequence[Any], Sequence[Any], bool], Any]
    scan: HigherOrderOperator  # the raw scan its reverse mode runs (map's too: its derivative is a scan)

    def node_args(
        self, gm: Any, init: tuple[Any, ...], xs: tuple[Any, ...], additional: tuple[Any, ...], reverse: bool
    ) -> tuple[Any, ...]:
        """A node's arguments, placed by the operator's spec (map has no carry, no reverse)."""
        spec = _spec.spec_of(self.name)
        assert spec is not None and spec.layout is not None, self.name
        assert init == () or spec.layout.carries is not None, f"{self.name} has no carry"
        return spec.node_args(subgraphs=(gm,), carries=init, xs=xs, inputs=additional, rest=(reverse,))


def runs_inline(n: Any, *groups: Sequence[Any]) -> bool:
    """Note [scans run inline]: real values, nothing tracing, a known length (an empty
    scan needs fake tensors for its output metadata, so only in plain eager). Under
    torch.jit.trace ``n`` is a tensor: the loop is unrolled (Note [sizes under jit.trace])."""
    if type(n) is not int:
        n = _common.static_size(n)
    if type(n) is not int or (n == 0 and _transforms.functorch_level() is not None):
        return False
    return _common.runs_inline(*groups)


def dense(
    looping: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """The loop over dim 0 of ``xs``, at the current level (Note [scans run inline])."""
    # Note [traced bodies see contiguous values]
    traced = isinstance(body, torch.fx.GraphModule)
    columns = [(x.contiguous() if traced else x).unbind(0) for x in xs]
    n = len(columns[0])  # an int also under torch.jit.trace (Note [sizes under jit.trace])
    _common.refuse_legacy_onnx(looping.name, LENGTH)
    if n == 0:
        return _empty(looping, body, init, xs, additional)
    nc = len(init)
    # a traced body has no module hooks: skip nn.Module's call path (Note [running a traced body per step])
    step = (_lean_body.step_function(body) or body.forward) if isinstance(body, torch.fx.GraphModule) else body
    carry: Sequence[Any] = tuple(c.contiguous() for c in init) if traced else tuple(init)
    ys: list[Any] = [None] * n
    for i in range(n - 1, -1, -1) if reverse else range(n):
        out = as_tuple(step(*carry, *[c[i] for c in columns], *additional))
        carry, ys[i] = (tuple(c.contiguous() for c in out[:nc]) if traced else out[:nc]), out[nc:]
    stacked = [torch.stack(col) for col in zip(*ys, strict=True)]
    carry = [c.contiguous() for c in carry]  # as the fake rule says
    return raw_output([*no_alias(carry, [*init, *xs, *additional]), *stacked])


def _empty(looping: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> Any:
    """A loop of length 0: ``init`` (cloned) and empty ``ys`` shaped by one fake run of the body."""
    nc = len(init)

    def run(fake: list[Any]) -> list[Any]:
        out = as_tuple(body(*fake[:nc], *empty_slices(xs, [0] * len(xs)), *fake[nc:]))
        check_static(looping, body, out[nc:], [f"ys[{i}]" for i in range(len(out) - nc)])
        return [(y.shape, y.dtype, y.device) for y in out[nc:]]

    metas = on_fake(looping, body, [*init, *additional], run)
    ys = [torch.empty((0, *shape), dtype=dtype, device=device) for shape, dtype, device in metas]
    return raw_output([*(c.clone(memory_format=torch.contiguous_format) for c in init), *ys])


def autograd(
    looping: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """Inline for real tensors (Note [scans run inline]), else one node differentiated by scans;
    what the body closes over and needs grad for becomes additional inputs of the node
    (Note [closure conversion] in hop._closures: a node differentiates its inputs only)."""
    if runs_inline(xs[0].shape[0], init, xs, additional):
        return dense(looping, body, init, xs, additional, reverse)
    (body,), captured = _closures.convert_closures([body], [*init, *xs, *additional])
    additional = (*additional, *captured)
    counts = (len(init), len(xs), len(additional))
    return _ScanFunction.apply(looping, body, reverse, counts, *init, *xs, *additional)  # type: ignore[no-untyped-call]


def transform(
    looping: Looping,
    interpreter: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """torch.func.grad / jvp: as :func:`autograd`, with the tensors this transform tracks that
    the body closes over made explicit inputs of the node (see :func:`lift_transform_closures`)."""
    n = xs[0].shape[0]
    if not runs_inline(n, init, xs, additional):
        body, extra = lift_transform_closures(body, interpreter.level())
        additional = (*additional, *extra)
        if type(n) is int and n == 0:
            return _empty_here(looping, body, init, xs, additional)
    return autograd(looping, body, init, xs, additional, reverse)


def _empty_here(looping: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> Any:
    """A loop of length 0 at this transform's level: the carries pass through (their
    tangents and gradients with them) and the empty ``ys`` are shaped by the body
    itself, run on plain stand-ins (never on its derivative, which may not fake)."""

    def stand_ins(values: Sequence[Any]) -> list[Any]:
        return [torch.empty(v.shape, dtype=v.dtype, device=v.device) if isinstance(v, _Tensor) else v for v in values]

    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():  # the stand-ins are plain: so is their run
        shaped = as_tuple(_empty(looping, body, stand_ins(init), stand_ins(xs), stand_ins(additional)))
    return raw_output([*(c.clone() for c in init), *shaped[len(init) :]])


def lift_transform_closures(body: Fn, level: int) -> tuple[Fn, list[Any]]:
    """The tensors wrapped by the torch.func grad / jvp transform at ``level`` that ``body``
    closes over, and ``body`` taking them as extra trailing inputs that replace them
    (:func:`hop._closures.convert_closures`). A traced node is differentiated with respect
    to its inputs only: without this, their gradients would silently be zero."""
    (body,), found = _closures.convert_closures([body], (), level)
    return body, found


def lift_closures(body: Fn, examples: Callable[[], Sequence[Any]]) -> tuple[Fn, list[Any]]:
    """Under make_fx with grad enabled: ``body`` traced on ``examples()`` with what it closes
    over lifted to extra inputs (Note [closure lifting]), so that autograd sees those too
    (a closed-over tensor that requires grad is invisible to the dispatcher).

    Under C++ functionalization (``torch._enable_functionalization``) the values are
    functional wrappers, which the tracer below them does not know: a trace here would
    bake their contents into the graph. The closures are then found statically
    (:func:`hop._closures.convert_closures`); the op's functionalize rule traces the body."""
    from torch.fx.experimental import proxy_tensor

    if (
        proxy_tensor._CURRENT_MAKE_FX_TRACER is None
        or not torch.is_grad_enabled()
        or _transforms.functorch_level() is not None
    ):
        return body, []
    with proxy_tensor.disable_proxy_modes_tracing():
        values = list(examples())
        if any(isinstance(v, _Tensor) and torch._is_functional_tensor(v) for v in values):
            (converted,), captured = _closures.convert_closures([body], values)
            return converted, captured
        (gm,), lifted = _lifting.trace_branches([body], values)
    if not lifted:
        return body, []
    gm.__wrapped__ = body  # type: ignore[assignment]  # names the function in errors
    return gm, lifted


def vmap(
    looping: Looping,
    interpreter: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """Inline for real tensors; else the op one level down on the vmapped body.

    The carry always gets the batch (at dim 0), each batched leaf of ``xs`` has it
    moved to dim 1 (dim 0 is scanned), ``ys`` come back batched at dim 1.
    """
    if runs_inline(xs[0].shape[0], init, xs, additional):  # Note [size reads in a vmapped graph] (hop._tracing)
        return dense(looping, _tracing.per_element_sizes(body), init, xs, additional, reverse)
    nc = len(init)

    def batched(values: list[list[Any]], dims: list[list[int | None]], size: int, vmapped: Vmapped) -> Any:
        (init_u, xs_u, add_u), (init_d, xs_d, add_d) = values, dims
        init_b = [
            v.unsqueeze(0).expand(size, *v.shape) if d is None else v.movedim(d, 0)
            for v, d in zip(init_u, init_d, strict=True)
        ]
        xs_b = [v if d is None else v.movedim(d, 1) for v, d in zip(xs_u, xs_d, strict=True)]
        in_dims = (*[0] * nc, *[None if d is None else 0 for d in xs_d], *add_d)
        body_b = vmapped(body, in_dims)
        return lambda: looping.call(body_b, init_b, xs_b, add_u, reverse), lambda k: 0 if k < nc else 1

    return lower_vmap(
        interpreter, [init, xs, additional], lambda i, x, a: looping.call(body, i, x, a, reverse), batched
    )


def fake(
    looping: Looping,
    mode: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """Output metadata: the body once on fake slices; ``ys`` get the scanned length in front."""
    with mode:
        shape_env = mode.shape_env
        nc = len(init)
        values = [*init, *empty_slices(xs, [0] * len(xs))]
        if isinstance(body, torch.fx.GraphModule):  # Note [traced bodies see contiguous values]
            values = [_tracing.traced_layout(v) for v in values]
        out, local = run_in_subgraph(shape_env, lambda: as_tuple(body(*values, *additional)))
        check_carry(looping, body, list(init), list(out[:nc]))
        if any(isinstance(s, torch.SymInt) and s.node.expr.free_symbols & local for y in out[nc:] for s in y.shape):
            _check_same_size_every_step(looping, body, init, xs, additional, len(out))
        n = xs[0].shape[0]
        ys = [rebind_sizes(y.new_empty((n, *y.shape)), shape_env, local) for y in out[nc:]]
        return raw_output([*(torch.empty_like(c, memory_format=torch.contiguous_format) for c in init), *ys])


def _check_same_size_every_step(
    looping: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], n_out: int
) -> None:
    """Refuse ys whose size is computed from the carry or the slices: it may differ
    between steps. A size computed from the other inputs alone is the same in every step."""
    gm = body if isinstance(body, torch.fx.GraphModule) else None
    gm = gm or _tracing.trace_subgraph(body, examples(init, xs, additional))
    found = per_step_sizes(gm, len(init) + len(xs), range(len(init), n_out))
    if found:
        k, d, sym = found[0]
        path = f"ys[{k - len(init)}]"
        raise HopValueError(
            format_message(
                looping.name,
                f"the size {d} of this output is data dependent ({sym}) and computed from the "
                f"{'carry or the ' if init else ''}slice of xs, so it may differ between steps and the outputs "
                "cannot be stacked",
                role=looping.role,
                path=path,
                fix="Pad to a fixed size (and return the length separately), or compute the size from tensors that "
                "are not scanned.",
            ),
            op=looping.name,
            role=looping.role,
            path=path,
        )


# Note [traced bodies see contiguous values]
# A body traced into a graph bakes in the layout of the values it was traced on:
# `reshape` becomes `view` on a contiguous carry. It is traced on contiguous carries
# and slices, and when the dense rule runs a traced body (an exported program) it
# hands it contiguous carries and slices too, whatever layout the previous
# iteration produced. A Python body needs neither (nothing is baked in).


def examples(init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> list[Any]:
    """Fresh values to trace a body on (the carry must not alias closed-over tensors, nor
    two carries each other), and the additional inputs. Real values are copies of the
    initial carry and the first slice (Note [bodies are traced on values they can see]
    in hop._tracing); a real xs of length 0 has no slice: zeros stand in for one."""
    carries = [_tracing.trace_example(c) for c in init]
    slices = [_example_slice(x, e) for x, e in zip(xs, empty_slices(xs, [0] * len(xs)), strict=True)]
    return [*carries, *slices, *additional]


def _example_slice(x: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    if not _transforms.is_plain_tensor(x):
        return empty  # fake, meta: no data to copy
    return _tracing.trace_example(x.select(0, 0)) if x.shape[0] else torch.zeros_like(empty)


BODY_WRITES = Writes(
    "its input", "the carry, xs or closed-over tensors", "Return the updated value instead of writing the input."
)


def proxy(
    looping: Looping,
    mode: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """Trace the body on a carry and one slice and record one node (hop.ops._common's skeleton)."""
    dense = _common.dense_carries(mode, init)  # Note [a traced loop's carries are dense]
    if dense is not None:
        with mode:
            return looping.call(body, dense, xs, additional, reverse)
    (gm,), lifted = trace_callables(looping.name, [looping.role], [body], examples(init, xs, additional), BODY_WRITES)
    all_additional = (*additional, *lifted)
    return record_node(
        mode,
        looping.name,
        looping.op,
        looping.node_args(gm, tuple(init), tuple(xs), all_additional, reverse),
        lambda: looping.call(gm, init, xs, all_additional, reverse),
        why=f"the range {looping.role} gives it",
    )


class _ScanFunction(torch.autograd.Function):
    """A scan (or map) as one autograd node: backward is a reverse scan of the body's vjp,
    jvp a scan of the body's jvp (Note [scans run inline] covers real tensors)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(looping: Looping, body: Fn, reverse: bool, counts: tuple[int, int, int], *operands: Any) -> Any:
        init, xs, additional = _split(operands, counts)
        return looping.call(body, init, xs, additional, reverse)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.looping, ctx.body, ctx.reverse, ctx.counts, *operands = inputs
        ctx.out_diff = [differentiable(o) for o in as_tuple(output)]
        ctx.set_materialize_grads(False)  # None, not zeros: the derivatives leave them out
        save_operands(ctx, operands)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        init, xs, additional = _split(saved_operands(ctx), ctx.counts)
        named = (ctx.looping.name, ctx.looping.role)
        wanted = ctx.needs_input_grad[4:]  # a traced backward computes what it returns, used or not
        grads_in = scan_vjp(
            ctx.looping.scan,
            ctx.body,
            init,
            xs,
            additional,
            ctx.reverse,
            grads,
            ctx.out_diff,
            named=named,
            wanted=wanted,
        )
        return (None, None, None, None, *grads_in)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        init, xs, additional = _split(saved_operands(ctx), ctx.counts)
        return scan_jvp(ctx.looping.call, ctx.body, init, xs, additional, ctx.reverse, tangents[4:], ctx.out_diff)


def _split(operands: Sequence[Any], counts: tuple[int, int, int]) -> tuple[list[Any], list[Any], list[Any]]:
    nc, nx, _ = counts
    return list(operands[:nc]), list(operands[nc : nc + nx]), list(operands[nc + nx :])
