"""Validate-once machinery shared by the operators' eager paths.

An eager call runs only what its inputs select (one branch, the real number of
loop iterations), yet hop checks every callable once on fake tensors so that a
mistake anywhere is reported in eager as torch.export would report it. The
verdict is remembered per *signature*: the callables' code and the metadata of
what they close over, and the operands' structure and metadata (dtype, rank,
device). Fresh closures over fresh tensors of the same kind share a signature;
the cache is bounded by ``hop.config.validation_cache_size``.

This module holds the signatures, the verdicts and the output kinds they record
(Note [outputs are checked on every call]); the fake run itself, which it
re-exports, is ``hop._fake_run``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from hop import _closures, _observe, _pytree, config
from hop._fake_run import HookedModule, NotValidatable, check_hooks, fake_inputs, fakeable
from hop.errors import HopTypeError, HopValueError, format_message, type_name

__all__ = [
    "CANNOT_FAKE",
    "flat_signature",
    "signature",
    "is_known",
    "remember",
    # the fake run (hop._fake_run), called by the operators here
    "HookedModule",
    "NotValidatable",
    "check_hooks",
    "fake_inputs",
    "fakeable",
]

Fn = Callable[..., Any]
_Tensor = torch.Tensor


# Errors that mean "this callable cannot run on fake tensors", not "it is wrong".
# Here, not in hop._fake_run: the operators read it here and hop.compile.dynamo extends it.
CANNOT_FAKE: tuple[type[Exception], ...] = (
    NotValidatable,
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    GuardOnDataDependentSymNode,
)

_VERDICTS: dict[Any, set[Any]] = {}
# Per verdict, the callables a fake run gave up on and why (read only when an
# output check fails, to say that callable was checked by its real call alone).
_UNCHECKED: dict[Any, dict[int, str]] = {}
_SINKS = _observe.SINKS
# Per operator whose spec has the inline cache, its cache of validated eager calls
# (Note [the eager inline cache] in hop.ops.branching._call_cache, which fills this): each entry
# holds a verdict, and goes with it.
INLINE: dict[str, dict[Any, Any]] = {}  # name -> key -> hop.ops.branching._call_cache.Entry
# Verdicts whose fake run saw a callable return a tensor sharing memory with an
# operand without being it or a view of it (x.detach(), x.data); their calls are
# not cached inline, so each gets the general path's data-pointer check.
ALIASING: set[Any] = set()


def value_key(v: Any, depth: int = 0) -> Any:
    """What a verdict depends on of a closed-over value or a leaf. A number counts by
    its type only: a loop counter a branch closes over changes on every call, and
    what a new value could change of the output is caught by the per-call output
    check (Note [outputs are checked on every call]), not by validating again. A
    function counts by its code and what it closes over, a tuple by its items (Note
    [closures by kind, not identity]); anything else by identity (:class:`_Same`)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.ndim, v.get_device())
    kind = type(v)
    if kind in (int, float, bool):
        return kind
    if v is None or kind is str:
        return (kind, v)
    if depth < _DEPTH:
        if kind is FunctionType:
            return function_key(v, depth + 1)
        if kind is MethodType:
            return (value_key(v.__func__, depth + 1), _Same(v.__self__))
        if kind is tuple and len(v) <= _ITEMS:
            return (tuple, *(value_key(x, depth + 1) for x in v))
    return _Same(v)


# Note [closures by kind, not identity]
# A helper defined inside the function that calls hop (a solver's right-hand side,
# read by its accept and reject branches) is a new function object on every call.
# Keyed by identity, every call would validate again on fake tensors (a 12-step
# solve took 4x its Python loop), and when CPython reused a freed helper's address
# the check was skipped by chance. A function is keyed as the operators' callables
# are (its code and what its cells hold, by kind) to a bounded depth;
# other objects by identity, with a weak reference (or, for objects that take none,
# the object itself) so that a key never matches a new object at a freed address.
_DEPTH = 4
_ITEMS = 16


def function_key(fn: FunctionType, depth: int = 0) -> Any:
    """A plain function's key: its code and its cells' contents, by kind (as the inline
    paths key a closure-free function: by its code alone)."""
    cells = fn.__closure__
    if cells is None:
        return fn.__code__
    return (fn.__code__, *[_cell_key(c, depth) for c in cells])


