"""hop.associative_scan across the transform matrix, one section per column, then errors."""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as pytree
from harness import (
    assert_close,
    check_autograd,
    check_eager,
    check_export,
    check_jvp,
    check_make_fx,
    check_vmap,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, HopValueError, OutputMismatchError
from hop.ops.scanning.associative_scan import associative_scan_op


def reference_associative_scan(combine_fn: Any, xs: Any, dim: int, reverse: bool = False, **_: Any) -> Any:
    """The sequential scan hop.associative_scan must equal (its docstring's reference)."""
    n = pytree.tree_leaves(xs)[0].shape[dim]
    if n == 0:
        return pytree.tree_map(torch.clone, xs)
    out: list[Any] = [None] * n
    for k, i in enumerate(reversed(range(n)) if reverse else range(n)):
        x = pytree.tree_map(lambda leaf, i=i: leaf.select(dim, i), xs)
        out[i] = x if k == 0 else combine_fn(out[i + 1 if reverse else i - 1], x)
    return optree.tree_map(lambda *col: torch.stack(col, dim), *out, namespace="torch")


def linear(lhs: Any, rhs: Any) -> Any:
    """h -> a h + b composed: the linear recurrence h[t] = a[t] h[t - 1] + b[t]."""
    return lhs[0] * rhs[0], rhs[0] * lhs[1] + rhs[1]


def program(combine_fn: Any, dim: int = 0, **kwargs: Any) -> tuple[Any, Any]:
    def fn(*xs: torch.Tensor) -> Any:
        return hop.associative_scan(combine_fn, xs if len(xs) > 1 else xs[0], dim, **kwargs)

    def ref(*xs: torch.Tensor) -> Any:
        return reference_associative_scan(combine_fn, xs if len(xs) > 1 else xs[0], dim, **kwargs)

    return fn, ref


def _gen(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


X5, X8 = _gen(5, 3), _gen(8, 2)
MATS = _gen(6, 2, 2) / 2 + torch.eye(2)
PROGRAMS = {
    "cumsum": (*program(torch.add), [(X5,), (X8,), (X5[:1],)]),
    "cummax_generic": (*program(torch.maximum, combine_mode="generic"), [(X5,), (X8,)]),
    "linear_recurrence": (*program(linear), [(X5.sigmoid(), X5), (X8.sigmoid(), X8)]),
    "matmul_generic": (*program(torch.matmul, combine_mode="generic"), [(MATS,), (MATS[:3],)]),
    "reverse": (*program(linear, reverse=True), [(X5.sigmoid(), X5)]),
    "dim1": (*program(torch.mul, dim=1), [(X5.T.contiguous(),)]),
}


def sum_and_product(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"s": a["s"] + b["s"], "p": a["p"] * b["p"]}


PROGRAMS["dict"] = (
    lambda x: hop.associative_scan(sum_and_product, {"s": x, "p": x}, 0),
    lambda x: reference_associative_scan(sum_and_product, {"s": x, "p": x}, 0),
    [(X5,)],
)


@pytest.fixture(params=sorted(PROGRAMS))
def table(request: pytest.FixtureRequest) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    return PROGRAMS[request.param]


# --- eager -----------------------------------------------------------------------------------


def test_eager(table: Any) -> None:
    fn, ref, inputs = table
    check_eager(fn, ref, inputs)


@pytest.mark.parametrize("mode", ["pointwise", "generic"])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_length_equals_the_sequential_scan(mode: str, reverse: bool) -> None:
    for n in range(10):
        a, b = torch.rand(n, 3), torch.randn(n, 3)
        got = hop.associative_scan(linear, (a, b), 0, reverse=reverse, combine_mode=mode)
        assert_close(got, reference_associative_scan(linear, (a, b), 0, reverse=reverse))


def test_logarithmic_depth() -> None:
    calls: list[int] = []

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape[0])
        return a + b

    for n in (2, 7, 64, 1000):
        calls.clear()
        x = torch.randn(n)
        torch.testing.assert_close(hop.associative_scan(add, x, 0), x.cumsum(0))
        assert len(calls) <= 2 * math.ceil(math.log2(n)), (n, calls)
        assert sum(calls) < 2 * n  # O(n) combinations in all


def test_outputs_never_alias_inputs() -> None:
    x = torch.randn(1, 3)
    out = hop.associative_scan(torch.add, x, 0)
    assert torch.equal(out, x) and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


# --- autograd, jvp ------------------------------------------------------------------------------


def test_autograd(table: Any) -> None:
    fn, ref, inputs = table
    check_autograd(fn, ref, inputs)


def test_gradients_reach_closed_over_tensors() -> None:
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(6, 3)

    def loss(scan: Any) -> torch.Tensor:
        return scan(lambda a, b: a + b, x * w, 0).pow(2).sum()  # type: ignore[no-any-return]

    torch.testing.assert_close(
        torch.autograd.grad(loss(hop.associative_scan), w)[0],
        torch.autograd.grad(loss(reference_associative_scan), w)[0],
    )


def test_traced_derivatives_are_scans() -> None:
    fn, _ = program(linear, combine_mode="generic")

    def grads(a: torch.Tensor, b: torch.Tensor) -> Any:
        return torch.autograd.grad(fn(a, b)[1].pow(2).sum(), (a, b))

    def tangents(a: torch.Tensor, b: torch.Tensor) -> Any:
        return torch.func.jvp(fn, (a, b), (torch.ones_like(a), b.cos()))

    a, b = torch.rand(6, 3, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    # the backward: the forward recomputed, an associative scan of affine maps (Note [a
    # parallel backward for an elementwise combine]); forward mode: the scan of the jvp
    for f, ops in ((grads, ["associative_scan"] * 3), (tangents, ["associative_scan", "scan"])):
        gm = make_fx(f, tracing_mode="symbolic")(a, b)
        assert [n.target.name() for n in gm.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)] == ops
        for n in (6, 2, 9):
            args = (torch.rand(n, 3, requires_grad=True), torch.randn(n, 3, requires_grad=True))
            assert_close(gm(*args), f(*args))


def test_traced_torch_func_grad_reaches_closed_over_tensors() -> None:
    def loss(w: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
        products = hop.associative_scan(lambda lhs, rhs: lhs @ w @ rhs, mats, 0, combine_mode="generic")  # associative
        return products.sum()  # type: ignore[no-any-return]

    w, mats = torch.randn(2, 2) / 2 + torch.eye(2), MATS
    gm = make_fx(torch.func.grad(loss), tracing_mode="fake")(w, mats)
    assert any(n.target is associative_scan_op for n in gm.graph.nodes)
    assert_close(gm(w, mats), torch.func.grad(loss)(w, mats))
    ref = torch.func.grad(lambda w, m: reference_associative_scan(lambda lhs, rhs: lhs @ w @ rhs, m, 0).sum())(w, mats)
    assert_close(gm(w, mats), ref)


def test_jvp(table: Any) -> None:
    fn, ref, inputs = table
    check_jvp(fn, ref, inputs)


# --- vmap ------------------------------------------------------------------------------------------


def test_vmap(table: Any) -> None:
    fn, ref, inputs = table
    args = inputs[0]
    batched = tuple(torch.stack([a, a * 0.5, a.flip(-1)]) for a in args)
    check_vmap(fn, ref, batched, (0,) * len(args))


def test_vmap_of_a_traced_scan() -> None:
    fn, ref = program(linear, combine_mode="pointwise")
    a, b = torch.rand(4, 6, 3), torch.randn(6, 3)
    gm = make_fx(torch.vmap(fn, in_dims=(0, None)), tracing_mode="fake")(a, b)
    assert sum(n.target is associative_scan_op for n in gm.graph.nodes) == 1
    assert_close(gm(a, b), torch.vmap(ref, in_dims=(0, None))(a, b))


# --- functionalization, fake, make_fx ---------------------------------------------------------------


def test_functionalize() -> None:
    fn, ref = program(linear)
    g = torch.func.functionalize(fn)
    a, b = X5.sigmoid(), X5
    assert_close(g(a, b), ref(a, b))
    gm = make_fx(g, tracing_mode="symbolic")(a, b)
    assert any(n.target is associative_scan_op for n in gm.graph.nodes)
    assert_close(gm(a[:3], b[:3]), ref(a[:3], b[:3]))


def test_fake_tensor_mode() -> None:
    with FakeTensorMode():
        out = hop.associative_scan(linear, (torch.rand(7, 2), torch.randn(7, 2)), 0)
    assert isinstance(out[1], FakeTensor) and out[1].shape == (7, 2)


def test_make_fx(table: Any) -> None:
    fn, _, inputs = table
    check_make_fx(fn, associative_scan_op, inputs[0], inputs[:1])


# --- export -------------------------------------------------------------------------------------------


class Recurrence(torch.nn.Module):
    """h[t] = sigmoid(gate)[t] * h[t - 1] + x[t], over dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.gate(x).sigmoid()
        return hop.associative_scan(linear, (a, x), 1, combine_mode="generic")[1]  # type: ignore[no-any-return]


def test_export_with_a_dynamic_scanned_dim() -> None:
    m = Recurrence()
    dims = {"x": {1: torch.export.Dim("T")}}
    inputs = [(torch.randn(2, n, 4),) for n in (1, 5, 8)]
    check_export(m, associative_scan_op, (torch.randn(2, 6, 4),), inputs, dims)


def test_torch_compile_default() -> None:
    m = Recurrence()
    x = torch.randn(2, 5, 4)
    torch._dynamo.reset()
    assert_close(torch.compile(m)(x), m(x))


# --- errors --------------------------------------------------------------------------------------------


def test_combine_fn_returning_another_dtype_or_structure() -> None:
    with pytest.raises(OutputMismatchError) as info:
        hop.associative_scan(lambda a, b: (a[0] + b[0], (a[1] * b[1]).double()), (X5, X5), 0)
    msg = str(info.value)
    assert msg.startswith(
        "hop.associative_scan: combine_fn: output[1]: xs and the output differ: dtype float32 vs float64"
    )
    assert msg.endswith("combine_fn must return values with the structure, dtypes, devices and shapes of its inputs.")
    with pytest.raises(
        OutputMismatchError, match=r"combine_fn: output: xs and the output differ: structure \(\*, \*\) vs \*"
    ):
        hop.associative_scan(lambda a, b: a[0] + b[0], (X5, X5), 0)
    with pytest.raises(
        OutputMismatchError, match=r"output: xs and the output differ: rank 1 vs 0 \(shapes \(2,\) vs \(\)\)"
    ):
        hop.associative_scan(lambda a, b: (a * b).sum(), torch.ones(4, 2), 0, combine_mode="generic")


def test_argument_errors() -> None:
    with pytest.raises(
        HopValueError, match=r'^hop.associative_scan: combine_mode must be "pointwise" or "generic", got'
    ):
        hop.associative_scan(torch.add, X5, 0, combine_mode="fast")
    with pytest.raises(HopValueError, match=r"^hop.associative_scan: xs\[1\]: has length 3 along dim 0, but xs\[0\]"):
        hop.associative_scan(torch.add, (X5, X5[:3]), 0)
    with pytest.raises(
        HopValueError, match=r"^hop.associative_scan: xs: dim -3 is out of range for a tensor of rank 2"
    ):
        hop.associative_scan(torch.add, X5, -3)
    with pytest.raises(HopTypeError, match=r"^hop.associative_scan: combine_fn must be callable, got NoneType$"):
        hop.associative_scan(None, X5, 0)  # type: ignore[arg-type]
