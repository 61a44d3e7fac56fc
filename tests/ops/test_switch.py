"""hop.switch across the transform matrix, one section per column, then errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import check_autograd, check_eager, check_export, check_jvp, check_make_fx, check_vmap, roundtrip
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, HopValueError, OutputMismatchError
from hop.ops.branching.switch import switch_op


def branches(w: torch.Tensor) -> list[Any]:
    return [lambda a: a.sin() * w, lambda a: a.cos() + w, lambda a: (a * a).tanh() - w]


def program(i: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.switch(i, branches(w), (x,))


def reference(i: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return branches(w)[int(i)](x)


X, W = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.5, 0.5, -0.5])
INPUTS = [(torch.tensor(k), X, W) for k in range(3)]


# --- eager ------------------------------------------------------------------------------------


def test_eager() -> None:
    check_eager(program, reference, INPUTS)


def test_python_int_and_int_tensors() -> None:
    fns = [lambda a: a + 0, lambda a: a + 1, lambda a: a + 2]
    for k in range(3):
        assert hop.switch(k, fns, (torch.zeros(1),)).item() == k
        for dtype in (torch.int64, torch.int32, torch.uint8):
            assert hop.switch(torch.tensor([k], dtype=dtype), fns, (torch.zeros(1),)).item() == k


def test_pytree_outputs_and_operands() -> None:
    fns = [lambda d: {"y": d["x"] * 2, "n": d["x"].sum()}, lambda d: {"y": d["x"] - 1, "n": d["x"].mean()}]
    out = hop.switch(torch.tensor(1), fns, ({"x": torch.ones(2)},))
    torch.testing.assert_close(out["y"], torch.zeros(2))
    torch.testing.assert_close(out["n"], torch.tensor(1.0))


def test_raw_op_takes_both_layouts() -> None:
    fns = (lambda a: a + 1, lambda a: a * 3)
    x = torch.ones(2)
    torch.testing.assert_close(switch_op(torch.tensor(1), fns, (x,)), torch.full((2,), 3.0))
    torch.testing.assert_close(switch_op(torch.tensor(0), (x,), *fns), torch.full((2,), 2.0))


def test_index_out_of_range_raises_in_eager() -> None:
    fns = [lambda a: a, lambda a: a]
    for bad in (2, -1, torch.tensor(5), torch.tensor(-1)):
        with pytest.raises(HopValueError, match=r"^hop.switch: index -?\d is out of range for 2 branches"):
            hop.switch(bad, fns, (torch.ones(1),))  # type: ignore[arg-type]


# --- autograd, jvp ---------------------------------------------------------------------------------


def test_autograd() -> None:
    check_autograd(program, reference, INPUTS)


def test_jvp() -> None:
    check_jvp(program, reference, INPUTS)


# --- untaken branches get zero gradients -------------------------------------------------------
# Note [untaken branches get zero gradients]: every differentiable tensor a branch reads gets a
# gradient, zeros for the branches not taken, so that DDP needs no find_unused_parameters.


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(3))

    def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.switch(i, [lambda a, m=m: m(a).tanh() for m in self.experts], (x,))  # defaults capture


@pytest.mark.parametrize("k", [0, 1, 2])
def test_untaken_experts_get_zero_grads(k: int) -> None:
    model, x = Experts(), torch.randn(2, 3)
    for _ in range(3):  # the first call validates, later ones take the fast path
        model.zero_grad(set_to_none=True)
        model(torch.tensor(k), x).sum().backward()
        for j, expert in enumerate(model.experts):
            if j == k:
                want = torch.autograd.grad(expert(x).tanh().sum(), list(expert.parameters()))
                for p, w in zip(expert.parameters(), want, strict=True):
                    torch.testing.assert_close(p.grad, w)
            else:
                assert all(p.grad is not None and not p.grad.any() for p in expert.parameters())


def test_operand_and_closure_cell_the_taken_branch_ignores_get_zeros() -> None:
    x, y, w = (torch.randn(3, requires_grad=True) for _ in range(3))
    fns = [lambda a, b: a.sin(), lambda a, b: b * w, lambda a, b: a + b]
    for _ in range(3):
        x.grad = y.grad = w.grad = None
        hop.switch(torch.tensor(0), fns, (x, y)).sum().backward()
        torch.testing.assert_close(x.grad, x.detach().cos())
        assert y.grad is not None and w.grad is not None and not y.grad.any() and not w.grad.any()


_SW_W = torch.nn.Parameter(torch.full((3,), 2.0))


def _sw_sin(a: torch.Tensor) -> torch.Tensor:
    return a.sin()


def _sw_global(a: torch.Tensor) -> torch.Tensor:
    return a * _SW_W


@pytest.mark.parametrize("k", [0, 1, 2])
def test_long_hand_path_with_functions_and_builtins(k: int) -> None:
    # one tensor, closure-free functions and a builtin: switch's long-hand path
    branches = [_sw_sin, torch.tanh, _sw_global]
    want_fn = [torch.sin, torch.tanh, lambda a: a * 2.0][k]
    for _ in range(3):  # the first call validates, later ones take the long-hand path
        x = torch.randn(3, requires_grad=True)
        _SW_W.grad = None
        out = hop.switch(torch.tensor(k), branches, (x,))
        torch.testing.assert_close(out, want_fn(x))
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.autograd.grad(want_fn(x).sum(), x)[0])
        assert _SW_W.grad is not None and bool(_SW_W.grad.any()) == (k == 2)
        with torch.no_grad():
            y = torch.randn(2, 3)
            assert not hop.switch(torch.tensor(k), branches, (y,)).requires_grad
    same = hop.switch(torch.tensor(0), [lambda a: a, torch.tanh], (torch.ones(2),))
    same2 = hop.switch(torch.tensor(0), [lambda a: a, torch.tanh], (x := torch.ones(2),))
    assert same2 is not x and same2.data_ptr() != x.data_ptr() and torch.equal(same, same2)  # never an alias


def test_long_hand_path_checks_every_output() -> None:
    def changes(a: torch.Tensor) -> torch.Tensor:
        return a.to(_SW_DTYPE[0])

    _SW_DTYPE[0] = torch.float32
    x = torch.randn(3)
    for _ in range(2):
        hop.switch(torch.tensor(0), [changes, torch.sin], (x,))
    _SW_DTYPE[0] = torch.float64  # a global changes what the branch returns
    with pytest.raises(OutputMismatchError, match="branches\\[0\\]"):
        hop.switch(torch.tensor(0), [changes, torch.sin], (x,))


_SW_DTYPE = [torch.float32]


def _experts_loss(i: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    return hop.switch(i, [lambda a, w=w: (a @ w).sin().sum() for w in ws], (x,))


def test_torch_func_grad_agrees() -> None:
    x, ws = torch.randn(2, 3), [torch.randn(3, 3) for _ in range(3)]
    for k in range(3):
        got = torch.func.grad(lambda ws, k=k: _experts_loss(torch.tensor(k), x, ws))(ws)
        leaves = [w.detach().requires_grad_() for w in ws]
        _experts_loss(torch.tensor(k), x, leaves).backward()
        for g, leaf in zip(got, leaves, strict=True):
            torch.testing.assert_close(g, leaf.grad)
        assert [bool(g.any()) for g in got] == [j == k for j in range(3)]


def _experts_grads(i: torch.Tensor, x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Any:
    ws = [w.detach().requires_grad_() for w in (w0, w1, w2)]
    return torch.autograd.grad(_experts_loss(i, x, ws), ws)  # raises if one got None


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_traced_backward_gives_untaken_branches_zeros(mode: str) -> None:
    x, ws = torch.randn(2, 3), [torch.randn(3, 3) for _ in range(3)]
    gm = make_fx(_experts_grads, tracing_mode=mode)(torch.tensor(0), x, *ws)
    for k in range(3):
        got = gm(torch.tensor(k), x, *ws)
        for g, w in zip(got, _experts_grads(torch.tensor(k), x, *ws), strict=True):
            torch.testing.assert_close(g, w)
        assert [bool(g.any()) for g in got] == [j == k for j in range(3)]


# --- vmap ---------------------------------------------------------------------------------------------


def test_vmap_batched_index() -> None:
    index = torch.tensor([2, 0, 1, 1, 0])
    xs = torch.randn(5, 3)
    check_vmap(program, reference, (index, xs, W), (0, 0, None))


def test_vmap_batched_index_out_of_range() -> None:
    with pytest.raises(HopValueError, match=r"index 3 \(of a batch\) is out of range for 3 branches"):
        torch.vmap(program, in_dims=(0, 0, None))(torch.tensor([0, 3]), torch.randn(2, 3), W)


def test_vmap_batched_index_traced_keeps_a_runtime_assert() -> None:
    gm = make_fx(torch.vmap(program, in_dims=(0, 0, None)), tracing_mode="fake")(
        torch.tensor([0, 1]), torch.randn(2, 3), W
    )
    assert "_assert_async" in gm.code
    torch.testing.assert_close(
        gm(torch.tensor([1, 2]), X.expand(2, 3), W), torch.stack([X.cos() + W, (X * X).tanh() - W])
    )
    with pytest.raises(RuntimeError, match="index out of range for 3 branches"):
        gm(torch.tensor([1, 4]), X.expand(2, 3), W)


class _VmappedSwitch(torch.nn.Module):
    def forward(self, index: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return torch.vmap(program, in_dims=(0, 0, None))(index, xs, W)


@pytest.mark.parametrize("strict", [False, True])
def test_vmap_batched_index_exports(strict: bool) -> None:
    # switch's tracing rule read the batched index as a constant (vmap's .item() error)
    index, xs = torch.tensor([2, 0, 1]), torch.randn(3, 3)
    ep = roundtrip(torch.export.export(_VmappedSwitch(), (index, xs), strict=strict))
    for other in (index, torch.tensor([1, 1, 0]), torch.tensor([0, 2, 2])):
        torch.testing.assert_close(ep.module()(other, xs), _VmappedSwitch()(other, xs))
    # the program runs vmap, and so switch's vmap rule, which checks every element
    with pytest.raises(HopValueError, match=r"index 3 \(of a batch\) is out of range for 3 branches"):
        try:
            ep.module()(torch.tensor([0, 3, 1]), xs)
        finally:
            # torch's exported vmap region has no cleanup: an error inside it leaves its level
            while torch._C._functorch.maybe_current_level() is not None:
                torch._C._functorch._vmap_decrement_nesting()
    # a trace of the rule (what AOTInductor compiles) keeps the check as an assert
    lowered = ep.run_decompositions().module()
    torch.testing.assert_close(lowered(index, xs), _VmappedSwitch()(index, xs))
    with pytest.raises(RuntimeError, match="index out of range for 3 branches"):
        lowered(torch.tensor([0, 3, 1]), xs)


@pytest.mark.parametrize("how", ["export", "strict export", "compile"])
def test_a_mistake_under_vmap_in_a_traced_program_leaves_no_transform_level(how: str) -> None:
    class Mismatch(torch.nn.Module):
        def forward(self, index: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
            return torch.vmap(lambda i, v: hop.switch(i, [lambda a: a + 1, lambda a: a.double()], (v,)))(index, xs)

    args = (torch.tensor([0, 1, 1]), torch.randn(3, 4))
    with pytest.raises(OutputMismatchError, match="dtype float32 vs float64"):
        if how == "compile":
            torch.compile(Mismatch(), fullgraph=True, backend="aot_eager")(*args)
        else:
            torch.export.export(Mismatch(), args, strict=how == "strict export")
    assert torch._C._functorch.maybe_current_level() is None  # (and the autouse leak guard checks the rest)


def test_vmap_unbatched_index() -> None:
    xs = torch.randn(4, 3)
    out = torch.vmap(program, in_dims=(None, 0, None))(torch.tensor(2), xs, W)
    torch.testing.assert_close(out, (xs * xs).tanh() - W)


# --- fake, make_fx, export --------------------------------------------------------------------------


def test_fake() -> None:
    with FakeTensorMode():
        out = program(torch.tensor(1), torch.randn(3), torch.randn(3))
    assert out.shape == (3,)


def test_make_fx() -> None:
    check_make_fx(program, switch_op, INPUTS[0], INPUTS)


def test_make_fx_symbolic_index() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return hop.switch(x.shape[0] - 2, [lambda a: a + 1, lambda a: a * 2], (x,))

    gm = make_fx(fn, tracing_mode="symbolic")(torch.ones(3))
    assert any(n.target is switch_op for n in gm.graph.nodes)
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 2.0))
    torch.testing.assert_close(gm(torch.ones(3)), torch.full((3,), 2.0))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(W.clone())

    def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return program(i, x, self.w)


def test_export_and_runtime_assert() -> None:
    m = Model()
    inputs = [(torch.tensor(k), X * (k + 1)) for k in range(3)]
    ep = check_export(m, switch_op, inputs[0], inputs)
    node = next(n for n in ep.graph.nodes if n.target is switch_op)
    assert len(node.args) == 5  # (index, operands, *three branches)
    loaded = roundtrip(ep)
    with pytest.raises(RuntimeError, match="index out of range for 3 branches"):
        loaded.module()(torch.tensor(3), X)


def test_export_dynamic_shapes() -> None:
    dims = {"i": None, "x": {0: torch.export.Dim("n")}}
    inputs = [(torch.tensor(k), torch.randn(n)) for k, n in ((0, 5), (2, 7))]
    m = Model()
    m.w = torch.nn.Parameter(torch.tensor(0.5))
    check_export(m, switch_op, (torch.tensor(1), torch.randn(3)), inputs, dims)


# --- errors -----------------------------------------------------------------------------------------------


def test_empty_branches() -> None:
    with pytest.raises(HopValueError, match=r"^hop.switch: branches must be a non-empty list or tuple of callables"):
        hop.switch(0, [], (torch.ones(1),))


def test_branch_not_callable() -> None:
    with pytest.raises(HopTypeError, match=r"^hop.switch: branches\[1\] must be callable, got str"):
        hop.switch(torch.tensor(0), [lambda a: a, "no"], (torch.ones(1),))  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (torch.tensor(1.0), "index must be an integer tensor, got dtype float32"),
        (torch.tensor(True), "index must be an integer tensor, got dtype bool"),
        (torch.tensor([0, 1]), r"index must have exactly one element, got shape \(2,\)"),
        (1.5, "index must be an int, a SymInt or a one-element integer tensor, got float"),
    ],
)
def test_bad_index(index: Any, message: str) -> None:
    with pytest.raises((HopTypeError, HopValueError), match=message):
        hop.switch(index, [lambda a: a, lambda a: a], (torch.ones(1),))


def test_mismatch_names_the_branches_and_the_path() -> None:
    fns = [lambda a: {"h": a}, lambda a: {"h": a}, lambda a: {"h": a.int()}]
    with pytest.raises(OutputMismatchError, match=r'branches\[0\] and branches\[2\] disagree at output\["h"\]: dtype'):
        hop.switch(torch.tensor(0), fns, (torch.ones(1),))


def test_python_int_index_just_runs_that_branch() -> None:
    ran: list[int] = []
    fns = [lambda a: ran.append(0) or a, lambda a: ran.append(1) or a * 2]
    out = hop.switch(1, fns, (torch.ones(1),))
    assert ran == [1] and out.item() == 2.0
    gm = make_fx(lambda x: hop.switch(0, fns, (x,)))(torch.ones(1))
    assert not any(n.target is switch_op for n in gm.graph.nodes)
