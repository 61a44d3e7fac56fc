"""hop's dispatcher: modes, subclasses, missing rules, torch-function, no leaked state."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from apply_op import apply
from conftest import dispatch_state
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode

import hop
from hop.errors import MissingRuleError


class PassThrough(TorchDispatchMode):
    """A user mode that knows nothing of HOPs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def dense_only(name: str) -> hop.HigherOrderOperator:
    op = hop.HigherOrderOperator(name)

    @op.py_impl(DispatchKey.CompositeExplicitAutograd)
    def dense(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
        return fn(*xs)

    return op


# --- modes ---------------------------------------------------------------------------


def test_mode_without_hop_support_runs_the_kernel_with_the_mode_active() -> None:
    # Note [user modes]: the mode sees the ops inside, as for a plain Python call
    seen: list[str] = []

    class Logging(PassThrough):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2)
    with Logging():
        before = dispatch_state()
        with hop.debug.trace() as records:
            out = apply(torch.sin, x)
        assert dispatch_state() == before
    torch.testing.assert_close(out, x.sin())
    assert seen == ["sin"]
    assert any(r.route == "kernel under user mode" and r.detail == "Logging" for r in records)


def test_mode_supporting_hops_gets_torch_dispatch() -> None:
    seen: list[Any] = []

    class Recorder(PassThrough):
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is apply:
                seen.append(func)
                fn, *xs = args
                with self:  # handlers run with the mode popped; re-enter for the body
                    return fn(*xs)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2)
    with Recorder():
        out = apply(torch.cos, x)
    assert seen == [apply]
    torch.testing.assert_close(out, x.cos())


