"""hop's dispatcher: where a call to a hop operator goes, and why.

A call computes the dispatch key set of its tensor arguments (plus the TLS
include set, minus the TLS exclude set and the keys no HOP handles) and takes
the highest key. The routes, highest precedence first, follow torch's own key
order, so a hop operator meets the layers of a program exactly where an aten
operator would:

0. ``__torch_function__``: torch-function modes and overriding arguments
   (torch.export's non-strict handler sees hop calls here).
1. ``PreDispatch``: the mode on torch.export's pre-dispatch stack, looked up by
   mode type in ``op.python_key_table``.
2. ``FuncTorchDynamicLayerFrontMode``: the innermost functorch transform; the
   rule ``op.functorch_table[Vmap | Grad | Jvp | Functionalize]`` gets the
   interpreter and redispatches with ``interpreter.lower()``.
3. ``Autograd*``: grad mode off or no tensor argument requiring grad -> run
   again below autograd; otherwise the op's ``DispatchKey.Autograd`` rule.
4. ``Functionalize``: C++ functionalization (the op's functionalize rule).
5. ``Python``: the innermost TorchDispatchMode (rule by mode type; a mode with
   ``supports_higher_order_operators`` gets ``__torch_dispatch__``), then tensor
   subclasses (a FakeTensor without an active mode uses its ``fake_mode``;
   traceable wrapper subclasses with no rule of their own: the node runs on their
   inner tensors, Note [subclass operands desugared] in ``hop._subclasses``).
6. Backend keys (CPU, CUDA, Meta, ...): a per-backend kernel or the
   ``CompositeExplicitAutograd`` dense kernel.

Keys no HOP handles (autocast, ADInplaceOrView, BackendSelect, the JIT
tracer's: Note [the JIT tracer's key]) fall through. Each kernel runs with the
layers above it out of the way: the mode it serves is popped, autograd is
excluded below the autograd route (but for a backend kernel running callables
with grad enabled: Note [callables run with autograd on]), functorch rules lower
their interpreter themselves. Every guard and popped mode is a context manager,
so all of it is restored when a kernel raises.

Calls with nothing active (``hop._transforms.nothing_active``: no mode, no
transform, no torch-function mode) on plain tensors that need no grad take a fast
path decided with a handful of cheap checks, which lands on the same backend
kernel the full computation would. Under user modes only (Note [plain eager]) the
routes below reach that kernel too, with the modes active; a torch-function mode
sees the raw op as one call, as it sees any torch function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)

from hop import _observe, _records, _state, _subclasses
from hop._closures import closure_tensors
from hop._export_refusals import refuse_grad_level, refuse_lost_tensors
from hop._kernels import Derived, Kernel, Operator, all_not_implemented, find_kernel, lookup_rule, unsupported_mode
from hop._pytree import map_tensors, tensors_in
from hop._transforms import callers_rewrites, is_user_mode, nothing_active, rewrites_reentered
from hop.errors import MissingRuleError, format_message

__all__ = ["Operator", "call", "dispatch"]

_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter is a Tensor that disables __torch_function__
_mode_stack_len = torch._C._len_torch_dispatch_stack
_is_included = torch._C._dispatch_tls_is_dispatch_key_included
_is_functional = torch._is_functional_tensor
_grad_enabled = torch.is_grad_enabled
_BelowAutograd = torch._C._AutoDispatchBelowAutograd
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_SINKS = _records.SINKS
_SEQUENCES = (tuple, list)
_CONTAINERS = (tuple, list, dict)

# torch leaves these two untyped
_pre_dispatch_stack_len: Callable[[], int] = torch._ops._len_torch_dispatch_stack_pre_dispatch
_pre_dispatch_mode: Callable[[], Any] = torch._ops._get_current_dispatch_mode_pre_dispatch

_K = DispatchKey
_DEAD_WRAPPER_KEYS = (_K.FuncTorchGradWrapper, _K.FuncTorchBatched)
_PRE_DISPATCH = _K.PreDispatch
_FUNCTIONALIZE = _K.Functionalize
_AUTOGRAD = _K.AutogradFunctionality
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(_K.Python)  # the backend keys

# Note [the JIT tracer's key]
# While torch.jit.trace runs, the TLS include set holds the Tracer key, which
# Python's DispatchKey does not name (a kernel lookup for it reports "???"). The
# tracer records the aten ops a kernel runs; a hop operator itself has nothing to
# record (on real tensors its rules run the callables inline, which the tracer
# unrolls as the Python loop they replace), so the key falls through, as autocast
# does. It is the one functionality key between AutogradNestedTensor and AutocastCPU.
TRACER_KEYS = (
    torch._C._dispatch_keyset_full_after(_K.AutocastCPU)
    - torch._C._dispatch_keyset_full_after(_K.AutogradNestedTensor)
    - DispatchKeySet(_K.AutogradNestedTensor)
)


def _record(op: Operator, key: Any, route: str, kernel: Any = None, detail: Any = None) -> None:
    if not _SINKS:  # nothing watches (a watched call's frame exists only while a sink does)
        return
    name = getattr(kernel, "__qualname__", None) if kernel is not None else None
    key_name = str(key).removeprefix("DispatchKey.")
    rec = _records.DispatchRecord(
        op.name(), key_name, route, name, None if detail is None else str(detail), depth=_observe.depth(op.name())
    )
    _observe.dispatched(rec)
    _observe.emit(rec)


# --- entry points -----------------------------------------------------------


def call(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(*args, **kwargs)``: the fast path for plain eager calls, else :func:`dispatch`."""
    if (
        not kwargs
        and not _SINKS
        and nothing_active()  # Note [plain eager]: under user modes the routes below reach the same kernel
        and not _is_included(_PRE_DISPATCH)
        and not _is_included(_FUNCTIONALIZE)
    ):
        kernel = _plain_kernel(op, args)
        if kernel is not None:
            # Below autograd, as the Autograd route would do for inputs that need
            # no grad. Only dense CPU/Meta tensors get here, for which excluding
            # the autograd functionality bit is what _AutoDispatchBelowAutograd
            # does, at half the cost. Callables with grad enabled: Note
            # [callables run with autograd on].
            if _is_excluded(_AUTOGRAD) or (_grad_enabled() and _has_callables(args)):
                return kernel(*args)
            _set_excluded(_AUTOGRAD, True)
            try:
                return kernel(*args)
            finally:
                _set_excluded(_AUTOGRAD, False)
    with _state.entry() as first:
        try:
            tensors = tensors_in((args, kwargs))
            if torch.overrides.has_torch_function(tensors):
                _record(op, "TorchFunction", "torch-function")
                with callers_rewrites():
                    return torch.overrides.handle_torch_function(cast(Any, op), tensors, *args, **kwargs)
            return dispatch(op, _highest_key(op, tensors), args, kwargs)
        except _state.StateWrites as e:
            if not first:
                raise
            if e.op != op.name():  # a nested operator's, with no first frame of its own
                raise e.refusal from None
            writes = e
    return _state.rewrite(op, args, kwargs, writes)  # Note [state inside control flow]


