"""hop.associative_scan's traced derivatives: in log depth where combine_fn is elementwise in
its carry (Note [a parallel backward for an elementwise combine]), the sequential scan's
otherwise; both equal to the derivatives of the sequential reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_associative_scan import reference_associative_scan
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.ops.scanning import _parallel_derivatives
from hop.ops.scanning.associative_scan import associative_scan_op


def linear(lhs: Any, rhs: Any) -> Any:
    return lhs[0] * rhs[0], rhs[0] * lhs[1] + rhs[1]


def complex_product(lhs: Any, rhs: Any) -> Any:
    """(re, im) pairs multiplied: each output reads both carry leaves."""
    (a, b), (c, d) = lhs, rhs
    return a * c - b * d, a * d + b * c


def ordered_pair(lhs: Any, rhs: Any) -> Any:
    """(max, the sum of everything): output 1 reads both leaves, output 0 one."""
    return torch.maximum(lhs[0], rhs[0]), lhs[1] + rhs[1] + 0 * lhs[0]


def _sigmoid(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, dtype=torch.float64) * 0.5 + 0.5


def _normal(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def _scale() -> torch.Tensor:
    return torch.tensor(0.9, dtype=torch.float64, requires_grad=True)


class Scaled:
    """``x * y * scale``: associative, with a closed-over tensor (an additional input of the node)."""


# name: (combine_fn, or Scaled, make inputs (one tuple of leaves), kwargs, parallel)
CASES: dict[str, tuple[Any, Any, dict[str, Any], bool]] = {
    "cumsum": (torch.add, lambda n: (_normal(n, 3),), {}, True),
    "cumprod": (torch.mul, lambda n: (_sigmoid(n, 3),), {}, True),
    "cummax": (torch.maximum, lambda n: (_normal(n, 3),), {"combine_mode": "generic"}, True),
    "linear": (linear, lambda n: (_sigmoid(n, 2, 3), _normal(n, 2, 3)), {}, True),
    "linear_generic": (linear, lambda n: (_sigmoid(n, 3), _normal(n, 3)), {"combine_mode": "generic"}, True),
    "linear_reverse": (linear, lambda n: (_sigmoid(n, 3), _normal(n, 3)), {"reverse": True}, True),
    "linear_dim1": (linear, lambda n: (_sigmoid(2, n), _normal(2, n)), {"dim": 1}, True),
    "complex_product": (complex_product, lambda n: (_sigmoid(n, 3), _normal(n, 3) / 2), {}, True),
    "ordered_pair": (ordered_pair, lambda n: (_normal(n, 3), _normal(n, 3)), {}, True),
    "closure": (Scaled, lambda n: (_sigmoid(n, 3),), {}, True),
    "matmul": (torch.matmul, lambda n: (_normal(n, 2, 2) / 2 + torch.eye(2),), {"combine_mode": "generic"}, False),
    "sum_then_broadcast": (
        lambda x, y: x + y + 0 * x.sum(),
        lambda n: (_normal(n, 3),),
        {"combine_mode": "generic"},
        False,
    ),
}


def _scanned(name: str, scan: Any) -> Any:
    """``fn(scale, *xs)``: the scan's outputs."""
    given, _, kwargs, _ = CASES[name]
    dim = kwargs.get("dim", 0)
    rest = {k: v for k, v in kwargs.items() if k != "dim"}

    def fn(scale: torch.Tensor, *xs: torch.Tensor) -> Any:
        combine = (lambda x, y: x * y * scale) if given is Scaled else given
        return scan(combine, xs if len(xs) > 1 else xs[0], dim, **rest)

    return fn


def _program(name: str, scan: Any) -> Any:
    """``fn(scale, *xs)``: a weighted sum of the scan's outputs."""
    scanned = _scanned(name, scan)

    def fn(scale: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        out = scanned(scale, *xs)
        leaves = out if isinstance(out, tuple) else (out,)
        return sum(((k + 1) * o.sin()).sum() for k, o in enumerate(leaves))  # type: ignore[return-value]

    return fn


def _inputs(name: str, n: int) -> tuple[torch.Tensor, ...]:
    """``(scale, *xs)``, every one requiring grad."""
    torch.manual_seed(n)
    return (_scale(), *(x.requires_grad_() for x in CASES[name][1](n)))


def _detached(name: str, n: int) -> tuple[torch.Tensor, ...]:
    return tuple(a.detach() for a in _inputs(name, n))


def _grads(fn: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(fn(*args), args, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_gradients_equal_the_sequential_scans(name: str) -> None:
    fn, ref = _program(name, hop.associative_scan), _program(name, reference_associative_scan)
    gm = make_fx(lambda *args: _grads(fn, args), tracing_mode="symbolic")(*_inputs(name, 6))
    scans = [n.target.name() for n in gm.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)]
    parallel = CASES[name][3]
    # the forward, then the backward: the forward recomputed and an associative scan of affine
    # maps, or a recompute of the carries and a reverse scan
    parallel_nodes = ["associative_scan"] * 3
    assert scans == (parallel_nodes if parallel else ["associative_scan", "scan", "scan"])
    for n in (6, 2, 9):  # a symbolic size is traced as >= 2
        args = _inputs(name, n)
        torch.testing.assert_close(gm(*args), _grads(ref, args))


@pytest.mark.parametrize("name", sorted(CASES))
def test_traced_tangents_equal_the_sequential_scans(name: str) -> None:
    def tangents(scan: Any) -> Any:
        fn = _scanned(name, scan)

        def f(*args: torch.Tensor) -> Any:
            return torch.func.jvp(fn, args, tuple(a.cos() for a in args))

        return f

    gm = make_fx(tangents(hop.associative_scan), tracing_mode="symbolic")(*_detached(name, 7))
    scans = [n.target.name() for n in gm.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)]
    assert scans == ["associative_scan", "scan"]  # forward mode: the sequential scan of the jvp
    for n in (7, 3, 2):
        args = _detached(name, n)
        torch.testing.assert_close(gm(*args), tangents(reference_associative_scan)(*args))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["linear", "complex_product", "closure", "linear_reverse", "matmul"])
