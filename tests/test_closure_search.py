"""What the closure search (``hop._closures.closure_tensors``) finds beyond cells and
globals: parameters a branch or body reaches only through a user's module or class
(``config.W``, ``Shared.W``), a function or method kept there (``config.helper``,
``Tools.scale``), a class attribute read through an object, or a method of a module.
Each must get a gradient (zeros from an untaken branch: Note [untaken branches get
zero gradients]), and a loop reading one must differentiate with respect to it, as
the same Python code does. A library's modules and classes are not searched."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest
import torch

import hop
from hop._closures import closure_tensors
from hop.errors import HopRuntimeError

# A config module holding a parameter, and a nested one; a class holding one, inherited.
_CONFIG = types.ModuleType("_hop_test_config")
_CONFIG.W = torch.nn.Parameter(torch.full((3,), 2.0))  # type: ignore[attr-defined]
_CONFIG.sub = types.ModuleType("_hop_test_config.sub")  # type: ignore[attr-defined]
_CONFIG.sub.V = torch.nn.Parameter(torch.full((3,), 3.0))  # type: ignore[attr-defined]


class _Shared:
    W = torch.nn.Parameter(torch.full((3,), 4.0))


class _Derived(_Shared):
    pass


# A user's helpers module, holding functions that read parameters kept elsewhere.
_HELPERS = types.ModuleType("_hop_test_helpers")
_W_FN = torch.nn.Parameter(torch.full((3,), 2.0))
_W_STATIC = torch.nn.Parameter(torch.full((3,), 3.0))
_W_METHOD = torch.nn.Parameter(torch.full((3,), 5.0))
_W_FORWARD = torch.nn.Parameter(torch.full((3,), 6.0))


def _scale(a: torch.Tensor) -> torch.Tensor:
    return a * _W_FN  # read by the helper only, not by the branch


_HELPERS.scale = _scale  # type: ignore[attr-defined]


class _Tools:
    @staticmethod
    def scale(a: torch.Tensor) -> torch.Tensor:
        return a * _W_STATIC

    @classmethod
    def shift(cls, a: torch.Tensor) -> torch.Tensor:
        return a + cls.BIAS

    BIAS = torch.nn.Parameter(torch.full((3,), 7.0))


class _Holder:
    """A plain object (not a Module) whose parameter is a class attribute."""

    W = torch.nn.Parameter(torch.full((3,), 4.0))

    def apply(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.W


class _Block(torch.nn.Module):
    """A module whose method reads a parameter kept as a global (a shared table)."""

    def scaled(self, a: torch.Tensor) -> torch.Tensor:
        return a * _W_METHOD


class _Head(torch.nn.Module):
    """A module whose forward reads a parameter kept as a global: called as a branch."""

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * _W_FORWARD


@dataclasses.dataclass(slots=True)
class _Slotted:
    """A config object without a ``__dict__``: its parameter is in a slot."""

    W: torch.Tensor


_HOLDER = _Holder()
_SLOTTED = _Slotted(torch.nn.Parameter(torch.full((3,), 8.0)))
_BLOCK = _Block()
_HEAD = _Head()


def _via_module_attribute(a: torch.Tensor) -> torch.Tensor:
    return a * _CONFIG.W


def _via_nested_module_attribute(a: torch.Tensor) -> torch.Tensor:
    return a * _CONFIG.sub.V


def _via_class_attribute(a: torch.Tensor) -> torch.Tensor:
    return a * _Derived.W  # inherited: found through the class's MRO


def _via_module_function(a: torch.Tensor) -> torch.Tensor:
    return _HELPERS.scale(a)


def _via_staticmethod(a: torch.Tensor) -> torch.Tensor:
    return _Tools.scale(a)


def _via_classmethod(a: torch.Tensor) -> torch.Tensor:
    return _Tools.shift(a)


def _via_instance_class_attribute(a: torch.Tensor) -> torch.Tensor:
    return a * _HOLDER.W


def _via_module_method(a: torch.Tensor) -> torch.Tensor:
    return _BLOCK.scaled(a)


_CASES = [
    (_via_module_attribute, _CONFIG.W),
    (_via_nested_module_attribute, _CONFIG.sub.V),
    (_via_class_attribute, _Shared.W),
    ((lambda cfg: lambda a: a * cfg.W)(_CONFIG), _CONFIG.W),  # a module in a closure cell
    (_via_module_function, _W_FN),
    (_via_staticmethod, _W_STATIC),
    (_via_classmethod, _Tools.BIAS),
    (_via_instance_class_attribute, _Holder.W),
    (_HOLDER.apply, _Holder.W),  # a bound method as the branch: its class is searched
    (_via_module_method, _W_METHOD),
    (_HEAD, _W_FORWARD),  # a module as the branch: its forward is searched
    ((lambda head: lambda a: head(a))(_HEAD), _W_FORWARD),  # a module in a closure cell, called
    ((lambda cfg: lambda a: a * cfg.W)(_SLOTTED), _SLOTTED.W),
]
_IDS = [
    "module-attr",
    "nested-module-attr",
    "class-attr",
    "module-in-cell-attr",
    "module-function",
    "staticmethod",
    "classmethod",
    "instance-class-attr",
    "bound-method",
    "module-method",
    "module-as-branch",
    "module-in-cell",
    "slots",
]


@pytest.mark.parametrize(("branch", "param"), _CASES, ids=_IDS)
def test_found_by_the_search(branch: Any, param: torch.Tensor) -> None:
    assert any(t is param for t in closure_tensors([branch]))


@pytest.mark.parametrize(("branch", "param"), _CASES, ids=_IDS)
def test_untaken_branch_gives_zeros(branch: Any, param: torch.Tensor) -> None:
    x = torch.randn(3)
    for _ in range(3):  # the first call validates, later ones take the fast paths
        param.grad = None
        hop.cond(torch.tensor(True), torch.sin, branch, (x,)).sum().backward()
        assert param.grad is not None and not param.grad.any()
        param.grad = None
        hop.switch(torch.tensor(0), [torch.cos, branch], (x,)).sum().backward()
        assert param.grad is not None and not param.grad.any()
        param.grad = None
        hop.cond(torch.tensor(False), torch.sin, branch, (x,)).sum().backward()
        want = torch.autograd.grad(branch(x).sum(), param)[0]
        torch.testing.assert_close(param.grad, want)


@pytest.mark.parametrize(("branch", "param"), _CASES, ids=_IDS)
def test_raw_operator_differentiates_what_the_body_reads(branch: Any, param: torch.Tensor) -> None:
    """torch.ops.hop.* takes the autograd route only when the search finds a tensor
    requiring grad: a miss would run it below autograd, silently without gradient."""
    x = torch.randn(3)
    param.grad = None
    out = torch.ops.hop.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, branch(v)), (torch.tensor(0), x), ())
    assert out[1].requires_grad
    out[1].sum().backward()
    want = torch.autograd.grad(branch(branch(x)).sum(), param)[0]
    torch.testing.assert_close(param.grad, want)


@pytest.mark.parametrize(("branch", "param"), _CASES, ids=_IDS)
def test_checkpointed_loop_differentiates_what_the_body_reads(branch: Any, param: torch.Tensor) -> None:
    x = torch.randn(3)
    param.grad = None
    out = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, branch(v)), (torch.tensor(0), x), checkpoint=True)
    out[1].sum().backward()
    want = torch.autograd.grad(branch(branch(branch(x))).sum(), param)[0]
    torch.testing.assert_close(param.grad, want)


def test_a_users_package_named_like_a_standard_module_is_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the standard library's own modules (loaded from its directory) are skipped."""
    package = types.ModuleType("nntplib")  # a standard module's name, which torch never imports
    package.__file__ = "/home/user/project/nntplib/__init__.py"
    package.W = torch.nn.Parameter(torch.full((3,), 2.0))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nntplib", package)
    namespace: dict[str, Any] = {"nntplib": package}
    branch = eval("lambda a: a * nntplib.W", namespace)  # reads the package as a global
    for _ in range(3):
        package.W.grad = None
        hop.cond(torch.tensor(True), torch.sin, branch, (torch.randn(3),)).sum().backward()
        assert package.W.grad is not None and not package.W.grad.any()


