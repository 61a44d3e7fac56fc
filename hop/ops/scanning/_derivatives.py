"""Scan's derivatives: the reverse scan of a body's vjp and the scan of its jvp.

:func:`scan_vjp` gives the gradients of every operand of a scan (recomputing the
carries with a forward scan, then scanning the body's vjp the other way);
:func:`scan_jvp` runs the op again on the body's jvp. Besides scan and map (whose
derivatives are scans), ``while_loop``'s reverse mode (``hop.ops.while_loops._reverse``)
and ``associative_scan`` call them, each naming the operator the user called;
hence a module of their own, below every operator that uses them. The raw scan
they run is passed in, never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _transforms
from hop._operator import HigherOrderOperator
from hop.ops._common import as_tuple, differentiable_at
from hop.ops.scanning._values import raw_output

Fn = Callable[..., Any]


def _scatter(n: int, at: Sequence[int], values: Sequence[Any]) -> list[Any]:
    return _transforms.place([None] * n, at, values)


def scan_vjp(
    scan_op: HigherOrderOperator,
    body: Fn,
    init: list[Any],
    xs: list[Any],
    additional: list[Any],
    reverse: bool,
    grads: Sequence[Any],
    out_diff: Sequence[bool],
    *,
    named: tuple[str, str] = ("scan", "the body"),
    wanted: Sequence[bool] | None = None,
) -> list[Any]:
    """Gradients of every operand: a scan in the other direction over the stacked input
    carries (recomputed by a forward scan), ``xs`` and the cotangents of ``ys``; its carry
    is the cotangent of the carry and the running sum of the gradients of the additional inputs.
    ``named``: the operator the user called and its callable, for errors (map, a loop's
    backward and associative_scan run this too). ``wanted``: per operand (init, xs,
    additional), whether autograd asks for its gradient; the xs and additional inputs it
    does not ask for get None and cost nothing (the carries' gradients chain the steps,
    so they are always computed)."""
    nc = len(init)
    dc, dx, da = differentiable_at(init), differentiable_at(xs), differentiable_at(additional)
    if wanted is not None:
        dx = [i for i in dx if wanted[nc + i]]
        da = [i for i in da if wanted[nc + len(xs) + i]]
    dy = [j for j in range(len(grads) - nc) if out_diff[nc + j] and grads[nc + j] is not None]
    carries: tuple[Any, ...] = ()
    if nc:
        carries = as_tuple(scan_op(_carries_body(body, nc), init, xs, additional, reverse))[nc:]
    step = _vjp_body(body, (nc, len(xs), len(additional)), dc, dx, da, dy, named)
    g_carry = [torch.zeros_like(init[i]) if grads[i] is None else grads[i] for i in dc]  # a carry keeps its shape
    g_ys = [grads[nc + j] for j in dy]
    zeros = [torch.zeros_like(additional[i]) for i in da]
    out = as_tuple(scan_op(step, (*g_carry, *zeros), (*carries, *xs, *g_ys), additional, not reverse))
    g_init, g_add, g_xs = out[: len(dc)], out[len(dc) : len(dc) + len(da)], out[len(dc) + len(da) :]
    return [*_scatter(nc, dc, g_init), *_scatter(len(xs), dx, g_xs), *_scatter(len(additional), da, g_add)]


def _carries_body(body: Fn, nc: int) -> Fn:
    """``body`` that also returns its input carry as a y, to stack every iteration's carry."""

    def carries(*args: Any) -> tuple[Any, ...]:
        return (*as_tuple(body(*args))[:nc], *args[:nc])

    return carries


