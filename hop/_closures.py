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
from collections.abc import Callable, Iterator, Sequence
from types import BuiltinFunctionType, CodeType, FunctionType, MemberDescriptorType, MethodType, ModuleType
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


# What held_attributes follows although callable: functions (their cells, globals and
# the attributes they name are searched) and modules (their parameters).
_FOLLOWED = (FunctionType, torch.nn.Module)


def held_attributes(owner: Any, names: Sequence[str], depth: int = 3) -> list[Any]:
    """The values the namespace ``owner`` (:func:`is_namespace`) holds under ``names``
    (the attributes a function's code loads) that may lead to a tensor: tensors,
    modules, functions (a static or class method's, a property's getter) and other
    objects; found in the namespaces held so too (``config.sub.W``), ``depth`` levels
    deep. A class's attributes are looked up along its MRO, without running
    descriptors, in its own classes only: a library base's (``nn.Module``) are not."""
    found: list[Any] = []
    for name in names:
        value = _own_attribute(owner, name)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if value is _NO_VALUE or (is_inert(value) and not is_namespace(value)):
            continue
        if is_namespace(value):
            if depth > 1:
                found.extend(held_attributes(value, names, depth - 1))
        elif isinstance(value, _FOLLOWED) or not (callable(value) or hasattr(type(value), "__get__")):
            found.append(value)  # not other descriptors or callables: builtins, slots
    return found


def _own_attribute(owner: Any, name: str) -> Any:
    """``owner``'s attribute ``name`` as stored: a module's global, or the first entry
    along a class's MRO when that class is not a library's; else ``_NO_VALUE``."""
    if isinstance(owner, ModuleType):
        return vars(owner).get(name, _NO_VALUE)
    for k in owner.__mro__:
        if name in k.__dict__:
            return k.__dict__[name] if is_namespace(k) else _NO_VALUE
    return _NO_VALUE


def _slot_values(obj: Any) -> list[Any]:
    """What an object of a user's class with ``__slots__`` (a ``dataclass(slots=True)``)
    holds in them: up to 64 values, unset slots left out."""
    values: list[Any] = []
    for k in type(obj).__mro__:
        if not is_namespace(k):
            continue
        slots = k.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            member = k.__dict__.get(name)
            if type(member) is MemberDescriptorType:
                with contextlib.suppress(AttributeError):
                    values.append(member.__get__(obj, k))
    return values[:64]


# The attributes a call of an instance runs: a user's module's ``forward``, an object's
# ``__call__``.
_CALLED = ("forward", "__call__")


# Where a module holds a tensor: (the module or submodule, "_parameters" or "_buffers", name).
Slot = tuple[torch.nn.Module, str, str]


