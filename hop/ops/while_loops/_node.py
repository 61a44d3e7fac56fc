"""A while_loop as one autograd node, and the raw op's ``checkpoint`` keyword.

Where the loop cannot run inline (traced carries, or ``checkpoint=True``), the
autograd, grad and jvp rules make it one node (:func:`as_node`): forward mode is
a loop over (carry, tangent), reverse mode is Note [reverse mode of a traced loop]
(``while_loops._reverse``). The raw op is passed in by ``hop.ops.while_loops.while_loop``, which
imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _state, _transforms
from hop import subgraph as _subgraph
from hop._unbacked import unrecorded_symbols
from hop.ops._common import as_tuple, differentiable, save_operands, saved_operands
from hop.ops.scanning._checks import leaf_difference
from hop.ops.while_loops import _reverse

Fn = Callable[..., Any]


class _LoopFunction(torch.autograd.Function):
    """A traced loop as one autograd node: forward mode is a loop over (carry,
    tangent); reverse mode is Note [reverse mode of a traced loop] (while_loops._reverse).
    Its outputs are ``(trips, *final_carry)``: the backward starts from the trip count.
    ``op`` is the raw while_loop the derivatives' loops run as."""

    generate_vmap_rule = True

    @staticmethod
    def forward(op: Any, cond_fn: Fn, body_fn: Fn, n: int, checkpoint: bool, *args: Any) -> Any:
        return _reverse.count_trips(op, cond_fn, body_fn, args[:n], args[n:])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op, ctx.cond_fn, ctx.body_fn, ctx.n, ctx.checkpoint = inputs[:5]
        ctx.args = inputs[5:]
        ctx.mark_non_differentiable(output[0])
        ctx.set_materialize_grads(False)  # None, not zeros: the derivatives leave them out
        ctx.final_shapes = [o.shape if isinstance(o, torch.Tensor) else None for o in output[1:]]
        # a size the body changes is a fresh unbacked one in the fake rule's final carry
        ctx.fixed_sizes = all(
            not isinstance(a, torch.Tensor) or leaf_difference(a, o) is None
            for a, o in zip(ctx.args[: ctx.n], output[1:], strict=True)
        )
        save_operands(ctx, (output[0], *ctx.args))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        trips, *args = saved_operands(ctx)
        n = ctx.n
        carried, extra = list(args[:n]), list(args[n:])
        g_carry = [
            None if not differentiable(x) else (x.new_zeros(s) if g is None else g)
            for x, s, g in zip(carried, ctx.final_shapes, grads[1:], strict=True)
        ]
        g_c, g_e = _reverse.gradients(
            ctx.op,
            ctx.body_fn,
            carried,
            extra,
            trips,
            g_carry,
            fixed_sizes=ctx.fixed_sizes,
            checkpoint=ctx.checkpoint,
            wanted_extra=ctx.needs_input_grad[5 + n :],
        )
        return (None, None, None, None, None, *g_c, *g_e)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        n, args = ctx.n, ctx.args
        carried, extra = args[:n], args[n:]
        diff = [i for i, x in enumerate(carried) if differentiable(x)]
        t_carry = [torch.zeros_like(carried[i]) if tangents[5 + i] is None else tangents[5 + i] for i in diff]
        # every differentiable carry (its tangent chains the trips), but only the
        # extra inputs that carry a tangent: a zero one is work with no effect
        d_extra = [i for i, x in enumerate(extra) if differentiable(x) and tangents[5 + n + i] is not None]
        t_extra = [tangents[5 + n + i] for i in d_extra]
        cond_fn, body_fn = ctx.cond_fn, ctx.body_fn
        k = len(diff)

        def jvp_cond(*a: Any) -> Any:
            return cond_fn(*a[:n], *a[n + k : n + k + len(extra)])

        def jvp_body(*a: Any) -> tuple[Any, ...]:
            primal, tan, ex, ex_t = a[:n], a[n : n + k], a[n + k : n + k + len(extra)], a[n + k + len(extra) :]

            def on_diff(*d: Any) -> tuple[Any, ...]:
                full, ext = list(primal), list(ex)
                for i, v in zip(diff, d[:k], strict=True):
                    full[i] = v
                for i, v in zip(d_extra, d[k:], strict=True):
                    ext[i] = v
                return as_tuple(body_fn(*full, *ext))

            out, t_out = _transforms.jvp(
                on_diff, (*[primal[i] for i in diff], *[ex[i] for i in d_extra]), (*tan, *ex_t)
            )
            # torch's forward AD may give a 0-dim tangent a Python float took part in the
            # default float64 dtype: a tangent carry keeps its dtype from step to step
            return (*out, *[_as_dtype(t_out[i], tan[j]) for j, i in enumerate(diff)])

        with unrecorded_symbols([*t_carry, *t_extra]):  # an int carry, counted again, has no tangent
            res = as_tuple(ctx.op(jvp_cond, jvp_body, (*carried, *t_carry), (*extra, *t_extra)))
        t_full = [torch.zeros_like(x) if differentiable(x) else None for x in res[:n]]
        for j, i in enumerate(diff):
            t_full[i] = res[n + j]
        return (None, *t_full)


# Note [the checkpoint keyword]
# The raw op is torch's while_loop(cond_fn, body_fn, carried_inputs,
# additional_inputs) plus one keyword, checkpoint, which only the reverse mode
# reads. It is passed, and so recorded in a traced node, only when True: a graph of
# a loop without it is the graph torch's lowering and exporters know, and a
# graph with it trains (ep.module() with grad) with the bounded-memory reverse mode
# it asked for. Every rule takes it; those that call the op again pass it on.


def flag(checkpoint: bool) -> dict[str, bool]:
    """The raw op's keywords for ``checkpoint`` (Note [the checkpoint keyword])."""
    return {"checkpoint": True} if checkpoint else {}


def as_node(
    op: Any,
    cond_fn: Fn,
    body_fn: Fn,
    carried: Sequence[Any],
    additional: Sequence[Any],
    checkpoint: bool,
    level: int | None = None,
) -> Any:
    """One autograd node for the raw op ``op``; what the functions close over and need
    grad for becomes additional inputs (Note [closure conversion] in hop._closures)."""
    (cond_fn, body_fn), captured = _subgraph.convert_closures([cond_fn, body_fn], [*carried, *additional], level)
    n_c, n_a = len(carried), len(additional)
    additional = (*additional, *captured)
    apply: Callable[..., Any] = _LoopFunction.apply
    try:
        out = apply(op, cond_fn, body_fn, n_c, checkpoint, *carried, *additional)[1:]
    except _state.StateWrites as writes:  # placeholders: the trip counter, the carries, additional, captured

        def where(i: int) -> int | torch.Tensor:
            return i - 1 if i <= n_c + n_a else captured[i - 1 - n_c - n_a]

        raise writes.reindexed(n_c + n_a, where, outputs_first=1) from None
    return out[0] if len(out) == 1 else out


def _as_dtype(tangent: Any, like: Any) -> Any:
    if isinstance(tangent, torch.Tensor) and isinstance(like, torch.Tensor) and tangent.dtype != like.dtype:
        return tangent.to(like.dtype)
    return tangent
