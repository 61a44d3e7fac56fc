"""The checks of transform compositions: ``vmap_grad``, ``grad_vmap``, ``vmap_jvp``, and
(opt-in, compiled) ``compile_inductor_vmap``; the batched reference ``export_vmap`` reads.

Each batches ``batch_size`` perturbed copies of the arguments, as ``vmap`` does, and
compares with the reference run row by row: ``vmap_grad`` the per-row gradient taken
inside the vmap (``vmap(grad(f))``, per-example gradients), ``grad_vmap`` the gradient
of the batched program taken outside it (how a batch is trained: an element's
gradient must not see a branch or a step that element did not take), ``vmap_jvp``
forward mode inside the vmap, ``compile_inductor_vmap`` the batched program compiled
with Inductor (forward, and the gradient outside the vmap). The gradient is of the
float outputs weighted by seeded cotangents, with respect to the float inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop._pytree import flatten
from hop.testing._case import (
    CheckCase,
    CheckFailure,
    Fn,
    Skip,
    arg_leaves,
    compare_tensors,
    limitation,
    on_leaves,
    perturbed,
    reference,
    running,
)


class _Batch:
    """The rows (perturbed copies of the arguments), their tensor leaves stacked, and
    which of those leaves are floating-point."""

    def __init__(self, case: CheckCase) -> None:
        self.rows = [perturbed(case, k) for k in range(case.batch_size)]
        leaves, _ = arg_leaves(case)
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.floats = tuple(k for k, i in enumerate(tensors) if leaves[i].is_floating_point())
        if not self.floats:
            raise Skip("no floating-point tensor inputs")
        self.row_leaves = [[flatten(r)[0][i] for i in tensors] for r in self.rows]
        self.stacked = [torch.stack(column) for column in zip(*self.row_leaves, strict=True)]
        self.paths = [f"grad of input {k}" for k in self.floats]


def _scalar(fn: Fn, case: CheckCase, cotangents: list[torch.Tensor] | None = None) -> tuple[Fn, list[torch.Tensor]]:
    """``fn`` (of the tensor leaves) reduced to one number: its float outputs weighted by
    seeded cotangents, made on first use (by the reference: then shared by ``fn``)."""
    is_reference = cotangents is None
    on, _ = on_leaves(fn, case, lambda x: isinstance(x, torch.Tensor))
    made: list[torch.Tensor] = [] if cotangents is None else cotangents

    def s(*xs: Any) -> torch.Tensor:
        outs = [o for o in flatten(on(*xs))[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if not outs:
            raise Skip("no floating-point outputs")
        if not made:
            gen = case.generator(-3)
            made.extend(torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs)
        if len(made) != len(outs) or any(c.shape != o.shape for c, o in zip(made, outs, strict=False)):
            if is_reference:
                raise Skip("the outputs' shapes differ across the batch, so no batched output exists")
            raise CheckFailure("vmap_grad", "the float outputs differ from the reference's in number or shape")
        return sum(((o * c).sum() for o, c in zip(outs, made, strict=True)), torch.zeros((), dtype=outs[0].dtype))

    return s, made


def _reference_grads(case: CheckCase, name: str, batch: _Batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row, the reference's gradient (stacked by input), and the cotangents used."""
    s, cotangents = _scalar(case.ref, case)
    with running(name, reference=True):
        rows = [torch.func.grad(s, argnums=batch.floats)(*leaves) for leaves in batch.row_leaves]
    return [torch.stack(column) for column in zip(*rows, strict=True)], cotangents


def _batched(name: str, call: Callable[[], Any], python: Callable[[], Any]) -> Any:
    """``call()`` (something under torch.vmap); when it fails, skip if vmap fails on the
    plain-Python program (``python()``) too, or for a documented limitation."""
    try:
        return call()
    except (CheckFailure, Skip):
        raise
    except Exception as e:
        if limitation(name, e) is None:
            try:
                with reference():
                    python()
            except Exception as p:
                raise Skip(f"torch.vmap fails on the plain-Python program too: {type(p).__name__}") from None
        with running(name):
            raise


