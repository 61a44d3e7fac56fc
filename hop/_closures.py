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
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
import torch.utils._pytree as py_pytree

from hop import _observe

__all__ = [
    "GLOBALS_READ",
    "INERT_TYPES",
    "closure_tensors",
    "convert_closures",
    "globals_read",
    "is_inert",
    "with_closure_as_inputs",
]


# The global names each code object loads, the code nested in it included (lambdas,
# inner functions, comprehensions): read once per code object, which stays alive as
# the key (a bounded set: the code of a program, not one entry per call).
GLOBALS_READ: dict[CodeType, tuple[str, ...]] = {}


def globals_read(code: CodeType) -> tuple[str, ...]:
    """The names of the globals ``code`` and the code nested in it may read."""
    names = GLOBALS_READ.get(code)
    if names is None:
        found = dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        for const in code.co_consts:
            if type(const) is CodeType:
                found.update(dict.fromkeys(globals_read(const)))
        names = GLOBALS_READ[code] = tuple(found)
    return names


# Values that can lead to no tensor (Note [untaken branches get zero gradients]): a
# global or a bound builtin's owner of one of these types is not searched. Python
# modules count as inert (``torch``, ``math``): a parameter kept as a module
# attribute is missed, and so is one kept as a class attribute.
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
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, level + 1)
            for name in globals_read(obj.__code__):
                value = obj.__globals__.get(name)
                if not is_inert(value):
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
