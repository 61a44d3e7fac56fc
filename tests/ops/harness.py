"""The shared harness every operator's program table runs through.

Each check compares a hop program against its plain-Python reference under one
column of the transform matrix (docs/design.md).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

Fn = Callable[..., Any]


def assert_close(actual: Any, expected: Any) -> None:
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"structure {a_spec} vs {e_spec}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        torch.testing.assert_close(a, e)


def check_eager(fn: Fn, ref: Fn, inputs: Sequence[tuple[Any, ...]]) -> None:
    for args in inputs:
        assert_close(fn(*args), ref(*args))


def _float_args(args: tuple[Any, ...]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _with_grad(args: tuple[Any, ...]) -> tuple[Any, ...]:
    idx = _float_args(args)
    return tuple(a.detach().double().requires_grad_() if i in idx else a for i, a in enumerate(args))


def check_autograd(fn: Fn, ref: Fn, inputs: Sequence[tuple[Any, ...]]) -> None:
    """Gradients equal the reference's; gradcheck and gradgradcheck in float64."""
    for args in inputs:
        _check_autograd_one(fn, ref, _with_grad(args))


def _check_autograd_one(fn: Fn, ref: Fn, args: tuple[Any, ...]) -> None:
    diff = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def scalar(f: Fn) -> torch.Tensor:
        out = pytree.tree_leaves(f(*args))
        floats = [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return sum((o * (k + 1)).sum() for k, o in enumerate(floats))  # type: ignore[return-value]

    got = torch.autograd.grad(scalar(fn), diff, allow_unused=True)
    want = torch.autograd.grad(scalar(ref), diff, allow_unused=True)
    for a, g, w in zip(diff, got, want, strict=True):
        zero = torch.zeros_like(a)
        torch.testing.assert_close(zero if g is None else g, zero if w is None else w)

    def flat(*xs: Any) -> tuple[torch.Tensor, ...]:
        it = iter(xs)
        full = [next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        return tuple(o for o in pytree.tree_leaves(fn(*full)) if isinstance(o, torch.Tensor) and o.is_floating_point())

    assert torch.autograd.gradcheck(flat, tuple(diff))
    assert torch.autograd.gradgradcheck(flat, tuple(diff))


def check_jvp(fn: Fn, ref: Fn, inputs: Sequence[tuple[Any, ...]]) -> None:
    """torch.func.jvp equals the reference's (the reference is plain Python)."""
    for args in inputs:
        _check_jvp_one(fn, ref, args)


def _check_jvp_one(fn: Fn, ref: Fn, args: tuple[Any, ...]) -> None:
    idx = _float_args(args)
    primals = tuple(args[i].double() for i in idx)
    tangents = tuple(torch.randn_like(p) for p in primals)

    def on(f: Fn) -> Fn:
        def g(*ps: torch.Tensor) -> Any:
            full = list(args)
            for i, p in zip(idx, ps, strict=True):
                full[i] = p
            return tuple(o for o in pytree.tree_leaves(f(*full)) if isinstance(o, torch.Tensor))

        return g

    got = torch.func.jvp(on(fn), primals, tangents)
    want = torch.func.jvp(on(ref), primals, tangents)
    assert_close(got, want)


def _tensors_only(f: Fn) -> Fn:
    def g(*args: Any) -> tuple[torch.Tensor, ...]:  # torch.vmap returns tensors only
        return tuple(o for o in pytree.tree_leaves(f(*args)) if isinstance(o, torch.Tensor))

    return g


def check_vmap(fn: Fn, ref: Fn, batched: tuple[Any, ...], in_dims: tuple[int | None, ...]) -> None:
    """torch.vmap of the hop program equals a Python loop of the reference over the batch."""
    size = next(a.shape[d] for a, d in zip(batched, in_dims, strict=True) if d is not None)
    got = torch.vmap(_tensors_only(fn), in_dims=in_dims)(*batched)
    rows = [
        _tensors_only(ref)(*[a if d is None else a.select(d, b) for a, d in zip(batched, in_dims, strict=True)])
        for b in range(size)
    ]
    want = pytree.tree_map(lambda *xs: torch.stack(xs), *rows) if size else None
    assert_close(got, want)


def check_make_fx(
    fn: Fn,
    op: Any,
    trace_args: tuple[Any, ...],
    inputs: Sequence[tuple[Any, ...]],
    modes: Sequence[str] = ("real", "fake", "symbolic"),
) -> None:
    """make_fx in real, fake and symbolic modes keeps ``op`` and matches eager on every input."""
    for mode in modes:
        gm = make_fx(fn, tracing_mode=mode)(*trace_args)
        assert any(n.target is op for n in gm.graph.nodes), f"{mode}: {op} not in\n{gm.code}"
        for args in inputs:
            assert_close(gm(*args), fn(*args))


def roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def check_export(
    module: torch.nn.Module,
    op: Any,
    trace_args: tuple[Any, ...],
    inputs: Sequence[tuple[Any, ...]],
    dynamic_shapes: Any = None,
) -> torch.export.ExportedProgram:
    """torch.export keeps ``op``; ep.module(), run_decompositions() and save/load match eager."""
    ep = torch.export.export(module, trace_args, dynamic_shapes=dynamic_shapes)
    assert any(n.target is op for n in ep.graph.nodes), ep.graph_module.code
    programs = [ep, ep.run_decompositions(), roundtrip(ep)]
    assert any(n.target is op for n in programs[2].graph.nodes)
    for args in inputs:
        want = module(*args)
        for program in programs:
            assert_close(program.module()(*args), want)
    return ep


class OpCounts(torch.utils._python_dispatch.TorchDispatchMode):
    """How many times each aten op (by overload packet name) runs while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
