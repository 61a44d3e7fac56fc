"""Reverse mode through a loop with bounded memory (``while_loop(..., checkpoint=True)``).

Note [sqrt checkpointing with an unknown trip count]
The forward pass keeps the carry at every k-th iteration, starting with k = 1.
Whenever more than k + 1 checkpoints are kept, k doubles and every other one is
dropped, so after n iterations k is about sqrt(2n) at most and there are at most
k + 1 checkpoints. The backward pass walks the segments from the last: it replays
the at most k iterations of a segment from its checkpoint with autograd on and
backpropagates through them. Peak memory: k + 1 checkpoints plus one segment's
intermediates, about 2 sqrt(2n) carries (65 for n = 1024), instead of n; the
price is one more forward pass. Gradients reach the initial carries and the
tensors the functions close over (found by ``_closures.closure_tensors``); a replay
that reads a tensor requiring grad the search missed raises instead of dropping its
gradient (:func:`_check_reads_found`).

The backward pass is first-order only: the replayed segments are differentiated
with ``torch.autograd.grad`` and their graphs freed. Under ``create_graph=True`` the
gradients it returns carry a node whose backward raises (``_FirstOrderOnly``), so
a second derivative says so instead of failing inside torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from hop.errors import HopRuntimeError, HopTypeError, format_message, type_name
from hop.ops._common import differentiable
from hop.ops.while_loops._checks import NAME as _NAME

Fn = Callable[..., Any]

__all__ = ["run", "checkpoints", "check_flag"]


def check_flag(checkpoint: Any) -> None:
    """``checkpoint`` must be a bool: ``checkpoint="no"`` would read as true."""
    if type(checkpoint) is not bool:
        raise HopTypeError(
            format_message(
                _NAME,
                f"checkpoint must be True or False, got {type_name(checkpoint)} {checkpoint!r}",
                fix="Pass checkpoint=True for bounded-memory reverse mode, else leave it out.",
            ),
            op=_NAME,
            role="checkpoint",
        )


def checkpoints(cond_fn: Fn, body_fn: Fn, carry: tuple[Any, ...]) -> tuple[list[tuple[int, tuple[Any, ...]]], int]:
    """Run the loop, keeping the carries of Note [sqrt checkpointing with an unknown trip count]."""
    kept: list[tuple[int, tuple[Any, ...]]] = [(0, carry)]
    k, i = 1, 0
    while cond_fn(*carry):
        carry = tuple(body_fn(*carry))
        i += 1
        if i % k == 0:
            kept.append((i, carry))
            if len(kept) > k + 1:
                k *= 2
                kept = [c for c in kept if c[0] % k == 0]
    if kept[-1][0] != i:
        kept.append((i, carry))
    return kept, i


def run(cond_fn: Fn, body_fn: Fn, leaves: Sequence[Any], closures: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The final carry; differentiable with memory about 2 sqrt(2n) carries."""
    needs = [c for c in closures if c.requires_grad]
    if not torch.is_grad_enabled() or not any(getattr(x, "requires_grad", False) for x in (*leaves, *needs)):
        with torch.no_grad():
            kept, _ = checkpoints(cond_fn, body_fn, tuple(leaves))
        return _fresh(kept[-1][1], leaves)
    apply: Callable[..., Any] = _CheckpointedLoop.apply
    out = apply(cond_fn, body_fn, len(leaves), *leaves, *needs)
    return out if isinstance(out, tuple) else (out,)


