"""Int carries in a traced while_loop: how they travel through the node, and what cond_fn and body_fn see.

An exported node cannot mix ints and tensors in one list, so :func:`ints_as_tensors`
(the proxy rule's path for Python-int carries) sends them through the node as 0-dim
int64 tensors that ``.item()`` turns back into unbacked SymInts inside. Which of
the two a condition or a body is given is Note [int carries in a traced
condition]; :func:`body_on_tensors` is the body that takes tensors. The raw op is
passed in by ``hop.ops.while_loops.while_loop``, which imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from hop import _closures
from hop import subgraph as _subgraph
from hop._state import counted_as
from hop._transforms import batched_inside
from hop._unbacked import assert_ranges, assume_range, trial_run
from hop._unbacked_loops import carry_ranges
from hop.errors import HopError, HopValueError, format_message
from hop.ops._common import as_tuple
from hop.ops.while_loops._checks import NAME

Fn = Callable[..., Any]
DERIVED = "the range derived from the initial value and body_fn"


def ints_as_tensors(
    op: Any, mode: ProxyTorchDispatchMode, cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any]
) -> Any:
    """Python-int carries travel as 0-dim tensors through the node ``op`` makes (an
    exported node cannot mix ints and tensors in one list); inside, ``.item()`` makes
    them SymInts."""
    n, slots = len(carried), [i for i, c in enumerate(carried) if type(c) is int]
    name = counted_as(body_fn) or NAME  # the function the user called: fori_loop for its counted body
    refuse_batched(carried, (*additional, *_closures.closure_tensors([cond_fn, body_fn])), name)
    _refuse_differentiated(carried, additional, name)

    def as_ints(args: Sequence[Any]) -> list[Any]:
        return [a.item() if i in slots else a for i, a in enumerate(args)]

    fake_mode = torch._guards.detect_fake_mode([*carried, *additional])
    assert fake_mode is not None and fake_mode.shape_env is not None  # the caller checked
    fake_mode.allow_scalar_outputs = True  # for .item(): AOTAutograd's fake mode under torch.compile forbids it
    ints_in_cond = _reads_symints(cond_fn, carried, additional, slots, fake_mode)
    if not _reads_symints(body_fn, carried, additional, slots, fake_mode):
        _check_kinds_on_ints(body_fn, carried, additional, fake_mode)
        body_fn = functools.partial(body_on_tensors, tuple(slots), body_fn)

    def cond_t(*args: Any) -> Any:
        return cond_fn(*(as_ints(args[:n]) if ints_in_cond else args[:n]), *args[n:])

    def body_t(*args: Any) -> tuple[Any, ...]:
        out = as_tuple(body_fn(*as_ints(args[:n]), *args[n:]))
        return tuple(torch.scalar_tensor(o, dtype=torch.int64) if i in slots else o for i, o in enumerate(out))

    cond_t.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    body_t.__wrapped__ = body_fn  # type: ignore[attr-defined]
    with fake_mode:
        ranges = carry_ranges(NAME, body_fn, tuple(carried), tuple(additional), fake_mode.shape_env)
    with mode:
        carried_t = [torch.scalar_tensor(c, dtype=torch.int64) if i in slots else c for i, c in enumerate(carried)]
        out = as_tuple(op(cond_t, body_t, tuple(carried_t), tuple(additional)))
        result = as_ints(out)
    fresh = [assume_range(r, *rng, size=False) for r, rng in zip(result, ranges, strict=True) if rng and _symbolic(r)]
    assert_ranges(mode, NAME, tuple(result), fresh, root="carry", why=DERIVED)
    return result[0] if n == 1 else tuple(result)


def refuse_batched(carried: Sequence[Any], additional: Sequence[Any], name: str = NAME) -> None:
    """Int carries under vmap cannot be exported (``additional``: the loop's other
    tensors, those its callables close over included). Only export's pre-dispatch trace meets
    vmap's batched tensors here (elsewhere vmap's rule runs first and keeps int carries
    ints): as tensors the ints would be batched with the carries, and the body's .item()
    of them fails inside vmap. Strict export refuses when Dynamo captures the loop,
    before its graph's vmap has entered a level that an error would leave behind."""
    if any(type(c) is int or isinstance(c, torch.SymInt) for c in carried) and any(
        batched_inside(t) for t in (*carried, *additional)
    ):
        raise HopValueError(
            format_message(
                name,
                "under vmap, exported loops carry tensors only (an int carry or Python-int fori_loop bounds)",
                fix="Pass fori_loop tensor bounds (torch.tensor(n)), or carry the counter as a tensor.",
            ),
            op=name,
        )