class _Linear(torch.nn.Linear):
    """A user's subclass of a library module: its own class is searched, nn.Linear's is not."""


def test_library_namespaces_are_not_searched() -> None:
    lin = _Linear(3, 3)
    found = closure_tensors([lambda a: torch.nn.functional.gelu(lin(a))])
    assert {id(t) for t in found} == {id(lin.weight), id(lin.bias)}


# A parameter no static search can see: read through getattr with a computed name.
_HIDDEN = types.ModuleType("_hop_test_hidden")
_HIDDEN.W = torch.nn.Parameter(torch.full((3,), 1.5))  # type: ignore[attr-defined]
_HIDDEN_NAME = "W"


def _hidden_scale(v: torch.Tensor) -> torch.Tensor:
    return v * getattr(_HIDDEN, _HIDDEN_NAME)


def test_raw_operator_differentiates_what_the_search_cannot_see() -> None:
    """With nothing found that requires grad, the raw operator's callables still run with
    autograd on (Note [callables run with autograd on]): a tensor the search misses gets its
    gradient as in Python, never none."""
    w = _HIDDEN.W
    assert not any(t is w for t in closure_tensors([_hidden_scale]))
    x = torch.randn(3)
    cond = torch.tensor(True)
    scan_body = lambda c, a: (_hidden_scale(c), c + a)  # noqa: E731
    twice = lambda v: _hidden_scale(_hidden_scale(v))  # noqa: E731
    runs = {
        "while_loop": lambda: torch.ops.hop.while_loop(
            lambda i, v: i < 2, lambda i, v: (i + 1, _hidden_scale(v)), (torch.tensor(0), x), ()
        )[1],
        "cond": lambda: torch.ops.hop.cond(cond, twice, torch.sin, (x,)),
        "switch": lambda: torch.ops.hop.switch(torch.tensor(1), (x,), torch.sin, twice),
        "map": lambda: torch.ops.hop.map(twice, (x.unsqueeze(0),), ()),
        "scan": lambda: torch.ops.hop.scan(scan_body, (x,), (torch.ones(2, 3),), (), False)[0],
    }
    for name, run in runs.items():
        w.grad = None
        run().sum().backward()
        torch.testing.assert_close(w.grad, 2 * x * w.detach(), msg=name)


def test_checkpointed_loop_names_a_tensor_the_search_cannot_see() -> None:
    """The checkpointed loop differentiates what the search found only: a tensor it
    misses is a clear error, not a silently missing gradient."""
    _HIDDEN.W.grad = None
    x = torch.randn(3, requires_grad=True)
    out = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, _hidden_scale(v)), (0, x), checkpoint=True)[1]
    with pytest.raises(HopRuntimeError, match=r"checkpoint=True.*shape \[3\].*could not find"):
        out.sum().backward()
    assert _HIDDEN.W.grad is None
