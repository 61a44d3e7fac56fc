"""Every route of hop's dispatcher, exercised by the test-only ``apply`` HOP."""

from __future__ import annotations

import io

import pytest
import torch
from apply_op import apply
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop


def f(a: torch.Tensor) -> torch.Tensor:
    return a.sin() * 2


def f2(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a * b, a - b.cos()


def routes(records: list[hop.debug.DispatchRecord]) -> list[tuple[str, str]]:
    return [(r.key, r.route) for r in records]


# --- eager --------------------------------------------------------------------


def test_eager_cpu() -> None:
    x = torch.randn(5)
    torch.testing.assert_close(apply(f, x), f(x))
    a, b = apply(f2, x, x + 1)
    torch.testing.assert_close(a, x * (x + 1))
    torch.testing.assert_close(b, x - (x + 1).cos())


def test_eager_meta() -> None:
    x = torch.empty(2, 3, device="meta")
    out = apply(f, x)
    assert out.device.type == "meta" and out.shape == (2, 3)


def test_eager_returns_no_alias_of_inputs() -> None:
    x = torch.randn(3)
    out = apply(lambda a: a, x)
    assert out.untyped_storage()._cdata != x.untyped_storage()._cdata
    torch.testing.assert_close(out, x)


def test_eager_fast_path_lands_on_dense_kernel_below_autograd() -> None:
    x = torch.randn(3)
    with hop.debug.trace() as rec:
        apply(f, x)
    assert routes(rec) == [("AutogradCPU", "below-autograd"), ("CPU", "kernel")]
    # The fast path (no sinks) and the full path agree: the kernel runs below
    # autograd, so a closed-over tensor requiring grad records nothing.
    w = torch.randn(3, requires_grad=True)
    with hop.debug.trace():
        slow = apply(lambda a: a * w, x)
    fast = apply(lambda a: a * w, x)
    assert not slow.requires_grad and not fast.requires_grad
    assert torch.is_grad_enabled() and (x * w).requires_grad


def test_no_grad_goes_below_autograd() -> None:
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad(), hop.debug.trace() as rec:
        out = apply(f, x)
    assert not out.requires_grad
    assert routes(rec)[0] == ("AutogradCPU", "below-autograd")


# --- autograd -------------------------------------------------------------------


def test_autograd_gradcheck_and_gradgradcheck() -> None:
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: apply(f2, a, b), (x, y))
    assert torch.autograd.gradgradcheck(lambda a, b: apply(f2, a, b), (x, y))


def test_autograd_routes_to_autograd_rule() -> None:
    x = torch.randn(3, requires_grad=True)
    with hop.debug.trace() as rec:
        apply(f, x).sum().backward()
    assert ("AutogradCPU", "kernel") in routes(rec)
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


# --- functorch ------------------------------------------------------------------------


def test_vmap() -> None:
    y = torch.randn(4, 3)
    torch.testing.assert_close(torch.vmap(lambda a: apply(f, a))(y), f(y))
    torch.testing.assert_close(torch.vmap(lambda a: apply(f, a), in_dims=1)(y), f(y.t()))


def test_vmap_nested_and_partially_batched() -> None:
    y = torch.randn(2, 4, 3)
    z = torch.randn(3)
    out = torch.vmap(torch.vmap(lambda a, b: apply(f2, a, b)[0], in_dims=(0, None)), in_dims=(0, None))(y, z)
    torch.testing.assert_close(out, y * z)


def test_vmap_routes_to_transform_rule() -> None:
    with hop.debug.trace() as rec:
        torch.vmap(lambda a: apply(f, a))(torch.randn(2, 3))
    assert rec[0].route == "transform" and rec[0].detail is not None and rec[0].detail.startswith("Vmap")


