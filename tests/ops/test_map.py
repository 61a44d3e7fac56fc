"""hop.map across the transform matrix, one section per column, then errors."""

from __future__ import annotations

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
    roundtrip,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopError, HopTypeError, HopValueError
from hop.ops.scanning.map import map_op
from hop.ops.scanning.scan import scan_op


def reference_map(f: Any, xs: Any, *args: Any) -> Any:
    """The Python loop hop.map must equal (its docstring's reference)."""
    n = pytree.tree_leaves(xs)[0].shape[0]
    ys = [f(pytree.tree_map(lambda leaf, i=i: leaf[i], xs), *args) for i in range(n)]
    return optree.tree_map(lambda *col: torch.stack(col), *ys, none_is_leaf=False, namespace="torch")


# --- the program table: (hop program, plain-Python reference, inputs) ----------------------


def f(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def simple(xs: torch.Tensor) -> Any:
    return hop.map(f, xs)


def simple_ref(xs: torch.Tensor) -> Any:
    return reference_map(f, xs)


def affine(x: torch.Tensor, w: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return (x @ w + b["b"]).tanh()


def args(xs: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    return hop.map(affine, xs, w, {"b": b})


def args_ref(xs: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    return reference_map(affine, xs, w, {"b": b})


def tree_f(d: dict[str, Any]) -> Any:
    return {"s": d["a"] * d["b"][0], "t": (d["b"][1].cos(), d["a"].sum())}


def pytrees(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
    return hop.map(tree_f, {"a": a, "b": (b, c)})


def pytrees_ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
    return reference_map(tree_f, {"a": a, "b": (b, c)})


def closure(xs: torch.Tensor, w: torch.Tensor) -> Any:
    return hop.map(lambda x: x * w + w.exp(), xs)


def closure_ref(xs: torch.Tensor, w: torch.Tensor) -> Any:
    return reference_map(lambda x: x * w + w.exp(), xs)


def nested(xs: torch.Tensor) -> Any:
    return hop.map(lambda row: hop.map(lambda v: v * row.sum(), row), xs)


def nested_ref(xs: torch.Tensor) -> Any:
    return reference_map(lambda row: reference_map(lambda v: v * row.sum(), row), xs)


def int_arg(xs: torch.Tensor) -> Any:
    return hop.map(lambda x, n: x * n, xs, 3)


def int_arg_ref(xs: torch.Tensor) -> Any:
    return reference_map(lambda x, n: x * n, xs, 3)


def empty(xs: torch.Tensor) -> Any:
    return hop.map(f, xs[:0])


def empty_ref(xs: torch.Tensor) -> Any:
    return torch.empty(0, *xs.shape[1:], dtype=xs.dtype)


XS = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
W, B = torch.randn(3, 2), torch.randn(2)
PROGRAMS = {
    "simple": (simple, simple_ref, [(XS,), (-XS,)]),
    "args": (args, args_ref, [(XS, W, B)]),
    "pytrees": (pytrees, pytrees_ref, [(XS, XS * 2, XS[:, :2])]),
    "closure": (closure, closure_ref, [(XS, torch.tensor([0.5, -1.0, 2.0]))]),
    "nested": (nested, nested_ref, [(XS.reshape(2, 3, 2),)]),
    "int_arg": (int_arg, int_arg_ref, [(XS,)]),
    "empty": (empty, empty_ref, [(XS,)]),
}


@pytest.fixture(params=sorted(PROGRAMS))
def program(request: pytest.FixtureRequest) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    return PROGRAMS[request.param]


# --- eager -----------------------------------------------------------------------------------


def test_eager(program: Any) -> None:
    fn, ref, inputs = program
    check_eager(fn, ref, inputs)


def test_eager_calls_f_once_per_slice() -> None:
    seen: list[str] = []

    def g(x: torch.Tensor) -> torch.Tensor:
        seen.append(type(x).__name__)
        return x + 1

    hop.map(g, torch.ones(5, 2))
    assert seen == ["Tensor"] * 5


def test_empty_map_has_the_output_shapes() -> None:
    out = hop.map(lambda x, w: {"y": x @ w, "n": x.sum()}, torch.zeros(0, 3), torch.ones(3, 7))
    assert out["y"].shape == (0, 7) and out["n"].shape == (0,)


def test_outputs_never_alias_inputs() -> None:
    xs = torch.randn(3, 2)
    out = hop.map(lambda x: x, xs)
    assert out.untyped_storage().data_ptr() != xs.untyped_storage().data_ptr()
    assert torch.equal(out, xs)


# --- autograd ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"empty"}))  # an empty map depends on nothing
def test_autograd(name: str) -> None:
    fn, ref, inputs = PROGRAMS[name]
    check_autograd(fn, ref, inputs)


def test_gradients_reach_module_parameters() -> None:
    lin = torch.nn.Linear(3, 2)
    xs = torch.randn(5, 3)
    got = torch.autograd.grad(hop.map(lambda x: lin(x).relu(), xs).sum(), lin.weight)
    want = torch.autograd.grad(reference_map(lambda x: lin(x).relu(), xs).sum(), lin.weight)
    torch.testing.assert_close(got, want)


def test_backward_of_a_traced_map_is_a_scan() -> None:
    def grads(xs: torch.Tensor, w: torch.Tensor) -> Any:
        return torch.autograd.grad(hop.map(lambda x: (x * w).sin(), xs).sum(), (xs, w))

    args = (torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True))
    gm = make_fx(grads, tracing_mode="symbolic")(*args)
    assert [n.target for n in gm.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)] == [map_op, scan_op]
    assert_close(gm(*args), grads(*args))


def test_traced_torch_func_grad_reaches_closed_over_tensors() -> None:
    def loss(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda x: (x * w).sin(), xs).sum()

    w, xs = torch.randn(3), torch.randn(4, 3)
    gm = make_fx(torch.func.grad(loss), tracing_mode="symbolic")(w, xs)
    assert any(n.target is map_op for n in gm.graph.nodes)
    assert_close(gm(w, xs), torch.func.grad(loss)(w, xs))


# --- jvp and the torch.func family ---------------------------------------------------------------


def test_jvp(program: Any) -> None:
    fn, ref, inputs = program
    check_jvp(fn, ref, inputs)


def test_torch_func_family() -> None:
    xs = torch.randn(4, 3, dtype=torch.float64)

    def fn(w: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda x: (x * w).sin().sum(), xs).sum()

    def ref(w: torch.Tensor) -> torch.Tensor:
        return reference_map(lambda x: (x * w).sin().sum(), xs).sum()  # type: ignore[no-any-return]

    w = torch.randn(3, dtype=torch.float64)
    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
        torch.testing.assert_close(transform(fn)(w), transform(ref)(w))


# --- vmap ------------------------------------------------------------------------------------------


def test_vmap_of_map(program: Any) -> None:
    fn, ref, inputs = program
    args = inputs[0]
    batched = (torch.stack([args[0], args[0] * -2, args[0] + 1]), *args[1:])
    check_vmap(fn, ref, batched, (0, *[None] * (len(args) - 1)))


def test_vmap_of_map_batched_along_the_mapped_dim_and_in_args() -> None:
    xs, w, b = torch.randn(4, 5, 3), torch.randn(5, 3, 2), torch.randn(2)
    got = torch.vmap(args, in_dims=(1, 0, None))(xs, w, b)
    want = torch.stack([args_ref(xs[:, i], w[i], b) for i in range(5)])
    torch.testing.assert_close(got, want)


def test_map_inside_vmap_and_nested_vmap() -> None:
    xs = torch.randn(2, 3, 4, 5)
    got = torch.vmap(torch.vmap(lambda a: hop.map(lambda r: r.cumsum(0) * r.max(), a)))(xs)
    torch.testing.assert_close(got, xs.cumsum(-1) * xs.amax(-1, keepdim=True))


def test_vmap_of_a_traced_map_maps_the_vmapped_body() -> None:
    xs, w = torch.randn(3, 4, 2), torch.randn(3, 2)
    gm = make_fx(torch.vmap(closure), tracing_mode="fake")(xs, w)
    assert sum(n.target is map_op for n in gm.graph.nodes) == 1
    assert_close(gm(xs, w), torch.stack([closure_ref(xs[i], w[i]) for i in range(3)]))


# --- functionalization --------------------------------------------------------------------------------


def test_functionalize() -> None:
    g = torch.func.functionalize(args)
    assert_close(g(XS, W, B), args_ref(XS, W, B))
    gm = make_fx(g, tracing_mode="symbolic")(XS, W, B)
    assert any(n.target is map_op for n in gm.graph.nodes)
    assert_close(gm(XS[:2], W, B), args_ref(XS[:2], W, B))


# --- fake / make_fx ---------------------------------------------------------------------------------


def test_fake_tensor_mode() -> None:
    with FakeTensorMode():
        out = hop.map(lambda x: (x.sum(), x * 2), torch.randn(6, 3))
    assert isinstance(out[0], FakeTensor) and out[0].shape == (6,) and out[1].shape == (6, 3)


def test_make_fx(program: Any) -> None:
    fn, _, inputs = program
    check_make_fx(fn, map_op, inputs[0], inputs)


# --- export -------------------------------------------------------------------------------------------


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, xs: torch.Tensor, scale: torch.Tensor) -> Any:
        return hop.map(lambda x, s: self.lin(x).relu() * s, xs, scale)


class Programs(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def test_export_with_a_dynamic_leading_dim() -> None:
    m = Model()
    dims = {"xs": {0: torch.export.Dim("n")}, "scale": None}
    s = torch.tensor(2.0)
    ep = check_export(m, map_op, (torch.randn(4, 3), s), [(torch.randn(n, 3), s) for n in (1, 4, 9)], dims)
    node = next(n for n in ep.graph.nodes if n.target is map_op)
    assert [a.name for a in node.args[2]] == ["scale", "p_lin_weight", "p_lin_bias"]


def test_export_output_size_made_inside_the_body_gets_an_unbacked_symbol() -> None:
    def fn(xs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        def body(x: torch.Tensor) -> torch.Tensor:
            n = k.item()
            torch._check(n >= 0)
            torch._check(n <= 10)
            return x.sum() * torch.ones(n)

        return hop.map(body, xs) + 1  # type: ignore[no-any-return]

    ep = torch.export.export(Programs(fn), (torch.randn(4, 3), torch.tensor(5)))
    node = next(n for n in ep.graph.nodes if n.target is map_op)
    assert node.meta["unbacked_bindings"]  # bound to the node, not to the body's symbol
    for program in (ep, roundtrip(ep)):
        assert program.module()(torch.randn(4, 3), torch.tensor(7)).shape == (4, 7)
    with pytest.raises(RuntimeError, match=r"u\d+ <= 10"):
        ep.module()(torch.randn(4, 3), torch.tensor(12))


def test_export_program_table(program: Any) -> None:
    fn, _, inputs = program
    check_export(Programs(fn), map_op, inputs[0], inputs)


def test_torch_compile_default() -> None:
    m = Model()
    xs, s = torch.randn(5, 3), torch.tensor(3.0)
    torch._dynamo.reset()
    assert_close(torch.compile(m)(xs, s), m(xs, s))


# --- errors --------------------------------------------------------------------------------------------


def _error(cls: type[HopError], fn: Any, xs: Any, *args: Any) -> str:
    with pytest.raises(cls) as info:
        hop.map(fn, xs, *args)
    return str(info.value)


def test_xs_leaves_of_different_lengths() -> None:
    msg = _error(HopValueError, lambda d: d["a"], {"a": torch.ones(4), "b": torch.ones(3)})
    assert msg == (
        'hop.map: xs["b"]: has length 3 along dim 0, but xs["a"] has length 4. '
        "Give every leaf of xs the same length along dim 0."
    )


def test_outputs_that_cannot_be_stacked() -> None:
    sizes = iter(range(1, 5))
    msg = _error(HopValueError, lambda x: {"y": x[: next(sizes)]}, torch.ones(4, 4))
    assert msg.startswith('hop.map: f: output["y"]: iterations 0 and 1 differ: shape (1,) vs (2,) (f is ')
    assert msg.endswith("Every iteration must return tensors of the same dtype, device and shape.")
    msg = _error(HopValueError, lambda x: (x, "s"), torch.ones(2, 1))
    assert msg.startswith("hop.map: f: output[1]: must be a tensor, got str (f is ")


def test_argument_errors() -> None:
    assert _error(HopTypeError, "f", torch.ones(2)) == "hop.map: f must be callable, got str"
    msg = _error(HopTypeError, lambda x, s: x * s, torch.ones(2), 0.5)
    assert msg == (
        "hop.map: args[0]: must be a tensor or an int, got float. "
        "Close over other values in the function instead of passing them in args."
    )
    msg = _error(HopValueError, lambda x: x, torch.tensor(1.0))
    assert msg == "hop.map: xs: dim 0 is out of range for a tensor of rank 0. Pass tensors of rank >= 1."


class _TwoSequences(torch.nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        if self.op == "map":
            return hop.map(lambda t: t[0].sum() + t[1].sum(), (a, b))
        if self.op == "scan":
            return hop.scan(lambda c, r: (c + r[0].sum() * r[1].mean(), r[0] * c), torch.zeros(()), (a, b))
        return hop.associative_scan(lambda p, q: (p[0] + q[0], p[1] * q[1]), (a, b), 0)


@pytest.mark.parametrize("op", ["map", "scan", "associative_scan"])
def test_export_with_one_dim_shared_by_two_leaves_of_xs(op: str) -> None:
    # two inputs of one Dim are two symbols until something guards them equal
    length = torch.export.Dim("length")
    model = _TwoSequences(op)
    ep = torch.export.export(model, (torch.randn(5, 2), torch.randn(5, 2)), dynamic_shapes=({0: length}, {0: length}))
    a, b = torch.randn(7, 2), torch.randn(7, 2)
    torch.testing.assert_close(ep.module()(a, b), model(a, b))
