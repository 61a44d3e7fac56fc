"""``hop.cond`` and its raw op ``torch.ops.hop.cond``.

Rules are cond's registrations of the shared branching rules (cond is a
two-branch switch, see ``branching._rules``), in hop's fixed order: dense, autograd,
grad / jvp, vmap, functionalize, fake, proxy.

Compiled: Dynamo ``hop.compile._dynamo_branching.CondVariable``; Inductor ``hop.compile.inductor._lower_cond``
(``hop.compile._inductor_rewrites.rewrite_cond`` first, for int outputs); ONNX
``hop.compile._onnx_ops.translate_cond``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import FunctionType
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _effects, _observe, _observe_calls, _reference, _spec
from hop import _validation as validation
from hop._operator import HigherOrderOperator
from hop._transforms import in_plain_eager, is_dynamo_compiling
from hop.errors import HopTypeError, HopValueError, format_message
from hop.ops._common import NOT_TAKEN, front, refuse_legacy_onnx
from hop.ops.branching import _call_cache, _record
from hop.ops.branching import _eager as fast
from hop.ops.branching import _rules as rules

__all__ = ["cond", "cond_op"]

_Tensor = torch.Tensor
_BOOL = torch.bool
_Function = FunctionType
_ONCE = "once"
_grad_enabled = torch.is_grad_enabled
_INT_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}
_VERDICTS = validation._VERDICTS
_SINKS = _observe.SINKS
_tracing_state = torch._C._get_tracing_state
_fast = _call_cache.cond


def cond(
    pred: bool | torch.SymBool | torch.Tensor,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: tuple[Any, ...] | list[Any] = (),
) -> Any:
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``.

    Equivalent Python::

        def reference_cond(pred, true_fn, false_fn, operands=()):
            return true_fn(*operands) if pred else false_fn(*operands)

    Args:
        pred: a Python bool (the branch just runs, like torch.cond), a SymBool, or
            a one-element tensor: bool, or a number taken as a Python ``if``
            takes it (nonzero is true, as torch.cond and JAX), or a ``numpy.bool_``.
        true_fn, false_fn: callables taking ``*operands`` and returning pytrees of
            the same structure, with matching dtype, device and rank per leaf
            (sizes may differ: traced, they become unbacked sizes).
        operands: a tuple or list of pytrees of tensors (ints allowed).

    In eager only the chosen branch runs; both are checked once per signature on
    fake tensors (``hop.config.validate``). Outputs never alias the operands.
    Autograd, ``torch.func`` (grad, jvp, vjp, jacrev, jacfwd, hessian) and vmap
    (also with a batched ``pred``: both branches run and ``torch.where``
    selects) work; make_fx and torch.export keep one ``torch.ops.hop.cond`` node.
    The backward gives every differentiable tensor the branches read a gradient,
    zeros for the untaken branch (as torch.cond; DDP needs no find_unused_parameters).
    """
    if not is_dynamo_compiling():  # Note [the eager inline cache] (it checks the two below)
        if _tracing_state() is not None and type(pred) is not bool:  # Note [the legacy ONNX exporter]
            refuse_legacy_onnx("cond", "which branch runs depends on pred, a tensor")
        r = _fast(pred, true_fn, false_fn, operands)
        if type(r) is _Tensor:
            return r
        if r is not NOT_TAKEN:
            return fast.finish_ran(COND, (true_fn, false_fn), operands, *r)
    taken = front("cond", cond, cond_op, _reference.reference_cond, (pred, true_fn, false_fn, operands))
    if taken is not NOT_TAKEN:  # Note [a public function's front]
        return taken
    if type(pred) is bool:
        for role, fn in (("true_fn", true_fn), ("false_fn", false_fn)):
            if not callable(fn):
                raise HopTypeError(format_message("cond", f"{role} must be callable, got {type(fn).__name__}"))
        _record.check_operands("cond", operands)
        return true_fn(*operands) if pred else false_fn(*operands)
    k = -1  # the branch pred gives, once read (read once: a user mode sees one read, as in Python)
    if (
        type(pred) is _Tensor and type(operands) is tuple and in_plain_eager()  # Note [plain eager]
    ):  # see branching._eager
        try:
            k = 0 if pred else 1  # a number's truth, as a Python if; meta or several elements raise
        except (RuntimeError, NotImplementedError):
            k = -1  # the general path explains
        if k >= 0:
            if len(operands) == 1 and type(operands[0]) is _Tensor:  # the commonest call
                out = fast.eager_one(COND, k, (true_fn, false_fn), operands[0])
                if out is not NOT_TAKEN:
                    return out
            out = fast.eager_fast("cond", k, (true_fn, false_fn), operands)
            if out is not NOT_TAKEN:
                return out
    if _is_numpy_bool(pred):
        return cond(bool(pred), true_fn, false_fn, operands)
    check_pred(pred)
    if isinstance(pred, torch.Tensor) and pred.dtype is not _BOOL:
        pred = pred != 0  # a number's truth, as a Python if (the graph then holds a bool pred)
    return _record.call(COND, pred, (true_fn, false_fn), operands, taken=k if k >= 0 else None)


