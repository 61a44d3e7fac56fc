"""hop.fori_loop: static and tensor bounds; eager, grad, vmap, export; errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import check_autograd, check_eager, check_export, check_jvp
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, OutputMismatchError
from hop.ops.while_loop import while_loop_op


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
