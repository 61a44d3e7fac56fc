"""The HigherOrderOperator base class and the ``torch.ops.hop`` namespace.

A hop operator is an instance of ``torch._ops.HigherOrderOperator`` (torch.fx,
the export verifier and the serializer key on that class) that

- lives at ``torch.ops.hop.<name>`` and prints as such in FX graph code, so a
  saved exported program resolves it again on load once ``hop`` is imported;
- never registers into ``torch.ops.higher_order`` (torch's constructor does,
  under the op's name; hop restores whatever was there);
- is called through hop's own dispatcher (:mod:`hop._dispatch`).

Kernels are registered with torch's spelling: ``op.py_impl(DispatchKey...)``,
``op.py_impl(SomeTorchDispatchMode)``, ``op.py_impl(SomeTensorSubclass)``,
``op.py_impl(TransformType...)``, ``op.py_autograd_impl``,
``op.py_functionalize_impl``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar, cast

import torch
import torch._ops
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch.utils._python_dispatch import TorchDispatchMode

from hop import _decomposed, _dispatch, _spec, _transforms
from hop.errors import HopTypeError, HopValueError, UnknownOperatorError, format_message, not_a_sequence, type_name

__all__ = ["HigherOrderOperator", "registered_ops"]

_F = TypeVar("_F", bound=Callable[..., Any])

# Every hop operator by name: the source of truth for torch.ops.hop.
_REGISTRY: dict[str, HigherOrderOperator] = {}
_MISSING = object()


class _HopNamespace(torch._ops._OpNamespace):
    """``torch.ops.hop``: hop's operators, then any ``torch.library`` op ``hop::<name>``."""

    def __init__(self) -> None:
        super().__init__("hop")

    def __getattr__(self, name: str) -> Any:
        op = _REGISTRY.get(name)
        if op is not None:
            return op
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            known = ", ".join(sorted(_REGISTRY)) or "none"
            raise AttributeError(f"torch.ops.hop has no operator {name!r}; known hop operators: {known}") from None

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_REGISTRY))


_NAMESPACE = _HopNamespace()


def _install_namespace() -> None:
    # Unconditional: an earlier access (e.g. a failed torch.export.load) may
    # have cached a plain _OpNamespace under this name.
    torch.ops.hop = _NAMESPACE  # type: ignore[attr-defined]
    if "hop" not in torch.ops._dir:
        torch.ops._dir.append("hop")


def registered_ops() -> dict[str, HigherOrderOperator]:
    """A copy of the name -> operator table behind ``torch.ops.hop``."""
    return dict(_REGISTRY)


