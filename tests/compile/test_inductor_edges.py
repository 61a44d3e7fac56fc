"""Edge cases of hop's operators under Inductor: zero-length scans, int outputs of
branches, loop carries that change size. Each test compiles one small program."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hop
from hop.compile._torch_api import VERSION
from hop.errors import CompileUnsupported
from hop.testing import check
from hop.testing.strategies import with_layout


def _scans(xs: torch.Tensor) -> Any:
    ys = hop.map(lambda r: r * 2, xs)
    carry, zs = hop.scan(lambda c, r: (c * r, c + r), torch.ones(2), xs)
    return ys, carry, zs


@pytest.mark.parametrize("dynamic", [False, True])
def test_zero_length_map_and_scan(dynamic: bool) -> None:
    """A length-0 map or scan runs no step: empty ys and a copy of init, as in eager
    (the rewritten loop's body was traced anyway, and its bound checks failed). With
    ``dynamic=True``, length 0 recompiles after a length-4 call (0 is specialized)."""
    torch._dynamo.reset()
    compiled = torch.compile(_scans, backend="inductor", fullgraph=True, dynamic=dynamic)
    for n in (4, 0) if dynamic else (0,):
        xs = torch.randn(n, 2)
        torch.testing.assert_close(compiled(xs), _scans(xs))
    torch._dynamo.reset()


def _masked_scans(x: torch.Tensor) -> Any:
    xs = x[x > 0]  # a data-dependent length, 0 for some inputs
    ys = hop.map(lambda r: r * 2, xs)
    forward = hop.scan(lambda c, r: (c + r, c * r), torch.zeros(()), xs)
    backward = hop.scan(lambda c, r: (c + r, c * r), torch.zeros(()), xs, reverse=True)
    prefix = hop.associative_scan(lambda p, q: p + q, xs, dim=0)
    suffix = hop.associative_scan(torch.maximum, xs, dim=0, reverse=True)
    return ys, forward, backward, prefix, suffix


def test_data_dependent_lengths_that_are_zero() -> None:
    """Note [scans as while loops]: the rewritten loops never check their counter
    against a symbolic length, which made Inductor assert the length >= 1 before the
    loop (a RuntimeError "u0 >= 1" for an x[mask] with no element)."""
    torch._dynamo.reset()
    compiled = torch.compile(_masked_scans, backend="inductor", fullgraph=True)
    for values in ([1.0, -2.0, 3.0], [-1.0, -2.0, -3.0], [5.0, 6.0, 7.0, 8.0], [-4.0]):
        x = torch.tensor(values)
        torch.testing.assert_close(compiled(x), _masked_scans(x))
    torch._dynamo.reset()


def _ints(a: torch.Tensor) -> Any:
    """cond and switch branches returning ints beside tensors: constants they agree on
    or not, a size, an ``.item()``; a bare int output; each int used after the call."""
    y, n, same = hop.cond(a.sum() > 0, lambda u: (u * 2, (u > 0).sum().item(), 7), lambda u: (u - 1, 3, 7), (a,))
    index = (a.sum() > 0).long() + (a.sum() > 5).long()
    branches = [
        lambda u: (u * 2, 4, u.shape[0]),
        lambda u: (u - 1, 5, u.shape[0]),
        lambda u: (u + 1, (u > 0).sum().item(), u.shape[0]),
    ]
    z, m, rows = hop.switch(index, branches, (a,))
    bare = hop.cond(a.sum() > 0, lambda u: u.shape[0] * 2, lambda u: u.shape[0] + 1, (a,))
    return y * n + z * m + rows * same, torch.zeros(m).sum() + bare, n, m


_INT_INPUTS = [torch.randn(6, 3), -torch.rand(6, 3), torch.rand(5, 3) + 1, torch.rand(4, 3) * 0.1]


@pytest.mark.parametrize("dynamic", [False, True])
def test_int_outputs_of_branches(dynamic: bool) -> None:
    """Inductor's conditional holds tensors only: ints leave the branches as 0-dim
    tensors and are read back after it (Note [int outputs of branches])."""
    torch._dynamo.reset()
    compiled = torch.compile(_ints, backend="inductor", fullgraph=True, dynamic=dynamic)
    for x in _INT_INPUTS:
        torch.testing.assert_close(compiled(x), _ints(x))
    torch._dynamo.reset()


def test_int_outputs_of_branches_backward() -> None:
    """The backward cond and switch get None as the int outputs' cotangents: not operands
    of Inductor's conditional."""

    def f(a: torch.Tensor) -> torch.Tensor:
        y, n = hop.cond(a.sum() > 0, lambda u: (u * 2, (u > 0).sum().item()), lambda u: (u - 1, 3), (a,))
        z, m = hop.switch((a.sum() > 0).long(), [lambda u: (u.sin(), 4), lambda u: (u - 1, 5)], (a,))
        return y * n + z * m

    torch._dynamo.reset()
    x = torch.randn(6, 3, requires_grad=True)
    out = torch.compile(f, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x), torch.autograd.grad(f(x).sum(), x))
    torch._dynamo.reset()