def _vjp_body(
    body: Fn,
    counts: tuple[int, int, int],
    dc: list[int],
    dx: list[int],
    da: list[int],
    dy: list[int],
    named: tuple[str, str],
) -> Fn:
    """``(*g_carry, *g_add, *carry, *x, *g_y, *additional) -> (*g_carry_in, *g_add + step's, *g_x)``."""
    nc, nx, _ = counts

    def vjp_step(*args: Any) -> tuple[Any, ...]:
        g_carry, g_add = args[: len(dc)], args[len(dc) : len(dc) + len(da)]
        rest = args[len(dc) + len(da) :]
        carry, x = rest[:nc], rest[nc : nc + nx]
        g_y, additional = rest[nc + nx : nc + nx + len(dy)], rest[nc + nx + len(dy) :]

        def on_diff(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(carry, dc, d[: len(dc)])
            xx = _transforms.place(x, dx, d[len(dc) : len(dc) + len(dx)])
            out = as_tuple(body(*c, *xx, *_transforms.place(additional, da, d[len(dc) + len(dx) :])))
            return (*[out[i] for i in dc], *[out[nc + j] for j in dy])

        primals = [*[carry[i] for i in dc], *[x[i] for i in dx], *[additional[i] for i in da]]
        with _transforms.torch_ops_without_rules(*named):
            grads = torch.func.vjp(on_diff, *primals)[1]((*g_carry, *g_y))
        g_x, g_add_step = grads[len(dc) : len(dc) + len(dx)], grads[len(dc) + len(dx) :]
        return (*grads[: len(dc)], *[a + b for a, b in zip(g_add, g_add_step, strict=True)], *g_x)

    vjp_step.__qualname__ = f"vjp_{getattr(body, '__qualname__', 'body')}"
    return vjp_step


def scan_jvp(
    call: Callable[[Fn, Sequence[Any], Sequence[Any], Sequence[Any], bool], Any],
    body: Fn,
    init: list[Any],
    xs: list[Any],
    additional: list[Any],
    reverse: bool,
    tangents: Sequence[Any],
    out_diff: Sequence[bool],
) -> Any:
    """Output tangents: the op again on the body's jvp, carrying ``(carry, carry tangent)``."""
    nc, nx, na = len(init), len(xs), len(additional)
    # every differentiable carry (its tangent chains the steps), but only the xs and
    # additional inputs that carry a tangent: a zero one is work with no effect
    dc = differentiable_at(init)
    dx = [i for i in differentiable_at(xs) if tangents[nc + i] is not None]
    da = [i for i in differentiable_at(additional) if tangents[nc + nx + i] is not None]
    dy = [j for j in range(len(out_diff) - nc) if out_diff[nc + j]]
    values = [*init, *xs, *additional]

    def tangent(k: int) -> Any:
        return torch.zeros_like(values[k]) if tangents[k] is None else tangents[k]

    t_init, t_xs, t_add = ([tangent(off + i) for i in idx] for off, idx in ((0, dc), (nc, dx), (nc + nx, da)))
    step = _jvp_body(body, (nc, nx, na), dc, dx, da, dy)
    out = as_tuple(call(step, (*init, *t_init), (*xs, *t_xs), (*additional, *t_add), reverse))
    t_carry = _scatter(nc, dc, out[nc : nc + len(dc)])
    t_ys = _scatter(len(out_diff) - nc, dy, out[nc + len(dc) + len(out_diff) - nc :])
    return raw_output([*t_carry, *t_ys])


def _jvp_body(body: Fn, counts: tuple[int, int, int], dc: list[int], dx: list[int], da: list[int], dy: list[int]) -> Fn:
    """``(*carry, *t_carry, *x, *t_x, *additional, *t_add) -> (*next_carry, *t_next_carry, *y, *t_y)``."""
    nc, nx, na = counts

    def jvp_step(*args: Any) -> tuple[Any, ...]:
        carry, t_carry = args[:nc], args[nc : nc + len(dc)]
        rest = args[nc + len(dc) :]
        x, t_x = rest[:nx], rest[nx : nx + len(dx)]
        additional, t_add = rest[nx + len(dx) : nx + len(dx) + na], rest[nx + len(dx) + na :]

        def on_diff(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(carry, dc, d[: len(dc)])
            xx = _transforms.place(x, dx, d[len(dc) : len(dc) + len(dx)])
            return as_tuple(body(*c, *xx, *_transforms.place(additional, da, d[len(dc) + len(dx) :])))

        primals = (*[carry[i] for i in dc], *[x[i] for i in dx], *[additional[i] for i in da])
        out, t_out = _transforms.jvp(on_diff, primals, (*t_carry, *t_x, *t_add))
        return (*out[:nc], *[t_out[i] for i in dc], *out[nc:], *[t_out[nc + j] for j in dy])

    jvp_step.__qualname__ = f"jvp_{getattr(body, '__qualname__', 'body')}"
    return jvp_step
