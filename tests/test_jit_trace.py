"""torch.jit.trace around hop: a traced program runs and differentiates as eager.

On real tensors hop's rules run the callables inline, so the tracer records the
aten ops inside, unrolled as the Python loop an operator replaces would be: the
loops' lengths are constants of the trace (Note [sizes under jit.trace] in
``hop.ops._common``), and the operators fall through the tracer's dispatch key
(Note [the JIT tracer's key] in ``hop._dispatch``). A trace is valid for inputs of
the traced shape (and, for a data-dependent branch, of the traced branch), as a
trace of the Python code is; the inputs here keep both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import hop
from hop import _dispatch

Fn = Callable[[torch.Tensor], torch.Tensor]
_W = torch.randn(4, 4)


def _positive() -> torch.Tensor:
    """Values whose data-dependent branches (``sum() > 0``) go the same way every time."""
    return torch.rand(5, 4) + 0.1


def _scan(a: torch.Tensor) -> torch.Tensor:
    carry, ys = hop.scan(lambda c, r: ((c + r).tanh(), c * r), torch.zeros(4), a)
    return ys + carry


def _scan_tree(a: torch.Tensor) -> torch.Tensor:
    # two leaves of xs and a carry compared by size: every size hop reads is checked
    carry, ys = hop.scan(lambda c, r: (c + r["u"] * r["v"], c.sin()), torch.ones(5), {"u": a, "v": a.cos()}, dim=1)
    return ys.sum() + carry


def _scan_reverse(a: torch.Tensor) -> torch.Tensor:
    return hop.scan(lambda c, r: (c * 0.5 + r, c), torch.zeros(4), a, reverse=True)[1]


def _map(a: torch.Tensor) -> torch.Tensor:
    return hop.map(lambda r, w: (r @ w).relu(), a, _W)


def _associative_scan(a: torch.Tensor) -> torch.Tensor:
    return hop.associative_scan(torch.add, a, 0)


def _associative_scan_generic(a: torch.Tensor) -> torch.Tensor:
    return hop.associative_scan(lambda p, q: p * q, a, 1, reverse=True, combine_mode="generic")


LOOPS: dict[str, Fn] = {
    "scan": _scan,
    "scan_tree": _scan_tree,
    "scan_reverse": _scan_reverse,
    "map": _map,
    "associative_scan": _associative_scan,
}


def _cond_in_scan(a: torch.Tensor) -> torch.Tensor:
    def body(c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = hop.cond(r.sum() > 0, lambda v, w: v * w, lambda v, w: v - w, (r, c))
        return c + y, y.exp()

    return hop.scan(body, torch.ones(4), a)[1]


OTHERS: dict[str, Fn] = {
    "cond_in_scan": _cond_in_scan,
    "associative_scan_generic": _associative_scan_generic,  # torch.vmap's own size checks warn
    "cond": lambda a: hop.cond(a.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (a,)),
    "switch": lambda a: hop.switch(1, [lambda v: v.sin(), lambda v: v * 3], (a,)),
    "while_loop": lambda a: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin() * 2), (0, a))[1],
    "fori_loop": lambda a: hop.fori_loop(0, 3, lambda i, v: v.tanh() + i, a),
}

RAW: dict[str, Fn] = {
    "scan": lambda a: torch.ops.hop.scan(lambda c, r: (c + r, c * r), (torch.zeros(4),), (a,), (), False)[1],
    "map": lambda a: torch.ops.hop.map(lambda r: r.sin(), (a,), ()),
    "associative_scan": lambda a: torch.ops.hop.associative_scan(lambda p, q: p + q, (a,), (), "pointwise"),
    "cond": lambda a: torch.ops.hop.cond(a.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (a,)),
    "while_loop": lambda a: torch.ops.hop.while_loop(
        lambda i, v: i < 2, lambda i, v: (i + 1, v * 2), (torch.zeros((), dtype=torch.long), a), ()
    )[1],
}


def _trace(fn: Fn, requires_grad: bool) -> torch.jit.ScriptFunction:
    traced = torch.jit.trace(fn, (_positive().requires_grad_(requires_grad),), check_trace=False)
    assert "PythonOp" not in str(traced.graph)  # no Python autograd node, nor a hop op, was recorded
    return traced


def _check_like_eager(traced: torch.jit.ScriptFunction, fn: Fn, requires_grad: bool) -> None:
    """On new values of the traced shape: the outputs, and the gradients when ``requires_grad``."""
    x = _positive()
    leaves = [x.clone().requires_grad_(requires_grad) for _ in range(2)]
    got, want = traced(leaves[0]), fn(leaves[1])
    torch.testing.assert_close(got, want)
    if requires_grad:
        cotangent = torch.randn_like(want)
        (g_traced,) = torch.autograd.grad(got, leaves[0], cotangent)
        (g_eager,) = torch.autograd.grad(want, leaves[1], cotangent)
        torch.testing.assert_close(g_traced, g_eager)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_loops_trace_unrolled_and_match_eager(name: str, requires_grad: bool) -> None:
    with warnings.catch_warnings():
        # hop's own bookkeeping reads the sizes the tracer follows: none of it may warn
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = _trace(LOOPS[name], requires_grad)
    _check_like_eager(traced, LOOPS[name], requires_grad)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the predicates are data
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_nested_and_branching_ops_trace(name: str, requires_grad: bool) -> None:
    _check_like_eager(_trace(OTHERS[name], requires_grad), OTHERS[name], requires_grad)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", sorted(RAW))
def test_raw_ops_trace(name: str, requires_grad: bool) -> None:
    # the raw ops go through hop's dispatcher, which meets the tracer's key
    _check_like_eager(_trace(RAW[name], requires_grad), RAW[name], requires_grad)


@pytest.mark.parametrize("name", ["scan", "map", "associative_scan"])
def test_empty_loops_trace(name: str) -> None:
    empty = torch.randn(0, 4)
    traced = torch.jit.trace(LOOPS[name], (empty,), check_trace=False)
    torch.testing.assert_close(traced(empty), LOOPS[name](empty))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.scan(lambda c, r: (self.lin(c + r).tanh(), c), torch.zeros(4), x)[1].sum()


def test_a_traced_model_gives_its_parameters_gradients() -> None:
    # the input needs no grad: the parameters the body closes over do
    model, x = _Model(), _positive()
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert "PythonOp" not in str(traced.graph)
    params = list(model.parameters())
    got, want = torch.autograd.grad(traced(x), params), torch.autograd.grad(model(x), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_the_scan_is_unrolled() -> None:
    traced = _trace(_scan, requires_grad=False)
    assert str(traced.graph).count("aten::tanh") == 5


def test_a_checked_trace_of_a_first_call() -> None:
    # torch.jit.trace's own check re-runs the function and compares the two traces
    def fn(a: torch.Tensor) -> torch.Tensor:
        return hop.scan(lambda c, r: (c * r + 1, c), torch.ones(4), a)[1]

    traced = torch.jit.trace(fn, (_positive(),))
    x = _positive()
    torch.testing.assert_close(traced(x), fn(x))


def test_hop_operators_let_the_tracer_key_fall_through() -> None:
    assert str(_dispatch.TRACER_KEYS) == "DispatchKeySet(Tracer)"
    for op in hop.registered_ops().values():
        assert str(op.non_fallthrough_keys & _dispatch.TRACER_KEYS) == "DispatchKeySet()"
        assert op.non_fallthrough_keys.has(torch._C.DispatchKey.AutogradCPU)
