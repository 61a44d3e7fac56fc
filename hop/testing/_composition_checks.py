"""The checks of transform compositions: ``vmap_grad``, ``grad_vmap``, ``vmap_jvp``,
``jvp_vmap``, and (opt-in, compiled) ``compile_inductor_vmap``, ``compile_compositions``
and ``export_compositions``; the batched reference ``export_vmap`` reads.

Each batches ``batch_size`` perturbed copies of the arguments, as ``vmap`` does, and
compares with the reference run row by row: ``vmap_grad`` the per-row gradient taken
inside the vmap (``vmap(grad(f))``, per-example gradients), ``grad_vmap`` the gradient
of the batched program taken outside it (how a batch is trained: an element's
gradient must not see a branch or a step that element did not take), ``vmap_jvp``
forward mode inside the vmap, ``jvp_vmap`` forward mode outside it (the tangents
batched too). The gradient is of the float outputs weighted by seeded cotangents,
with respect to the float inputs; the tangents are seeded, one per float input, the
same for every row.

The compiled checks run the same compositions (and ``jvp`` of one row) through
``torch.compile(fullgraph=True)`` with aot_eager and Inductor, dynamic and static, and
through ``torch.export`` (strict and non-strict, saved and loaded) and an AOTInductor
package. torch's export cannot trace ``torch.func.grad`` (non-strict: "Cannot access
data pointer"; strict leaves functorch's interpreter stack behind) nor a ``jvp``
under ``vmap``, and its ONNX exporter cannot convert a ``jvp``, even of a plain
program (torch 2.13-2.15): those pairs are not checked, since no program could pass them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hop._pytree import flatten
from hop.testing._case import (
    CheckCase,
    CheckFailure,
    Fn,
    ProgramModule,
    Skip,
    arg_leaves,
    compare_tensors,
    limitation,
    on_leaves,
    perturbed,
    reference,
    roundtrip,
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
        first = self.row_leaves[0]
        gen = case.generator(-4)
        self.tangents = tuple(torch.randn(first[k].shape, generator=gen, dtype=first[k].dtype) for k in self.floats)
        # jvp outside the vmap: each row's tangent, the same for every row
        self.batched_tangents = tuple(torch.stack([t] * case.batch_size) for t in self.tangents)


def _scalar(fn: Fn, case: CheckCase, name: str, cotangents: list[torch.Tensor], *, is_reference: bool = False) -> Fn:
    """``fn`` (of the tensor leaves) reduced to one number: its float outputs weighted by
    ``cotangents`` (the reference's, made by ``_Wants.grads``)."""
    outputs = _float_outputs_of(fn, case)

    def s(*xs: Any) -> torch.Tensor:
        outs = outputs(*xs)
        if not outs:
            raise Skip("no floating-point outputs")
        if len(cotangents) != len(outs) or any(c.shape != o.shape for c, o in zip(cotangents, outs, strict=False)):
            if is_reference:
                raise Skip("the outputs' shapes differ across the batch, so no batched output exists")
            raise CheckFailure(name, "the float outputs differ from the reference's in number or shape")
        return _weighted(outs, cotangents)

    return s


def _weighted(outs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum(((o * c).sum() for o, c in zip(outs, cotangents, strict=True)), torch.zeros((), dtype=outs[0].dtype))


def _float_outputs_of(fn: Fn, case: CheckCase) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn`` as a function of the tensor leaves of the arguments, returning its float outputs."""
    on, _ = on_leaves(fn, case, lambda x: isinstance(x, torch.Tensor))
    return lambda *xs: tuple(o for o in flatten(on(*xs))[0] if isinstance(o, torch.Tensor) and o.is_floating_point())


def _tangents_of(outputs: Fn, floats: tuple[int, ...], tangents: tuple[torch.Tensor, ...]) -> Fn:
    """A function of the tensor leaves: the tangents of ``outputs`` along ``tangents``
    (one per float leaf), by ``torch.func.jvp``."""

    def one(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def of_floats(*fs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(leaves)
            for k, f in zip(floats, fs, strict=True):
                full[k] = f
            return tuple(outputs(*full))

        pair: Any = torch.func.jvp(of_floats, tuple(leaves[k] for k in floats), tangents)
        # torch's forward AD gives a 0-dim output a float64 tangent where a Python float
        # took part (``x * 0.5``), and a batched one its primal's dtype: compare in the primal's
        return tuple(t.to(p.dtype) for p, t in zip(pair[0], pair[1], strict=True))

    return one


# The compositions: (name, program of the stacked leaves or of one row's) built from the
# program's float outputs, its weighted sum, and the batch.
def _compositions(outputs: Fn, s: Fn, batch: _Batch) -> dict[str, tuple[Fn, list[torch.Tensor]]]:
    floats = batch.floats
    vmap_grad = torch.vmap(torch.func.grad(s, argnums=floats))

    def grad_vmap(*b: torch.Tensor) -> Any:
        return torch.func.grad(lambda *c: torch.vmap(s)(*c).sum(), argnums=floats)(*b)

    return {
        "vmap_grad": (vmap_grad, batch.stacked),
        "grad_vmap": (grad_vmap, batch.stacked),
        "vmap_jvp": (torch.vmap(_tangents_of(outputs, floats, batch.tangents)), batch.stacked),
        "jvp_vmap": (_tangents_of(torch.vmap(outputs), floats, batch.batched_tangents), batch.stacked),
        # torch.compile cannot trace torch.func.jvp of a primal that is not contiguous
        # (dynamic shapes; an expanded one even static), in a plain program either
        # ("Cannot call storage_offset() on tensor with symbolic sizes"): the row is
        # given as a fresh contiguous copy (an offset counts too); the other paths check the layouts
        "jvp": (
            _tangents_of(outputs, floats, batch.tangents),
            [x.clone(memory_format=torch.contiguous_format) for x in batch.row_leaves[0]],
        ),
    }


class _Wants:
    """The reference's answers row by row, made when first asked for: the gradients of the
    weighted outputs, and the tangents (stacked), with their paths."""

    def __init__(self, case: CheckCase, name: str, batch: _Batch) -> None:
        self.case, self.name, self.batch = case, name, batch
        self.cotangents: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] | None = None
        self._tangents: list[torch.Tensor] | None = None

    def grads(self) -> list[torch.Tensor]:
        if self._grads is None:
            batch, case = self.batch, self.case
            # made here, outside every transform: a tensor made inside torch.func.grad is
            # its wrapper, which has no storage once the transform returns (Inductor reads it)
            with running(self.name, reference=True):
                outs = _float_outputs_of(case.ref, case)(*batch.row_leaves[0])
            if not outs:
                raise Skip("no floating-point outputs")
            gen = case.generator(-3)
            self.cotangents[:] = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
            s = _scalar(case.ref, case, self.name, self.cotangents, is_reference=True)
            with running(self.name, reference=True):
                rows = [torch.func.grad(s, argnums=batch.floats)(*leaves) for leaves in batch.row_leaves]
            self._grads = [torch.stack(column) for column in zip(*rows, strict=True)]
        return self._grads

    def tangents(self) -> list[torch.Tensor]:
        if self._tangents is None:
            batch, outputs = self.batch, _float_outputs_of(self.case.ref, self.case)
            one = _tangents_of(outputs, batch.floats, batch.tangents)
            with running(self.name, reference=True):
                rows = [one(*leaves) for leaves in batch.row_leaves]
            if not rows[0]:
                raise Skip("no floating-point outputs")
            self._tangents = _stacked(rows)
        return self._tangents

    def of(self, composition: str) -> tuple[list[torch.Tensor], list[str]]:
        if composition in ("vmap_grad", "grad_vmap"):
            return self.grads(), self.batch.paths
        tangents = self.tangents()
        paths = [f"tangent of output {k}" for k in range(len(tangents))]
        return ([t[0] for t in tangents] if composition == "jvp" else tangents), paths


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


def _check_eager(case: CheckCase, name: str) -> None:
    batch = _Batch(case)
    wants = _Wants(case, name, batch)
    want, paths = wants.of(name)
    s = _scalar(case.fn, case, name, wants.cotangents)
    program, inputs = _compositions(_float_outputs_of(case.fn, case), s, batch)[name]
    got = _batched(name, lambda: program(*inputs), lambda: program(*inputs))
    compare_tensors(case, name, list(got), want, paths)


def check_vmap_grad(case: CheckCase) -> None:
    _check_eager(case, "vmap_grad")


def check_grad_vmap(case: CheckCase) -> None:
    _check_eager(case, "grad_vmap")


def check_vmap_jvp(case: CheckCase) -> None:
    _check_eager(case, "vmap_jvp")


def check_jvp_vmap(case: CheckCase) -> None:
    _check_eager(case, "jvp_vmap")


def _traced_outputs(traceable: Fn) -> Fn:
    """``traceable`` (of the tensor leaves, in a form Dynamo traces) returning its float outputs."""
    import torch.utils._pytree as py_pytree  # Dynamo traces torch's Python pytree, not hop's

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:
        leaves = py_pytree.tree_leaves(traceable(*xs))
        return tuple(o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point())

    return floats


def compile_vmap(case: CheckCase, traceable: Fn) -> None:
    """``torch.compile(torch.vmap(fn), backend="inductor")``: the batched outputs, and the
    gradient taken outside the vmap, against the reference row by row. ``traceable``:
    ``fn`` of the tensor leaves in a form Dynamo traces."""
    batch = _Batch(case)
    _, want = batched_reference(case, "compile_inductor_vmap", batch)
    wants = _Wants(case, "compile_inductor_vmap", batch)
    torch._dynamo.reset()
    compiled = torch.compile(torch.vmap(_traced_outputs(traceable)), backend="inductor", fullgraph=True, dynamic=True)
    inputs = [x.detach().clone().requires_grad_(k in batch.floats) for k, x in enumerate(batch.stacked)]
    with running("compile_inductor_vmap"):
        out = list(compiled(*inputs))
    compare_tensors(
        case, "compile_inductor_vmap", [o.detach() for o in out], want, [f"output {k}" for k in range(len(want))]
    )
    if not any(o.requires_grad for o in out):
        return
    want_grads = wants.grads()
    total = _weighted(out, wants.cotangents)
    with running("compile_inductor_vmap"):
        got = torch.autograd.grad(total, [inputs[k] for k in batch.floats], allow_unused=True, materialize_grads=True)
    compare_tensors(case, "compile_inductor_vmap", list(got), want_grads, batch.paths)


def batched_reference(
    case: CheckCase, name: str, batch: _Batch | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The batch's stacked tensor inputs, and the reference's float outputs row by row, stacked."""
    batch = _Batch(case) if batch is None else batch
    outputs = _float_outputs_of(case.ref, case)
    with running(name, reference=True):
        rows = [list(outputs(*leaves)) for leaves in batch.row_leaves]
    if not rows[0]:
        raise Skip("no floating-point outputs")
    return batch.stacked, _stacked(rows)


# (backend, dynamic) pairs compile_compositions compiles each composition with
_BACKENDS = (("aot_eager", True), ("inductor", True), ("inductor", False))


def compile_compositions(case: CheckCase, traceable: Fn) -> None:
    """Every composition (``vmap_grad``, ``grad_vmap``, ``vmap_jvp``, ``jvp_vmap``, and
    ``jvp`` of one row) compiled with ``fullgraph=True`` by aot_eager and by Inductor,
    dynamic and static, against the reference row by row."""
    name = "compile_compositions"
    batch = _Batch(case)
    wants = _Wants(case, name, batch)
    outputs = _traced_outputs(traceable)

    def s(*xs: Any) -> torch.Tensor:
        return _weighted(outputs(*xs), wants.cotangents)

    for composition, (program, inputs) in _compositions(outputs, s, batch).items():
        want, paths = wants.of(composition)
        for backend, dynamic in _BACKENDS:
            where = f"{composition}, {backend}{'' if dynamic else ' static'}"
            torch._dynamo.reset()
            compiled = torch.compile(program, backend=backend, fullgraph=True, dynamic=dynamic)
            with _where(where), running(name):
                got = compiled(*inputs)
            compare_tensors(case, name, list(got), want, [f"{p} ({where})" for p in paths])
    torch._dynamo.reset()


def export_compositions(case: CheckCase, traceable: Fn, in_fresh_process: Fn) -> None:
    """``jvp`` of one row (what torch's export can trace of the compositions) exported
    non-strict and strict, each saved and loaded, and as an AOTInductor package run by
    ``in_fresh_process``, against the reference."""
    name = "export_compositions"
    batch = _Batch(case)
    wants = _Wants(case, name, batch)
    want, paths = wants.of("jvp")
    outputs = _traced_outputs(traceable)
    program, inputs = _compositions(outputs, outputs, batch)["jvp"]  # jvp takes no weighted sum
    module = ProgramModule(program, case.fn)
    for strict in (False, True):
        with _where(f"jvp, export strict={strict}"), running(name):
            ep = torch.export.export(module, tuple(inputs), strict=strict)
            got = list(roundtrip(ep).module()(*inputs))
        compare_tensors(case, name, got, want, [f"{p} (jvp, export strict={strict})" for p in paths])
    with _where("jvp, AOTInductor"), running(name):
        ep = torch.export.export(module, tuple(inputs))
        (got,) = in_fresh_process(ep, [list(inputs)])
    compare_tensors(case, name, list(got), want, [f"{p} (jvp, AOTInductor)" for p in paths])


@contextlib.contextmanager
def _where(where: str) -> Iterator[None]:
    """A failure inside says which composition and path it came from."""
    try:
        yield
    except CheckFailure as e:
        raise CheckFailure(e.transform, f"{where}: {str(e).split(': ', 2)[-1]}", path=e.path) from e.__cause__


def _stacked(rows: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The reference's rows stacked, output by output; a skip when their shapes differ."""
    if len({tuple(tuple(t.shape) for t in row) for row in rows}) > 1:
        raise Skip("the outputs' shapes differ across the batch, so no batched output exists")
    return [torch.stack(column) for column in zip(*rows, strict=True)]
