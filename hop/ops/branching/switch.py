"""``hop.switch`` and its raw op ``torch.ops.hop.switch``: an n-way cond.

Rules are switch's registrations of the shared branching rules (``branching._rules``),
in hop's fixed order: dense, autograd, grad / jvp, vmap, functionalize, fake,
proxy. An index out of range is never clamped: eager raises, traced programs
carry a runtime assert.

Compiled: Dynamo ``hop.compile._dynamo_branching.SwitchVariable``; Inductor
``hop.compile._inductor_rewrites.rewrite_switch`` (nested conds); ONNX
``hop.compile._onnx_ops.translate_switch``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _effects, _observe, _observe_calls, _reference, _spec
from hop._operator import HigherOrderOperator
from hop._transforms import in_plain_eager, is_dynamo_compiling, is_plain_tensor, mode_stack_len
from hop.errors import HopTypeError, HopValueError, format_message, type_name
from hop.ops._common import NOT_TAKEN, front, refuse_legacy_onnx
from hop.ops.branching import _call_cache, _record
from hop.ops.branching import _eager as fast
from hop.ops.branching import _rules as rules

__all__ = ["switch", "switch_op"]

_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_INDEX_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}

Fn = Callable[..., Any]
_check: Callable[..., None] = torch._check  # untyped in torch
_SINKS = _observe.SINKS
_tracing_state = torch._C._get_tracing_state
_fast = _call_cache.switch


def switch(
    index: int | torch.SymInt | torch.Tensor,
    branches: Sequence[Fn],
    operands: tuple[Any, ...] | list[Any] = (),
) -> Any:
    """``branches[index](*operands)``.

    Equivalent Python::

        def reference_switch(index, branches, operands=()):
            if not 0 <= index < len(branches):
                raise IndexError(index)
            return branches[index](*operands)

    Args:
        index: an int, a SymInt, or a one-element integer tensor. Out of range
            raises ``HopValueError`` in eager and fails a runtime assert in traced
            and exported programs; it is never clamped.
        branches: a non-empty sequence of callables taking ``*operands`` and
            returning pytrees of the same structure, with matching dtype, device
            and rank per leaf.
        operands: a tuple or list of pytrees of tensors (ints allowed).

    Transforms as ``hop.cond``; under vmap a batched index runs every branch and
    selects element-wise.
    """
    if not is_dynamo_compiling():  # Note [the eager inline cache] (it checks the two below)
        if _tracing_state() is not None and type(index) is not int:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx("switch", "which branch runs depends on index, a tensor")
        r = _fast(index, branches, operands)
        if type(r) is _Tensor:
            return r
        if r is not NOT_TAKEN:
            return fast.finish_ran(SWITCH, tuple(branches), operands, *r)
    taken = front("switch", switch, switch_op, _reference.reference_switch, (index, branches, operands))
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    k = -1  # the branch index gives, once read (read once: a user mode sees one read, as in Python)
    if (
        type(index) is _Tensor
        and type(operands) is tuple
        and type(branches) in _SEQUENCES
        and index.dtype in _INDEX_DTYPES
        and in_plain_eager()  # Note [plain eager]
    ):  # see branching._eager
        try:
            k = int(index)  # meta or several elements raise: the general path explains
        except (RuntimeError, NotImplementedError, ValueError):
            k = -1
        if 0 <= k < len(branches):
            if len(operands) == 1 and type(operands[0]) is _Tensor:  # the commonest call
                out = fast.eager_one(SWITCH, k, branches, operands[0])
                if out is not NOT_TAKEN:
                    return out
            out = fast.eager_fast("switch", k, branches, operands)
            if out is not NOT_TAKEN:
                return out
    if not isinstance(branches, (list, tuple)) or not branches:
        raise HopValueError(
            format_message(
                "switch",
                f"branches must be a non-empty list or tuple of callables, got {branches!r}",
            ),
            op="switch",
            role="branches",
        )
    check_index(index)
    if type(index) is int:  # a Python int: just run that branch, like cond's Python bool
        for role, fn in zip(SWITCH.roles(len(branches)), branches, strict=True):
            if not callable(fn):
                raise HopTypeError(
                    format_message("switch", f"{role} must be callable, got {type_name(fn)}"), op="switch", role=role
                )
        _record.check_operands("switch", operands)
        return branches[_index(index, len(branches))](*operands)
    taken = k if 0 <= k < len(branches) else None
    return _record.call(SWITCH, index, tuple(branches), operands, taken=taken)


def check_index(index: Any) -> None:
    """switch's check of ``index`` (also run by its Dynamo handler, on the traced value)."""
    if isinstance(index, (int, torch.SymInt)) and not isinstance(index, bool):
        return
    if not isinstance(index, torch.Tensor):
        raise HopTypeError(
            format_message(
                "switch",
                f"index must be an int, a SymInt or a one-element integer tensor, got {type_name(index)}",
            ),
            op="switch",
            role="index",
        )
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise HopTypeError(
            format_message(
                "switch",
                f"index must be an integer tensor, got dtype {str(index.dtype).removeprefix('torch.')}",
                fix="Convert it with index.long() (a bool with .long() too): hop never rounds an index.",
            ),
            op="switch",
            role="index",
        )
    if index.numel() != 1:
        raise HopValueError(
            format_message(
                "switch",
                f"index must have exactly one element, got shape {tuple(index.shape)}",
                fix="To pick a branch per element, torch.vmap the switch over the indices.",
            ),
            op="switch",
            role="index",
        )


