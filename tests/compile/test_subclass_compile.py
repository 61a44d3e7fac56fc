"""Tensor subclasses in compiled and exported programs (Note [subclass operands desugared]
in hop._subclasses): a node over traceable wrapper subclasses runs on their inner
tensors, its outputs rebuilt; what cannot keep its meaning is a named refusal."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.exc import BackendCompilerFailed
from torch.testing._internal.two_tensor import TwoTensor

import hop

BACKENDS = ["aot_eager", "inductor"]


def _two(*shape: int) -> TwoTensor:
    return TwoTensor(torch.randn(*shape), torch.randn(*shape))


def _close(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, TwoTensor):
        torch.testing.assert_close(got.a, want.a)
        torch.testing.assert_close(got.b, want.b)
    else:
        torch.testing.assert_close(got, want)


def _compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cond_over_a_two_tensor_operand_and_closure(backend: str) -> None:
    w = _two(3, 3)

    def f(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(p, lambda v: v @ w, lambda v: (v * 2) @ w, (x,))

    x = _two(2, 3)
    for p in (torch.tensor(True), torch.tensor(False)):
        _close(_compiled(f, backend)(p, x), f(p, x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_loops_over_two_tensor_carries(backend: str) -> None:
    w = _two(3, 3) * 0.5

    def loops(n: torch.Tensor, x: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, y = hop.while_loop(lambda i, a: i < n, lambda i, a: (i + 1, a @ w), (torch.tensor(0), x))
        c, ys = hop.scan(lambda c, r: (c + r.sum(), r * 2), x, xs)  # plain xs, a TwoTensor carry
        z = hop.fori_loop(0, 3, lambda i, a: a * 1.5, x)
        return y, c, ys, z

    x, xs = _two(2, 3), torch.randn(4, 2)
    for got, want in zip(_compiled(loops, backend)(torch.tensor(3), x, xs), loops(torch.tensor(3), x, xs), strict=True):
        _close(got, want)


def _raises_named(fn: Callable[..., Any], *args: Any, match: str) -> None:
    with pytest.raises((hop.errors.CompileUnsupported, BackendCompilerFailed), match=match):
        _compiled(fn, "aot_eager")(*args)


def test_what_cannot_keep_its_meaning_is_refused_by_name() -> None:
    x = _two(2, 3)
    _raises_named(  # which of its inner tensors is a TwoTensor predicate's value?
        lambda x: hop.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,)),
        x,
        match=r"hop\.cond: traced with a TwoTensor selector",
    )
    _raises_named(
        lambda xs: hop.scan(lambda c, r: (c + r, r), torch.zeros(3), xs), _two(4, 3), match=r"hop\.scan: .*xs"
    )
    _raises_named(
        lambda p, x: hop.cond(p, lambda v: v * 2, lambda v: torch.zeros(2, 3), (x,)),
        torch.tensor(True),
        x,
        match=r"hop\.cond: traced with branches that return different tensor subclasses \(true_fn and false_fn\)",
    )


def test_an_exported_two_tensor_program_runs() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(_two(3, 3))

        def forward(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return hop.cond(p, lambda v: v @ self.w, lambda v: v * 2, (x,))

    model, x = Model(), _two(2, 3)
    ep = torch.export.export(model, (torch.tensor(True), x))
    for p in (torch.tensor(True), torch.tensor(False)):
        _close(ep.module()(p, x), model(p, x))


# --- a weight-only quantized Linear read by a branch (torchao) ------------------------------


@pytest.fixture
def quantized() -> Any:
    torchao = pytest.importorskip("torchao", reason="torchao is in hop's dev extras (pinned)")
    del torchao
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big, self.small = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return hop.cond(x.sum() > 0, lambda v: self.big(v).relu(), lambda v: self.small(v) * 0.5, (x,))

    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, Int8WeightOnlyConfig())
    assert type(model.big.weight).__name__ != "Parameter"  # a quantized subclass
    return model


def _both_branches() -> list[torch.Tensor]:
    return [torch.randn(4, 16).abs(), -torch.randn(4, 16).abs()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_quantized_linear_in_a_branch_compiles(quantized: Any, backend: str) -> None:
    compiled = _compiled(quantized, backend)
    for x in _both_branches():
        torch.testing.assert_close(compiled(x), quantized(x))


def test_a_quantized_linear_in_a_branch_exports_and_deploys(quantized: Any) -> None:
    xs = _both_branches()
    ep = torch.export.export(quantized, (xs[0],))
    decomposed = ep.run_decompositions()
    with tempfile.TemporaryDirectory() as d:
        package = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/quantized.pt2")
        )
        for x in xs:
            want = quantized(x)
            torch.testing.assert_close(ep.module()(x), want)
            torch.testing.assert_close(decomposed.module()(x), want)
            torch.testing.assert_close(package(x), want)


# --- DTensor under torch.compile (one rank: the sharding logic, no communication) ------------


@pytest.fixture
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtensor_operands_carries_and_predicates_compile(mesh: Any, backend: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(3, 3) * 0.5, mesh, [Replicate()])

    def f(x: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = hop.cond(x.sum() > 0, lambda a: a @ w, lambda a: a * 2, (x,))  # a DTensor predicate: its full value
        _, z = hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a @ w), (torch.tensor(0), y))
        c, ys = hop.scan(lambda c, r: (c @ w + r.sum(), r * 2), z, xs)  # a DTensor carry, plain xs
        m = hop.switch(torch.tensor(1), [lambda a: a, lambda a: a @ w], (c,))
        return y, z, c, m, ys

    xs = torch.randn(5, 2)
    for got, want in zip(_compiled(f, backend)(x, xs), f(x, xs), strict=True):
        if isinstance(want, torch.Tensor) and type(want) is torch.Tensor:
            torch.testing.assert_close(got, want)
            continue
        assert got.placements == want.placements
        torch.testing.assert_close(got.full_tensor(), want.full_tensor())


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_flow_to_a_two_tensor_parameter(backend: str) -> None:
    w = torch.nn.Parameter(_two(3, 3))

    def f(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(p, lambda v: v @ w, lambda v: (v * 2) @ w, (x,))

    x, compiled = _two(2, 3), _compiled(f, backend)
    for p in (torch.tensor(True), torch.tensor(False)):
        (got,) = torch.autograd.grad(compiled(p, x).sum(), w)
        (want,) = torch.autograd.grad(f(p, x).sum(), w)
        _close(got, want)


@pytest.mark.parametrize("trips", [0, 3])
def test_a_raw_loop_over_a_two_tensor_carry_runs_any_number_of_steps(trips: int) -> None:
    """The raw op called with real subclass values (as ``ep.module()`` does): a loop of no
    step returns its carries, not a refusal for a body that never ran."""
    from hop.ops.while_loops.while_loop import while_loop_op

    x = TwoTensor(torch.ones(3), torch.ones(3) * 2)
    out = while_loop_op(lambda i, a: i < trips, lambda i, a: (i + 1, a * 2), (torch.tensor(0), x), ())
    _close(out[1], TwoTensor(x.a * 2**trips, x.b * 2**trips))
