"""The eager fast paths of cond and switch, written out long-hand.

A plain eager call (Note [eager branches run inline] in ``branching._record``) whose
signature is already validated skips the pytree work and the checks the verdict
has passed: :func:`eager_one` serves the commonest call (one tensor operand,
closure-free branches) and leaves an inline-cache entry (Note [the eager inline
cache] in ``branching._call_cache``), :func:`eager_fast` any flat tensor operands, and
:func:`finish_ran` / :func:`finish_eager` finish what the cache or these ran
(a new output kind, zero gradients, an alias of an operand). Each returns
:data:`NOT_TAKEN` when the general path (``branching._record.call``) must take the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, FunctionType
from typing import Any

import torch

from hop import _closures, _effects, config
from hop import _validation as validation
from hop.ops._common import NOT_TAKEN
from hop.ops.branching import _call_cache
from hop.ops.branching._record import BY_NAME, Branching, check_new_kind, no_alias_tree
from hop.ops.branching._untaken_grads import reads_nothing, zero_untaken

Fn = Callable[..., Any]

_Tensor = torch.Tensor
_Function = FunctionType
_Builtin = BuiltinFunctionType
_VERDICTS = validation._VERDICTS
_grad_enabled = torch.is_grad_enabled
_ONCE = "once"


def eager_fast(name: str, k: int, branches: Sequence[Fn], operands: tuple[Any, ...]) -> Any:
    """``branches[k](*operands)`` for a plain eager call (the caller checked: no mode,
    no transform, a real one-element selector giving ``k``) with flat tensor
    operands whose signature is already validated; :data:`NOT_TAKEN` otherwise.

    Note [eager branches run inline]; this is the general path minus the pytree
    work and the checks a validated signature has already passed. Every
    microsecond here is paid by every call, so it is written out long-hand.
    """
    validate = config.validate
    if validate != _ONCE:  # an equal string not interned is "once" too
        if validate != "never":
            return NOT_TAKEN
        return _run_unchecked(k, branches, operands)
    key = validation.flat_signature(name, branches, operands)
    kinds = validation._VERDICTS.get(key)
    if kinds is None:
        return NOT_TAKEN
    out = branches[k](*operands)
    if (type(out) is not _Tensor or (out.dtype, out.ndim, out.get_device()) not in kinds) and not (
        validation.known_kind(key, out)
    ):
        check_new_kind(BY_NAME[name], key, branches, operands, k, out)
    return finish_eager(out, branches, operands)


def eager_one(branching: Branching, k: int, branches: Sequence[Fn], x: torch.Tensor) -> Any:
    """``branches[k](x)`` for a plain eager call (as :func:`eager_fast`) with the one
    plain tensor operand ``x``, closure-free functions or builtins as branches and a
    validated signature; :data:`NOT_TAKEN` otherwise.

    The commonest call of cond and switch, long-hand: one walk over the branches
    builds the verdict's key (``validation.flat_signature``'s) and, with grad
    enabled, decides whether any of them can read a tensor that requires grad (Note
    [untaken branches get zero gradients]), which would otherwise be a walk each.
    """
    if config.validate != _ONCE:
        return NOT_TAKEN
    grad = _grad_enabled()
    plain = True  # no branch reads a tensor from outside its arguments
    key: list[Any] = [branching.name]
    add = key.append
    for fn in branches:
        kind = type(fn)
        if kind is _Function:
            if fn.__closure__ is not None:
                return NOT_TAKEN
            add(fn.__code__)
        elif kind is _Builtin and _closures.is_inert(fn):
            add(id(fn))  # validation.callable_key's (torch.tanh lives as long as torch)
        else:
            return NOT_TAKEN
        if plain and grad:
            plain = reads_nothing(fn)
    add(x.dtype)
    add(x.ndim)
    add(x.get_device())
    signature = tuple(key)
    kinds = _VERDICTS.get(signature)
    if kinds is None:
        return NOT_TAKEN
    _call_cache.remember(branching.name, branches, x, signature, kinds)  # later calls: Note [the eager inline cache]
    out = branches[k](x)
    # Note [outputs are checked on every call]
    if (type(out) is not _Tensor or (out.dtype, out.ndim, out.get_device()) not in kinds) and not (
        validation.known_kind(signature, out)
    ):
        check_new_kind(branching, signature, branches, (x,), k, out)
    if grad and (x.requires_grad or not plain):
        return finish_eager(out, branches, (x,))
    if type(out) is _Tensor and out is not x and not out._is_view() and not _effects.same_memory(out, x):
        return out
    return no_alias_tree(out, (x,))


def finish_ran(
    branching: Branching, branches: Sequence[Fn], operands: Sequence[Any], out: Any, k: int, entry: Any
) -> Any:
    """Finish a call the inline cache found (Note [the eager inline cache]): branch
    ``k`` returned ``out``, which needs more than the cache checks (a new output
    kind, zero gradients, an alias of the operand)."""
    key = entry[-1]
    if not validation.known_kind(key, out):  # Note [outputs are checked on every call]
        check_new_kind(branching, key, branches, operands, k, out)
    return finish_eager(out, branches, operands)


def _run_unchecked(k: int, branches: Sequence[Fn], operands: tuple[Any, ...]) -> Any:
    for x in operands:
        if type(x) is not _Tensor:
            return NOT_TAKEN
    return finish_eager(branches[k](*operands), branches, operands)


def finish_eager(out: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """The chosen branch's ``out`` (from flat ``operands``) without aliases of them,
    and with Note [untaken branches get zero gradients] when grad is enabled."""
    if type(out) is _Tensor and not out._is_view():
        for x in operands:
            if out is x or _effects.same_memory(out, x):  # x itself, x.detach()
                out = out.clone()
                break
    else:
        out = no_alias_tree(out, operands)
    return zero_untaken(out, branches, operands) if _grad_enabled() else out