def test_mode_rule_runs_with_the_mode_popped() -> None:
    op = dense_only("mode_popped")
    inside: list[int] = []

    class Counted(PassThrough):
        pass

    @op.py_impl(Counted)
    def counted(mode: Counted, fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
        inside.append(torch._C._len_torch_dispatch_stack())
        return op(fn, *xs)

    x = torch.randn(2)
    with Counted():
        out = op(torch.sin, x)
    assert inside == [0]
    torch.testing.assert_close(out, x.sin())


def test_mode_rule_is_found_for_a_subclass_of_the_registered_mode() -> None:
    x = torch.randn(3)

    class MyFake(FakeTensorMode):
        pass

    with MyFake():
        fx = torch.empty(3)
        out = apply(torch.sin, fx)
    assert out.shape == x.shape


# --- subclasses ------------------------------------------------------------------------


def test_subclass_rule() -> None:
    op = dense_only("on_two_tensor")

    @op.py_impl(TwoTensor)
    def two(fn: Callable[..., Any], x: TwoTensor) -> TwoTensor:
        return TwoTensor(op(fn, x.a), op(fn, x.b))

    t = TwoTensor(torch.zeros(2), torch.ones(2))
    out = op(torch.cos, t)
    assert isinstance(out, TwoTensor)
    torch.testing.assert_close(out.b, torch.ones(2).cos())


def test_subclass_without_rule_is_a_missing_rule_error() -> None:
    op = dense_only("no_two_tensor")
    t = TwoTensor(torch.zeros(2), torch.ones(2))
    with pytest.raises(MissingRuleError, match=r"hop.no_two_tensor: has no rule for the tensor subclass TwoTensor"):
        op(torch.cos, t)


# --- missing rules -----------------------------------------------------------------------


def test_missing_autograd_rule() -> None:
    op = dense_only("no_autograd")
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(MissingRuleError, match=r"hop.no_autograd: has no autograd rule for dispatch key AutogradCPU"):
        op(torch.sin, x)
    with torch.no_grad():
        op(torch.sin, x)  # grad off: below autograd, no rule needed


@pytest.mark.parametrize(
    ("transform", "name"),
    [
        (lambda f: torch.vmap(f), "Vmap"),
        (lambda f: torch.func.grad(lambda x: f(x).sum()), "Grad"),
        (lambda f: lambda x: torch.func.jvp(f, (x,), (x,)), "Jvp"),
        (lambda f: torch.func.functionalize(f), "Functionalize"),
    ],
)
def test_missing_transform_rule_is_not_a_key_error(transform: Callable[..., Any], name: str) -> None:
    op = dense_only(f"no_{name.lower()}")
    before = dispatch_state()
    with pytest.raises(
        MissingRuleError, match=rf"hop.no_{name.lower()}: has no rule for the functorch transform {name}"
    ):
        transform(lambda x: op(torch.sin, x))(torch.randn(2))
    assert dispatch_state() == before


def test_missing_dense_kernel() -> None:
    op = hop.HigherOrderOperator("no_dense")
    with pytest.raises(MissingRuleError, match=r"hop.no_dense: has no kernel for dispatch key CPU"):
        op(torch.sin, torch.randn(2))


# --- torch function ------------------------------------------------------------------------


def test_torch_function_modes_see_the_call() -> None:
    seen: list[Any] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        out = apply(torch.sin, torch.zeros(2))
    assert apply in seen
    torch.testing.assert_close(out, torch.zeros(2))


# --- no leaked state after an error ----------------------------------------------------------


def boom(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom")


@contextlib.contextmanager
def fake() -> Iterator[None]:
    with FakeTensorMode():
        yield


def _export(f: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return f(x)

    return lambda x: torch.export.export(M(), (x,))


ROUTES: dict[str, Callable[[Callable[[torch.Tensor], Any]], Callable[[torch.Tensor], Any]]] = {
    "dense": lambda f: f,
    "autograd": lambda f: lambda x: f(x.requires_grad_()),
    "vmap": lambda f: torch.vmap(f),
    "grad": lambda f: torch.func.grad(lambda x: f(x).sum()),
    "jvp": lambda f: lambda x: torch.func.jvp(f, (x,), (x,)),
    "functionalize": lambda f: torch.func.functionalize(f),
    "make_fx": lambda f: make_fx(f, tracing_mode="symbolic"),
    "export": _export,
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_state_is_restored_when_a_kernel_raises(route: str) -> None:
    before = dispatch_state()
    with pytest.raises(ValueError, match="boom"):
        ROUTES[route](lambda x: apply(boom, x))(torch.randn(3))
    assert dispatch_state() == before
    torch.testing.assert_close(apply(torch.sin, torch.zeros(2)), torch.zeros(2))  # still healthy


def test_state_is_restored_when_the_fake_rule_raises() -> None:
    before = dispatch_state()
    with pytest.raises(ValueError, match="boom"), FakeTensorMode():
        apply(boom, torch.empty(2))
    assert dispatch_state() == before


def test_state_is_restored_when_the_fast_path_kernel_raises() -> None:
    before = dispatch_state()
    with pytest.raises(ValueError, match="boom"):
        apply(boom, torch.randn(2))
    assert dispatch_state() == before
    w = torch.randn(2, requires_grad=True)
    assert (w * 2).requires_grad  # autograd is not left excluded


# --- observability ------------------------------------------------------------------------


def test_trace_records_each_decision() -> None:
    x = torch.randn(2, requires_grad=True)
    with hop.debug.trace() as rec:
        apply(torch.sin, x)
    assert str(rec[0]).startswith("test_apply: AutogradCPU -> kernel apply_autograd")
    assert rec[0].op == "test_apply" and rec[0].kernel == "apply_autograd"
    assert not hop.debug.SINKS  # removed on exit


def test_hop_log_env_logs_to_stderr() -> None:
    code = "import sys, torch; sys.path.insert(0, 'tests'); from apply_op import apply; apply(torch.sin, torch.ones(2))"
    env = {**os.environ, "HOP_LOG": "dispatch"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert "[hop.dispatch] test_apply: AutogradCPU -> below-autograd" in proc.stderr
    assert "[hop.dispatch] test_apply: CPU -> kernel apply_dense" in proc.stderr
