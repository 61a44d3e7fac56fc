"""The steady-state eager call of cond and switch: an inline cache of validated calls.

Note [the eager inline cache]
The commonest call of cond and switch, in eager with nothing active (no mode, no
transform: ``hop._transforms.nothing_active``, the cheap part of Note [plain eager];
under user modes the long-hand Python paths serve it) and a validated signature,
runs one branch on one tensor. What it must check on every call (the verdict's
operand kind, the output's kind: Note [outputs are checked on every call]; whether
the branches can read a tensor that requires grad: Note [untaken branches get zero
gradients], which needs no node when they read nothing but the operand and the
output's graph reaches it within a few nodes, :func:`reaches`; that the output does
not alias the operand) costs, in Python, about what a Python ``if`` costs. So a call
that found its verdict leaves an *entry* here, and later calls with the same branches
(the same code, for fresh lambdas too) and an operand of the same kind are run by
:func:`cond` / :func:`switch`: hop's C module ``hop._fastpath`` where it is built
(``pip install`` compiles it; it needs no torch headers), else the Python
functions below, which are its reference (the tests run both).

An entry is an :class:`Entry`: per branch its code (an inert builtin such as
``torch.tanh``: itself), the operand's kind, the verdict's set of output kinds and
one of them (compared first), per branch the globals its code loads, and the
verdict's key. The C module reads entries by position: ``configure`` checks that
its layout is :class:`Entry`'s fields. Whether any branch can read a
tensor but its argument is decided again on every call that needs it
(``reads_nothing`` of each: its defaults, the current values of those globals):
an entry holds no value a program could rebind, nor a tensor. Entries are
dropped with any verdict (``hop._validation.forget``), and all of them when the
cache holds :data:`CACHE_SIZE`.

:func:`cond` and :func:`switch` return the result, :data:`NOT_TAKEN` (nothing ran:
Python takes over), or ``(out, k, entry)``: branch ``k`` ran and returned ``out``,
which ``branching._eager.finish_ran`` finishes (a new output kind, zero gradients to
attach, an alias to clone).

The two give the same answer for every call (tests/property/test_fastpath_twin.py
feeds both the same calls), with these deliberate differences, none of which can
change an answer: C's ``key`` folds what ``py_key`` lists into one int (an entry
found by a colliding key is still checked item by item); C's lookup takes any
builtin as an item and finds no entry for one that is not inert, where Python stops
at it; and C reads a tensor's attributes by name, Python by the interpreter.
``HOP_FASTPATH=0`` in the environment (read at import) leaves the C module unused,
so the whole suite can run on the Python functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, FunctionType
from typing import Any, NamedTuple

import torch

from hop import _closures, _observe, _reference, config
from hop import _validation as validation
from hop._transforms import functorch_level, mode_stack_len, nothing_active, tf_mode_enabled
from hop.ops._common import NOT_TAKEN  # one sentinel: this path did not take the call
from hop.ops.branching._untaken_grads import ACCUMULATE_GRAD as _AccumulateGrad
from hop.ops.branching._untaken_grads import reads_nothing

__all__ = ["BUILT", "CACHE_SIZE", "NOT_TAKEN", "Entry", "cond", "key", "remember", "switch"]

CACHE_SIZE = 1024
_Tensor = torch.Tensor
_Function = FunctionType
_Builtin = BuiltinFunctionType
_CACHES = validation.INLINE
_CACHES.update(cond={}, switch={})  # the two operators this module (and hop._fastpath) serves
_INDEX_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}
_grad_enabled = torch.is_grad_enabled
Fn = Callable[..., Any]


class Entry(NamedTuple):
    """An inline-cache entry; the C module reads its fields by position, in this order."""

    items: tuple[Any, ...]  # per branch: its code, or an inert builtin itself
    dtype: torch.dtype  # the operand's kind the verdict is for
    ndim: int
    device: int
    kinds: set[Any]  # the verdict's output kinds
    usual: Any  # one of them, compared first (None if there is none)
    names: tuple[tuple[str, ...] | None, ...]  # per branch: the globals its code loads
    key: Any  # the verdict's key


def py_key(fns: Sequence[Fn], x: torch.Tensor) -> Any:
    """An entry's key where ``hop._fastpath`` is not built (else its ``key``, which folds
    the same into an int): the branches' items and the operand's kind; None for a
    branch that is never cached."""
    items = []
    for fn in fns:
        item = _item(fn)
        if item is None:
            return None
        items.append(id(item))
    return (*items, id(x.dtype), x.ndim, x.get_device())


def _item(fn: Fn) -> Any:
    """A plain function's code, an inert builtin (``torch.tanh``; not ``w.mul``, which
    an entry would keep alive with its tensor) itself; None: never cached."""
    if type(fn) is _Function:
        return fn.__code__ if fn.__closure__ is None else None
    return fn if type(fn) is _Builtin and _closures.is_inert(fn) else None


def remember(name: str, fns: Sequence[Fn], x: torch.Tensor, verdict: Any, kinds: set[Any]) -> None:
    """Make the entry for a call of ``name`` that found its ``verdict`` (key and kinds)."""
    if verdict in validation.ALIASING or validation._UNCHECKED.get(verdict) or None in map(_item, fns):
        return  # an output may alias x unseen, a branch was never checked, or one is never cached
    k = key(list(fns), x)
    if k is None:
        return
    cache = _CACHES[name]
    if len(cache) >= CACHE_SIZE:
        cache.clear()
    cache[k] = Entry(
        tuple(map(_item, fns)),
        x.dtype,
        x.ndim,
        x.get_device(),
        kinds,
        _usual(kinds, (x.dtype, x.ndim, x.get_device())),
        tuple(_closures.globals_read(fn.__code__) if type(fn) is _Function else None for fn in fns),
        verdict,
    )


def _usual(kinds: set[Any], operand_kind: Any) -> Any:
    """The output kind compared first: the operand's when the verdict has it (a branch
    keeping dtype and rank), else any kind of a tensor (None when there is none)."""
    if operand_kind in kinds:
        return operand_kind
    return next((k for k in kinds if len(k) == 3 and isinstance(k[0], torch.dtype)), None)


# --- the reference: what hop._fastpath does, in Python --------------------------------------


def py_cond(pred: Any, true_fn: Fn, false_fn: Fn, operands: Any) -> Any:
    """The result, :data:`NOT_TAKEN`, or ``(out, k, entry)`` for ``branching._eager.finish_ran``."""
    if type(pred) is not _Tensor or type(operands) is not tuple or len(operands) != 1:
        return NOT_TAKEN
    x = operands[0]
    if type(x) is not _Tensor or not _served():
        return NOT_TAKEN
    fns = (true_fn, false_fn)
    e = _find("cond", fns, x)
    if e is None:
        return NOT_TAKEN
    try:
        k = 0 if pred else 1
    except (RuntimeError, NotImplementedError):
        return NOT_TAKEN  # meta, or several elements: the general path explains
    return _run(e, fns, k, x)


def py_switch(index: Any, branches: Any, operands: Any) -> Any:
    """As :func:`py_cond`."""
    if type(index) is not _Tensor or type(operands) is not tuple or len(operands) != 1:
        return NOT_TAKEN
    if type(branches) is not list and type(branches) is not tuple:
        return NOT_TAKEN
    x = operands[0]
    if type(x) is not _Tensor or not branches or not _served() or index.dtype not in _INDEX_DTYPES:
        return NOT_TAKEN
    try:
        k = int(index)  # before the list is read: it may release the GIL
    except (RuntimeError, NotImplementedError, ValueError):
        return NOT_TAKEN
    fns = tuple(branches)  # a list can change while a branch runs
    if not 0 <= k < len(fns):
        return NOT_TAKEN  # out of range: the general path raises
    e = _find("switch", fns, x)
    if e is None:
        return NOT_TAKEN
    return _run(e, fns, k, x, branches)


def _run(e: Entry, fns: Sequence[Fn], k: int, x: torch.Tensor, branches: Any = None) -> Any:
    out = fns[k](x)
    # a branch that changed switch's list: Python finishes with the entry the call found
    done = branches is None or (len(branches) == len(fns) and all(map(_is, branches, fns)))
    done = done and type(out) is _Tensor and (out.dtype, out.ndim, out.get_device()) in e.kinds
    if done and (out is x or out._is_view()):
        done = False
    if done and (x.requires_grad or not _still_plain(fns)) and _grad_enabled():
        # only x can need a gradient, and the graph gives it one: no zero-gradient node
        done = x.requires_grad and _still_plain(fns) and reaches(out, x)
    return out if done else (out, k, e)


REACH = 8


def reaches(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``out``'s autograd graph reaches ``x`` within :data:`REACH` nodes,
    visited breadth first from ``out.grad_fn`` (duplicates count): then ``x`` gets its
    gradient from the branch that ran and no zero-gradient node is needed (Note
    [untaken branches get zero gradients]; ``branching._untaken_grads`` walks further when this
    says no)."""
    target = x.grad_fn  # None for a leaf: its AccumulateGrad node holds it
    fn = out.grad_fn
    queue = [] if fn is None else [fn]
    i = 0
    while i < len(queue):
        node = queue[i]
        i += 1
        if target is not None and node is target:
            return True
        if type(node) is _AccumulateGrad:
            if node.variable is x:  # type: ignore[attr-defined]
                return True
            continue
        for n, _ in node.next_functions:
            if n is not None and len(queue) < REACH:
                queue.append(n)
    return False