def test_grad_jvp_and_friends() -> None:
    x = torch.randn(3, dtype=torch.float64)
    t = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(torch.func.grad(lambda a: apply(f, a).sum())(x), 2 * x.cos())
    _, tangent = torch.func.jvp(lambda a: apply(f, a), (x,), (t,))
    torch.testing.assert_close(tangent, 2 * x.cos() * t)
    jac = torch.diag(2 * x.cos())
    torch.testing.assert_close(torch.func.jacrev(lambda a: apply(f, a))(x), jac)
    torch.testing.assert_close(torch.func.jacfwd(lambda a: apply(f, a))(x), jac)
    torch.testing.assert_close(torch.func.hessian(lambda a: apply(f, a).sum())(x), torch.diag(-2 * x.sin()))
    _, vjp_fn = torch.func.vjp(lambda a: apply(f, a), x)
    torch.testing.assert_close(vjp_fn(t)[0], 2 * x.cos() * t)


def test_vmap_of_grad() -> None:
    y = torch.randn(5, 3, dtype=torch.float64)
    out = torch.vmap(torch.func.grad(lambda a: apply(f, a).sum()))(y)
    torch.testing.assert_close(out, 2 * y.cos())


def test_functionalize() -> None:
    x = torch.randn(3)
    out = torch.func.functionalize(lambda a: apply(f, a))(x)
    torch.testing.assert_close(out, f(x))
    gm = make_fx(torch.func.functionalize(lambda a: apply(f, a)))(x)
    assert "torch.ops.hop.test_apply" in gm.code


# --- fake and tracing -------------------------------------------------------------------


def test_fake_mode() -> None:
    with FakeTensorMode():
        x = torch.randn(2, 5)
        out = apply(f, x)
    assert isinstance(out, FakeTensor) and out.shape == (2, 5)


def test_fake_tensor_without_active_mode() -> None:
    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(4))
    with hop.debug.trace() as rec:
        out = apply(f, x)
    assert isinstance(out, FakeTensor) and out.shape == (4,)
    assert ("Python", "subclass") in routes(rec)


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_keeps_the_op_with_its_subgraph(tracing_mode: str) -> None:
    x = torch.randn(3)
    gm = make_fx(lambda a: apply(f, a) + 1, tracing_mode=tracing_mode)(x)
    calls = [n for n in gm.graph.nodes if n.target is apply]
    assert len(calls) == 1
    sub = calls[0].args[0]
    assert sub.op == "get_attr" and isinstance(getattr(gm, sub.target), torch.fx.GraphModule)
    assert "torch.ops.hop.test_apply(" in gm.code
    torch.testing.assert_close(gm(x), f(x) + 1)


def test_make_fx_symbolic_sizes_flow_into_the_subgraph() -> None:
    gm = make_fx(lambda a: apply(lambda b: b.new_zeros(b.shape[0] * 2), a), tracing_mode="symbolic")(torch.randn(3))
    assert gm(torch.randn(5)).shape == (10,)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply(lambda a, w, s: (a @ w).sin() * s, x, self.lin.weight, self.scale) + self.lin.bias


def _roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def test_export_module_decompositions_and_save_load() -> None:
    m = Model()
    x = torch.randn(4, 3)
    ep = torch.export.export(m, (x,))
    assert "torch.ops.hop.test_apply(" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(x), m(x))
    torch.testing.assert_close(ep.run_decompositions().module()(x), m(x))
    loaded = _roundtrip(ep)
    assert any(n.target is apply for n in loaded.graph.nodes)
    torch.testing.assert_close(loaded.module()(x), m(x))


def test_export_dynamic_shapes() -> None:
    m = Model()
    batch = torch.export.Dim("batch")
    ep = torch.export.export(m, (torch.randn(4, 3),), dynamic_shapes={"x": {0: batch}})
    for n in (2, 7):
        x = torch.randn(n, 3)
        torch.testing.assert_close(ep.module()(x), m(x))
        torch.testing.assert_close(_roundtrip(ep).module()(x), m(x))


def test_torch_compile_default() -> None:
    m = Model()
    x = torch.randn(4, 3)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(m)(x), m(x))