def _is_numpy_bool(pred: Any) -> bool:
    return type(pred).__module__ == "numpy" and type(pred).__name__ in ("bool", "bool_")


def check_pred(pred: Any) -> None:
    """cond's check of ``pred`` (also run by its Dynamo handler, on the traced value)."""
    if isinstance(pred, (bool, torch.SymBool)):
        return
    if not isinstance(pred, torch.Tensor):
        raise HopTypeError(
            format_message(
                "cond",
                f"pred must be a bool, a SymBool or a one-element tensor, got {type(pred).__name__}",
            ),
            op="cond",
            role="pred",
        )
    if not (pred.dtype.is_floating_point or pred.dtype.is_complex or pred.dtype in _INT_DTYPES):
        raise HopTypeError(
            format_message(
                "cond",
                f"pred must be a bool or number tensor, got dtype {str(pred.dtype).removeprefix('torch.')}",
                fix="Compare it to something, e.g. pred=x.sum() > 0.",
            ),
            op="cond",
            role="pred",
        )
    if pred.numel() != 1:
        raise HopValueError(
            format_message(
                "cond",
                f"pred must have exactly one element, got shape {tuple(pred.shape)}",
                fix="Reduce it first, e.g. pred=mask.any().",
            ),
            op="cond",
            role="pred",
        )


def _index(pred: Any, n: int) -> int:
    if type(pred) is not _Tensor or pred.dtype is not _BOOL or pred.numel() != 1:
        if _is_numpy_bool(pred):
            return 0 if pred else 1
        check_pred(pred)
    return 0 if pred else 1  # a number tensor's truth, as a Python if


def _masks(pred: Any, n: int) -> list[Any]:
    mask = pred if pred.dtype is _BOOL else pred != 0
    return [mask, ~mask]


def _call(pred: Any, branches: Sequence[Callable[..., Any]], operands: Sequence[Any]) -> Any:
    return cond_op(pred, branches[0], branches[1], tuple(operands))


def _describe(frame: _observe.Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _observe_calls.branch_facts(
        frame, bool, "a Python bool pred", 0 if args[0] else 1, args[0]
    )  # eager: pred has a value


SPEC = _spec.register(
    _spec.OpSpec(
        name="cond",
        params=("pred", "true_fn", "false_fn", "operands"),
        roles=("true_fn", "false_fn"),
        layout=_spec.Layout(subgraphs=(1, 2), selector=0, inputs=3),  # cond(pred, true_gm, false_gm, operands)
        validates=True,
        inline_cache=True,
        branch=lambda pred: 0 if bool(pred) else 1,  # truthy as a Python if: true_gm comes first
        describe=_describe,
    )
)

cond_op = HigherOrderOperator(SPEC.name, cacheable=True, tuple_args=SPEC.tuple_args())

COND = _record.Branching(
    name="cond",
    op=cond_op,
    call=_call,
    index=_index,
    masks=_masks,
    roles=SPEC.role_names,
    selector="pred",
)

Fn = Callable[..., Any]


@cond_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def cond_dense(pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.dense(COND, pred, (true_fn, false_fn), operands)


@cond_op.py_autograd_impl
def cond_autograd(pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.autograd(COND, pred, (true_fn, false_fn), operands)


@cond_op.py_impl(TransformType.Grad)
def cond_grad(interpreter: Any, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.grad_or_jvp(COND, interpreter, pred, (true_fn, false_fn), operands)


@cond_op.py_impl(TransformType.Jvp)
def cond_jvp(interpreter: Any, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.grad_or_jvp(COND, interpreter, pred, (true_fn, false_fn), operands)


@cond_op.py_impl(TransformType.Vmap)
def cond_vmap(interpreter: Any, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.vmap(COND, interpreter, pred, (true_fn, false_fn), operands)


@cond_op.py_functionalize_impl
def cond_functionalize(ctx: Any, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return _effects.functionalize_rule(cond_op, SPEC, ctx, (pred, true_fn, false_fn, operands), {})


@cond_op.py_impl(FakeTensorMode)
def cond_fake(mode: FakeTensorMode, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.fake(COND, mode, pred, (true_fn, false_fn), operands)


@cond_op.py_impl(ProxyTorchDispatchMode)
def cond_proxy(mode: ProxyTorchDispatchMode, pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any]) -> Any:
    return rules.proxy(COND, mode, pred, (true_fn, false_fn), operands)
