"""hop.fori_loop: static and tensor bounds; eager, grad, vmap, export; errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import OpCounts, check_autograd, check_eager, check_export, check_jvp
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, OutputMismatchError
from hop.ops.while_loops.while_loop import while_loop_op


def reference(lower: int, upper: int, body_fn: Any, init_val: Any) -> Any:
    val = init_val
    for i in range(lower, upper):
        val = body_fn(i, val)
    return val


def body(i: Any, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"h": v["h"] * 0.9 + i * v["c"], "c": v["c"].sin()}


def static(x: torch.Tensor) -> Any:
    return hop.fori_loop(2, 7, body, {"h": x, "c": x.cos()})


def static_ref(x: torch.Tensor) -> Any:
    return reference(2, 7, body, {"h": x, "c": x.cos()})


def dynamic(x: torch.Tensor, n: torch.Tensor) -> Any:
    return hop.fori_loop(torch.tensor(0), n, body, {"h": x, "c": x.cos()})


def dynamic_ref(x: torch.Tensor, n: torch.Tensor) -> Any:
    return reference(0, int(n), body, {"h": x, "c": x.cos()})


X = torch.tensor([0.2, -0.4, 1.0])


def test_eager() -> None:
    check_eager(static, static_ref, [(X,), (-X,)])
    check_eager(dynamic, dynamic_ref, [(X, torch.tensor(3)), (X, torch.tensor(0))])


def test_index_is_an_int_with_int_bounds_and_a_tensor_with_tensor_bounds() -> None:
    seen: list[Any] = []
    hop.fori_loop(0, 2, lambda i, v: seen.append(i) or v, torch.zeros(1))
    assert type(seen[-1]) is int and seen[-2:] == [0, 1]
    hop.fori_loop(torch.tensor(0), torch.tensor(1), lambda i, v: seen.append(i) or v, torch.zeros(1))
    assert type(seen[-1]) is torch.Tensor
    # one tensor bound (either one) makes the counter a tensor, as docs/fori_loop.md says
    for lower, upper in ((0, torch.tensor(2)), (torch.tensor(0), 2)):
        seen.clear()
        hop.fori_loop(lower, upper, lambda i, v: seen.append(i) or v, torch.zeros(1))
        assert all(type(i) is torch.Tensor and i.dtype == torch.int64 for i in seen[-2:]), seen
        assert [int(i) for i in seen[-2:]] == [0, 1]


def test_empty_range_returns_a_fresh_copy() -> None:
    x = torch.ones(2)
    out = hop.fori_loop(5, 5, lambda i, v: v + 1, x)
    torch.testing.assert_close(out, x)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_autograd_and_jvp() -> None:
    check_autograd(static, static_ref, [(X,)])
    check_jvp(static, static_ref, [(X,)])
    check_autograd(dynamic, dynamic_ref, [(X, torch.tensor(4))])


def test_vmap_with_batched_upper_bound() -> None:
    ns = torch.tensor([0, 2, 5])
    out = torch.vmap(lambda n: hop.fori_loop(torch.tensor(0), n, lambda i, v: v + i, torch.zeros(2)))(ns)
    want = torch.stack([reference(0, int(n), lambda i, v: v + i, torch.zeros(2)) for n in ns])
    torch.testing.assert_close(out, want)


def test_vmap_over_the_value() -> None:
    xs = torch.randn(4, 3)
    out = torch.vmap(static)(xs)
    want = [static_ref(x) for x in xs]
    torch.testing.assert_close(out["h"], torch.stack([w["h"] for w in want]))


def test_traced_static_bounds_keep_one_loop() -> None:
    gm = make_fx(lambda x: static(x)["h"], tracing_mode="symbolic")(X)
    assert sum(n.target is while_loop_op for n in gm.graph.nodes) == 1
    torch.testing.assert_close(gm(-X), static_ref(-X)["h"])


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> Any:
        return dynamic(x, n)


def test_export_with_tensor_bounds() -> None:
    check_export(Model(), while_loop_op, (X, torch.tensor(3)), [(X, torch.tensor(1)), (-X, torch.tensor(6))])


def test_errors() -> None:
    with pytest.raises(HopTypeError, match=r"^hop.fori_loop: body_fn must be callable, got NoneType"):
        hop.fori_loop(0, 2, None, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(
        HopTypeError, match=r"^hop.fori_loop: upper must be an int, a SymInt or an integer tensor, got float"
    ):
        hop.fori_loop(0, 2.5, lambda i, v: v, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(
        OutputMismatchError, match=r"^hop.fori_loop: init_val and body_fn disagree at val: dtype float32 vs float64"
    ):
        hop.fori_loop(0, 3, lambda i, v: v.double(), torch.zeros(2))


def test_vmap_with_an_int_lower_and_a_batched_upper() -> None:
    ns = torch.tensor([0, 2, 5])
    out = torch.vmap(lambda n: hop.fori_loop(0, n, lambda i, v: v + i, torch.zeros(2)))(ns)
    want = torch.stack([reference(0, int(n), lambda i, v: v + i, torch.zeros(2)) for n in ns])
    torch.testing.assert_close(out, want)


def test_int_bounds_under_a_trace_without_symbols_name_fori_loop() -> None:
    # was: "hop.while_loop: body_fn changes carry[0] between iterations", naming an internal carry
    with pytest.raises(HopTypeError, match=r"^hop\.fori_loop: with int bounds the counter i is a Python int.*symbolic"):
        make_fx(lambda v: hop.fori_loop(0, 3, lambda i, u: u + i, v))(torch.zeros(2))
    traced = make_fx(lambda v, n: hop.fori_loop(0, n, lambda i, u: u + i, v))(torch.zeros(2), torch.tensor(3))
    torch.testing.assert_close(traced(torch.zeros(2), torch.tensor(4)), torch.full((2,), 6.0))


# --- a traced counted loop run eagerly (Note [running a traced body per step]) ---------------------


_COUNTER_OPS = ("_local_scalar_dense", "item", "scalar_tensor", "lt", "add")


def _counter_ops(counts: dict[str, int]) -> int:
    return sum(counts.get(name, 0) for name in _COUNTER_OPS)


class Counted(torch.nn.Module):
    def __init__(self, lower: int, upper: int, uses_i: bool) -> None:
        super().__init__()
        self.lower, self.upper, self.uses_i = lower, upper, uses_i
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)

    def step(self, i: Any, y: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(y @ self.w)
        return y * (0.5 + 0.01 * i) if self.uses_i else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(self.lower, self.upper, self.step, x)  # type: ignore[no-any-return]

    def python(self, x: torch.Tensor) -> torch.Tensor:
        return reference(self.lower, self.upper, self.step, x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("uses_i", [False, True])
def test_exported_counted_loop_moves_no_counter_per_step(uses_i: bool) -> None:
    # the counter of a traced fori_loop with int bounds travels as a tensor read with
    # .item() and rebuilt with scalar_tensor; run eagerly, the loop counts in Python:
    # the counter's ops run a fixed number of times, whatever the trip count
    x = torch.randn(3, 4)
    counts = {}
    for lower, upper in ((0, 5), (2, 40)):
        m = Counted(lower, upper, uses_i)
        ep = torch.export.export(m, (x,))
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(x), m.python(x))
            with OpCounts() as seen:
                ep.module()(x)
        assert seen.counts["tanh"] == upper - lower
        counts[upper - lower] = _counter_ops(seen.counts)
    assert counts[5] == counts[38]


def test_exported_counted_loop_saved_and_loaded(tmp_path: Any) -> None:
    x = torch.randn(3, 4)
    m = Counted(1, 9, uses_i=True)
    path = tmp_path / "counted.pt2"
    torch.export.save(torch.export.export(m, (x,)), path)
    loaded = torch.export.load(path).module()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m.python(x))


def test_traced_counted_loop_with_a_symbolic_bound() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(0, x.shape[0], lambda i, y: y * 0.5 + i, x)  # type: ignore[no-any-return]

    gm = make_fx(f, tracing_mode="symbolic")(torch.ones(3))
    counts = set()
    for n in (0, 1, 7):
        with OpCounts() as seen:
            got = gm(torch.ones(n))
        torch.testing.assert_close(got, reference(0, n, lambda i, y: y * 0.5 + i, torch.ones(n)))
        assert seen.counts.get("mul", 0) == n
        counts.add(_counter_ops(seen.counts) - seen.counts.get("add", 0))  # y * 0.5 + i adds once per step
    assert len(counts) == 1


def test_traced_counted_loop_forward_and_backward_equal_eager() -> None:
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = hop.fori_loop(0, 30, lambda i, y: torch.tanh(y @ w) * (1 + 0.01 * i), x)
        return torch.autograd.grad(y.sum(), (x, w))

    x, w = torch.randn(2, 4), torch.randn(4, 4) * 0.5
    gm = make_fx(step, tracing_mode="fake")(x, w)
    with OpCounts() as seen:
        got = gm(x, w)
    torch.testing.assert_close(got, step(x, w))
    # 3 * 30 runs of the body: the forward loop, the scan that stacks its carries, the
    # scan that pulls the gradient back (which recomputes tanh); the forward loop counts
    # in Python, the stacking scan still carries the counter as a tensor (one scalar_tensor
    # a step), the pulling one reads it (one .item() a step) and drops the rest
    assert seen.counts["tanh"] == 90 and seen.counts["tanh_backward"] == 30
    assert seen.counts.get("scalar_tensor", 0) <= 30 + 2 and seen.counts.get("_local_scalar_dense", 0) <= 60 + 4


def test_traced_counted_loop_follows_a_recompiled_body() -> None:
    gm = make_fx(lambda x: hop.fori_loop(0, 4, lambda i, y: y.sin(), x), tracing_mode="fake")(torch.ones(2))
    torch.testing.assert_close(gm(torch.ones(2)), reference(0, 4, lambda i, y: y.sin(), torch.ones(2)))
    body = next(
        m for m in gm.modules() if m is not gm and any(n.target is torch.ops.aten.sin.default for n in m.graph.nodes)
    )
    for node in body.graph.nodes:
        if node.target is torch.ops.aten.sin.default:
            node.target = torch.ops.aten.cos.default
    body.recompile()
    torch.testing.assert_close(gm(torch.ones(2)), reference(0, 4, lambda i, y: y.cos(), torch.ones(2)))