def _index(index: Any, n: int) -> int:
    check_index(index)
    i = int(index)
    if not 0 <= i < n:
        raise HopValueError(
            format_message(
                "switch",
                f"index {i} is out of range for {n} branches",
                fix=f"Pass an index in [0, {n - 1}]; hop never clamps it.",
            ),
            op="switch",
            role="index",
        )
    return i


def _masks(index: Any, n: int) -> list[Any]:
    _check_batched_index(index, n)
    return [index == k for k in range(n)]


def _unwrapped(index: torch.Tensor) -> torch.Tensor:
    """The tensor under every functorch wrapper of ``index`` (a vmap batch: all its elements)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(index):
        index = torch._C._functorch.get_unwrapped(index)
    return index


def _check_batched_index(index: torch.Tensor, n: int) -> None:
    """Range-check every element of a vmap-batched index (batching rules cannot assert)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = _unwrapped(index)
    with temporarily_clear_interpreter_stack():
        bad = (raw < 0) | (raw >= n)
        if is_plain_tensor(raw) and not mode_stack_len():
            if bad.any():
                raise HopValueError(
                    format_message(
                        "switch",
                        f"index {raw[bad].flatten()[0].item()} (of a batch) is out of range for {n} branches",
                        fix=f"Pass indices in [0, {n - 1}]; hop never clamps them.",
                    ),
                    op="switch",
                    role="index",
                )
        else:
            torch._assert_async(~bad.any(), f"hop.switch: index out of range for {n} branches")


# Note [a recorded range check runs under vmap]
# A traced switch records its index check as ``_assert_async`` (hop's graphs and the
# exported program keep it), and torch's vmap has no batching rule for it: a graph that
# holds one and is run on a batch (a map body holding a switch, vmapped by map's rule or
# run by an exported vmap) failed with "Batching rule not implemented". The rule below,
# registered for every program once hop is imported, checks every element of the
# batch, as switch's own vmap rule does for an index.


def _assert_every_element(cond: torch.Tensor, msg: str) -> None:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = _unwrapped(cond)
    with temporarily_clear_interpreter_stack():
        torch._assert_async(raw.all(), msg)


_BATCHED_ASSERT = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
_BATCHED_ASSERT.impl("_assert_async.msg", _assert_every_element, "FuncTorchBatched")  # type: ignore[no-untyped-call]


def _call(index: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    return switch_op(index, tuple(operands), *branches)


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _observe_calls.branch_facts(frame, int, "a Python int index", int(args[0]), args[0])


SPEC = _spec.register(
    _spec.OpSpec(
        name="switch",
        params=("index", "operands", "branches"),
        role_pattern="branches[{k}]",
        # switch(index, operands, *branch_gms): the branches last, as many as there are
        layout=_spec.Layout(subgraphs=(2,), variadic=True, selector=0, inputs=1),
        validates=True,
        inline_cache=True,
        branch=int,
        describe=_describe,
    )
)


class SwitchOp(HigherOrderOperator):
    """``torch.ops.hop.switch(index, operands, *branches)``.

    Branches are separate positional arguments so that each is a get_attr
    argument of the node (torch.export cannot serialize a list of subgraphs).
    ``switch_op(index, branches, operands)``, the user-level order, is accepted too.
    """

    def __init__(self) -> None:
        super().__init__(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and isinstance(args[1], (list, tuple)) and args[1] and all(map(callable, args[1])):
            index, branches, operands = args
            args = (index, operands, *branches)
        return super().__call__(*args, **kwargs)


switch_op = SwitchOp()

SWITCH = _record.Branching(
    name="switch",
    op=switch_op,
    call=_call,
    index=_index,
    masks=_masks,
    roles=SPEC.role_names,
)


@switch_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def switch_dense(index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.dense(SWITCH, index, branches, operands)


@switch_op.py_autograd_impl
def switch_autograd(index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.autograd(SWITCH, index, branches, operands)


@switch_op.py_impl(TransformType.Grad)
def switch_grad(interpreter: Any, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.grad_or_jvp(SWITCH, interpreter, index, branches, operands)


@switch_op.py_impl(TransformType.Jvp)
def switch_jvp(interpreter: Any, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.grad_or_jvp(SWITCH, interpreter, index, branches, operands)


@switch_op.py_impl(TransformType.Vmap)
def switch_vmap(interpreter: Any, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.vmap(SWITCH, interpreter, index, branches, operands)


@switch_op.py_functionalize_impl
def switch_functionalize(ctx: Any, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return _effects.functionalize_rule(switch_op, SPEC, ctx, (index, operands, *branches), {})


@switch_op.py_impl(FakeTensorMode)
def switch_fake(mode: FakeTensorMode, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    return rules.fake(SWITCH, mode, index, branches, operands)


@switch_op.py_impl(ProxyTorchDispatchMode)
def switch_proxy(mode: ProxyTorchDispatchMode, index: Any, operands: Sequence[Any], *branches: Fn) -> Any:
    n = len(branches)
    if isinstance(index, torch.SymInt):
        _check(index >= 0)
        _check(index < n)
    elif isinstance(index, torch.Tensor) and _unwrapped(index) is index:
        # (Under vmap, export's pre-dispatch trace outranks vmap's rule and the index is
        # a batch: the program runs that rule, which checks every element, and a trace
        # of it records the check on tensors the trace follows.)
        known = index if not isinstance(index, FakeTensor) else index.constant  # a value known while tracing
        if known is not None:
            with unset_fake_temporarily():  # a real value: read it outside the fake mode
                _index(known, n)  # out of range: a HopValueError now, as in eager (not the assert below)
        with mode:  # recorded in the graph: the exported program checks it at run time
            torch._assert_async((index >= 0) & (index < n), f"hop.switch: index out of range for {n} branches")
    return rules.proxy(SWITCH, mode, index, branches, operands)
