"""Validate-once machinery shared by the operators' eager paths.

An eager call runs only what its inputs select (one branch, the real number of
loop iterations), yet hop checks every callable once on fake tensors so that a
mistake anywhere is reported in eager as torch.export would report it. The
verdict is remembered per *signature*: the callables' code and the metadata of
what they close over, and the operands' structure and metadata (dtype, rank,
device). Fresh closures over fresh tensors of the same kind share a signature;
the cache is bounded by ``hop.config.validation_cache_size``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from types import FunctionType, MethodType
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from hop import config
from hop.errors import HopValueError, format_message

__all__ = [
    "CANNOT_FAKE",
    "flat_signature",
    "signature",
    "is_known",
    "remember",
    "fake_inputs",
]

Fn = Callable[..., Any]
_Tensor = torch.Tensor

# Errors that mean "this callable cannot run on fake tensors", not "it is wrong".
CANNOT_FAKE = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    GuardOnDataDependentSymNode,
)

_VERDICTS: dict[Any, None] = {}


def value_key(v: Any) -> Any:
    """What a verdict depends on of a closed-over value or a leaf."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.ndim, v.get_device())
    if v is None or type(v) in (int, float, bool, str):
        return (type(v), v)
    return id(v)


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
        if type(fn) is FunctionType:
            cells = fn.__closure__
            key.append(fn.__code__ if cells is None else (fn.__code__, *[value_key(c.cell_contents) for c in cells]))
        else:
            key.append(callable_key(fn))
    for x in operands:
        if type(x) is not _Tensor:
            return None
        key += (x.dtype, x.ndim, x.get_device())
    return tuple(key)


def callable_key(fn: Any) -> Any:
    """Key of a callable that is not a plain function: methods by code and owner,
    partials by function and arguments, anything else (builtins, modules) by identity."""
    if type(fn) is MethodType:
        return (callable_key(fn.__func__), id(fn.__self__))
    if type(fn) is FunctionType:
        return flat_signature("", (fn,), ())
    if isinstance(fn, functools.partial):
        kwargs = tuple(sorted((k, value_key(v)) for k, v in fn.keywords.items()))
        return (callable_key(fn.func), *map(value_key, fn.args), kwargs)
    return id(fn)


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
    return mode == "never" or (mode == "once" and key in _VERDICTS)


def remember(key: Any) -> None:
    """Record a passed validation, starting over when the cache is full."""
    if len(_VERDICTS) >= config.validation_cache_size:
        _VERDICTS.clear()
    _VERDICTS[key] = None


@contextlib.contextmanager
def fake_inputs(leaves: Sequence[Any]) -> Iterator[list[Any]]:
    """Static-shape fake copies of ``leaves``, inside their (quiet) fake mode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fake = [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in leaves]
    # torch logs a traceback when a meta kernel fails; here that is the verdict, not news.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with mode:
            yield fake
    finally:
        logger.setLevel(previous)
