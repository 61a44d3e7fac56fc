"""JAX's loop controls: ``scan(..., length=, unroll=)``, ``fori_loop(..., unroll=)`` and
``map(..., batch_size=)`` give the values and gradients of the loop without them, in
eager, under torch.func transforms, make_fx and torch.export (dynamic lengths, save and
load); misuse is a HopError. Compiled and deployed: tests/compile/test_loop_controls_compile.py."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, HopValueError

W = torch.tensor([0.5, -1.0, 2.0])


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    c = torch.tanh(c * W + x)
    return c, {"y": c.sum() * x, "none": None}


def python_scan(init: torch.Tensor, xs: torch.Tensor, reverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    c, ys = init, [torch.empty(0)] * xs.shape[0]
    for i in reversed(range(xs.shape[0])) if reverse else range(xs.shape[0]):
        c, out = step(c, xs[i])
        ys[i] = out["y"]
    return c, torch.stack(ys)


def scan_of(unroll: Any, reverse: bool = False, dim: int = 0) -> Callable[..., Any]:
    def run(init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, ys = hop.scan(step, init, xs, unroll=unroll, reverse=reverse, dim=dim)
        assert ys["none"] is None
        return c, ys["y"]

    return run


def counted(i: Any, v: torch.Tensor) -> torch.Tensor:
    return v * 0.9 + torch.sin(v) * i


def python_fori(lower: int, upper: int, v: torch.Tensor) -> torch.Tensor:
    for i in range(lower, upper):
        v = counted(i, v)
    return v


def field(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a * w, lambda a: a.exp() + w, (x,))


def python_map(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([field(x, w) for x in xs])


def trace(fn: Callable[..., Any], tracing_mode: str = "real") -> Callable[..., Any]:
    """make_fx, which takes the module's constant tensors (W) as a plain trace of them would."""
    return make_fx(fn, tracing_mode=tracing_mode, _allow_non_fake_inputs=True)


XS = torch.linspace(-1, 1, 30).reshape(10, 3)
INIT = torch.tensor([0.1, 0.2, 0.3])


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("unroll", "nodes"), [(1, 1), (2, 1), (3, 2), (4, 2), (10, 0), (11, 0), (True, 0), (False, 1)])
def test_unrolled_scan_equals_the_loop(unroll: Any, nodes: int, reverse: bool) -> None:
    want = python_scan(INIT, XS, reverse)
    torch.testing.assert_close(scan_of(unroll, reverse)(INIT, XS), want)
    for mode in ("real", "symbolic"):  # a static length, a dynamic one
        traced = trace(scan_of(unroll, reverse), tracing_mode=mode)(INIT, XS)
        torch.testing.assert_close(traced(INIT, XS), want)
    if unroll is not True:  # which specializes the length, as range(n) would
        torch.testing.assert_close(traced(INIT, XS[:7]), python_scan(INIT, XS[:7], reverse))
    scans = sum(n.target is torch.ops.hop.scan for n in trace(scan_of(unroll, reverse))(INIT, XS).graph.nodes)
    # a static length: True or k >= n is the whole loop as Python; chunks, and a scan of the rest if any
    assert scans == nodes