def _fresh(carry: tuple[Any, ...], leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(c.clone() if any(c is x for x in leaves) else c for c in carry)


class _CheckpointedLoop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cond_fn: Fn, body_fn: Fn, n: int, *args: Any) -> Any:
        kept, _ = checkpoints(cond_fn, body_fn, tuple(args[:n]))
        ctx.body_fn, ctx.n, ctx.n_closures = body_fn, n, len(args) - n
        ctx.starts = [i for i, _ in kept]
        ctx.layout = [[isinstance(x, torch.Tensor) for x in c] for _, c in kept]
        ctx.ints = [[x for x in c if not isinstance(x, torch.Tensor)] for _, c in kept]
        ctx.save_for_backward(*args[n:], *[x for _, c in kept for x in c if isinstance(x, torch.Tensor)])
        out = _fresh(kept[-1][1], args[:n])
        return out[0] if n == 1 else out

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            out = _CheckpointedLoop._grads(ctx, grads)
        # create_graph=True: make a second derivative raise (the module docstring)
        anchors = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not anchors:
            return out
        at = [i for i, g in enumerate(out) if isinstance(g, torch.Tensor)]
        first_order: Callable[..., Any] = _FirstOrderOnly.apply
        marked = first_order(len(at), *[out[i] for i in at], *anchors)
        final = list(out)
        for i, g in zip(at, marked, strict=True):
            final[i] = g
        return tuple(final)

    @staticmethod
    def _grads(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        closures, flat = list(saved[: ctx.n_closures]), iter(saved[ctx.n_closures :])
        kept = []
        for layout, ints in zip(ctx.layout, ctx.ints, strict=True):
            it = iter(ints)
            kept.append(tuple(next(flat) if is_t else next(it) for is_t in layout))
        g = [
            torch.zeros_like(x) if grad is None and differentiable(x) else grad
            for x, grad in zip(kept[-1], grads, strict=True)
        ]
        g_closures: list[Any] = [None] * len(closures)
        for s in range(len(kept) - 2, -1, -1):
            g, g_seg = _segment_grads(ctx.body_fn, kept[s], ctx.starts[s + 1] - ctx.starts[s], g, closures)
            g_closures = [
                a if b is None else (b if a is None else a + b) for a, b in zip(g_closures, g_seg, strict=True)
            ]
        return (None, None, None, *g, *g_closures)


class _FirstOrderOnly(torch.autograd.Function):
    """``forward(n, *grads, *anchors)`` returns copies of the ``n`` grads, attached to
    the anchors (tensors that require grad); differentiating them raises."""

    @staticmethod
    def forward(ctx: Any, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise HopRuntimeError(
            format_message(
                _NAME,
                "the gradient of a loop run with checkpoint=True is first-order only: it cannot be "
                "differentiated again (a second derivative after create_graph=True)",
                fix="Use checkpoint=False (the default) for higher-order derivatives: that loop runs "
                "inline and has exact derivatives of every order.",
            ),
            op=_NAME,
            role="checkpoint",
        )


def _segment_grads(
    body_fn: Fn, start: tuple[Any, ...], steps: int, grads: list[Any], closures: list[torch.Tensor]
) -> tuple[list[Any], list[Any]]:
    """Replay ``steps`` iterations from a checkpoint and backpropagate ``grads`` through them."""
    diff = [i for i, x in enumerate(start) if differentiable(x)]
    with torch.enable_grad():
        x = [v.detach().requires_grad_() if i in diff else v for i, v in enumerate(start)]
        y: tuple[Any, ...] = tuple(x)
        for _ in range(steps):
            y = tuple(body_fn(*y))
        pairs = [(y[i], grads[i]) for i in diff if y[i].requires_grad and grads[i] is not None]
        if not pairs:
            return [None] * len(start), [None] * len(closures)
        inputs = [x[i] for i in diff] + closures
        _check_reads_found([p for p, _ in pairs], inputs)
        got = torch.autograd.grad([p for p, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True)
    out: list[Any] = [None] * len(start)
    for i, gi in zip(diff, got[: len(diff)], strict=True):
        out[i] = torch.zeros_like(start[i]) if gi is None else gi
    return out, list(got[len(diff) :])


def _check_reads_found(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Raise if the replayed iterations read a tensor that requires grad other than
    ``inputs`` (the carries and what the static closure search found): its gradient
    would be lost silently (read through ``getattr`` with a computed name, say). A walk
    of the replay's autograd graph, stopping at ``inputs``; a leaf it reaches that is
    not one of them is such a tensor (or feeds one that is not a leaf). It visits each
    node once, as the backward that follows does: no cap, which would let a large
    replay skip the check silently."""
    # by gradient edge, not identity: a saved tensor unpacked by hooks is another object;
    # the dicts keep the nodes alive, so their ids stay theirs
    stops = {id(n): n for n in (get_gradient_edge(t).node for t in inputs if t.requires_grad)}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, torch.Tensor):
            raise HopRuntimeError(
                format_message(
                    _NAME,
                    f"with checkpoint=True, body_fn reads a tensor that requires grad (shape "
                    f"{list(variable.shape)}) that hop could not find among what it closes over, so its "
                    "gradient would be lost",
                    fix="Read it as a closure variable, a global or an attribute named in the code "
                    "(not through getattr with a computed name), or carry it through the loop.",
                ),
                op=_NAME,
                role="body_fn",
            )
        stack.extend(n for n, _ in node.next_functions if n is not None)
