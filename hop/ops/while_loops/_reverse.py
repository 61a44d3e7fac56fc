"""Reverse mode of a while_loop that is one autograd node (traced, or under torch.func).

Note [reverse mode of a traced loop]
A traced loop's trip count n is a run-time value, so its iterations cannot be
stored in the graph when it is traced: the backward is made of loops too. The
forward node also counts the trips (one more carry, an int64 tensor). From n:

- ``stacked`` (the default): a scan over ``arange(n)`` from the initial carry
  stacks the carry before every step (an O(n) buffer whose length is the
  unbacked n), then a reverse scan pulls the cotangent through each step with
  ``torch.func.vjp`` and sums the additional inputs' gradients in its carry.
  That is scan's own backward (``_derivatives.scan_vjp``) applied to the loop seen
  as a scan of n steps: 2n body runs after the forward's n (one in each vjp),
  n carries in memory.
- ``segments`` (``checkpoint=True``): segments of s = ceil(sqrt(n)) steps. A scan
  over the segments runs the loop from the initial carry and keeps the carry
  before each (ceil(n / s) carries); a reverse scan over them replays one segment
  at a time with ``stacked`` (s carries). 3n body runs after the forward's,
  about 2 sqrt(n) carries in memory.
- ``recompute``: for carries whose size changes between iterations (they cannot
  be stacked), and where the count cannot become a traced length (make_fx with
  ``tracing_mode="real"`` has no ShapeEnv, ``.item()`` would bake the traced
  value in). A sweep k = n .. 1 recomputes carry k-1 from the initial carry (an
  inner loop of k-1 steps) and pulls the gradient through step k: O(n^2) body
  runs, constant memory.

Int carries are stacked as 0-dim int64 tensors and read back with ``.item()``
inside the steps (unbacked SymInts there, as in the traced forward loop); they
get no gradient. Tensors reach the inner functions as inputs, never by closure:
under torch.func they live at a level the loops' bodies run below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from hop import _transforms
from hop._operator import HigherOrderOperator
from hop._unbacked import unrecorded_symbols
from hop.errors import HopRuntimeError, format_message
from hop.ops._common import as_tuple, differentiable
from hop.ops.scanning import _derivatives
from hop.ops.scanning.scan import scan_op
from hop.ops.while_loops import _run
from hop.ops.while_loops._checks import NAME

__all__ = ["count_trips", "gradients"]

Fn = Callable[..., Any]
_Tensor = torch.Tensor
_check: Callable[..., None] = torch._check  # untyped in torch


def count_trips(
    loop: HigherOrderOperator, cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], extra: Sequence[Any]
) -> tuple[Any, ...]:
    """``(trips, *final_carry)``: the loop (``loop``: while_loop's raw op), counting its
    iterations in an int64 tensor."""
    zero = torch.zeros((), dtype=torch.int64, device=_device(carried))

    def count_cond(k: Any, *a: Any) -> Any:
        return cond_fn(*a)

    def count_body(k: Any, *a: Any) -> tuple[Any, ...]:
        return (k + 1, *as_tuple(body_fn(*a)))

    count_cond.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    count_body.__wrapped__ = body_fn  # type: ignore[attr-defined]
    return as_tuple(loop(count_cond, count_body, (zero, *carried), tuple(extra)))


def gradients(
    loop: HigherOrderOperator,
    body_fn: Fn,
    carried: list[Any],
    extra: list[Any],
    trips: _Tensor,
    g_carry: list[Any],
    *,
    fixed_sizes: bool,
    checkpoint: bool,
    wanted_extra: Sequence[bool],
) -> tuple[list[Any], list[Any]]:
    """The gradients of every carry and of the additional inputs autograd asks for
    (``wanted_extra``; None for the others and where not differentiable: a traced
    backward computes what it returns, used or not), given ``g_carry`` for the final
    carry (None where not differentiable); Note [reverse mode of a traced loop] chooses
    the method. ``loop`` is while_loop's raw op, which the recomputing methods run."""
    if _untracked(trips):
        raise _export_backward_error()
    d_e = [i for i, x in enumerate(extra) if differentiable(x) and wanted_extra[i]]
    if not fixed_sizes or not _count_is_traceable([*carried, *extra, trips]):
        return _recompute(loop, body_fn, carried, extra, trips, g_carry, d_e)
    n_t = _longest(trips)
    if _transforms.is_concrete(n_t) and int(n_t) == 0:  # torch.func, eager: nothing ran, nothing to pull through
        return g_carry, _transforms.place([None] * len(extra), d_e, [torch.zeros_like(extra[i]) for i in d_e])
    carry_t, step = _int_carries_as_tensors(body_fn, carried)
    nc, ne = len(carried), len(extra)
    if _raw(trips).dim():
        step, extra = _masked(step, nc), [*extra, trips]
    if checkpoint:
        g = _segments(loop, step, carry_t, extra, n_t, g_carry, d_e)
    else:
        g = _stacked(step, carry_t, extra, _size(n_t), g_carry, d_e)
    return g[:nc], g[nc : nc + ne]


def _untracked(trips: _Tensor) -> bool:
    """Whether the active tracer never saw ``trips``: torch.export's pre-dispatch tracer
    records the forward node above autograd, so the count made below it is not in
    the program (read in the backward, it would become a constant)."""
    mode = get_proxy_mode()
    if mode is None:
        return False
    inner = _raw(trips)
    if isinstance(inner, FunctionalTensor):  # AOTAutograd functionalizes above the tracer
        inner = inner.elem
    if torch._is_functional_tensor(inner):
        inner = torch._from_functional_tensor(inner)
    return get_proxy_slot(inner, mode.tracer, None) is None


def _export_backward_error() -> HopRuntimeError:
    return HopRuntimeError(
        format_message(
            NAME,
            "reverse mode through a loop cannot be traced by torch.export (torch.autograd.grad inside the "
            "exported function: the backward's steps are torch.func.vjp's, which export's tracer cannot record)",
            fix="Trace the training step with make_fx(step, tracing_mode='symbolic') and export that GraphModule, "
            "or export the forward only and differentiate ep.module().",
        ),
        op=NAME,
    )


def _count_is_traceable(values: Sequence[Any]) -> bool:
    """Whether ``trips.item()`` is a value of this run: an unbacked SymInt when a
    ShapeEnv is tracing, a plain int when nothing records the program."""
    fake_mode = torch._guards.detect_fake_mode(list(values))
    if fake_mode is not None:
        return fake_mode.shape_env is not None
    return get_proxy_mode() is None


# Note [a batched trip count]
# Under vmap (a backward vmapped by torch.func) each batch element has its own trip
# count. The scans run as many steps as the longest loop of the batch, and a step
# past an element's own count leaves its carry as it is (torch.where), so that
# element's cotangent passes through unchanged, as in the forward masked loop.


def _raw(trips: _Tensor) -> _Tensor:
    """The tensor under every functorch wrapper: one count per batch element."""
    while torch._C._functorch.is_functorch_wrapped_tensor(trips):
        trips = torch._C._functorch.get_unwrapped(trips)
    return trips


def _longest(trips: _Tensor) -> _Tensor:
    """The trip count as a tensor no transform batches: the longest one of a vmapped
    batch (Note [a batched trip count])."""
    raw = _raw(trips)
    if not raw.dim():
        return trips
    with temporarily_clear_interpreter_stack():
        return raw.max()


def _size(count: _Tensor) -> Any:
    """A count tensor as an int (an unbacked SymInt when traced)."""
    with unrecorded_symbols([count]):
        n = count.item()
    _check(n >= 0)  # a count: arange(n) may be empty, never negative
    return n


def _masked(step: Fn, nc: int) -> Fn:
    """``step(*carry, i, *extra, trips)``: a step past ``trips`` keeps the carry (Note [a
    batched trip count]), as a cond (Note [finished elements are not differentiated] in
    ``while_loops._run``)."""

    def masked(*a: Any) -> tuple[Any, ...]:
        def own_step(*b: Any) -> tuple[Any, ...]:
            return as_tuple(step(*b[:nc], *b[nc:-1]))

        return _run.active_step(a[nc] < a[-1], own_step, a[:nc], a[nc:])

    masked.__qualname__ = step.__qualname__
    return masked


def _int_of(t: _Tensor) -> Any:
    """An int carry's value from the 0-dim tensor it travels as. A vmap batching the
    loop broadcast that tensor (an int is one value for the whole batch: a batched
    condition may not change it), so every element holds the same int."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return t.item()
    with temporarily_clear_interpreter_stack():
        return _raw(t).reshape(-1)[0].item()


def _int_carries_as_tensors(body_fn: Fn, carried: list[Any]) -> tuple[list[Any], Fn]:
    """The carry with ints as 0-dim int64 tensors (a scan carries tensors only), and
    ``step(*carry, i, *extra)``: one iteration of the body on that carry."""
    nc = len(carried)
    ints = [i for i, c in enumerate(carried) if not isinstance(c, _Tensor)]
    carry_t = [torch.scalar_tensor(c, dtype=torch.int64) if i in ints else c for i, c in enumerate(carried)]

    def step(*a: Any) -> tuple[Any, ...]:
        carry = [_int_of(a[i]) if i in ints else a[i] for i in range(nc)]
        out = as_tuple(body_fn(*carry, *a[nc + 1 :]))
        return tuple(torch.scalar_tensor(o, dtype=torch.int64) if i in ints else o for i, o in enumerate(out))

    step.__qualname__ = getattr(body_fn, "__qualname__", "body_fn")
    return carry_t, step


def _stacked(
    step: Fn, carried: list[Any], extra: list[Any], n: Any, g_carry: list[Any], d_e: Sequence[int]
) -> list[Any]:
    """Gradients of ``(*carried, *extra at d_e)`` through ``n`` steps: the loop as a scan over
    ``arange(n)``, differentiated by scan's own backward (Note [reverse mode of a traced loop])."""
    steps = torch.arange(n, device=_device(carried))
    out_diff = [g is not None for g in g_carry]
    wanted = [True] * len(carried) + [False] + [i in d_e for i in range(len(extra))]
    g = _derivatives.scan_vjp(
        scan_op, step, carried, [steps], extra, False, g_carry, out_diff, named=(NAME, "body_fn"), wanted=wanted
    )
    nc = len(carried)
    return [*g[:nc], *g[nc + 1 :]]


def _segments(
    loop: HigherOrderOperator,
    step: Fn,
    carried: list[Any],
    extra: list[Any],
    n_t: _Tensor,
    g_carry: list[Any],
    d_e: Sequence[int],
) -> list[Any]:
    """Gradients of ``(*carried, *extra)`` through ``n_t`` steps, keeping the carry before
    every segment of about sqrt(n) steps and replaying one segment at a time (Note
    [reverse mode of a traced loop])."""
    nc, ne = len(carried), len(extra)
    seg_t = torch.sqrt(n_t.double()).ceil().long().clamp(min=1)
    count = _size((n_t + seg_t - 1) // seg_t)
    segments = torch.arange(count, device=_device(carried))
    sizes = (seg_t, n_t)  # every scan body reads them as inputs, never by closure
    starts = as_tuple(scan_op(_run_segment(loop, step, nc), carried, (segments,), (*extra, *sizes), False))[nc:]
    d_c = [i for i, g in enumerate(g_carry) if g is not None]
    d_e = list(d_e)
    init = (*[g_carry[i] for i in d_c], *[torch.zeros_like(extra[i]) for i in d_e])
    body = _segment_vjp(step, nc, d_c, d_e)
    out = as_tuple(scan_op(body, init, (*starts, segments), (*extra, *sizes), True))
    g_c = _transforms.place([None] * nc, d_c, out[: len(d_c)])
    return [*g_c, *_transforms.place([None] * ne, d_e, out[len(d_c) :])]


def _bounds(k: _Tensor, seg_t: _Tensor, n_t: _Tensor) -> tuple[_Tensor, _Tensor]:
    """The first step of segment ``k`` and its number of steps (the last one may be short)."""
    start = k * seg_t
    return start, torch.minimum(seg_t, n_t - start)


def _run_segment(loop: HigherOrderOperator, step: Fn, nc: int) -> Fn:
    """Scan body ``(*carry, k, *extra, seg_t, n_t) -> (*carry after segment k, *carry before it)``."""

    def run_segment(*a: Any) -> tuple[Any, ...]:
        carry, k, extra, (seg_t, n_t) = a[:nc], a[nc], a[nc + 1 : -2], a[-2:]
        start, length = _bounds(k, seg_t, n_t)

        def cond(j: Any, *b: Any) -> Any:
            return j < b[-1]

        def body(j: Any, *b: Any) -> tuple[Any, ...]:
            return (j + 1, *as_tuple(step(*b[:nc], b[-2] + j, *b[nc:-2])))

        zero = torch.zeros_like(start)
        out = as_tuple(loop(cond, body, (zero, *carry), (*extra, start, length)))
        return (*out[1:], *carry)

    return run_segment


def _segment_vjp(step: Fn, nc: int, d_c: list[int], d_e: list[int]) -> Fn:
    """Reverse scan body ``(*g_carry, *g_extra, *start carry, k, *extra, seg_t, n_t)``: replay
    segment k with ``_stacked`` and pull the cotangent through it."""
    m = len(d_c)

    def segment_vjp(*a: Any) -> tuple[Any, ...]:
        g, acc = a[:m], a[m : m + len(d_e)]
        rest = a[m + len(d_e) :]
        start_carry, k, extra, (seg_t, n_t) = list(rest[:nc]), rest[nc], list(rest[nc + 1 : -2]), rest[-2:]
        start, length = _bounds(k, seg_t, n_t)
        steps = torch.arange(_size(length), device=k.device) + start
        g_full = _transforms.place([None] * nc, d_c, g)
        out_diff = [x is not None for x in g_full]
        wanted = [True] * nc + [False] + [i in d_e for i in range(len(extra))]
        pulled = _derivatives.scan_vjp(
            scan_op,
            step,
            start_carry,
            [steps],
            extra,
            False,
            g_full,
            out_diff,
            named=(NAME, "body_fn"),
            wanted=wanted,
        )
        g_extra = pulled[nc + 1 :]
        return (*[pulled[i] for i in d_c], *[s + g_extra[i] for s, i in zip(acc, d_e, strict=True)])

    return segment_vjp


def _recompute(
    loop: HigherOrderOperator,
    body_fn: Fn,
    carried: list[Any],
    extra: list[Any],
    trips: _Tensor,
    g_carry: list[Any],
    d_extra: Sequence[int],
) -> tuple[list[Any], list[Any]]:
    """Note [reverse mode of a traced loop], ``recompute``: O(n^2) body runs, constant memory."""
    n, e = len(carried), len(extra)
    d_carry = [i for i, g in enumerate(g_carry) if g is not None]
    d_extra = list(d_extra)
    m = len(d_carry)

    def sweep_cond(k: Any, *a: Any) -> Any:
        return k > 0

    def sweep(k: Any, *a: Any) -> tuple[Any, ...]:
        gs, init, ext = a[: m + len(d_extra)], a[-(n + e) : len(a) - e], a[len(a) - e :]

        def replay_cond(j: Any, *b: Any) -> Any:
            return j < b[-1]

        def replay_body(j: Any, *b: Any) -> tuple[Any, ...]:
            return (j + 1, *as_tuple(body_fn(*b[:n], *b[n : n + e])))

        replay = as_tuple(loop(replay_cond, replay_body, (torch.zeros_like(k), *init), (*ext, k - 1)))
        before = list(replay[1:])

        def one_step(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(before, d_carry, d[:m])
            out = as_tuple(body_fn(*c, *_transforms.place(list(ext), d_extra, d[m:])))
            return tuple(out[i] for i in d_carry)

        primals = (*[before[i] for i in d_carry], *[ext[i] for i in d_extra])
        with _transforms.torch_ops_without_rules(NAME, "body_fn"):
            pulled = torch.func.vjp(one_step, *primals)[1](tuple(gs[:m]))
        return (k - 1, *pulled[:m], *[a + b for a, b in zip(gs[m:], pulled[m:], strict=True)])

    init = (trips, *[g_carry[i] for i in d_carry], *[torch.zeros_like(extra[i]) for i in d_extra])
    out = as_tuple(loop(sweep_cond, sweep, init, (*carried, *extra)))
    return _transforms.place([None] * n, d_carry, out[1 : 1 + m]), _transforms.place([None] * e, d_extra, out[1 + m :])


def _device(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, _Tensor)), torch.device("cpu"))