def _sized_cond(a: torch.Tensor) -> Any:
    return hop.cond(a.sum() > 0, lambda u: (u[:2], 2), lambda u: (u[:3], 3), (a,))


def _sized_switch(a: torch.Tensor) -> Any:
    return hop.switch((a.sum() > 0).long(), [lambda u: u[:2] * 2, lambda u: u[:3]], (a,))


_SIZED = [
    (_sized_cond, "hop.cond: branches returning ints beside outputs whose sizes differ between the branches"),
    (_sized_switch, "hop.switch: branches whose output sizes differ"),
]


@pytest.mark.parametrize(("fn", "message"), _SIZED, ids=["cond", "switch"])
def test_rewritten_branches_of_differing_sizes_are_refused(fn: Any, message: str) -> None:
    """The rewrite builds torch's cond, which cannot unify data-dependent sizes that differ
    between branches: a clear refusal, before any code is generated, not torch's TypeError."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape(message + " (a data-dependent size) do not compile")) as info:
        torch.compile(fn, backend="inductor", fullgraph=True)(torch.rand(6, 3))
    assert any(isinstance(e, CompileUnsupported) for e in _causes(info.value))
    torch._dynamo.reset()


def _grow(s: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda a: a.shape[0] < 8, lambda a: torch.cat([a, a[-1:] + 1]), (s,))[0] * 2


def _shrink(s: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda a: a.sum() > 1, lambda a: a[a > a.mean()] * 0.9, (s,))[0] + 1


def _fori_grow(s: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, 3, lambda i, a: torch.cat([a, a[-1:] + i]), s)


_RESIZED = "loop carries that change size between iterations ({}, dim 0) do not compile with Inductor"
_CARRIES = [
    (_grow, torch.zeros(2), "hop.while_loop: " + _RESIZED.format("carry 0")),
    (_shrink, torch.tensor([3.0, 1, 2, 5]), "hop.while_loop: " + _RESIZED.format("carry 0")),
    (_fori_grow, torch.zeros(2), "hop.fori_loop: " + _RESIZED.format("init_val leaf 0")),
]


@pytest.mark.parametrize(("fn", "x", "message"), _CARRIES, ids=["grow", "shrink", "fori"])
def test_resized_carries_are_refused_with_fullgraph(fn: Any, x: torch.Tensor, message: str) -> None:
    """Inductor's while loop keeps carries at their initial size: Dynamo refuses the loop
    (before any Inductor build) with a message that says what to do instead."""
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=re.escape(message)) as info:
        torch.compile(fn, backend="inductor", fullgraph=True)(x)
    assert 'backend="aot_eager"' in str(info.value)
    torch._dynamo.reset()


def test_resized_carries_break_the_graph_without_fullgraph() -> None:
    """The loop runs eagerly, the rest compiles: the result is eager's."""
    torch._dynamo.reset()
    for fn, x, _ in _CARRIES:
        torch.testing.assert_close(torch.compile(fn, backend="inductor")(x), fn(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("entry", ["aoti_compile_and_package", "aot_compile"])
def test_resized_carries_are_refused_by_aoti(entry: str) -> None:
    """An exported program reaches Inductor without Dynamo's check: hop's post-grad pass
    refuses the loop (the build stops before any code is generated), and the AOTInductor
    entry point raises that CompileUnsupported itself, not Inductor's wrapper of it."""

    class Grow(torch.nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return _grow(s)

    ep = torch.export.export(Grow(), (torch.zeros(2),))
    with pytest.raises(CompileUnsupported, match=re.escape(_CARRIES[0][2])) as info:
        if entry == "aot_compile":
            torch._inductor.aot_compile(ep.module(), (torch.zeros(2),))
        else:
            torch._inductor.aoti_compile_and_package(ep)
    assert 'backend="aot_eager"' in str(info.value)
    assert isinstance(info.value.__cause__, torch._inductor.exc.InductorError)


def test_aoti_leaves_other_errors_as_they_were() -> None:
    entry = torch._inductor.aoti_compile_and_package
    errors = []
    for call in (entry, entry.__wrapped__):  # hop's wrapper, and torch's own function
        with pytest.raises(Exception) as info:
            call("not a program")
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _reversed(t: torch.Tensor) -> torch.Tensor:
    # a gather then a reshape: the traced strides are floor divisions of the size symbol
    return t.reshape(-1)[torch.arange(t.numel() - 1, -1, -1)].reshape(t.shape)


_GATHERED = [
    lambda x: hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 0.5), (0, _reversed(_reversed(x))))[1],
    lambda x: hop.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (_reversed(_reversed(x)),)),
    lambda x: hop.scan(lambda c, r: (c + r, c), torch.zeros_like(x[0]), _reversed(_reversed(x)))[0],
]


