"""An operator's rules as hop's dispatcher finds them: what it reads of an operator
(:class:`Operator`, a protocol: ``hop.HigherOrderOperator`` is one, and the
dispatcher below it does not import it), the lookup of a rule by dispatch key, by
mode or subclass type, or derived from a decomposition, and the errors it raises
when there is none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch._ops import resolve_key

from hop.errors import HopRuntimeError, MissingRuleError, UnsupportedModeError, format_message

__all__ = [
    "Derived",
    "Kernel",
    "Operator",
    "all_not_implemented",
    "find_kernel",
    "lookup_rule",
    "unsupported_mode",
]

Kernel = Callable[..., Any]


class Operator(Protocol):
    """What the dispatcher reads of an operator: torch's tables of rules, and hop's cache
    of resolved kernels (``hop.HigherOrderOperator`` is one; the dispatcher, below it,
    does not import it)."""

    @property
    def _hop_kernels(self) -> dict[DispatchKey, Kernel]: ...
    @property
    def py_kernels(self) -> Any: ...
    @property
    def functorch_table(self) -> Any: ...
    @property
    def python_key_table(self) -> Any: ...
    @property
    def non_fallthrough_keys(self) -> DispatchKeySet: ...
    @property
    def _hop_decomposition(self) -> Derived | None: ...
    def name(self) -> str: ...


class Derived(Protocol):
    """The rules an operator defined by a decomposition derives from it, for every route
    it has no rule of its own for (Note [an operator from its decomposition] in
    ``hop._decomposed``)."""

    def run(self, args: Any, kwargs: dict[str, Any]) -> Any: ...
    def proxy(self, op: Any, mode: Any, args: Any, kwargs: dict[str, Any]) -> Any: ...


def lookup_rule(table: dict[Any, Kernel], cls: type) -> Kernel | None:
    """The rule registered for ``cls`` or its nearest base class (also asked before a
    public function's call reaches the dispatcher: Note [tensor subclasses run as Python])."""
    for base in cls.__mro__:
        rule = table.get(base)
        if rule is not None:
            return rule
    return None


def find_kernel(
    op: Operator, key: DispatchKey, what: str = "kernel", target: str = "CompositeExplicitAutograd"
) -> Kernel:
    """The kernel for ``key`` (direct, alias or CompositeExplicitAutograd), cached per key."""
    kernel: Kernel | None = op._hop_kernels.get(key)
    if kernel is not None:
        return kernel
    try:
        kernel = op.py_kernels.get(resolve_key(cast(torch._ops.OperatorBase, op), key))
    except NotImplementedError:
        kernel = None
    if (kernel is None or isinstance(kernel, DispatchKey)) and op._hop_decomposition is not None:
        derived = op._hop_decomposition

        def kernel(*args: Any, **kwargs: Any) -> Any:
            return derived.run(args, kwargs)

    if kernel is None or isinstance(kernel, DispatchKey):
        raise MissingRuleError(
            format_message(
                op.name(),
                f"has no {what} for dispatch key {key.name}",
                fix=f"Register one with @torch.ops.hop.{op.name()}.py_impl(DispatchKey.{target}).",
            ),
            op=op.name(),
        )
    op._hop_kernels[key] = kernel
    return kernel


def unsupported_mode(op: Operator, mode: Any) -> UnsupportedModeError:
    name = type(mode).__qualname__
    return UnsupportedModeError(
        format_message(
            op.name(),
            f"the active TorchDispatchMode {name} has no rule for this operator",
            fix=f"Register one with @torch.ops.hop.{op.name()}.py_impl({name}), or set "
            f"{name}.supports_higher_order_operators = True to receive hop operators in its __torch_dispatch__.",
        ),
        op=op.name(),
    )


def all_not_implemented(op: Operator, mode: Any, seen: list[type]) -> HopRuntimeError:
    """Nothing at the Python key handled the call: the active mode (its rule or its
    ``__torch_dispatch__``) and every tensor subclass returned NotImplemented."""
    name = op.name()
    subclasses = ", ".join(c.__qualname__ for c in seen) or "none"
    if mode is None:
        return MissingRuleError(
            format_message(
                name,
                f"every rule for the tensor subclasses ({subclasses}) returned NotImplemented",
                fix="Make one of them handle the operator.",
            ),
            op=name,
        )
    mode_name = type(mode).__qualname__
    return UnsupportedModeError(
        format_message(
            name,
            f"the active TorchDispatchMode {mode_name} returned NotImplemented for this operator "
            f"and no tensor subclass argument ({subclasses}) handled it",
            fix=f"Handle it in {mode_name}.__torch_dispatch__ (`return func(*args, **kwargs)` runs it "
            f"as usual), or register a rule with @torch.ops.hop.{name}.py_impl({mode_name}).",
        ),
        op=name,
    )