def check_vmap_grad(case: CheckCase) -> None:
    batch = _Batch(case)
    want, cotangents = _reference_grads(case, "vmap_grad", batch)
    s, _ = _scalar(case.fn, case, cotangents)
    call = lambda: torch.vmap(torch.func.grad(s, argnums=batch.floats))(*batch.stacked)  # noqa: E731
    got = _batched("vmap_grad", call, call)
    compare_tensors(case, "vmap_grad", list(got), want, batch.paths)


def check_grad_vmap(case: CheckCase) -> None:
    batch = _Batch(case)
    want, cotangents = _reference_grads(case, "grad_vmap", batch)
    s, _ = _scalar(case.fn, case, cotangents)
    call = lambda: torch.func.grad(lambda *b: torch.vmap(s)(*b).sum(), argnums=batch.floats)(*batch.stacked)  # noqa: E731
    got = _batched("grad_vmap", call, call)
    compare_tensors(case, "grad_vmap", list(got), want, batch.paths)


def check_vmap_jvp(case: CheckCase) -> None:
    batch = _Batch(case)
    gen = case.generator(-4)
    first = batch.row_leaves[0]
    tangents = tuple(torch.randn(first[k].shape, generator=gen, dtype=first[k].dtype) for k in batch.floats)

    def jvp(fn: Fn, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        on, _ = on_leaves(fn, case, lambda x: isinstance(x, torch.Tensor))

        def of_floats(*fs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(leaves)
            for k, f in zip(batch.floats, fs, strict=True):
                full[k] = f
            return tuple(o for o in flatten(on(*full))[0] if isinstance(o, torch.Tensor) and o.is_floating_point())

        pair: Any = torch.func.jvp(of_floats, tuple(leaves[k] for k in batch.floats), tangents)
        primal, tangent = pair
        # torch's forward AD gives a 0-dim output a float64 tangent where a Python float
        # took part (``x * 0.5``), and a batched one its primal's dtype: compare in the primal's
        return tuple(t.to(p.dtype) for p, t in zip(primal, tangent, strict=True))

    with running("vmap_jvp", reference=True):
        rows = [jvp(case.ref, leaves) for leaves in batch.row_leaves]
    if not rows[0]:
        raise Skip("no floating-point outputs")
    want = _stacked(rows)
    call = lambda: torch.vmap(lambda *xs: jvp(case.fn, xs))(*batch.stacked)  # noqa: E731
    got = _batched("vmap_jvp", call, call)
    compare_tensors(case, "vmap_jvp", list(got), want, [f"tangent of output {k}" for k in range(len(want))])


def compile_vmap(case: CheckCase, traceable: Fn) -> None:
    """``torch.compile(torch.vmap(fn), backend="inductor")``: the batched outputs, and the
    gradient taken outside the vmap, against the reference row by row. ``traceable``:
    ``fn`` of the tensor leaves in a form Dynamo traces."""
    batch = _Batch(case)
    want_grads, cotangents = _reference_grads(case, "compile_inductor_vmap", batch)
    _, want = batched_reference(case, "compile_inductor_vmap", batch)
    import torch.utils._pytree as py_pytree  # Dynamo traces torch's Python pytree, not hop's

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:  # what vmap can return
        leaves = py_pytree.tree_leaves(traceable(*xs))
        return tuple(o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point())

    torch._dynamo.reset()
    compiled = torch.compile(torch.vmap(floats), backend="inductor", fullgraph=True, dynamic=True)
    inputs = [x.detach().clone().requires_grad_(k in batch.floats) for k, x in enumerate(batch.stacked)]
    with running("compile_inductor_vmap"):
        out = list(compiled(*inputs))
    compare_tensors(
        case, "compile_inductor_vmap", [o.detach() for o in out], want, [f"output {k}" for k in range(len(want))]
    )
    if not any(o.requires_grad for o in out):
        return
    total = sum(((o * c).sum() for o, c in zip(out, cotangents, strict=True)), torch.zeros(()))
    with running("compile_inductor_vmap"):
        got = torch.autograd.grad(total, [inputs[k] for k in batch.floats], allow_unused=True, materialize_grads=True)
    compare_tensors(case, "compile_inductor_vmap", list(got), want_grads, batch.paths)


def batched_reference(
    case: CheckCase, name: str, batch: _Batch | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The batch's stacked tensor inputs, and the reference's float outputs row by row, stacked."""
    batch = _Batch(case) if batch is None else batch
    with running(name, reference=True):
        rows = [_float_outputs(case.ref, case, leaves) for leaves in batch.row_leaves]
    if not rows[0]:
        raise Skip("no floating-point outputs")
    return batch.stacked, _stacked(rows)


def compile_compositions(case: CheckCase, traceable: Fn) -> None:
    """``torch.compile(torch.vmap(torch.func.grad(s)))`` and the compiled ``vmap`` of a
    ``jvp`` (aot_eager), against the reference's per-row gradient and tangents."""
    import torch.utils._pytree as py_pytree  # Dynamo traces torch's Python pytree, not hop's

    name = "compile_compositions"
    batch = _Batch(case)
    want, cotangents = _reference_grads(case, name, batch)

    def floats(*xs: Any) -> list[torch.Tensor]:
        leaves = py_pytree.tree_leaves(traceable(*xs))
        return [o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point()]

    def s(*xs: Any) -> torch.Tensor:
        outs = floats(*xs)
        return sum(((o * c).sum() for o, c in zip(outs, cotangents, strict=True)), torch.zeros((), dtype=outs[0].dtype))

    torch._dynamo.reset()
    per_row = torch.compile(torch.vmap(torch.func.grad(s, argnums=batch.floats)), backend="aot_eager", fullgraph=True)
    with running(name):
        got = per_row(*batch.stacked)
    compare_tensors(case, name, list(got), want, batch.paths)
    gen = case.generator(-4)
    first = batch.row_leaves[0]
    tangents = tuple(torch.randn(first[k].shape, generator=gen, dtype=first[k].dtype) for k in batch.floats)

    def tangent_of(fn: Fn) -> Fn:
        def one(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
            def of_floats(*fs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                full = list(leaves)
                for k, f in zip(batch.floats, fs, strict=True):
                    full[k] = f
                return tuple(fn(*full))

            pair: Any = torch.func.jvp(of_floats, tuple(leaves[k] for k in batch.floats), tangents)
            return tuple(t.to(p.dtype) for p, t in zip(pair[0], pair[1], strict=True))

        return one

    with running(name, reference=True):
        rows = [tangent_of(lambda *xs: _float_outputs(case.ref, case, xs))(*leaves) for leaves in batch.row_leaves]
    want_tangents = _stacked(rows)
    torch._dynamo.reset()
    forward = torch.compile(torch.vmap(tangent_of(floats)), backend="aot_eager", fullgraph=True)
    with running(name):
        got = forward(*batch.stacked)
    compare_tensors(case, name, list(got), want_tangents, [f"tangent of output {k}" for k in range(len(want_tangents))])
    torch._dynamo.reset()


def _stacked(rows: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The reference's rows stacked, output by output; a skip when their shapes differ."""
    if len({tuple(tuple(t.shape) for t in row) for row in rows}) > 1:
        raise Skip("the outputs' shapes differ across the batch, so no batched output exists")
    return [torch.stack(column) for column in zip(*rows, strict=True)]


def _float_outputs(fn: Fn, case: CheckCase, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    on, _ = on_leaves(fn, case, lambda x: isinstance(x, torch.Tensor))
    return [o for o in flatten(on(*leaves))[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