@pytest.mark.parametrize(
    "fn",
    _GATHERED,
    ids=["while_loop", "cond", "scan"],
)
def test_operands_whose_traced_strides_are_floor_divisions(fn: Any) -> None:
    # Note [operands keep their traced strides]: an operand made by a gather then a
    # reshape, under dynamic shapes (found by the compiled fuzzer's long profile)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)
    for n in (3, 4):
        x = torch.randn(n, n, n)
        torch.testing.assert_close(compiled(x), fn(x))


def _ponder(x: torch.Tensor) -> Any:
    # a scan over dim 1: each slice has stride (length,) and starts a nested loop's carry
    def body(c: torch.Tensor, r: torch.Tensor) -> Any:
        _, s = hop.while_loop(lambda n, s: (n < 3) & (s.abs().sum() < 1e3), lambda n, s: (n + 1, s * 0.5 + c), (0, r))
        return c + s, s

    return hop.scan(body, torch.zeros_like(x[:, 0]), x.t())


def test_scanned_slices_feeding_a_nested_loop_keep_its_traced_strides() -> None:
    # Inductor: slices of a transposed xs reached the nested loop with strides its
    # carry does not keep (torch 2.13: a forward codegen failure; later releases:
    # torch's while_loop refused the carry in training)
    torch._dynamo.reset()
    compiled = torch.compile(_ponder, backend="inductor", fullgraph=True, dynamic=True)
    for n in (3, 5):
        x = torch.randn(4, n, dtype=torch.float64, requires_grad=True)
        out, ys = compiled(x)
        expected, expected_ys = _ponder(x)
        torch.testing.assert_close((out, ys), (expected, expected_ys))
        (grad,) = torch.autograd.grad((out.sum() + ys.pow(2).sum()), x)
        (expected_grad,) = torch.autograd.grad((expected.sum() + expected_ys.pow(2).sum()), x)
        torch.testing.assert_close(grad, expected_grad)


_TORCH_213_SCATTER = pytest.mark.xfail(
    VERSION < (2, 14),
    strict=True,
    reason="torch 2.13's Inductor (C++ codegen: assert index.is_vec) cannot vectorize an accumulating "
    "index_put whose index is a constant, into a tensor whose last dim has size 1; torch 2.14 builds it. "
    "A loud error, never a wrong value",
)


@_TORCH_213_SCATTER
def test_index_select_backward_inside_a_loop_body() -> None:
    # found by the compiled fuzzer's long profile: the backward of the map's body
    # recomputes the index (a constant) beside index_select's backward, an
    # accumulating index_put, which is the pattern of the next test
    def fn(y: torch.Tensor) -> Any:
        return hop.map(lambda r: r.index_select(0, torch.zeros(r.shape[0], dtype=torch.long)) * r, y)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)
    for n in (3, 5):
        y = torch.randn(4, n, 1, dtype=torch.float64, requires_grad=True)
        (got,) = torch.autograd.grad(compiled(y).sum(), y)
        (want,) = torch.autograd.grad(fn(y).sum(), y)
        torch.testing.assert_close(got, want)