def _plain_kernel(op: Operator, args: tuple[Any, ...]) -> Kernel | None:
    """The backend kernel if every tensor in ``args`` (at most one level of tuple/list
    deep) is a plain dense CPU or Meta tensor that needs no grad; else None."""
    grad = _grad_enabled()
    seen = on_cpu = on_meta = False
    for arg in args:
        for t in arg if type(arg) in _SEQUENCES else (arg,):
            if isinstance(t, _Tensor):
                if type(t) not in _PLAIN or _is_functional(t) or (grad and t.requires_grad):
                    return None
                if t.is_cpu:
                    on_cpu = True
                elif t.is_meta:
                    on_meta = True
                else:
                    return None
                seen = True
            elif type(t) in _CONTAINERS:
                return None
    if not seen or (on_cpu and on_meta):
        return None
    if grad and _closures_need_grad([], args):  # the Autograd route differentiates what they read
        return None
    key = _K.CPU if on_cpu else _K.Meta
    return op._hop_kernels.get(key) or find_kernel(op, key)


def _highest_key(op: Operator, tensors: Iterable[torch.Tensor]) -> DispatchKey:
    keys = torch._C._dispatch_tls_local_include_set()
    for t in tensors:
        keys = keys | torch._C._dispatch_keys(t)
    keys = (keys - torch._C._dispatch_tls_local_exclude_set()) & op.non_fallthrough_keys
    return keys.highestPriorityTypeId()