def test_compiled_gradients_equal_the_sequential_scans(name: str, backend: str) -> None:
    fn, ref = _program(name, hop.associative_scan), _program(name, reference_associative_scan)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for n in (16, 5):
        args = _inputs(name, n)
        torch.testing.assert_close(_grads(compiled, args), _grads(ref, args))


def test_second_derivatives_of_the_parallel_backward() -> None:
    fn, ref = _program("linear", hop.associative_scan), _program("linear", reference_associative_scan)

    def hessian_vector(f: Any) -> Any:
        def hv(s: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
            ga, gb = torch.autograd.grad(f(s, a, b), (a, b), create_graph=True)
            return torch.autograd.grad((ga * b.cos()).sum() + (gb * a).sum(), (a, b))

        return hv

    gm = make_fx(hessian_vector(fn), tracing_mode="fake")(*_inputs("linear", 6))
    xs = _inputs("linear", 6)
    torch.testing.assert_close(gm(*xs), hessian_vector(ref)(*xs))


def test_the_carry_pattern() -> None:
    def pattern(combine: Any, *xs: torch.Tensor, pointwise: bool = True) -> Any:
        k = len(xs)

        def flat(*leaves: torch.Tensor) -> Any:  # the raw op's combine_fn takes the leaves
            lhs, rhs = leaves[:k], leaves[k:]
            return combine(lhs, rhs) if k > 1 else combine(lhs[0], rhs[0])

        return _parallel_derivatives.carry_pattern(flat, pointwise, xs, ())

    x = torch.randn(5, 3)
    assert pattern(torch.add, x) == ((True,),)
    assert pattern(linear, x, x) == ((True, False), (False, True))
    assert pattern(complex_product, x, x) == ((True, True), (True, True))
    assert pattern(ordered_pair, x, x) == ((True, False), (True, True))
    assert pattern(lambda a, b: a.flip(-1) + b, x) is None  # moves elements
    assert pattern(lambda a, b: a + a.sum(), x) is None  # mixes them
    assert pattern(lambda a, b: (a @ b).expand_as(a), x) is None
    assert pattern(lambda lhs, rhs: (lhs[0] + rhs[0], lhs[1] + rhs[1]), x, x.int()) is None  # an int leaf
    assert pattern(lambda a, b: b, x) == ((False,),)  # reads no carry: J = 0
    m = torch.randn(5, 2, 2)
    assert pattern(torch.matmul, m, pointwise=False) is None
    assert pattern(lambda lhs, rhs: (lhs[0] + rhs[0], lhs[1] + rhs[1]), x, torch.randn(5, 4)) is None  # shapes

    def writes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(b)
        out.add_(a)  # an in-place pointwise write keeps the element where it is
        return out * b

    assert pattern(writes, x) == ((True,),)

    def indexes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = b.clone()
        out[..., 0] = a[..., 1]
        return out

    assert pattern(indexes, x) is None


def test_a_parallel_node_has_the_operators_own_rules() -> None:
    """The backward's scan of affine maps is hop's raw op: its own node under tracing."""
    fn = _program("linear", hop.associative_scan)
    gm = make_fx(lambda *args: _grads(fn, args), tracing_mode="fake")(*_inputs("linear", 8))
    nodes = [n for n in gm.graph.nodes if n.target is associative_scan_op]
    assert len(nodes) == 3  # the forward, its recompute, the scan of affine maps
    assert nodes[2].args[3] == "pointwise"


def test_an_output_made_out_of_sight_keeps_the_sequential_backward() -> None:
    """A value the dependency run never saw made (a mode set aside, a wrapper's values) may
    read the carry in ways it cannot know: no pattern, never a zero entry."""
    from torch.utils._python_dispatch import _disable_current_modes

    def hidden(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            return a * b

    x = torch.randn(5, 3)
    assert _parallel_derivatives.carry_pattern(hidden, True, (x,), ()) is None
    assert _parallel_derivatives.carry_pattern(torch.mul, True, (x,), ()) == ((True,),)


@pytest.mark.parametrize("name", ["linear", "matmul"])
def test_an_output_written_in_place_before_the_backward(name: str) -> None:
    """The node saves its operands only, as before the parallel backward: a program that
    writes the scan's output in place before differentiating traces as it runs in eager."""
    scanned, ref = _scanned(name, hop.associative_scan), _scanned(name, reference_associative_scan)

    def grads(scan: Any) -> Any:
        def g(*args: torch.Tensor) -> Any:
            out = scan(*args)
            leaves = out if isinstance(out, tuple) else (out,)
            leaves[-1].mul_(2)
            return torch.autograd.grad(sum(o.sum() for o in leaves), args[1:])

        return g

    gm = make_fx(grads(scanned), tracing_mode="fake")(*_inputs(name, 6))
    torch.testing.assert_close(gm(*_inputs(name, 6)), grads(ref)(*_inputs(name, 6)))