def _refuse_differentiated(carried: Sequence[Any], additional: Sequence[Any], name: str) -> None:
    """Int carries under ``torch.func.jvp`` (or ``grad``) inside an exported function
    cannot be exported: export's pre-dispatch trace meets the transform's wrapped
    tensors here, and the 0-dim tensors the ints travel as, made under the transform,
    are wrappers its tracer never sees, recorded as constants (the loop ran a wrong
    number of steps, silently)."""
    if any(
        isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)
        for t in (*carried, *additional)
    ):
        raise HopValueError(
            format_message(
                name,
                "under torch.func.jvp inside an exported function, loops carry tensors only "
                "(an int carry or Python-int fori_loop bounds)",
                fix="Pass fori_loop tensor bounds (torch.tensor(n)), or carry the counter as a tensor.",
            ),
            op=name,
        )


# Note [int carries in a traced condition]
# A traced loop gives its int carries to cond_fn as unbacked SymInts. A condition that
# mixes one with a tensor (``(~done).any() & (t < n)``) makes torch read ``t < n`` as a
# Python bool, which a data-dependent value cannot be: the trace fails where eager,
# which has a real int, works. Such a condition gets the carries as the 0-dim int64
# tensors they travel as instead, so that ``t < n`` is a tensor too; the value it
# computes is the same. Conditions that work on SymInts keep getting SymInts. make_fx
# and torch.export decide by a run of cond_fn on fake values (_reads_symints);
# Dynamo, whose stand-ins for a callable cannot always run, by tracing it again
# (hop.compile._dynamo_while.WhileLoopVariable.trace_cond).
#
# body_fn mixes them alike (``stop = done | (t + 1 >= n)``, an ACT RNN's forced last
# step). It is decided the same way, and a body that cannot take SymInts is called by
# body_on_tensors: the int carries in as 0-dim int64 tensors, its int outputs read back
# with ``.item()``, so that the loop around it still carries SymInts. Under Dynamo,
# which traces ``.item()`` only when told to capture scalar outputs, the body is traced
# so (hop.compile._dynamo_while.WhileLoopVariable.trace_body).


def body_on_tensors(slots: tuple[int, ...], body_fn: Fn, *args: Any) -> tuple[Any, ...]:
    """Note [int carries in a traced condition]: ``body_fn`` given its int carries as tensors."""
    out = body_fn(*(torch.scalar_tensor(a, dtype=torch.int64) if k in slots else a for k, a in enumerate(args)))
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o.item() if k in slots and isinstance(o, torch.Tensor) else o for k, o in enumerate(out))


def _reads_symints(
    fn: Fn, carried: Sequence[Any], additional: Sequence[Any], slots: Sequence[int], fake_mode: FakeTensorMode
) -> bool:
    """Note [int carries in a traced condition]: whether cond_fn (or body_fn) can be traced on SymInts."""
    shape_env = fake_mode.shape_env
    assert shape_env is not None
    with fake_mode, shape_env.ignore_fresh_unbacked_symbols(), trial_run():
        values = [shape_env.create_unbacked_symint() if i in slots else c for i, c in enumerate(carried)]
        try:
            fn(*values, *additional)
        except GuardOnDataDependentSymNode:
            return False
        except Exception:  # any other mistake is reported by the real trace
            return True
    return True


def _check_kinds_on_ints(fn: Fn, carried: Sequence[Any], additional: Sequence[Any], fake_mode: FakeTensorMode) -> None:
    """Note [int carries in a traced condition]: a body given its int carries as
    tensors returns tensors for them, so what it returns on real ints is checked
    first, as eager checks it: a tensor returned for an int carry is refused."""
    shape_env = fake_mode.shape_env
    assert shape_env is not None
    with fake_mode, shape_env.ignore_fresh_unbacked_symbols(), trial_run():
        try:
            out = as_tuple(fn(*carried, *additional))
        except HopError:
            raise
        except Exception:  # any other mistake is reported by the real trace
            return
    roles = ("carried_inputs", "body_fn")
    _subgraph.check_same_outputs(NAME, roles, (tuple(carried), out), root="carry", fns=(None, fn))


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and value.node.expr.is_Symbol
