"""hop.scan across the transform matrix, one section per column, then errors."""

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
from uninitialized import all_finite, observer, traced_with_nan_fill

import hop
from hop.errors import HopError, HopTypeError, HopValueError, MutationError, OutputMismatchError
from hop.ops.scanning.scan import scan_op


def reference_scan(combine_fn: Any, init: Any, xs: Any, *, dim: int = 0, reverse: bool = False) -> Any:
    """The Python loop hop.scan must equal (its docstring's reference)."""
    n = pytree.tree_leaves(xs)[0].shape[dim]
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        carry, ys[i] = combine_fn(carry, pytree.tree_map(lambda leaf, i=i: leaf.select(dim, i), xs))
    return carry, optree.tree_map(lambda *col: torch.stack(col, dim), *ys, none_is_leaf=False, namespace="torch")


# --- the program table: (hop program, plain-Python reference, inputs) ----------------------


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = (c * 0.9 + x).tanh()
    return c, c * x


def simple(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return hop.scan(step, init, xs)


def simple_ref(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return reference_scan(step, init, xs)


def tree_step(c: dict[str, torch.Tensor], x: tuple[torch.Tensor, torch.Tensor]) -> Any:
    h = (c["h"] * x[0] + c["n"]).sin()
    return {"h": h, "n": c["n"] + x[1].sum()}, {"out": (h * 2, x[1].cos())}


def pytrees(h: torch.Tensor, n: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    return hop.scan(tree_step, {"h": h, "n": n}, (a, b))


def pytrees_ref(h: torch.Tensor, n: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    return reference_scan(tree_step, {"h": h, "n": n}, (a, b))


def closure(init: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
    return hop.scan(lambda c, x: (c * w + x, (c * w).sum()), init, xs)


def closure_ref(init: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
    return reference_scan(lambda c, x: (c * w + x, (c * w).sum()), init, xs)


def reverse(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return hop.scan(step, init, xs, reverse=True)


def reverse_ref(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return reference_scan(step, init, xs, reverse=True)


def dim1(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return hop.scan(lambda c, x: (c + x.sum(), x * c), init, xs, dim=1)


def dim1_ref(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return reference_scan(lambda c, x: (c + x.sum(), x * c), init, xs, dim=1)


def rnn(h0: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> Any:
    return hop.scan(lambda h, x: ((x @ w + h @ u).tanh(), h.sum(-1)), h0, xs)


def rnn_ref(h0: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> Any:
    h, ys = h0, []
    for x in xs:
        ys.append(h.sum(-1))
        h = (x @ w + h @ u).tanh()
    return h, torch.stack(ys)


def empty(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return hop.scan(step, init, xs[:0])


def empty_ref(init: torch.Tensor, xs: torch.Tensor) -> Any:
    return init.clone(), torch.empty(0, *xs.shape[1:], dtype=xs.dtype)


def mixed(init: torch.Tensor, xs: torch.Tensor, k: torch.Tensor) -> Any:
    return hop.scan(lambda c, x: (c + x[0] * x[1], (x[1] * 2, c.argmax())), init, (xs, k))


def mixed_ref(init: torch.Tensor, xs: torch.Tensor, k: torch.Tensor) -> Any:
    return reference_scan(lambda c, x: (c + x[0] * x[1], (x[1] * 2, c.argmax())), init, (xs, k))


C, XS = torch.tensor([0.1, -0.2, 0.3]), torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
H0, SEQ, W, U = torch.zeros(2, 4), torch.randn(3, 2, 3), torch.randn(3, 4) / 2, torch.randn(4, 4) / 2
K = torch.tensor([[1, 2, 3], [0, 1, 0], [2, 2, 2], [1, 0, 1]])
PROGRAMS = {
    "simple": (simple, simple_ref, [(C, XS), (C * 2, -XS)]),
    "pytrees": (pytrees, pytrees_ref, [(C, torch.tensor(0.5), XS, XS * 2)]),
    "closure": (closure, closure_ref, [(C, XS, torch.tensor([0.5, 1.0, -1.0]))]),
    "reverse": (reverse, reverse_ref, [(C, XS)]),
    "dim1": (dim1, dim1_ref, [(C[:1], XS.T.contiguous())]),
    "rnn": (rnn, rnn_ref, [(H0, SEQ, W, U)]),
    "empty": (empty, empty_ref, [(C, XS)]),
    "mixed": (mixed, mixed_ref, [(C, XS, K)]),
}


@pytest.fixture(params=sorted(PROGRAMS))
def program(request: pytest.FixtureRequest) -> tuple[Any, Any, list[tuple[Any, ...]]]:
    return PROGRAMS[request.param]


# --- eager -----------------------------------------------------------------------------------


def test_eager(program: Any) -> None:
    fn, ref, inputs = program
    check_eager(fn, ref, inputs)


def test_eager_runs_the_python_loop_only() -> None:
    seen: list[str] = []

    def f(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(type(c).__name__)
        return c + x, c

    hop.scan(f, torch.zeros(2), torch.ones(5, 2))
    assert seen == ["Tensor"] * 5  # no tracing, no fake run, no compile step


def test_none_is_an_empty_carry_or_y() -> None:
    carry, ys = hop.scan(lambda c, x: (None, (x * 2, None)), None, torch.ones(3, 2))
    assert carry is None and ys[1] is None and torch.equal(ys[0], torch.full((3, 2), 2.0))
    carry, ys = hop.scan(lambda c, x: (c + x, None), torch.zeros(2), torch.ones(3, 2))
    assert ys is None and torch.equal(carry, torch.full((2,), 3.0))


def test_zero_length_returns_init_and_empty_ys() -> None:
    init = {"h": torch.ones(3)}
    carry, ys = hop.scan(lambda c, x: ({"h": c["h"] + x}, (x * 2, x.sum())), init, torch.zeros(0, 3))
    assert carry["h"] is not init["h"] and torch.equal(carry["h"], init["h"])
    assert ys[0].shape == (0, 3) and ys[1].shape == (0,)
    carry, ys = hop.scan(lambda c, x: (c, x), torch.ones(2), torch.zeros(4, 0, 5), dim=1)
    assert ys.shape == (4, 0, 5)


def test_outputs_never_alias_inputs() -> None:
    init, xs = torch.ones(3), torch.randn(4, 3)
    carry, _ = hop.scan(lambda c, x: (c, x), init, xs)
    assert carry.untyped_storage().data_ptr() != init.untyped_storage().data_ptr()
    carry, _ = hop.scan(lambda c, x: (x, x), init, xs)
    assert carry.untyped_storage().data_ptr() != xs.untyped_storage().data_ptr()
    carry = scan_op(lambda c, x: (c, x), (init,), (xs,), (), False)[0]
    assert carry.untyped_storage().data_ptr() != init.untyped_storage().data_ptr()


def test_meta_tensors() -> None:
    carry, ys = hop.scan(step, torch.empty(3, device="meta"), torch.empty(5, 3, device="meta"))
    assert carry.device.type == "meta" and ys.shape == (5, 3)


def test_raw_op_returns_a_bare_tensor_for_one_leaf() -> None:
    out = scan_op(lambda x: x * 2, (), (torch.ones(3, 2),), (), False)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 2)


# --- autograd ----------------------------------------------------------------------------------


def test_autograd(program: Any) -> None:
    fn, ref, inputs = program
    check_autograd(fn, ref, inputs)


def test_rnn_gradients_to_module_parameters_equal_the_python_loop() -> None:
    cell = torch.nn.GRUCell(3, 5)
    h0, xs = torch.zeros(2, 5), torch.randn(7, 2, 3)

    def loss(fn: Any) -> tuple[torch.Tensor, ...]:
        h, ys = fn(lambda h, x: (cell(x, h), cell(x, h).relu()), h0, xs)
        return torch.autograd.grad((h.sum() + ys.pow(2).sum()), list(cell.parameters()))

    for got, want in zip(loss(hop.scan), loss(reference_scan), strict=True):
        torch.testing.assert_close(got, want)


def test_backward_of_a_node_is_a_reverse_scan() -> None:
    def grads(init: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
        carry, ys = hop.scan(lambda c, x: ((c * w + x).sin(), c * x), init, xs)
        return torch.autograd.grad(carry.sum() + ys.sum(), (init, xs, w))

    args = (torch.randn(3, requires_grad=True), torch.randn(5, 3, requires_grad=True), torch.randn(3).requires_grad_())
    for mode in ("fake", "symbolic"):
        gm = make_fx(grads, tracing_mode=mode)(*args)
        scans = [n for n in gm.graph.nodes if n.target is scan_op]
        assert [n.args[-1] for n in scans] == [False, False, True]  # forward, carries, reverse vjp scan
        assert_close(gm(*args), grads(*args))


# --- jvp and the torch.func family ---------------------------------------------------------------


def test_jvp(program: Any) -> None:
    fn, ref, inputs = program
    check_jvp(fn, ref, inputs)


def test_torch_func_family() -> None:
    xs = torch.randn(4, 3, dtype=torch.float64)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return hop.scan(lambda c, x: ((c * x).sin(), c.sum()), c, xs)[1].sum()

    def ref(c: torch.Tensor) -> torch.Tensor:
        return reference_scan(lambda c, x: ((c * x).sin(), c.sum()), c, xs)[1].sum()  # type: ignore[no-any-return]

    c = torch.randn(3, dtype=torch.float64)
    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
        torch.testing.assert_close(transform(fn)(c), transform(ref)(c))
    batch = torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(torch.vmap(torch.func.grad(fn))(batch), torch.vmap(torch.func.grad(ref))(batch))


def test_traced_torch_func_differentiates_closed_over_tensors() -> None:
    def loss(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return hop.scan(lambda c, x: (c * w + x, (c * w).sin()), torch.zeros_like(w), xs)[1].sum()

    def tangents(w: torch.Tensor, xs: torch.Tensor) -> Any:
        return torch.func.jvp(lambda v: loss(v, xs), (w,), (torch.ones_like(w),))

    w, xs = torch.randn(3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    for f in (torch.func.grad(loss), torch.func.grad(lambda w, xs: torch.func.grad(loss)(w, xs).sin().sum()), tangents):
        gm = make_fx(f, tracing_mode="fake")(w, xs)
        assert any(n.target is scan_op for n in gm.graph.nodes)
        assert_close(gm(w, xs), f(w, xs))


def test_jvp_of_a_node_is_a_scan() -> None:
    def tangents(init: torch.Tensor, xs: torch.Tensor) -> Any:
        return torch.func.jvp(lambda c: hop.scan(step, c, xs), (init,), (torch.ones_like(init),))

    gm = make_fx(tangents, tracing_mode="fake")(C, XS)
    assert sum(n.target is scan_op for n in gm.graph.nodes) == 2
    assert_close(gm(C, XS), tangents(C, XS))


# --- vmap ------------------------------------------------------------------------------------------


def test_vmap_batched_xs(program: Any) -> None:
    fn, ref, inputs = program
    args = inputs[0]
    batched = (args[0], torch.stack([args[1], args[1] * -2, args[1] + 1]), *args[2:])
    check_vmap(fn, ref, batched, (None, 0, *[None] * (len(args) - 2)))


def test_vmap_batched_init_and_nested() -> None:
    inits, xs = torch.randn(3, 2, 4), torch.randn(5, 4)

    def fn(c: torch.Tensor) -> Any:
        return hop.scan(step, c, xs)

    check_vmap(torch.vmap(fn), lambda c: torch.vmap(lambda d: reference_scan(step, d, xs))(c), (inits,), (0,))


def test_vmap_of_a_node_scans_the_vmapped_body() -> None:
    inits, xs = torch.randn(3, 4), torch.randn(3, 5, 4)
    gm = make_fx(torch.vmap(simple, in_dims=(0, 1)), tracing_mode="fake")(inits, xs.transpose(0, 1))
    assert sum(n.target is scan_op for n in gm.graph.nodes) == 1
    assert_close(gm(inits, xs.transpose(0, 1)), torch.vmap(simple_ref)(inits, xs))


# --- functionalization --------------------------------------------------------------------------------


def test_functionalize() -> None:
    f = torch.func.functionalize(simple)
    assert_close(f(C, XS), simple_ref(C, XS))
    gm = make_fx(f, tracing_mode="fake")(C, XS)
    assert any(n.target is scan_op for n in gm.graph.nodes)
    assert_close(gm(C, XS[:3]), simple_ref(C, XS[:3]))


# --- fake / make_fx ---------------------------------------------------------------------------------


def test_fake_tensor_mode() -> None:
    with FakeTensorMode():
        carry, ys = hop.scan(lambda c, x: (c + x, (x * 2).sum()), torch.randn(3), torch.randn(6, 3))
    assert isinstance(ys, FakeTensor) and carry.shape == (3,) and ys.shape == (6,)


def test_make_fx(program: Any) -> None:
    fn, _, inputs = program
    check_make_fx(fn, scan_op, inputs[0], inputs)


def test_make_fx_symbolic_length_follows_the_input() -> None:
    gm = make_fx(simple, tracing_mode="symbolic")(C, XS)
    for n in (1, 7):
        xs = torch.randn(n, 3)
        assert_close(gm(C, xs), simple_ref(C, xs))


# --- export -------------------------------------------------------------------------------------------


class RNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = torch.nn.GRUCell(3, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, h0: torch.Tensor, xs: torch.Tensor) -> Any:
        return hop.scan(lambda h, x: (self.cell(x, h), self.cell(x, h) * self.scale), h0, xs)


def test_export_rnn_with_a_dynamic_sequence_length() -> None:
    m = RNN()
    dims = {"h0": None, "xs": {0: torch.export.Dim("T")}}
    h0 = torch.zeros(2, 4)
    ep = check_export(m, scan_op, (h0, torch.randn(5, 2, 3)), [(h0, torch.randn(n, 2, 3)) for n in (1, 5, 9)], dims)
    node = next(n for n in ep.graph.nodes if n.target is scan_op)
    params = ["p_cell_weight_ih", "p_cell_weight_hh", "p_cell_bias_ih", "p_cell_bias_hh", "b_scale"]
    assert [a.name for a in node.args[3]] == params


class Programs(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def test_export_program_table(program: Any) -> None:
    fn, _, inputs = program
    check_export(Programs(fn), scan_op, inputs[0], inputs)


def test_export_dynamic_dim_that_is_not_the_first() -> None:
    dims = {"args": (None, {1: torch.export.Dim("T")})}
    xs = XS.T.contiguous()
    ep = check_export(Programs(dim1), scan_op, (C[:1], xs), [(C[:1], torch.randn(3, n)) for n in (2, 6)], dims)
    assert any(n.target is scan_op for n in roundtrip(ep).graph.nodes)


def test_torch_compile_default() -> None:
    m = RNN()
    h0, xs = torch.zeros(2, 4), torch.randn(5, 2, 3)
    torch._dynamo.reset()
    compiled = torch.compile(m)
    assert_close(compiled(h0, xs), m(h0, xs))
    assert_close(compiled(h0, xs[:2]), m(h0, xs[:2]))


# --- errors --------------------------------------------------------------------------------------------


def _error(cls: type[HopError], fn: Any, init: Any = None, xs: Any = None, **kwargs: Any) -> str:
    init = torch.zeros(3) if init is None else init
    xs = torch.ones(4, 3) if xs is None else xs
    with pytest.raises(cls) as info:
        hop.scan(fn, init, xs, **kwargs)
    return str(info.value)


def test_combine_fn_not_returning_a_pair() -> None:
    def bad(c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return c + x

    msg = _error(HopTypeError, bad)
    assert msg.startswith("hop.scan: combine_fn must return a (next_carry, y) pair, got Tensor (combine_fn is ")
    assert ".bad (test_scan.py:" in msg
    assert msg.endswith("Return a tuple (next_carry, y); use () or None for an empty carry or no y.")
    assert "got a tuple of length 3" in _error(HopTypeError, lambda c, x: (c, x, x))


def test_carry_changing_dtype_names_the_path() -> None:
    def bad(c: dict[str, Any], x: torch.Tensor) -> Any:
        return {"h": c["h"] + x, "n": [c["n"][0].double()]}, x

    msg = _error(OutputMismatchError, bad, init={"h": torch.zeros(3), "n": [torch.zeros(())]})
    assert msg.startswith('hop.scan: combine_fn: carry["n"][0]: init and next_carry differ: dtype float32 vs float64 ')
    assert ".bad (test_scan.py:" in msg
    assert msg.endswith("combine_fn must return a next_carry with the structure, dtypes, devices and shapes of init.")


def test_carry_changing_structure_rank_or_shape() -> None:
    msg = _error(OutputMismatchError, lambda c, x: ((c, c), x))
    assert msg.startswith("hop.scan: combine_fn: carry: init and next_carry differ: structure * vs (*, *) ")
    msg = _error(OutputMismatchError, lambda c, x: (c[None] + x, x))
    assert "carry: init and next_carry differ: rank 1 vs 2 (shapes (3,) vs (1, 3))" in msg
    msg = _error(OutputMismatchError, lambda c, x: (torch.cat([c, x]), x))
    assert "carry: init and next_carry differ: shape (3,) vs (6,)" in msg


def test_carry_mismatch_is_reported_the_same_when_traced() -> None:
    def bad(c: torch.Tensor, x: torch.Tensor) -> Any:
        return c.double(), x

    with pytest.raises(OutputMismatchError, match=r"^hop.scan: combine_fn: carry: init and next_carry differ: dtype"):
        torch.export.export(Programs(lambda i, x: hop.scan(bad, i, x)), (torch.zeros(3), torch.ones(4, 3)))


def test_xs_leaves_of_different_lengths() -> None:
    msg = _error(HopValueError, lambda c, x: (c, x[0]), xs=(torch.ones(4, 3), {"k": torch.ones(5, 3)}))
    assert msg == (
        'hop.scan: xs[1]["k"]: has length 5 along dim 0, but xs[0] has length 4. '
        "Give every leaf of xs the same length along dim 0."
    )


def test_dim_out_of_range() -> None:
    msg = _error(HopValueError, lambda c, x: (c, x), dim=2)
    assert msg == "hop.scan: xs: dim 2 is out of range for a tensor of rank 2. Pass a dim in [-2, 1]."
    with pytest.raises(HopTypeError, match=r"^hop.scan: dim must be an int, got str$"):
        hop.scan(lambda c, x: (c, x), torch.zeros(3), torch.ones(4, 3), dim="0")  # type: ignore[arg-type]


def test_ys_that_cannot_be_stacked() -> None:
    sizes = iter(range(1, 5))
    msg = _error(HopValueError, lambda c, x: (c, x[: next(sizes)]))
    assert "hop.scan: combine_fn: y: iterations 0 and 1 differ: shape (1,) vs (2,) (combine_fn is" in msg
    msg = _error(HopValueError, lambda c, x: (c, {"k": 3}))
    assert msg.startswith('hop.scan: combine_fn: y["k"]: must be a tensor, got int (combine_fn is')
    msg = _error(HopValueError, lambda c, x: (c, x.sum()), xs=torch.ones(3, 4), dim=1)
    assert msg.startswith("hop.scan: combine_fn: y: a tensor of rank 0 cannot be stacked along dim 1 (combine_fn is")


def test_argument_types() -> None:
    with pytest.raises(HopTypeError, match=r"^hop.scan: combine_fn must be callable, got int$"):
        hop.scan(3, torch.zeros(1), torch.ones(2, 1))  # type: ignore[arg-type]
    with pytest.raises(HopTypeError, match=r"^hop.scan: init\[1\]: must be a tensor, got float"):
        hop.scan(lambda c, x: (c, x), (torch.zeros(1), 0.5), torch.ones(2, 1))
    with pytest.raises(HopTypeError, match=r"^hop.scan: dim must be an int, got str"):
        hop.scan(lambda c, x: (c, x), torch.zeros(1), (), dim="0")  # type: ignore[arg-type]
    with pytest.raises(HopTypeError, match=r"^hop.scan: reverse must be a bool, got int$"):
        hop.scan(lambda c, x: (c, x), torch.zeros(1), torch.ones(2, 1), reverse=1)  # type: ignore[arg-type]


def test_in_place_update_runs_in_eager_and_is_refused_when_traced() -> None:
    def f(c: torch.Tensor, x: torch.Tensor) -> Any:
        c.add_(x)
        return c * 1, x * 1

    init = torch.zeros(3)
    carry, _ = hop.scan(f, init, torch.ones(4, 3))
    assert torch.equal(carry, torch.full((3,), 4.0))
    with pytest.raises(
        MutationError, match=r"^hop.scan: combine_fn \(.*\.f \(test_scan.py:\d+\)\) writes carry 0 in place.*another"
    ):
        make_fx(lambda i, x: hop.scan(f, i, x), tracing_mode="fake")(torch.zeros(3), torch.ones(4, 3))


# --- tracing bugs found by torch's own test suite ----------------------------------------------------------


@pytest.mark.parametrize("length", [4, 0])
def test_make_fx_real_never_runs_a_nested_loop_on_placeholder_values(length: int) -> None:
    seen: list[torch.Tensor] = []
    observe = observer(seen)

    def inner_cond(j: torch.Tensor, w: torch.Tensor) -> Any:
        observe(w)
        return (j < 40) & ~(w.sum() >= 8)  # a data-dependent trip count; NaN keeps it going

    def step(c: torch.Tensor, x: torch.Tensor) -> Any:
        _, w = hop.while_loop(inner_cond, lambda j, w: (j + 1, w + 1), (torch.zeros((), dtype=torch.int64), c + x))
        return w * 0.5, w.sum()

    fn = lambda c, xs: hop.scan(step, c, xs)  # noqa: E731
    gm = traced_with_nan_fill(fn, "real", (torch.zeros(3), torch.ones(length, 3)))
    assert all_finite(seen), "a loop in combine_fn ran on uninitialized memory"
    for n in (0, 3):
        args = (torch.randn(3), torch.randn(n, 3))
        assert_close(gm(*args), fn(*args))


def with_a_new_tensor(c: torch.Tensor, xs: torch.Tensor) -> Any:  # torch.tensor in the body: no mutation
    return hop.scan(lambda c, x: (c + x * torch.tensor([1.0, 2.0, 3.0]), c.sum() + torch.tensor([5.0])), c, xs)


def test_a_combine_fn_building_a_tensor_from_python_data_traces_and_exports() -> None:
    inputs = [(torch.randn(3), torch.randn(4, 3)), (torch.randn(3), torch.randn(4, 3))]
    check_make_fx(with_a_new_tensor, scan_op, inputs[0], inputs)
    with torch.no_grad():  # no closure lifting before the op: its proxy rule sees the constant first
        check_make_fx(with_a_new_tensor, scan_op, inputs[0], inputs)
    check_export(Programs(with_a_new_tensor), scan_op, inputs[0], inputs)


@pytest.mark.parametrize("how", ["eager", "make_fx", "compile"])
def test_no_xs_returns_init_and_no_ys(how: str) -> None:
    # hop raised "xs must contain at least one tensor"; a Python loop over nothing (and torch's scan) returns init
    init = (torch.randn(3), {"h": torch.randn(2)})

    def program(a: torch.Tensor, b: torch.Tensor) -> Any:
        return hop.scan(lambda c, x: (c, c), (a, {"h": b}), [])

    if how == "make_fx":
        run: Any = make_fx(program, tracing_mode="symbolic")(init[0], init[1]["h"])
    elif how == "compile":
        torch._dynamo.reset()
        run = torch.compile(program, backend="aot_eager", fullgraph=True)
    else:
        run = program
    carry, ys = run(init[0], init[1]["h"])
    assert ys == []
    torch.testing.assert_close(carry[0], init[0])
    torch.testing.assert_close(carry[1]["h"], init[1]["h"])
    if how == "eager":
        assert carry[0] is not init[0]  # outputs never alias inputs