def closure_tensors(
    fns: Sequence[Any], *, depth: int = 4, slots: dict[int, list[Slot]] | None = None
) -> list[torch.Tensor]:
    """Tensors the callables may read without receiving them: in closure cells, bound
    ``self``, referenced globals, default arguments and partial arguments, including
    the parameters and buffers of modules found there (searched ``depth`` levels deep).

    A static over-approximation, for eager paths that must differentiate with respect
    to what a function closes over (traced paths lift exactly, Note [closure lifting]).
    Of a user's module or class a function reads (``config``, ``Tools``), and of the
    class of a user's object it reads (``holder``, ``self``), the attributes its code
    names are searched: ``config.W``, ``holder.W`` kept on the class, and the
    functions and methods found so (``config.helper``, ``self.scaled``), with what
    they read in turn.

    With ``slots``, each parameter or buffer found in a module is also recorded with
    where the module holds it (Note [a re-run reads the closure it was converted with]).
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    searched: set[tuple[int, tuple[str, ...]]] = set()

    def visit(obj: Any, level: int, names: tuple[str, ...] = ()) -> None:
        """``names``: the attributes the code that reached ``obj`` loads."""
        if level > depth or id(obj) in seen:
            return
        if isinstance(obj, _NAMESPACES):
            search(obj, names, level)  # not marked seen: other code may name other attributes
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, FunctionType):
            if hasattr(obj, "__hop_closure_map__"):
                inner, mapping = obj.__hop_closure_map__  # a converted callable: what it reads instead
                for t in closure_tensors([inner], depth=depth - level):
                    v = mapping.get(id(t), t)
                    if v is not None:
                        found.setdefault(id(v), v)
                return
            code = obj.__code__
            read = ATTRIBUTES_READ.get(code)
            if read is None:
                read = attributes_read(code)
            if obj.__closure__ is not None:
                for cell in obj.__closure__:
                    with contextlib.suppress(ValueError):  # an empty cell
                        visit(cell.cell_contents, level + 1, read)
            names_read = GLOBALS_READ.get(code)
            for name in globals_read(code) if names_read is None else names_read:
                value = obj.__globals__.get(name)
                if not is_inert(value) or is_namespace(value):
                    visit(value, level + 1, read)
            for value in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
                visit(value, level + 1, read)  # captured as a default: lambda a, w=w: a @ w
        elif isinstance(obj, torch.nn.Module):
            if slots is None:
                for t in (*obj.parameters(), *obj.buffers()):
                    found.setdefault(id(t), t)
            else:
                _module_slots(obj, found, slots)
            search(type(obj), names + _CALLED, level)  # its methods: self.scaled, forward
        elif isinstance(obj, MethodType):
            func = obj.__func__
            visit(func, level)
            visit(obj.__self__, level + 1, attributes_read(func.__code__) if type(func) is FunctionType else ())
        elif isinstance(obj, functools.partial):
            for v in (obj.func, *obj.args, *obj.keywords.values()):
                visit(v, level + 1, names)
        elif isinstance(obj, (list, tuple)):
            for v in obj[:64]:
                visit(v, level + 1, names)
        elif isinstance(obj, dict):
            for v in list(obj.values())[:64]:
                visit(v, level + 1, names)
        elif type(obj) is BuiltinFunctionType:
            visit(obj.__self__, level + 1)  # W.mul: the tensor it is bound to
        elif not is_inert(obj):  # a namespace or config object holding parameters
            state = getattr(obj, "__dict__", None)
            for v in list(state.values())[:64] if isinstance(state, dict) else _slot_values(obj):
                visit(v, level + 1, names)
            search(type(obj), names + _CALLED, level)  # its class: holder.W kept there, methods

    def search(owner: Any, names: tuple[str, ...], level: int) -> None:
        """A user's module or class: the attributes ``names`` found there; of a
        function found on a class (a method), the class again for the attributes its
        code loads (``self.W``, ``cls.BIAS``)."""
        if not names or not is_namespace(owner) or (id(owner), names) in searched:
            return
        searched.add((id(owner), names))
        for v in held_attributes(owner, names):
            visit(v, level)
            if isinstance(v, FunctionType) and isinstance(owner, type):
                search(owner, attributes_read(v.__code__), level + 1)

    for fn in fns:
        visit(fn, 0)
    return list(found.values())


def _module_slots(module: torch.nn.Module, found: dict[int, torch.Tensor], slots: dict[int, list[Slot]]) -> None:
    for owner in module.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(owner, kind).items():
                if t is not None:
                    found.setdefault(id(t), t)
                    slots.setdefault(id(t), []).append((owner, kind, name))


# Note [a re-run reads the closure it was converted with]
# A converted callable runs again after its first call: the backward and jvp of an
# autograd node re-run a branch or body to differentiate it. By then a module it reads
# may hold other tensors: ``torch.func.functional_call`` (how torch.func differentiates
# a module: per-example gradients, ``vmap(grad(...))``) swaps the parameters in for the
# call only, and torch.func.grad differentiates after the call returned. The re-run
# would read the module's own parameters, which the swap by identity does not know,
# and the gradient of what the forward read would silently be zero. So every run puts
# each converted tensor back where a module held it (the value it is given, as
# functional_call does), and restores the module after.


@contextlib.contextmanager
def _installed(installs: Sequence[tuple[Slot, Any]]) -> Iterator[None]:
    saved = []
    try:
        for (owner, kind, name), value in installs:
            held = getattr(owner, kind)
            saved.append((held, name, held.get(name, _NO_VALUE)))
            held[name] = value
        yield
    finally:
        for held, name, old in reversed(saved):
            if old is _NO_VALUE:
                held.pop(name, None)
            else:
                held[name] = old


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


def _rebound_callable(
    fn: Callable[..., Any], subs: dict[int, Any], installs: Sequence[tuple[Slot, Any]] = ()
) -> Callable[..., Any]:
    def rebound(*args: Any) -> Any:
        if installs:
            with _installed(installs), _Rebind(subs):
                out = fn(*args)
        else:
            with _Rebind(subs):
                out = fn(*args)
        return py_pytree.tree_map(lambda x: subs.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    rebound.__wrapped__ = fn  # type: ignore[attr-defined]
    rebound.__qualname__ = getattr(fn, "__qualname__", "branch")
    rebound.__hop_closure_map__ = (fn, subs)  # type: ignore[attr-defined]
    return rebound


def convert_closures(
    fns: Sequence[Callable[..., Any]],
    operands: Sequence[Any],
    level: int | None = None,
    *,
    batched_at: int | None = None,
) -> tuple[list[Callable[..., Any]], list[torch.Tensor]]:
    """The tensors ``fns`` read from their closures that a derivative must reach (they
    require grad, or a torch.func grad / jvp transform at ``level`` tracks them) and
    that are not operands already, and ``fns`` taking them as extra trailing inputs
    (Note [closure conversion]); ``fns`` unchanged when there are none.

    With ``batched_at``, tensors batched at that vmap level are taken too: an autograd
    node under vmap runs its forward under a vmap of its own (torch's generated vmap
    rule), which re-batches its inputs; a closure still batched at the old level would
    be used where that level no longer exists (an internal assert of functorch)."""
    from torch._C._functorch import is_batchedtensor, is_gradtrackingtensor, maybe_get_level

    def tracked(t: torch.Tensor) -> bool:
        if level is not None and is_gradtrackingtensor(t) and maybe_get_level(t) == level:
            return True
        if batched_at is not None and is_batchedtensor(t) and maybe_get_level(t) == batched_at:
            return True
        return t.requires_grad and (t.is_floating_point() or t.is_complex())

    slots: dict[int, list[Slot]] = {}
    found = closure_tensors(fns, slots=slots)
    captured = [t for t in found if tracked(t) and not any(t is x for x in operands)]
    if not captured:
        return list(fns), []
    _observe.closures(captured)
    return [with_closure_as_inputs(fn, captured, slots=slots) for fn in fns], captured


def with_closure_as_inputs(
    fn: Callable[..., Any], captured: Sequence[torch.Tensor], *, slots: dict[int, list[Slot]] | None = None
) -> Callable[..., Any]:
    """``fn`` taking ``captured`` as extra trailing inputs: ``converted(*args, *values)``
    runs ``fn(*args)`` in which every use of ``captured[i]`` reads ``values[i]``.

    Note [closure conversion]: an autograd node can only differentiate with respect
    to its inputs, so tensors a branch or body reads from its closure (a module's
    parameters, a tensor a torch.func transform tracks) become extra inputs. Every
    torch call made while ``fn`` runs sees them swapped by identity (a
    torch-function mode), whatever the closure's form (cells, bound ``self``,
    globals); so do the callables of hop operators nested in it. ``slots`` (from
    :func:`closure_tensors`) says where modules hold captured tensors: each run puts
    the values it is given there (Note [a re-run reads the closure it was converted with]).
    """
    keep = list(captured)  # keeps the ids valid
    n = len(keep)
    where = [(k, slot) for k, t in enumerate(keep) for slot in (slots or {}).get(id(t), ())]

    def converted(*args: Any) -> Any:
        values = args[len(args) - n :]
        subs = {id(t): a for t, a in zip(keep, values, strict=True)}
        installs = [(slot, values[k]) for k, slot in where]
        return _rebound_callable(fn, subs, installs)(*args[: len(args) - n])

    converted.__wrapped__ = fn  # type: ignore[attr-defined]
    converted.__qualname__ = getattr(fn, "__qualname__", "branch")
    converted.__hop_closure_map__ = (fn, {id(t): None for t in keep})  # type: ignore[attr-defined]
    return converted