def _cell_key(cell: Any, depth: int) -> Any:
    try:
        contents = cell.cell_contents
    except ValueError:  # a name assigned later in the enclosing function
        return "empty cell"
    return value_key(contents, depth)


class _Same:
    """An object in a key, by identity: equal only to a key of the same live object."""

    __slots__ = ("_id", "_ref")

    def __init__(self, obj: Any) -> None:
        self._id = id(obj)
        try:
            self._ref: Callable[[], Any] = weakref.ref(obj)
        except TypeError:  # no weak reference (a list, a builtin): the key keeps it alive
            self._ref = functools.partial(_itself, obj)

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same) or other._id != self._id:
            return False
        obj = self._ref()
        return obj is not None and obj is other._ref()


def _itself(obj: Any) -> Any:
    return obj


def flat_signature(name: str, fns: Sequence[Fn], operands: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The signature of a call with flat plain-tensor operands (None otherwise).

    On every eager call's path: written out long-hand, with the commonest call (two
    closure-free functions, one tensor: a ``cond``) first, giving the same key.
    """
    if len(fns) == 2 and len(operands) == 1:
        t, f = fns
        x = operands[0]
        if (
            type(t) is FunctionType
            and type(f) is FunctionType
            and t.__closure__ is None
            and f.__closure__ is None
            and type(x) is _Tensor
        ):
            return (name, t.__code__, f.__code__, x.dtype, x.ndim, x.get_device())
    key: list[Any] = [name]
    for fn in fns:
        key.append(function_key(fn) if type(fn) is FunctionType else callable_key(fn))
    for x in operands:
        if type(x) is not _Tensor:
            return None
        key += (x.dtype, x.ndim, x.get_device())
    return tuple(key)


def callable_key(fn: Any) -> Any:
    """Key of a callable that is not a plain function: methods by code and owner,
    partials by function and arguments, builtin methods by name and owner's kind,
    anything else (builtins such as torch.tanh, modules) by identity."""
    if type(fn) is MethodType:
        return (callable_key(fn.__func__), _Same(fn.__self__))
    if type(fn) is FunctionType:
        return function_key(fn)
    if isinstance(fn, functools.partial):
        kwargs = tuple(sorted((k, value_key(v)) for k, v in fn.keywords.items()))
        return (callable_key(fn.func), *map(value_key, fn.args), kwargs)
    if type(fn) is BuiltinFunctionType and not _closures.is_inert(fn):
        # w.mul: a method object made per access, whose address a later one reuses
        # after it is freed (an id would find another method's verdict)
        return ("builtin method", fn.__name__, type(fn.__self__), value_key(fn.__self__))
    if type(fn) is BuiltinFunctionType:
        return id(fn)  # inert: torch.tanh lives as long as torch (the inline paths key it so)
    return _Same(fn)


def signature(name: str, fns: Sequence[Fn], operands: Any, leaves: Sequence[Any], spec: Any) -> Any:
    """The signature of any call: flat tensor operands share :func:`flat_signature`'s key."""
    if type(operands) is tuple:
        key = flat_signature(name, fns, operands)
        if key is not None:
            return key
    return (*(flat_signature(name, fns, ()) or ()), spec, *map(value_key, leaves))


def is_known(key: Any) -> bool:
    """Whether ``key`` needs no validation now (``hop.config.validate``)."""
    mode = config.validate
    if mode not in ("once", "always", "never"):
        raise HopValueError(
            format_message("config", f'validate must be "once", "always" or "never", got {mode!r}'), role="validate"
        )
    known = mode == "never" or (mode == "once" and key in _VERDICTS)
    if known and _SINKS:
        _observe.validation_cached(off=mode == "never")
    return known


def remember(key: Any, kind: Any = None, *, aliasing: bool = False) -> None:
    """Record a passed validation and the kind of output it found (None: no branch
    could run on fake tensors), and whether an output shared memory with an operand;
    starting over when the cache is full."""
    if len(_VERDICTS) >= _cache_size():
        clear()
    _VERDICTS[key] = set() if kind is None else {kind}
    if aliasing:
        ALIASING.add(key)
    else:
        ALIASING.discard(key)
    _observe.verdict(key, kind, _describe_output_kind)


