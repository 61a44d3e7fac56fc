"""Note [plain eager]: one definition, asked by every path in the same states.

Each state below (nothing active, a user's dispatch or torch-function mode, a
default device, a tracer, a transform, hop's own modes) is entered, and inside it
every definition is asked: ``hop._transforms.in_plain_eager`` (the definition), its
cheap part ``nothing_active`` in Python and in the C module, and the inline cache's
``_served``. They must agree with the table and with each other; and wherever it is
plain eager, a cond must behave as under a Python ``if``: the user's mode sees the
taken branch run, and the untaken branch is still validated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hop
from hop import _transforms
from hop import _validation as validation
from hop.errors import OutputMismatchError
from hop.ops.branching import _call_cache


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CallLog(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class WantsOperators(TorchFunctionMode):
    """A torch-function mode that takes hop's operators whole, as hop's own do."""

    supports_higher_order_operators = True

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _probe() -> dict[str, bool]:
    answers = {
        "in_plain_eager": _transforms.in_plain_eager(),
        "nothing_active": _transforms.nothing_active(),
        "served": _call_cache._served(),
    }
    if _call_cache.BUILT:
        from hop import _fastpath

        answers["c_nothing_active"] = _fastpath.nothing_active()
    return answers


def _under_mode(mode: Callable[[], Any]) -> Callable[[Callable[[], Any]], Any]:
    def run(fn: Callable[[], Any]) -> Any:
        with mode():
            return fn()

    return run


def _in_make_fx(fn: Callable[[], Any]) -> Any:
    box = []
    make_fx(lambda x: box.append(fn()) or x)(torch.zeros(2))
    return box[0]


def _in_export(fn: Callable[[], Any]) -> Any:
    box = []

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            box.append(fn())
            return x + 1

    torch.export.export(M(), (torch.zeros(2),))
    return box[0]


def _in_vmap(fn: Callable[[], Any]) -> Any:
    box = []
    torch.vmap(lambda x: box.append(fn()) or x)(torch.zeros(2))
    return box[0]


def _in_grad(fn: Callable[[], Any]) -> Any:
    box = []
    torch.func.grad(lambda x: box.append(fn()) or x.sum())(torch.zeros(2))
    return box[0]


@contextlib.contextmanager
def _fake() -> Iterator[None]:
    with torch._subclasses.fake_tensor.FakeTensorMode():
        yield


# state -> (how to enter it, whether it is plain eager)
STATES: dict[str, tuple[Callable[[Callable[[], Any]], Any], bool]] = {
    "nothing": (lambda fn: fn(), True),
    "user dispatch mode": (_under_mode(OpLog), True),
    "user torch-function mode": (_under_mode(CallLog), True),
    "default device": (_under_mode(lambda: torch.device("cpu")), True),
    "both user modes": (lambda fn: _under_mode(OpLog)(lambda: _under_mode(CallLog)(fn)), True),
    "fake tensor mode": (_under_mode(_fake), False),
    "torch-function mode taking operators": (_under_mode(WantsOperators), False),
    "user mode under make_fx": (lambda fn: _in_make_fx(lambda: _under_mode(OpLog)(fn)), False),
    "make_fx": (_in_make_fx, False),
    "torch.export": (_in_export, False),
    "vmap": (_in_vmap, False),
    "grad": (_in_grad, False),
}


@pytest.mark.parametrize("state", list(STATES))
def test_every_definition_agrees(state: str) -> None:
    enter, plain = STATES[state]
    answers = enter(_probe)
    assert answers["in_plain_eager"] is plain, answers
    if answers["nothing_active"]:  # the cheap part never takes more than plain eager
        assert answers["in_plain_eager"]
    assert answers["served"] is answers["nothing_active"]  # validate "once", no sink: the cache serves exactly then
    if "c_nothing_active" in answers:
        assert answers["c_nothing_active"] is answers["nothing_active"]


def _taken(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def _untaken_other_dtype(x: torch.Tensor) -> torch.Tensor:
    return x.cos().double()


def _untaken(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


@pytest.mark.parametrize("mode", [OpLog, CallLog])
@pytest.mark.parametrize("op", ["cond", "switch"])
def test_a_user_mode_sees_the_branch_and_validation_still_runs(mode: type, op: str) -> None:
    validation.clear()
    x = torch.randn(3)

    def call(untaken: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if op == "cond":
            return hop.cond(torch.tensor(True), _taken, untaken, (x,))
        return hop.switch(torch.tensor(0), [_taken, untaken], (x,))

    seen = []
    for _ in range(3):  # the first call validates, the second makes the entry, the third finds it
        with mode() as log:
            out = call(_untaken)
        torch.testing.assert_close(out, x.sin())
        seen.append(log.ops.count("sin"))
        assert "cos" not in log.ops  # neither the untaken branch nor validation's fake run
    assert seen == [1, 1, 1]
    with pytest.raises(OutputMismatchError), mode():
        call(_untaken_other_dtype)


def test_a_default_device_reaches_the_branch() -> None:
    """``torch.device(...)`` as a context manager: a branch's factory call makes its
    tensor there, as under a Python ``if`` (the fake run makes it there too)."""
    validation.clear()
    x = torch.randn(3)
    with torch.device("meta"):
        for _ in range(2):
            out = hop.cond(torch.tensor(True, device="cpu"), lambda a: torch.zeros(3), lambda a: torch.ones(3), (x,))
            assert out.device.type == "meta"
