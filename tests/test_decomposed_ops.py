"""A user's operator defined only by its decomposition, through every mode.

Three operators of different shapes (a loop, a branch, a map over rows), each
``hop.HigherOrderOperator(name, decomposition=fn)`` with no other rule, checked
against the plain Python program in eager, autograd, torch.func (grad, jvp,
vmap, functionalize), fake tensors, make_fx and torch.export (one node of the
operator kept, save and load, run_decompositions). Strict export, torch.compile,
AOTInductor and ONNX: tests/compile/test_decomposed_compile.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, HopValueError


def _bounded_while(cond_fn: Any, body_fn: Any, carries: tuple[Any, ...], max_steps: int) -> Any:
    """``while cond_fn(*c) and steps < max_steps: c = body_fn(*c)``."""

    def cond(i: Any, *c: Any) -> Any:
        return (i < max_steps) & cond_fn(*c)

    def body(i: Any, *c: Any) -> Any:
        return (i + 1, *body_fn(*c))

    counter = carries[0].new_zeros((), dtype=torch.int64)  # made from an input: traced under every transform
    return hop.while_loop(cond, body, (counter, *carries))[1:]


def _apply_if(pred: Any, fn: Any, operands: tuple[Any, ...]) -> Any:
    """``fn(*operands) if pred else operands``."""
    return hop.cond(pred, fn, lambda *xs: tuple(x.clone() for x in xs), operands)


def _rowwise(fn: Any, rows: Any, scale: Any) -> Any:
    """``torch.stack([fn(r, scale) for r in rows])``."""
    return hop.map(fn, rows, scale)


bounded_while = hop.HigherOrderOperator("test_bounded_while", decomposition=_bounded_while)
apply_if = hop.HigherOrderOperator("test_apply_if", decomposition=_apply_if)
rowwise = hop.HigherOrderOperator("test_rowwise", decomposition=_rowwise)


class Loop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        (out,) = bounded_while(lambda c: c.abs().sum() < 50, lambda c: ((c * self.w).sin() + c,), (a,), 6)
        return out

    def python(self, a: torch.Tensor) -> torch.Tensor:
        steps = 0
        while steps < 6 and bool(a.abs().sum() < 50):
            a, steps = (a * self.w).sin() + a, steps + 1
        return a


class Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        (out,) = apply_if(a.sum() > 0, lambda x: (x * self.w + x.cos(),), (a,))
        return out * 2

    def python(self, a: torch.Tensor) -> torch.Tensor:
        return (a * self.w + a.cos() if bool(a.sum() > 0) else a) * 2


class Rows(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return rowwise(lambda r, s: (r * self.w).tanh() * s, a.reshape(-1, 3), a.sum()).reshape(a.shape)

    def python(self, a: torch.Tensor) -> torch.Tensor:
        rows = a.reshape(-1, 3)
        return torch.stack([(r * self.w).tanh() * a.sum() for r in rows]).reshape(a.shape)


MODELS: dict[str, Callable[[], Any]] = {"loop": Loop, "branch": Branch, "rows": Rows}
OPS = {"loop": bounded_while, "branch": apply_if, "rows": rowwise}


def inputs(name: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    if name == "rows":
        return [torch.randn(6, dtype=torch.float64), 3 * torch.randn(6, dtype=torch.float64)]
    # the loop stops at its bound and on its condition; the branch takes both sides
    return [torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64), torch.tensor([4.0, -9.0, 2.0], dtype=torch.float64)]


def nodes_of(gm: torch.fx.GraphModule, op: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def grads(f: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, w: torch.Tensor | None = None) -> Any:
    """The gradients of ``f(a).sum()`` for ``a`` and ``w`` (``f``'s parameter); zeros where
    Python's untaken branch never read ``w`` (hop's cond gives it zeros, as torch.cond)."""
    x = a.clone().requires_grad_()
    wrt = (x, w if w is not None else f.w)  # type: ignore[attr-defined]
    return torch.autograd.grad(f(x).sum(), wrt, allow_unused=True, materialize_grads=True)


@pytest.fixture(params=sorted(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, MODELS[request.param]()


def test_eager_and_autograd_equal_python(case: tuple[str, Any]) -> None:
    name, model = case
    for a in inputs(name):
        torch.testing.assert_close(model(a), model.python(a))
        torch.testing.assert_close(grads(model, a), grads(model.python, a, model.w))
    assert torch.autograd.gradcheck(model, (inputs(name)[0].clone().requires_grad_(),))


def test_torch_func_transforms_equal_python(case: tuple[str, Any]) -> None:
    name, model = case
    for a in inputs(name):
        torch.testing.assert_close(
            torch.func.grad(lambda x: model(x).sum())(a), torch.func.grad(lambda x: model.python(x).sum())(a)
        )
        t = torch.ones_like(a)
        torch.testing.assert_close(torch.func.jvp(model, (a,), (t,)), torch.func.jvp(model.python, (a,), (t,)))
        torch.testing.assert_close(torch.func.jacrev(model)(a), torch.func.jacfwd(model)(a))
        torch.testing.assert_close(torch.func.functionalize(model)(a), model.python(a))
        batch = torch.stack([a, a.flip(0), a * 3])
        torch.testing.assert_close(torch.vmap(model)(batch), torch.stack([model.python(b) for b in batch]))


def test_fake_tensors_give_the_shapes(case: tuple[str, Any]) -> None:
    name, model = case
    a = inputs(name)[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = model(mode.from_tensor(a))
    assert out.shape == a.shape and out.dtype == a.dtype


def test_make_fx_records_one_node(case: tuple[str, Any]) -> None:
    name, model = case
    a = inputs(name)[0]
    params = dict(model.named_parameters())

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    gm = make_fx(f, tracing_mode="symbolic")({k: v.detach() for k, v in params.items()}, a)
    assert nodes_of(gm, OPS[name]) == 1
    detached = {k: v.detach() for k, v in params.items()}
    for b in inputs(name):
        torch.testing.assert_close(gm(detached, b), model.python(b))


def test_export_keeps_one_node_that_saves_loads_and_decomposes(case: tuple[str, Any]) -> None:
    name, model = case
    first, second = inputs(name)
    ep = torch.export.export(model, (first,))
    assert nodes_of(ep.graph_module, OPS[name]) == 1
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    decomposed = ep.run_decompositions()
    assert nodes_of(decomposed.graph_module, OPS[name]) == 1  # still the user's operator
    for program in (ep, loaded, decomposed):
        for b in (first, second):
            torch.testing.assert_close(program.module()(b), model.python(b))


def test_a_registered_rule_overrides_the_derived_one() -> None:
    calls = []
    op = hop.HigherOrderOperator("test_overridden", decomposition=lambda fn, x: fn(x))

    @op.py_impl(DispatchKey.CompositeExplicitAutograd)
    def dense(fn: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append("dense")
        return fn(x)

    def functionalize(ctx: Any, fn: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append("functionalize")
        with ctx.redispatch_to_next():
            return op(ctx.functionalize(fn), ctx.unwrap_tensors(x))

    op.py_functionalize_impl(functionalize)  # replaces the derived functionalize rule
    x = torch.randn(3)
    torch.testing.assert_close(op(lambda t: t * 2, x), x * 2)
    assert calls == ["dense"]
    torch.func.functionalize(lambda t: op(lambda u: u + 1, t))(x)
    assert calls[1] == "functionalize"
    with pytest.raises(HopValueError, match="already registered"):
        op.py_impl(DispatchKey.CompositeExplicitAutograd)(dense)


def test_what_cannot_be_recorded_is_refused() -> None:
    with pytest.raises(HopTypeError, match="decomposition must be a callable"):
        hop.HigherOrderOperator("test_not_callable", decomposition=3)  # type: ignore[arg-type]
    ignores = hop.HigherOrderOperator("test_ignores_fn", decomposition=lambda fn, x: x * 2)
    x = torch.randn(3)
    torch.testing.assert_close(ignores(lambda t: t, x), x * 2)  # eager runs it
    with pytest.raises(HopValueError, match=r"test_ignores_fn: its decomposition never called the callable"):
        make_fx(lambda t: ignores(lambda u: u, t), tracing_mode="fake")(x)
    varies = hop.HigherOrderOperator("test_varying_int", decomposition=lambda fn, x: fn(x, 1) + fn(x, 2))
    torch.testing.assert_close(varies(lambda t, k: t * k, x), x * 3)
    with pytest.raises(HopValueError, match="with argument 1 1 and 2"):
        make_fx(lambda t: varies(lambda u, k: u * k, t), tracing_mode="fake")(x)
    # a graph traced on the first call would give the second call the first's size: refused
    sizes = hop.HigherOrderOperator("test_two_sizes", decomposition=lambda fn, x: fn(x).sum() + fn(x[:2]).sum())
    torch.testing.assert_close(sizes(lambda t: t * t.shape[0], torch.ones(3)), torch.tensor(13.0))
    with pytest.raises(HopValueError, match=r"test_two_sizes: .* with argument 0 of shape \(3,\) float32 and of shape"):
        torch.export.export(_Calls(sizes, lambda t: t * t.shape[0]), (torch.ones(3),))
    keyword = hop.HigherOrderOperator("test_keyword_call", decomposition=lambda fn, x: fn(x, k=2))
    torch.testing.assert_close(keyword(lambda t, k: t * k, x), x * 2)
    with pytest.raises(HopTypeError, match=r"test_keyword_call: its decomposition called the callable .* with keyword"):
        make_fx(lambda t: keyword(lambda u, k: u * k, t), tracing_mode="fake")(x)


class _Calls(torch.nn.Module):
    def __init__(self, op: Any, fn: Any) -> None:
        super().__init__()
        self.op, self.fn = op, fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.op(self.fn, x)