@_TORCH_213_SCATTER
def test_the_same_scatter_without_hop() -> None:
    """The previous test's failure is torch's, not hop's: the same accumulating index
    put in a plain program, with no hop operator, fails alike on torch 2.13."""

    def fn(r: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(r).index_add(0, torch.zeros(r.shape[0], dtype=torch.long), r * 2) + r

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    r = torch.randn(5, 1)
    torch.testing.assert_close(compiled(r), fn(r))


def _scan_then_combine(x: torch.Tensor) -> Any:
    carry, ys = hop.scan(lambda c, r: (c + r, r * c), x.sum(-1), x, dim=-1, reverse=True)
    return (ys + carry.unsqueeze(-1),)


def test_aoti_of_a_scan_whose_outputs_are_combined() -> None:
    check(_scan_then_combine, torch.tensor([1.5, 2.0, -1e-5]), transforms=("eager", "aoti"))


def _zero_trips_fori(x: torch.Tensor, y: torch.Tensor) -> Any:
    a = hop.fori_loop(0, (y.sum() > 100).long(), lambda i, c: c * 0.5 + i, x.sin())
    return a, y.cos() * 2


def _zero_trips_while(x: torch.Tensor, y: torch.Tensor) -> Any:
    _, a = hop.while_loop(lambda k, c: (k < 3) & (c.sum() > 100), lambda k, c: (k + 1, c * 0.5), (0, x.sin()))
    return a, y.cos() * 2, x.sin() + 1


@pytest.mark.parametrize("fn", [_zero_trips_fori, _zero_trips_while], ids=["fori_loop", "while_loop"])
def test_aoti_of_a_loop_that_runs_no_step(fn: Any) -> None:
    # the C++ wrapper's loop returned the storage of its carried input, which the
    # memory planner then gave to the kernel after it: y.cos() * 2, silently
    check(fn, torch.randn(3), torch.randn(3), transforms=("eager", "aoti"))


def _reversed(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)[torch.arange(t.numel() - 1, -1, -1)].reshape(t.shape)


def _switch_of_a_reversal(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.switch((y.sum() > 0).long(), [lambda a: _reversed(a * x), lambda a: a], (y,)) * x


def test_a_rewritten_branch_output_whose_size_is_spelled_otherwise() -> None:
    # found by the compiled fuzzer's long profile: under dynamic shapes the reversal's
    # last size is traced as (s**2)//s, and torch's cond (which hop's switch is rewritten
    # to) failed to merge the branches' strides ("not a simple accumulative multiplication")
    check(_switch_of_a_reversal, torch.randn(4, 2, 2), torch.randn(4, 2, 2), transforms=("eager", "compile_inductor"))


def _switch_returning_its_operand(x: torch.Tensor, y: torch.Tensor) -> Any:
    return hop.switch(((x.sum().abs() * 3).long() % 2), [lambda a: a, lambda a: a], (x,))


def test_an_empty_branch_output_with_a_free_stride() -> None:
    # found by the compiled fuzzer's long profile: an empty operand of an odd layout,
    # returned by both branches, has under dynamic shapes a stride torch left a free
    # symbol (the stride of its dimension of size 0), and torch's cond refused it as
    # not dense ("not a simple accumulative multiplication of sizes")
    x = with_layout(torch.empty(0, 4, 4), "channels_last")
    check(_switch_returning_its_operand, x, x, transforms=("eager", "compile_inductor"))


def _last_dim_scan(s: torch.Tensor, reverse: bool) -> torch.Tensor:
    carry, ys = hop.scan(lambda c, r: (c + r, r * c), s.sum(-1), s, dim=-1, reverse=reverse)
    return ys + carry.unsqueeze(-1)


def _scans_over_the_last_dim(x: torch.Tensor, y: torch.Tensor) -> Any:
    a = _last_dim_scan(y * x, False)
    _, w = hop.while_loop(
        lambda i, a: (i < 0) & (a.reshape(-1)[:1].sum() < 0.5), lambda i, a: (i + 1, a), (torch.tensor(0), a)
    )
    return w, _last_dim_scan(y, True)


@pytest.mark.parametrize("shape", [(1, 1), (2, 3)])
def test_aoti_of_scans_over_the_last_dim(shape: tuple[int, ...]) -> None:
    # found by the compiled fuzzer's long profile: the loop read its slices through a
    # raw handle the C++ wrapper freed at the first use (a segfault), once the package
    # built at all (it failed to, on a redeclared buffer)
    check(_scans_over_the_last_dim, torch.randn(shape), torch.randn(shape), transforms=("eager", "aoti"))


def _switch_over_a_counted_loop_beside_an_int_carry(x: torch.Tensor, y: torch.Tensor) -> Any:
    def branch(a: torch.Tensor) -> torch.Tensor:
        looped = hop.fori_loop(2, torch.tensor(5), lambda i, c: x + 0.1 * i, torch.maximum(y, a))
        return ((looped + looped.sum() * 0.1) * a).cos() + a

    index = ((y.reshape(-1)[:1].sum() > 0).long() + 1) % 1
    stopped = hop.while_loop(lambda i, a: (i < 0) & (a.reshape(-1)[:1].sum() < 0.5), lambda i, a: (i + 1, a), (0, y))
    return hop.switch(index, [branch], (y,)), stopped[1]


def test_a_switch_over_a_counted_loop_beside_an_int_carry() -> None:
    # found by the compiled fuzzer's long profile: a switch of one branch is inlined by
    # the rewrite, so the loop's own .item() read came before the switch's int outputs
    # ("0 int outputs but 1 reads were rewritten"); then, in the backward, Inductor's
    # fake-tensor update failed on that read's symbol, which had no binding
    args = (torch.tensor(1.3234434127807617), torch.tensor(0.27824223041534424))
    check(_switch_over_a_counted_loop_beside_an_int_carry, *args, transforms=("eager", "compile_inductor"))


def _one_branch_switch_over_a_loop(x: torch.Tensor, y: torch.Tensor) -> Any:
    def branch(a: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(0, torch.tensor(3), lambda i, c: c * x + i, a)

    return hop.switch((y > 0).long() * 0, [branch], (y,))


def _one_branch_switch_over_a_loop_beside_an_int(x: torch.Tensor, y: torch.Tensor) -> Any:
    def branch(a: torch.Tensor) -> Any:
        return hop.fori_loop(0, torch.tensor(3), lambda i, c: c * x + i, a), 2

    looped, n = hop.switch((y > 0).long() * 0, [branch], (y,))
    return looped * n


@pytest.mark.parametrize(
    "fn", [_one_branch_switch_over_a_loop, _one_branch_switch_over_a_loop_beside_an_int], ids=["alone", "beside_an_int"]
)
def test_a_one_branch_switch_over_a_loop_with_a_tensor_bound(fn: Any) -> None:
    # the loop's bound is read with .item() inside the inlined branch: that read is not
    # one of the switch's int outputs
    check(fn, torch.tensor(0.5), torch.tensor(0.3), transforms=("eager", "compile_inductor"))


def _switch_in_a_loop_over_a_scanned_carry(x: torch.Tensor, y: torch.Tensor) -> Any:
    # the associative_scan over the last dim returns a (n, 1) tensor of strides (1, n)
    start = hop.associative_scan(lambda a, b: a + b, y * 0.75, dim=-1, reverse=True, combine_mode="pointwise")
    return hop.fori_loop(
        2,
        4,
        lambda i, a: (
            hop.switch(x.numel() % 2, [lambda o: a - a.sum(-1, keepdim=True) * 0.5, lambda o: a], (x,)) + 0.1 * i
        ),
        start,
    )


def test_a_switch_returning_a_carry_of_size_one_dims_laid_out_otherwise() -> None:
    # found by the compiled fuzzer's long profile: the loop's carry has strides (1, n) at
    # shape (n, 1), its body was traced on (1, 1), and torch's cond (the switch's rewrite)
    # refused branch outputs whose stride orders differ, in the forward (hop's loop re-run
    # by Inductor's fake-tensor update) and in the backward (the scan rewritten as a loop)
    check(
        _switch_in_a_loop_over_a_scanned_carry,
        torch.randn(2, 1),
        torch.randn(2, 1),
        transforms=("eager", "compile_inductor"),
    )


def _expanded_fori(u: torch.Tensor) -> Any:
    return hop.fori_loop(0, 3, lambda i, a: a + u * (i < 1 + (u > 2)).float(), torch.zeros(()).expand(4))


def _expanded_scan(u: torch.Tensor) -> Any:
    return hop.scan(lambda c, x: (c + x, c * 2), torch.zeros(()).expand(4), torch.stack([u, u * 2]))


def _vmapped_while(u: torch.Tensor) -> Any:
    # vmap expands the unbatched initial carries (stride 0)
    def one(e: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: i < e, lambda i, a: (i + 1, a + e), (torch.zeros(()), torch.zeros(())))

    return torch.vmap(one)(u)


def _vmapped_grad_of_loop(x: torch.Tensor) -> Any:
    # hop broadcasts its own trip counter for the batched backward
    def one(a0: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: a > 1.0, lambda i, a: (i + 1, (a - 1).sqrt()), (torch.zeros(()), a0))[1]

    return torch.vmap(torch.func.grad(one))(x)


@pytest.mark.parametrize("program", [_expanded_fori, _expanded_scan, _vmapped_while, _vmapped_grad_of_loop])
def test_carries_with_stride_zero(program: Any) -> None:
    """Note [a traced loop's carries are dense]: Inductor's loop laid its outputs out as
    an expanded initial carry, so the body stored every element into one: each read
    back the last (silently wrong), or a vmapped loop never ended."""
    torch._dynamo.reset()
    u = torch.tensor([5.0, 0.5, 3.0, 17.0]) if program is _vmapped_grad_of_loop else torch.tensor([1.5, 3.0, 3.0, 3.0])
    expected = program(u)
    torch.testing.assert_close(torch.compile(program, backend="inductor", fullgraph=True)(u), expected)
    torch._dynamo.reset()


def _sliced_cond(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return hop.cond(p, lambda x, y: x + y, lambda x, y: x - y, (a[:-1], b[:-1]))


def _sliced_while(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = b[:-1]
    return hop.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x + y), (torch.tensor(0), a[:-1]))[1]


def _sliced_cond_true(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _sliced_cond(torch.tensor(True), a, b)


def _sliced_cond_false(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _sliced_cond(torch.tensor(False), a, b)


@pytest.mark.parametrize(
    ("program", "want"),
    [
        (_sliced_cond_true, lambda a, b: a[:-1] + b[:-1]),
        (_sliced_cond_false, lambda a, b: a[:-1] - b[:-1]),
        (_sliced_while, lambda a, b: a[:-1] + 3 * b[:-1]),
    ],
    ids=["cond_true", "cond_false", "while_loop"],
)
def test_slices_of_two_dynamic_inputs(program: Any, want: Any) -> None:
    # from torch's Inductor suite: Dynamo gives a and b a size symbol each and replaces
    # one by the other; a branch's size input was bound to the replaced one
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    torch._dynamo.mark_dynamic(a, 0)
    torch._dynamo.mark_dynamic(b, 0)
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(a, b), want(a, b))
    for n in (7, 2):
        a2, b2 = torch.randn(n, 3), torch.randn(n, 3)
        torch.testing.assert_close(compiled(a2, b2), want(a2, b2))


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_switch_in_a_map_body_over_transposed_slices(dynamic: bool) -> None:
    # found by hop.testing's long profile: the switch's operand r * 1.0 kept the slice's
    # transposed layout, and torch's cond (what a switch is rewritten into) passed it to
    # branches compiled for contiguous operands: Inductor's stride assert failed
    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda r: hop.switch((r.sum() > 0).long(), [lambda a: a, lambda a: a * 2], (r * 1.0,)), x)

    x = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="inductor", fullgraph=True, dynamic=dynamic)(x), f(x))


@pytest.mark.xfail(
    VERSION < (2, 15),
    strict=True,
    reason="torch 2.13/2.14's Inductor compares a re-evaluated SymBool node (a runtime assert's `u >= 0` "
    "inside a loop body) as if it were a SymInt (sympy.Eq of two relations) in its fake-tensor update and "
    "raises TypeError; 2.15 compiles it. A loud error, never a wrong value; not yet avoided on hop's side",
)
def test_vmap_of_a_counted_loop_over_a_loop_with_an_int_counter() -> None:
    # found by the compiled fuzzer's long profile (compile_inductor_vmap)
    def fn(x: torch.Tensor) -> Any:
        def body(i: Any, a: torch.Tensor) -> torch.Tensor:
            return hop.while_loop(lambda k, v: k < 1, lambda k, v: (k + 1, v), (0, a))[1] + 0.1 * i

        return hop.fori_loop(2, torch.tensor(3), body, x * 0.5)

    torch._dynamo.reset()
    xs = torch.randn(3)
    got = torch.compile(torch.vmap(fn), backend="inductor", fullgraph=True, dynamic=True)(xs)
    torch.testing.assert_close(got, torch.stack([fn(x) for x in xs]))