def _cache_size() -> int:
    """``hop.config.validation_cache_size``, checked where it is read: on a new
    verdict only, never on a call whose signature is known."""
    size = config.validation_cache_size
    if type(size) is not int:
        raise HopTypeError(
            format_message(
                "config",
                f"validation_cache_size must be an int, got {size!r} ({type_name(size)})",
                fix="Assign a positive int, e.g. hop.config.validation_cache_size = 1024.",
            ),
            role="validation_cache_size",
        )
    if size < 1:
        raise HopValueError(
            format_message(
                "config",
                f"validation_cache_size must be at least 1, got {size}",
                fix='To validate every call instead of remembering verdicts, set hop.config.validate = "always".',
            ),
            role="validation_cache_size",
        )
    return size


def remember_unchecked(key: Any, unchecked: dict[int, str]) -> None:
    """Record which callables of ``key``'s verdict no fake run checked, and why."""
    if unchecked:
        _UNCHECKED[key] = unchecked
    else:
        _UNCHECKED.pop(key, None)


def forget(key: Any) -> None:
    _VERDICTS.pop(key, None)
    _UNCHECKED.pop(key, None)
    ALIASING.discard(key)
    for cache in INLINE.values():
        cache.clear()


def clear() -> None:
    """Forget every verdict (the next call of each signature validates again)."""
    _VERDICTS.clear()
    _UNCHECKED.clear()
    ALIASING.clear()
    for cache in INLINE.values():
        cache.clear()


# Note [outputs are checked on every call]
# A verdict is keyed on what can be read cheaply before a call (code, closure
# cells, operand metadata), but a callable's output can change without its key
# changing: new __defaults__, a global, an attribute of a closed-over object. So a
# verdict also holds the output kinds it validated (structure; per leaf its type,
# or a tensor's dtype, rank and device) and every eager call compares what the
# chosen callable returned with them: ``kind in kinds``, a hash and a compare. A
# new kind is validated again under the current state (autocast, say, legitimately
# changes dtypes), so it is either a valid new kind, remembered beside the old,
# or an error: never a result that differs from what was checked.


def output_kind(out: Any) -> Any:
    """What a verdict records of an output (Note [outputs are checked on every call])."""
    if isinstance(out, _Tensor):
        return (out.dtype, out.ndim, out.get_device())
    leaves, spec = _pytree.flatten(out)
    return (
        spec,
        *[
            (x.dtype, x.ndim, x.get_device()) if isinstance(x, torch.Tensor) else _SCALAR.get(type(x), type(x))
            for x in leaves
        ],
    )


# A fake run returns a symbolic number where the real run returns a Python one.
_SCALAR: dict[type, type] = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def describe_kind(value: Any, *, kind: bool = False) -> str:
    """An output (or, with ``kind``, an output kind) in words, for error messages."""
    k = value if kind else output_kind(value)

    def leaf(x: Any) -> str:
        if isinstance(x, tuple):
            dtype, ndim, device = x
            where = "cpu" if device < 0 else f"device {device}"
            return f"a {str(dtype).removeprefix('torch.')} tensor of rank {ndim} on {where}"
        return f"a {x.__name__}"

    if len(k) == 3 and isinstance(k[0], torch.dtype):
        return leaf(k)
    spec, *leaves = k
    shown = ", ".join(leaf(x) for x in leaves)
    return f"{spec.num_leaves} leaves in {_pytree.unflatten(['*'] * spec.num_leaves, spec)!r} ({shown})"


def _describe_output_kind(kind: Any) -> str:
    return describe_kind(kind, kind=True)


def known_kind(key: Any, out: Any) -> bool:
    """Whether ``out`` is of a kind the verdict for ``key`` validated (the first kind
    seen is taken when validation could not run the callables, or none is cached)."""
    kinds = _VERDICTS.get(key)
    if kinds is None:
        return True  # validate="never", or the cache started over: nothing to compare with
    kind = output_kind(out)
    if kind in kinds:
        return True
    if not kinds:
        kinds.add(kind)
        return True
    return False
