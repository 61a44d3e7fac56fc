"""What a callable closes over, found statically, and closure conversion for eager derivatives.

:func:`closure_tensors` over-approximates the tensors a callable may read without
receiving them (cells, bound ``self``, globals, defaults, partials, modules'
parameters); :func:`convert_closures` and :func:`with_closure_as_inputs` make the
ones a derivative must reach extra inputs (Note [closure conversion]);
:func:`is_inert` and :func:`globals_read` are the cheap tests the eager fast paths
share. Separate from ``hop._lifting``, which lifts exactly what a *traced*
callable reads: this module inspects Python objects and never traces.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import sys
import sysconfig
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
import torch.utils._pytree as py_pytree

from hop import _observe

__all__ = [
    "GLOBALS_READ",
    "ATTRIBUTES_READ",
    "INERT_TYPES",
    "LIBRARY_NAMESPACES",
    "attributes_read",
    "closure_tensors",
    "convert_closures",
    "globals_read",
    "held_attributes",
    "is_inert",
    "is_namespace",
    "with_closure_as_inputs",
]


# The global names and the attribute names each code object loads, the code nested in
# it included (lambdas, inner functions, comprehensions): read once per code object,
# which stays alive as the key (a bounded set: the code of a program, not one entry
# per call).
GLOBALS_READ: dict[CodeType, tuple[str, ...]] = {}
ATTRIBUTES_READ: dict[CodeType, tuple[str, ...]] = {}
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _names_loaded(code: CodeType, ops: frozenset[str], table: dict[CodeType, tuple[str, ...]]) -> tuple[str, ...]:
    names = table.get(code)
    if names is None:
        found = dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname in ops)
        for const in code.co_consts:
            if type(const) is CodeType:
                found.update(dict.fromkeys(_names_loaded(const, ops, table)))
        names = table[code] = tuple(found)
    return names


def globals_read(code: CodeType) -> tuple[str, ...]:
    """The names of the globals ``code`` and the code nested in it may read."""
    return _names_loaded(code, _GLOBAL_OPS, GLOBALS_READ)


def attributes_read(code: CodeType) -> tuple[str, ...]:
    """The attribute names ``code`` and the code nested in it load (``cfg.W``: ``W``)."""
    return _names_loaded(code, _ATTRIBUTE_OPS, ATTRIBUTES_READ)


# Values that can lead to no tensor (Note [untaken branches get zero gradients]): a
# global or a bound builtin's owner of one of these types is not searched. Python
# modules and classes count as inert (``torch``, ``math``) to every search but that
# of a function's globals and cells, which looks up the attributes its code names
# (:func:`held_attributes`).
INERT_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, ModuleType, torch.dtype, torch.device, torch.Size}
)


def is_inert(value: Any) -> bool:
    """Whether ``value`` can lead to no tensor: an inert type's value, a class, or a
    builtin function (``torch.tanh``, ``len``) whose owner is one."""
    kind = type(value)
    if kind in INERT_TYPES or isinstance(value, type):
        return True
    if kind is BuiltinFunctionType:
        owner = value.__self__
        return type(owner) in INERT_TYPES or isinstance(owner, type)
    return False


# Modules and classes of libraries, which keep no user's parameter: their attributes are
# never searched. A set of the objects met so far (a bounded set: what is imported);
# the C fast path reads it too (hop/_fastpath.c, still_plain).
LIBRARY_NAMESPACES: set[Any] = set()
_LIBRARIES = frozenset({"torch", "hop", "numpy"})
_STDLIB = sysconfig.get_paths()["stdlib"]
_NO_VALUE = object()
_NAMESPACES = (ModuleType, type)


def is_namespace(value: Any) -> bool:
    """Whether ``value`` is a module or a class that is not a library's: a parameter
    may be kept as its attribute (``config.W``, ``Shared.W``)."""
    if not isinstance(value, _NAMESPACES) or value in LIBRARY_NAMESPACES:
        return False
    name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
    if isinstance(name, str) and _library(name.partition(".")[0]):
        LIBRARY_NAMESPACES.add(value)
        return False
    return True


def _library(top: str) -> bool:
    """Whether the top-level module ``top`` is torch's, hop's, numpy's or the standard
    library's: a user's package named like a standard module (``test``, ``config``...)
    is loaded from elsewhere, and is searched."""
    if top in _LIBRARIES:
        return True
    if top not in sys.stdlib_module_names:
        return False
    module = sys.modules.get(top)
    if module is None:
        return False
    where = getattr(module, "__file__", None)
    return where is None or where.startswith(_STDLIB)  # None: built into the interpreter


def held_attributes(owner: Any, names: Sequence[str], depth: int = 3) -> list[Any]:
    """The values the namespace ``owner`` (:func:`is_namespace`) holds under ``names``
    (the attributes a function's code loads) that may lead to a tensor: tensors,
    modules, containers and other plain objects; found in the namespaces held so too
    (``config.sub.W``), ``depth`` levels deep. A class's attributes are looked up
    along its MRO, without running descriptors. Functions, descriptors and inert
    values are not followed: a function kept in a module is not searched."""
    found: list[Any] = []
    for name in names:
        if isinstance(owner, ModuleType):
            value = vars(owner).get(name, _NO_VALUE)
        else:
            value = next((k.__dict__[name] for k in owner.__mro__ if name in k.__dict__), _NO_VALUE)
        if value is _NO_VALUE:
            continue
        if is_namespace(value):
            if depth > 1:
                found.extend(held_attributes(value, names, depth - 1))
        elif isinstance(value, torch.nn.Module) or not (
            is_inert(value) or callable(value) or hasattr(type(value), "__get__")
        ):
            found.append(value)
    return found


def closure_tensors(fns: Sequence[Any], *, depth: int = 4) -> list[torch.Tensor]:
    """Tensors the callables may read without receiving them: in closure cells, bound
    ``self``, referenced globals, default arguments and partial arguments, including
    the parameters and buffers of modules found there (searched ``depth`` levels deep).

    A static over-approximation, for eager paths that must differentiate with respect
    to what a function closes over (traced paths lift exactly, Note [closure lifting]).
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if level > depth or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                found.setdefault(id(t), t)
        elif isinstance(obj, FunctionType) and hasattr(obj, "__hop_closure_map__"):
            inner, mapping = obj.__hop_closure_map__  # a converted callable: what it reads instead
            for t in closure_tensors([inner], depth=depth - level):
                v = mapping.get(id(t), t)
                if v is not None:
                    found.setdefault(id(v), v)
        elif isinstance(obj, FunctionType):
            code = obj.__code__
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    value = cell.cell_contents
                    if isinstance(value, _NAMESPACES):
                        visit_namespace(value, code, level + 1)
                    else:
                        visit(value, level + 1)
            for name in globals_read(code):
                value = obj.__globals__.get(name)
                if isinstance(value, _NAMESPACES):
                    visit_namespace(value, code, level + 1)
                elif not is_inert(value):
                    visit(value, level + 1)
            for value in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
                visit(value, level + 1)  # captured as a default: lambda a, w=w: a @ w
        elif isinstance(obj, MethodType):
            visit(obj.__func__, level)
            visit(obj.__self__, level + 1)
        elif isinstance(obj, functools.partial):
            for v in (obj.func, *obj.args, *obj.keywords.values()):
                visit(v, level + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj[:64]:
                visit(v, level + 1)
        elif isinstance(obj, dict):
            for v in list(obj.values())[:64]:
                visit(v, level + 1)
        elif type(obj) is BuiltinFunctionType:
            visit(obj.__self__, level + 1)  # W.mul: the tensor it is bound to
        elif not is_inert(obj) and isinstance(getattr(obj, "__dict__", None), dict):
            for v in list(vars(obj).values())[:64]:  # a namespace or config object holding parameters
                visit(v, level + 1)

    def visit_namespace(value: Any, code: CodeType, level: int) -> None:
        """A module or class a function's code reads by name: searched for the
        attributes that code loads only."""
        if is_namespace(value):
            for v in held_attributes(value, attributes_read(code)):
                visit(v, level)

    for fn in fns:
        visit(fn, 0)
    return list(found.values())


class _Rebind(torch.overrides.TorchFunctionMode):
    """Swaps tensors (by identity) for others in every torch call: Note [closure conversion]."""

    supports_higher_order_operators = True  # not a user mode: it rewrites an operator's callables

    def __init__(self, subs: dict[int, Any]) -> None:
        super().__init__()
        self.subs = subs

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        subs = self.subs

        def swap(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return subs.get(id(x), x)
            if callable(x) and isinstance(func, torch._ops.HigherOrderOperator):
                return _rebound_callable(x, subs)  # a nested operator's branches read the closure too
            return x

        args, kwargs = py_pytree.tree_map(swap, (tuple(args), kwargs or {}))
        return func(*args, **kwargs)


def _rebound_callable(fn: Callable[..., Any], subs: dict[int, Any]) -> Callable[..., Any]:
    def rebound(*args: Any) -> Any:
        with _Rebind(subs):
            out = fn(*args)
        return py_pytree.tree_map(lambda x: subs.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    rebound.__wrapped__ = fn  # type: ignore[attr-defined]
    rebound.__qualname__ = getattr(fn, "__qualname__", "branch")
    rebound.__hop_closure_map__ = (fn, subs)  # type: ignore[attr-defined]
    return rebound


def convert_closures(
    fns: Sequence[Callable[..., Any]], operands: Sequence[Any], level: int | None = None
) -> tuple[list[Callable[..., Any]], list[torch.Tensor]]:
    """The tensors ``fns`` read from their closures that a derivative must reach (they
    require grad, or a torch.func grad / jvp transform at ``level`` tracks them) and
    that are not operands already, and ``fns`` taking them as extra trailing inputs
    (Note [closure conversion]); ``fns`` unchanged when there are none."""
    from torch._C._functorch import is_gradtrackingtensor, maybe_get_level

    def tracked(t: torch.Tensor) -> bool:
        if level is not None and is_gradtrackingtensor(t) and maybe_get_level(t) == level:
            return True
        return t.requires_grad and (t.is_floating_point() or t.is_complex())

    captured = [t for t in closure_tensors(fns) if tracked(t) and not any(t is x for x in operands)]
    if not captured:
        return list(fns), []
    _observe.closures(captured)
    return [with_closure_as_inputs(fn, captured) for fn in fns], captured


def with_closure_as_inputs(fn: Callable[..., Any], captured: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """``fn`` taking ``captured`` as extra trailing inputs: ``converted(*args, *values)``
    runs ``fn(*args)`` in which every use of ``captured[i]`` reads ``values[i]``.

    Note [closure conversion]: an autograd node can only differentiate with respect
    to its inputs, so tensors a branch or body reads from its closure (a module's
    parameters, a tensor a torch.func transform tracks) become extra inputs. Every
    torch call made while ``fn`` runs sees them swapped by identity (a
    torch-function mode), whatever the closure's form (cells, bound ``self``,
    globals); so do the callables of hop operators nested in it.
    """
    keep = list(captured)  # keeps the ids valid
    n = len(keep)

    def converted(*args: Any) -> Any:
        subs = {id(t): a for t, a in zip(keep, args[len(args) - n :], strict=True)}
        return _rebound_callable(fn, subs)(*args[: len(args) - n])

    converted.__wrapped__ = fn  # type: ignore[attr-defined]
    converted.__qualname__ = getattr(fn, "__qualname__", "branch")
    converted.__hop_closure_map__ = (fn, {id(t): None for t in keep})  # type: ignore[attr-defined]
    return converted