class HigherOrderOperator(torch._ops.HigherOrderOperator):
    """Base class of every hop operator, and of the HOPs users define.

    Args:
        name: a Python identifier; the op becomes ``torch.ops.hop.<name>``.
        decomposition: a function of the operator's signature, written with torch ops
            and hop's operators, that computes what the operator does. Every route the
            operator has no rule for runs it at that level, so it gets eager, autograd,
            grad/jvp, vmap, functionalization, fake tensors and torch.compile (which
            inlines it) with no other rule; make_fx and torch.export record one node of
            the operator, its callables traced into subgraphs (they must take tensors
            and numbers). A rule you register overrides the derived one for its route.
            Creating a second op with the same name replaces the first in
            ``torch.ops.hop`` (as re-running a module that defines it would);
            the names of hop's own operators (``cond``, ``switch``, ...) are refused.
        cacheable: whether compiled graphs holding the operator may be saved in and
            loaded from Inductor's FX graph cache and the AOTAutograd cache. Their
            keys cover the graph's code and hop's source, not your rules: say True
            only if those never change between the processes that share a cache.
        tuple_args: positions of the arguments that must be a tuple or list, by role
            name (``{3: "operands"}``): a call with anything else there raises
            ``HopTypeError`` instead of unpacking, say, a tensor's rows as operands.

    Under ``torch.compile``, Dynamo inlines the decomposition of a user's operator;
    at a call of one without a decomposition it breaks the graph and runs it eagerly
    through hop's dispatcher (see ``hop.compile.dynamo``).

    Example::

        apply = hop.HigherOrderOperator("apply")

        @apply.py_impl(DispatchKey.CompositeExplicitAutograd)
        def apply_dense(fn, *tensors):
            return fn(*tensors)
    """

    def __init__(
        self,
        name: str,
        *,
        decomposition: Callable[..., Any] | None = None,
        cacheable: bool = False,
        tuple_args: Mapping[int, str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise HopValueError(
                format_message("HigherOrderOperator", f"name must be a Python identifier, got {name!r}"),
                role="name",
            )
        if _own(name) and name in _REGISTRY:
            raise HopValueError(
                format_message(
                    "HigherOrderOperator",
                    f"the name {name!r} is hop's own torch.ops.hop.{name}; a second operator of that name "
                    "would replace it, and programs saved with it would load yours",
                    fix="Choose another name.",
                ),
                role="name",
            )
        registry = torch._ops._higher_order_ops
        previous = registry.get(name, _MISSING)
        try:
            super().__init__(name, cacheable=cacheable)  # type: ignore[no-untyped-call]
        finally:  # torch's constructor registers under torch.ops.higher_order: undo it
            if previous is _MISSING:
                registry.pop(name, None)
            else:
                registry[name] = previous  # type: ignore[assignment]
        self._ns = "hop"
        # Note [the JIT tracer's key] (hop._dispatch)
        self.non_fallthrough_keys = self.non_fallthrough_keys - _dispatch.TRACER_KEYS
        self.__module__ = "torch.ops.hop"
        self.__qualname__ = name
        # hop's resolved-kernel cache per dispatch key; cleared on registration.
        self._hop_kernels: dict[DispatchKey, Callable[..., Any]] = {}
        self._tuple_args = tuple(sorted((tuple_args or {}).items()))
        # Note [an operator from its decomposition]
        self._hop_decomposition = None if decomposition is None else _decomposed.Decomposition(name, decomposition)
        # the routes whose rule was derived from the decomposition: a registration replaces it
        self._hop_derived_routes: set[Any] = set()
        if self._hop_decomposition is not None:
            self._derive_functionalize(self._hop_decomposition)
        _REGISTRY[name] = self
        _install_namespace()

    def _derive_functionalize(self, derived: _decomposed.Decomposition) -> None:
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        def functionalize(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            return derived.functionalize(self, ctx, args, kwargs)

        self.py_functionalize_impl(functionalize)
        self._hop_derived_routes = {DispatchKey.Functionalize, FunctionalTensorMode, TransformType.Functionalize}

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] is _transforms.DYNAMO_CALL:  # Note [public functions under Dynamo]
            return args[1](*args[2:], **kwargs)
        for position, role in self._tuple_args:
            if position < len(args) and not isinstance(args[position], (tuple, list)):
                self._not_a_sequence(role, args[position])
        return _dispatch.call(self, args, kwargs)

    def _not_a_sequence(self, role: str, value: Any) -> NoReturn:
        raise not_a_sequence(self.name(), role, type_name(value), named=f"{role} of torch.ops.hop.{self.name()}")

    def dispatch(self, /, dispatch_key: DispatchKey, *args: Any, **kwargs: Any) -> Any:
        """Run at ``dispatch_key`` through hop's dispatcher (torch code may call this)."""
        return _dispatch.dispatch(self, dispatch_key, args, kwargs)

    def py_impl(
        self,
        k: type[TorchDispatchMode] | type[torch.Tensor] | TransformType | DispatchKey,
    ) -> Callable[[_F], _F]:
        """Register a kernel for a dispatch key, mode type, tensor subclass or transform."""
        if not (
            isinstance(k, (DispatchKey, TransformType))
            or (isinstance(k, type) and issubclass(k, (TorchDispatchMode, torch.Tensor)))
        ):
            raise HopTypeError(
                format_message(
                    self.name(),
                    f"py_impl takes a DispatchKey, TransformType, TorchDispatchMode type or Tensor "
                    f"subclass, got {type_name(k)}",
                ),
                op=self.name(),
            )
        if k == DispatchKey.Python:  # torch would assert
            raise HopValueError(
                format_message(
                    self.name(),
                    "py_impl(DispatchKey.Python): the Python key is served by rules per "
                    "TorchDispatchMode type and per tensor subclass",
                    fix="Register py_impl(YourMode) or py_impl(YourTensorSubclass) instead.",
                ),
                op=self.name(),
            )
        table: dict[Any, Any]
        if isinstance(k, DispatchKey):
            table = self.py_kernels
        elif isinstance(k, TransformType):
            table = self.functorch_table
        else:
            table = self.python_key_table
        if k in self._hop_derived_routes:  # a rule of its own replaces the decomposition's
            self._hop_derived_routes.discard(k)
            table.pop(cast(Any, k))
        if k in table:
            raise HopValueError(
                format_message(self.name(), f"a rule for {k} is already registered"),
                op=self.name(),
            )
        register = super().py_impl(k)

        def inner(fn: _F) -> _F:
            if not callable(fn):
                raise HopTypeError(
                    format_message(self.name(), f"py_impl({k}) registers a function, got {type_name(fn)}"),
                    op=self.name(),
                )
            self._hop_kernels.clear()
            register(fn)
            if isinstance(k, type) and issubclass(k, TorchDispatchMode):
                _transforms.note_rule_for(k)  # Note [user modes]: a mode hop has a rule for is no user mode
            return fn

        return inner

    def py_autograd_impl(self, fn: _F) -> _F:
        """Register ``fn`` as the autograd rule.

        Unlike torch's helper, no wrapper is added: hop's dispatcher already
        sends calls with grad off, or with no input requiring grad, below autograd.
        """
        self.py_impl(DispatchKey.Autograd)(fn)
        return fn

    def name(self) -> str:
        """The operator's name: ``torch.ops.hop.<name>``."""
        return str(self._name)

    def __repr__(self) -> str:
        return f"torch.ops.hop.{self.name()}"

    def __reduce__(self) -> tuple[Callable[[str], HigherOrderOperator], tuple[str]]:
        return (_lookup_op, (self.name(),))


# hop's own operators declared by a decomposition (hop/ops), which have no node spec
_OWN_DECOMPOSED: set[str] = set()


def declare_own(op: HigherOrderOperator) -> HigherOrderOperator:
    """Mark ``op``, defined in hop/ops by its decomposition, as one of hop's own."""
    _OWN_DECOMPOSED.add(op.name())
    return op


def _own(name: str) -> bool:
    """Whether ``name`` is one of hop's own operators (hop/ops: a spec of its node, or
    declared by its decomposition): saved programs refer to them by name, so a user op
    may not take one over."""
    spec = _spec.spec_of(name)
    return (spec is not None and spec.layout is not None) or name in _OWN_DECOMPOSED


def _lookup_op(name: str) -> HigherOrderOperator:
    """The operator a pickle refers to by name (see ``HigherOrderOperator.__reduce__``)."""
    op = _REGISTRY.get(name)
    if op is None:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnknownOperatorError(
            format_message(
                name,
                f"a pickled program refers to the operator torch.ops.hop.{name}, which is not defined in this "
                f"process (hop operators defined: {known})",
                fix=f"Import the module that creates hop.HigherOrderOperator({name!r}) before unpickling.",
            ),
            op=name,
        )
    return op


_install_namespace()