def _is(a: Any, b: Any) -> bool:
    return a is b


def _served() -> bool:
    """validate "once", no hop.debug sink, no thread in hop.testing.reference(), and
    nothing active (``nothing_active``: the cache serves only part of plain eager,
    Note [plain eager])."""
    return config.validate == "once" and not _observe.SINKS and not _reference.ACTIVE and nothing_active()


def _find(name: str, fns: Sequence[Fn], x: torch.Tensor) -> Entry | None:
    k = key(fns, x)
    e: Entry | None = None if k is None else _CACHES[name].get(k)
    if e is None or e.dtype is not x.dtype or e.ndim != x.ndim or e.device != x.get_device():
        return None
    items = e.items
    if len(items) != len(fns):
        return None
    for j, fn in enumerate(fns):
        if _item(fn) is not items[j]:
            return None
    return e


def _still_plain(fns: Sequence[Fn]) -> bool:
    return all(map(reads_nothing, fns))


def _configure() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    if os.environ.get("HOP_FASTPATH", "1") == "0":
        return py_cond, py_switch, py_key
    try:
        from hop import _fastpath  # optional: the C extension builds where a compiler was found
    except ImportError:  # not built (no compiler at install time): the same, in Python
        return py_cond, py_switch, py_key
    _fastpath.configure(
        entry_fields=Entry._fields,
        tensor=_Tensor,
        not_taken=NOT_TAKEN,
        config=vars(config),
        reference=vars(_reference),
        sinks=_observe.SINKS,
        index_dtypes=_INDEX_DTYPES,
        inert_types=_closures.INERT_TYPES,
        cond_cache=_CACHES["cond"],
        switch_cache=_CACHES["switch"],
        mode_stack_len=mode_stack_len,
        functorch_level=functorch_level,
        tf_mode=tf_mode_enabled,
        grad_enabled=_grad_enabled,
        accumulate_grad=_AccumulateGrad,
        library_namespaces=_closures.LIBRARY_NAMESPACES,
    )
    return _fastpath.cond, _fastpath.switch, _fastpath.key


cond, switch, key = _configure()
BUILT = cond is not py_cond
"""Whether the C module runs the cached calls (else the Python reference does)."""