def redispatch(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dispatch again from the current TLS state, without torch-function handling."""
    return dispatch(op, _highest_key(op, tensors_in((args, kwargs))), args, kwargs)


def dispatch(op: Operator, key: DispatchKey, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``op`` at dispatch key ``key``; the routes in the module docstring's order."""
    if key == _K.PreDispatch:
        return _pre_dispatch(op, args, kwargs)
    if key == _K.FuncTorchDynamicLayerFrontMode:
        return _functorch(op, args, kwargs)
    if torch._C._dispatch_is_included_in_alias(key, _K.Autograd):
        return _autograd(op, key, args, kwargs)
    if key == _K.Functionalize:
        kernel = find_kernel(op, key, "functionalize rule", "Functionalize")
        _record(op, key, "kernel", kernel)
        return kernel(*args, **kwargs)
    if key == _K.Python:
        return _python(op, args, kwargs)
    if key in _DEAD_WRAPPER_KEYS:
        # functorch wrappers that outlived their transform: unwrap and go on.
        args, kwargs = map_tensors(torch._C._functorch.unwrap_if_dead, (args, kwargs))
        return redispatch(op, args, kwargs)
    kernel = op._hop_kernels.get(key) or find_kernel(op, key)
    _record(op, key, "kernel", kernel)
    return kernel(*args, **kwargs)


# --- the routes ---------------------------------------------------------------


def _pre_dispatch(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _pre_dispatch_stack_len() > 0 and not torch._C._dispatch_tls_is_dispatch_key_excluded(_K.Python):
        mode = _pre_dispatch_mode()
        refuse_grad_level(op)
        refuse_lost_tensors(op, mode, args)
        handler = lookup_rule(op.python_key_table, type(mode))
        if handler is None and op._hop_decomposition is not None:
            return _decomposed(op, op._hop_decomposition, mode, args, kwargs, _K.PreDispatch)
        if handler is None:
            raise unsupported_mode(op, mode)
        _record(op, _K.PreDispatch, "mode", handler, type(mode).__name__)
        with _pop_mode_temporarily(_K.PreDispatch) as popped, rewrites_reentered():
            return handler(popped, *args, **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(_K.PreDispatch)):
        return redispatch(op, args, kwargs)


def _functorch(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    interpreter = retrieve_current_functorch_interpreter()
    transform = interpreter.key()
    rule = op.functorch_table.get(transform)
    if rule is None and op._hop_decomposition is not None:
        _record(op, _K.FuncTorchDynamicLayerFrontMode, "decomposition", None, transform.name)
        return op._hop_decomposition.run(args, kwargs)
    if rule is None:
        raise MissingRuleError(
            format_message(
                op.name(),
                f"has no rule for the functorch transform {transform.name}",
                fix=f"Register one with @torch.ops.hop.{op.name()}.py_impl(TransformType.{transform.name}).",
            ),
            op=op.name(),
        )
    args, kwargs = map_tensors(torch._C._functorch.unwrap_if_dead, (args, kwargs))
    lift = getattr(interpreter, "lift", None)
    if lift is not None:  # Grad and Jvp: bring every tensor to this level first
        args, kwargs = lift(args, kwargs)
    _record(op, _K.FuncTorchDynamicLayerFrontMode, "transform", rule, f"{transform.name} level {interpreter.level()}")
    return rule(interpreter, *args, **kwargs)


def _autograd(op: Operator, key: DispatchKey, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = tensors_in((args, kwargs))
    if not _grad_enabled() or not (any(t.requires_grad for t in tensors) or _closures_need_grad(tensors, args)):
        _record(op, key, "below-autograd")
        if _grad_enabled() and _has_callables(args):
            with _BelowAutograd():
                below = _highest_key(op, tensors)
            if torch._C._dispatch_is_included_in_alias(below, _K.CompositeExplicitAutograd):
                return dispatch(op, below, args, kwargs)  # Note [callables run with autograd on]
        with _BelowAutograd():
            return redispatch(op, args, kwargs)
    kernel = find_kernel(op, key, "autograd rule", "Autograd")
    _record(op, key, "kernel", kernel)
    return kernel(*args, **kwargs)


# Note [callables run with autograd on]
# With grad enabled, a call whose tensors need no grad and whose callables read nothing
# that requires grad, as far as the static closure search finds (hop._closures), runs
# its backend kernel with autograd left on. The kernel runs the callables inline on
# real tensors, so a tensor that requires grad and that the search cannot see (read
# through getattr with a computed name, inside a library's code, deeper than the search
# goes) is differentiated as in plain Python, never dropped silently. When nothing
# requires grad, autograd records nothing. Only the Python and functorch routes still
# run with autograd excluded, as an aten op's kernels do.


def _has_callables(args: tuple[Any, ...]) -> bool:
    """Whether an argument, or an element of one, is a callable (a branch, a body)."""
    for arg in args:
        for a in arg if type(arg) in _SEQUENCES else (arg,):
            if callable(a) and not isinstance(a, torch.Tensor):
                return True
    return False


def _closures_need_grad(tensors: list[torch.Tensor], args: tuple[Any, ...]) -> bool:
    """Whether a callable argument reads a tensor that requires grad from its
    closure: then the autograd rule runs, to differentiate it (Note [closure
    conversion]; on real tensors the rules run the callables inline, where autograd
    sees what they read, but only if the Autograd route is taken at all)."""
    fns = [a for arg in args for a in (arg if type(arg) in _SEQUENCES else (arg,)) if callable(a)]
    fns = [f for f in fns if not isinstance(f, (torch.Tensor, torch.fx.GraphModule))]
    return bool(fns) and any(t.requires_grad for t in closure_tensors(fns))


def _python(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = _get_current_dispatch_mode()
    if mode is not None:
        handler = lookup_rule(op.python_key_table, type(mode))
        if handler is not None:
            _record(op, _K.Python, "mode", handler, type(mode).__name__)
            with _pop_mode_temporarily() as popped, rewrites_reentered():
                result = handler(popped, *args, **kwargs)
            if result is not NotImplemented:
                return result
        elif op._hop_decomposition is not None and not is_user_mode(mode) and not _receives_hops(mode):
            return _decomposed(op, op._hop_decomposition, mode, args, kwargs, _K.Python)
        elif _receives_hops(mode):
            _record(op, _K.Python, "mode.__torch_dispatch__", None, type(mode).__name__)
            with _pop_mode_temporarily() as popped:
                result = popped.__torch_dispatch__(op, [], args, kwargs)
            if result is not NotImplemented:  # else: the tensor subclasses, as for a rule
                return result
            if _runs_under_modes(args, kwargs):  # e.g. FlopCounterMode: it counts the ops inside
                return _under_modes(op, args, kwargs, mode)
        elif is_user_mode(mode):
            return _past_user_mode(op, args, kwargs, mode)
        else:  # a tracing mode other operators have a rule for
            raise unsupported_mode(op, mode)
    desugared = _subclasses.user_subclasses(op, args)
    if desugared and not any(lookup_rule(op.python_key_table, c) for c in desugared):
        _record(op, _K.Python, "subclass desugared", None, desugared[0].__qualname__)
        return _subclasses.desugar(op, args, kwargs)
    seen: list[type] = []
    for t in tensors_in((args, kwargs)):
        cls = type(t)
        if cls in seen or cls.__torch_dispatch__ is torch._C._disabled_torch_dispatch_impl:
            continue
        seen.append(cls)
        if isinstance(t, FakeTensor):
            handler = lookup_rule(op.python_key_table, FakeTensorMode)
            call_args: tuple[Any, ...] = (t.fake_mode, *args)
        else:
            handler = lookup_rule(op.python_key_table, cls)
            call_args = args
        if handler is None and op._hop_decomposition is not None:
            _record(op, _K.Python, "decomposition", None, cls.__qualname__)
            with t.fake_mode if isinstance(t, FakeTensor) else contextlib.nullcontext():
                return op._hop_decomposition.run(args, kwargs)
        if handler is None:
            raise MissingRuleError(
                format_message(
                    op.name(),
                    f"has no rule for the tensor subclass {cls.__qualname__}",
                    fix=f"Register one with @torch.ops.hop.{op.name()}.py_impl({cls.__qualname__}).",
                ),
                op=op.name(),
            )
        _record(op, _K.Python, "subclass", handler, cls.__qualname__)
        with rewrites_reentered():
            result = handler(*call_args, **kwargs)
        if result is not NotImplemented:
            return result
    raise all_not_implemented(op, mode, seen)


def _receives_hops(mode: Any) -> bool:
    return bool(getattr(mode, "supports_higher_order_operators", False))


def _decomposed(op: Operator, derived: Derived, mode: Any, args: Any, kwargs: dict[str, Any], key: DispatchKey) -> Any:
    """A tracing mode the operator has no rule for: make_fx's and torch.export's tracer
    records one node of it, any other runs its decomposition under the mode."""
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

    if not isinstance(mode, ProxyTorchDispatchMode):
        _record(op, key, "decomposition", None, type(mode).__name__)
        return derived.run(args, kwargs)
    _record(op, key, "decomposition node", None, type(mode).__name__)
    popping = _pop_mode_temporarily(key) if key == _PRE_DISPATCH else _pop_mode_temporarily()
    with popping as popped, rewrites_reentered():
        return derived.proxy(op, popped, args, kwargs)


def _past_user_mode(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Any) -> Any:
    """Note [user modes] in ``hop._transforms``: with only user modes (and modes that
    decline the op) active and real tensors, the backend kernel runs with the modes
    still active, so they see the aten ops inside; below a tracing mode, the user mode
    is stepped over and the op reaches the tracing mode whole."""
    if _runs_under_modes(args, kwargs):
        return _under_modes(op, args, kwargs, mode)
    _record(op, _K.Python, "past user mode", None, type(mode).__name__)
    with _pop_mode_temporarily():
        return redispatch(op, args, kwargs)


def _runs_under_modes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """No active mode has a hop rule (none traces) and every tensor is a plain one."""
    for i in range(_mode_stack_len()):
        mode = torch._C._get_dispatch_stack_at(i)
        if not is_user_mode(mode) and not getattr(mode, "supports_higher_order_operators", False):
            return False
    return all(type(t) in (_Tensor, torch.nn.Parameter) for t in tensors_in((args, kwargs)))


def _under_modes(op: Operator, args: tuple[Any, ...], kwargs: dict[str, Any], mode: Any) -> Any:
    tensors = tensors_in((args, kwargs))
    keys = DispatchKeySet(_K.CPU) if not tensors else torch._C._dispatch_keys(tensors[0])
    for t in tensors[1:]:
        keys = keys | torch._C._dispatch_keys(t)
    key = (keys & _BELOW_PYTHON & op.non_fallthrough_keys).highestPriorityTypeId()
    kernel = op._hop_kernels.get(key) or find_kernel(op, key)
    _record(op, key, "kernel under user mode", kernel, type(mode).__name__)
    if not _is_excluded(_AUTOGRAD):
        return kernel(*args, **kwargs)
    # The ops inside meet autograd as in a Python call (composite ops decompose there,
    # and the mode sees aten.mm, not aten.matmul); nothing is recorded that the route
    # below autograd would have: no input needs grad, or grad mode is off.
    _set_excluded(_AUTOGRAD, False)
    try:
        return kernel(*args, **kwargs)
    finally:
        _set_excluded(_AUTOGRAD, True)