def test_unrolled_scan_along_a_dim_and_over_pytrees() -> None:
    xs = XS.T.contiguous()
    torch.testing.assert_close(scan_of(3, dim=1)(INIT, xs), scan_of(1, dim=1)(INIT, xs))
    c, ys = scan_of(3, dim=-1)(INIT, xs)
    torch.testing.assert_close((c, ys.T), python_scan(INIT, XS))

    def pair(c: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return c + x["a"] * x["b"], (c, x["a"])

    tree = {"a": torch.randn(7, 2), "b": torch.randn(7, 2)}
    for reverse in (False, True):
        torch.testing.assert_close(
            hop.scan(pair, torch.zeros(2), tree, unroll=3, reverse=reverse),
            hop.scan(pair, torch.zeros(2), tree, reverse=reverse),
        )


@pytest.mark.parametrize("unroll", [1, 3, True])
def test_unrolled_scan_differentiates(unroll: Any) -> None:
    init, xs = INIT.clone().requires_grad_(), XS.clone().requires_grad_()
    c, ys = scan_of(unroll, reverse=True)(init, xs)
    got = torch.autograd.grad((c.sum() + (ys * ys).sum()), (init, xs))
    c, ys = python_scan(init, xs, reverse=True)
    want = torch.autograd.grad((c.sum() + (ys * ys).sum()), (init, xs))
    torch.testing.assert_close(got, want)
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda i: scan_of(unroll)(i, XS)[1].sum()  # noqa: E731
    torch.testing.assert_close(
        torch.func.grad(loss)(INIT), torch.func.grad(lambda i: python_scan(i, XS)[1].sum())(INIT)
    )
    tangent = torch.ones(3)
    torch.testing.assert_close(
        torch.func.jvp(lambda i: scan_of(unroll)(i, XS), (INIT,), (tangent,)),
        torch.func.jvp(lambda i: python_scan(i, XS), (INIT,), (tangent,)),
    )
    batch = torch.stack([XS, XS * 2, -XS])
    torch.testing.assert_close(
        torch.vmap(scan_of(unroll), in_dims=(None, 0))(INIT, batch),
        tuple(torch.stack(col) for col in zip(*[python_scan(INIT, b) for b in batch], strict=True)),
    )


def test_scan_with_no_xs_runs_length_steps() -> None:
    seen = []

    def grow(c: torch.Tensor, x: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x)
        return c * 2 + 1, c.sum()

    for unroll in (1, 2, True):
        c, ys = hop.scan(grow, torch.ones(2), None, length=5, unroll=unroll)
        torch.testing.assert_close(c, torch.full((2,), 63.0))
        torch.testing.assert_close(ys, torch.tensor([2.0, 6.0, 14.0, 30.0, 62.0]))
    assert all(x is None for x in seen)
    c, ys = hop.scan(lambda c, x: (c + len(x), c), torch.zeros(()), (), length=3)
    torch.testing.assert_close(ys, torch.tensor([0.0, 0.0, 0.0]))
    c, ys = hop.scan(grow, torch.ones(2), None, length=0)
    torch.testing.assert_close(c, torch.ones(2))
    assert ys.shape == (0,)
    c, ys = hop.scan(lambda c, x: (c + 1, c * torch.ones(2)), torch.zeros(()), None, length=3, dim=1)
    assert ys.shape == (2, 3)
    xs_len = hop.scan(grow, torch.ones(2), torch.ones(5, 1), length=5)  # length equal to xs's: accepted
    assert xs_len[1].shape == (5,)
    traced = trace(lambda c: hop.scan(grow, c, None, length=5, unroll=2))(torch.ones(2))
    torch.testing.assert_close(traced(torch.ones(2))[0], torch.full((2,), 63.0))


@pytest.mark.parametrize("batch_size", [1, 3, 5, 10, 16])
def test_batched_map_equals_the_map(batch_size: int) -> None:
    w = torch.tensor([1.0, 2.0, -1.0])
    want = python_map(XS, w)
    torch.testing.assert_close(hop.map(field, XS, w, batch_size=batch_size), want)
    traced = trace(lambda xs, w: hop.map(field, xs, w, batch_size=batch_size), tracing_mode="symbolic")(XS, w)
    torch.testing.assert_close(traced(XS, w), want)
    wr = w.clone().requires_grad_()
    got = torch.autograd.grad(hop.map(field, XS, wr, batch_size=batch_size).sum(), wr)
    torch.testing.assert_close(got, torch.autograd.grad(python_map(XS, wr).sum(), wr))


def test_batched_map_takes_int_args_and_pytrees() -> None:
    def f(x: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x["a"] * k, x["b"].sum()

    xs = {"a": torch.randn(7, 2), "b": torch.randn(7, 4)}
    torch.testing.assert_close(hop.map(f, xs, 3, batch_size=2), hop.map(f, xs, 3))


@pytest.mark.parametrize(("unroll", "nodes"), [(1, 1), (2, 2), (3, 2), (7, 0), (9, 0), (True, 0)])
def test_unrolled_fori_loop_equals_the_loop(unroll: Any, nodes: int) -> None:
    want = python_fori(2, 9, INIT)
    torch.testing.assert_close(hop.fori_loop(2, 9, counted, INIT, unroll=unroll), want)
    traced = trace(lambda v: hop.fori_loop(2, 9, counted, v, unroll=unroll), tracing_mode="symbolic")(INIT)
    torch.testing.assert_close(traced(INIT), want)
    loops = sum(n.target is torch.ops.hop.while_loop for n in traced.graph.nodes)
    assert loops == nodes
    if unroll is not True:
        lo, hi = torch.tensor(2), torch.tensor(9)
        torch.testing.assert_close(hop.fori_loop(lo, hi, counted, INIT, unroll=unroll), want)
        traced = trace(lambda lo, hi, v: hop.fori_loop(lo, hi, counted, v, unroll=unroll))(lo, hi, INIT)
        for a, b in ((2, 9), (4, 4), (5, 2), (0, 3)):
            torch.testing.assert_close(traced(torch.tensor(a), torch.tensor(b), INIT), python_fori(a, b, INIT))
    v = INIT.clone().requires_grad_()
    got = torch.autograd.grad(
        hop.fori_loop(torch.tensor(2), 9, counted, v, unroll=2 if unroll is True else unroll).sum(), v
    )
    torch.testing.assert_close(got, torch.autograd.grad(python_fori(2, 9, v).sum(), v))


def test_unrolled_fori_loop_vmaps_over_bounds() -> None:
    uppers = torch.tensor([3, 0, 8, 5])
    got = torch.vmap(lambda u: hop.fori_loop(0, u, counted, INIT, unroll=3))(uppers)
    torch.testing.assert_close(got, torch.stack([python_fori(0, int(u), INIT) for u in uppers]))


class Controls(torch.nn.Module):
    """Each control over the length of ``xs``, dynamic in export."""

    def forward(self, init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, ys = scan_of(3, reverse=True)(init, xs)
        n = xs.shape[0]
        v = hop.fori_loop(0, n, counted, c, unroll=2)
        mapped = hop.map(field, xs, W, batch_size=4)
        _, ticks = hop.scan(lambda c, _: (c + 1, c * 2), init, None, length=n, unroll=2)
        return c, ys, v, mapped, ticks


def python_controls(init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c, ys = python_scan(init, xs, reverse=True)
    ticks = torch.stack([init + i for i in range(xs.shape[0])]) * 2
    return c, ys, python_fori(0, xs.shape[0], c), python_map(xs, W), ticks


@pytest.mark.parametrize("strict", [False, True])
def test_exported_controls_keep_a_dynamic_length(strict: bool) -> None:
    n = torch.export.Dim("n", min=2, max=64)
    ep = torch.export.export(Controls(), (INIT, XS), dynamic_shapes=({}, {0: n}), strict=strict)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    decomposed = ep.run_decompositions()
    for length in (10, 12, 2, 7):  # remainders of every size
        xs = torch.linspace(-2, 1, 3 * length).reshape(length, 3)
        want = python_controls(INIT, xs)
        for program in (ep, loaded, decomposed):
            torch.testing.assert_close(program.module()(INIT, xs), want)


class _Ticks(torch.nn.Module):
    def forward(self, init: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return hop.scan(lambda c, _: (c + 1, c * 2), init, None, length=xs.shape[0], unroll=2)[1]


@pytest.mark.parametrize("strict", [False, True])
def test_a_dynamic_length_without_xs_down_to_one(strict: bool) -> None:
    n = torch.export.Dim("n", min=1, max=64)
    ep = torch.export.export(_Ticks(), (INIT, XS), dynamic_shapes=({}, {0: n}), strict=strict)
    for length in (1, 5, 9):
        want = torch.stack([(INIT + i) * 2 for i in range(length)])
        torch.testing.assert_close(ep.module()(INIT, XS[:1].expand(length, 3)), want)


def test_unroll_true_specializes_a_dynamic_length() -> None:
    # the whole loop as Python, as range(n) would: torch's export says the length became a constant
    n = torch.export.Dim("n", min=2, max=64)
    with pytest.raises(Exception, match=r"Constraints violated \(n\)"):
        torch.export.export(_WholeScan(), (INIT, XS), dynamic_shapes=({}, {0: n}))


class _WholeScan(torch.nn.Module):
    def forward(self, init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return scan_of(True)(init, xs)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: hop.scan(step, INIT, XS, unroll=0), HopValueError, "unroll must be at least 1"),
        (lambda: hop.scan(step, INIT, XS, unroll=2.0), HopTypeError, "unroll must be an int or a bool"),
        (lambda: hop.scan(step, INIT, None, length=-1), HopValueError, "length must be at least 0"),
        (lambda: hop.scan(step, INIT, None, length=torch.tensor(3)), HopTypeError, "length must be an int"),
        (lambda: hop.scan(step, INIT, XS, length=4), HopValueError, "length=4 but xs has length 10"),
        (lambda: hop.map(field, XS, W, batch_size=0), HopValueError, "batch_size must be at least 1"),
        (lambda: hop.map(field, XS, W, batch_size=True), HopTypeError, "batch_size must be an int"),
        (lambda: hop.fori_loop(0, torch.tensor(3), counted, INIT, unroll=True), HopValueError, "Python-int bounds"),
        (lambda: hop.fori_loop(0, 3, counted, INIT, unroll=-2), HopValueError, "unroll must be at least 1"),
        (lambda: hop.scan(lambda c, x: (c,), INIT, XS, unroll=3), HopTypeError, "combine_fn must return a"),
        (lambda: hop.scan(lambda c, x: (c[:2], c), INIT, XS, unroll=True), hop.errors.OutputMismatchError, "init"),
    ],
)
def test_misused_controls_name_the_operator(call: Callable[[], Any], error: type, words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        call()
    assert str(caught.value).startswith("hop.")


def _scan_program(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.scan(lambda c, xi: (torch.tanh(c * 0.9 + xi), c * xi), x[0] * 0, x, unroll=3, reverse=True)


def _length_program(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.scan(lambda c, _: (c * 0.5 + y, c.sum()), x[0], None, length=4, unroll=3)


def _map_program(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.map(lambda r, w: hop.cond(r.sum() > 0, lambda a: a * w, lambda a: a.sin(), (r,)), x, y, batch_size=2)


def _fori_program(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.fori_loop(0, 5, lambda i, v: v * 0.9 + y * i, x[0], unroll=2)


CONTROLLED = [_scan_program, _length_program, _map_program, _fori_program]


@pytest.mark.parametrize("program", CONTROLLED, ids=lambda p: p.__name__.strip("_"))
def test_controls_pass_every_transform_check(program: Callable[..., Any]) -> None:
    # hop.testing's default transforms: autograd, gradcheck, jvp, vmap and their
    # compositions, fake tensors, make_fx, export; against the reference semantics
    # (hop.testing.reference(), under which a control changes nothing)
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    hop.testing.check(program, x, y)
