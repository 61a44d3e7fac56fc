"""The validate-once run itself: callables run on fake copies of their operands, invisibly.

:func:`fake_inputs` gives static-shape fake copies of the operands inside their
fake mode, with the caller's world set aside for the run: user modes, torch.func
levels (Note [validation under torch.func]), closed-over real tensors, autocast's
cast cache, saved-tensor hooks, the JIT tracer, fake-tensor log records and
parametrize's cache (Note [validation is invisible]), and module forward hooks
(Note [module hooks do not see validation], :func:`check_hooks`). What a run can
raise that means "cannot be checked ahead of time" rather than "wrong" starts at
:class:`NotValidatable`; ``hop._validation`` (the verdicts) lists it in
``CANNOT_FAKE`` and re-exports this module's API, which the operators call there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
import torch.nn.modules.module as nn_module
import torch.nn.utils.parametrize as parametrize
import torch.utils._pytree as pytree
from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import _disable_current_modes

from hop import _observe, _transforms

__all__ = ["NotValidatable", "HookedModule", "fakeable", "fake_inputs", "check_hooks", "referents"]

Fn = Callable[..., Any]
_Tensor = torch.Tensor


class NotValidatable(Exception):
    """The callables cannot be checked ahead of time (recursion through hop operators,
    modules with forward hooks: Note [module hooks do not see validation])."""


class HookedModule(NotValidatable):
    """A fake run would call a module with forward hooks (Note [module hooks do not see validation])."""


def fakeable(leaves: Sequence[Any]) -> bool:
    """Whether fake tensors can stand for every tensor of ``leaves`` (not a quantized one)."""
    return not any(isinstance(x, torch.Tensor) and x.is_quantized for x in leaves)


@contextlib.contextmanager
def fake_inputs(leaves: Sequence[Any]) -> Iterator[list[Any]]:
    """Static-shape fake copies of ``leaves``, inside their fake mode, isolated from
    the caller's world (Note [validation is invisible]). Callers check
    :func:`fakeable` first."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=_shape_env())
    # user modes (Note [user modes]) would see the fake run's meta kernels: set them aside
    user_modes = _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()
    function_modes = _user_function_modes_aside() if torch._C._len_torch_function_stack() else contextlib.nullcontext()
    with user_modes, function_modes, temporarily_clear_interpreter_stack():  # Note [validation under torch.func]
        fake = [_to_fake(mode, x) if isinstance(x, torch.Tensor) else x for x in leaves]
        with (
            _observe.validation_run(),
            _isolated(),
            _no_module_hooks(),
            _no_parametrization_cache(),
            mode,
            _FakeClosures(mode),
        ):
            yield fake


def _shape_env() -> ShapeEnv:
    """A fresh ShapeEnv. Note [the first ShapeEnv imports torch._dynamo]: torch's ShapeEnv
    imports torch._dynamo when the first one is made (seconds, once per process); that
    time goes on the call's record (``import_us``), so that a first call's ``took`` is
    explained rather than charged to validation."""
    if "torch._dynamo" in sys.modules:
        return ShapeEnv()
    start = time.perf_counter()
    env = ShapeEnv()
    if "torch._dynamo" in sys.modules:
        _observe.one_time_import((time.perf_counter() - start) * 1e6)
    return env


@contextlib.contextmanager
def _user_function_modes_aside() -> Iterator[None]:
    """The torch-function stack without its user modes (Note [user modes]): a mode that
    logs torch calls never sees the fake run. A default device (``torch.device(...)``
    as a context manager) stays, so the fake run makes its tensors where the real run does."""
    popped = []
    while torch._C._len_torch_function_stack():
        popped.append(torch._C._pop_torch_function_stack())  # innermost first
    try:
        for mode in reversed(popped):
            if not _transforms.is_user_function_mode(mode) or _transforms.is_default_device(mode):
                torch._C._push_on_torch_function_stack(mode)
        yield
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


# Note [validation under torch.func]
# Under torch.func.grad, jvp or a vmap whose selector is not batched, a concrete
# cond/switch runs its chosen branch inline (Note [eager branches run inline]),
# and is validated as in plain eager: same signature, same verdict cache. The
# fake run happens outside every functorch level (the interpreter stack is set
# aside for it), so no transform sees it; a tensor wrapped by a transform (an
# operand, or a closed-over tensor of an outer level) becomes a fresh fake tensor
# of its logical metadata, the sizes the branch sees: a batched tensor's without
# its batch dimension.


def traced_mode(leaves: Sequence[Any]) -> FakeTensorMode | None:
    """The fake mode of a trace whose ``leaves`` have symbolic sizes (torch.compile's
    dynamic shapes), or None. An empty loop's outputs are shaped by a run of its body
    in that mode (:func:`in_traced_mode`): static copies in a fresh mode would bake the
    sizes in, and symbolic ones there hold symbols that mode cannot reason about."""
    from torch.fx.experimental.symbolic_shapes import has_free_symbols

    tensors = [x for x in leaves if isinstance(x, _Tensor)]
    if not any(has_free_symbols(x.shape) for x in tensors):
        return None
    mode = torch._guards.detect_fake_mode(tensors)
    return mode if mode is not None and mode.shape_env is not None else None


@contextlib.contextmanager
def in_traced_mode(mode: FakeTensorMode) -> Iterator[None]:
    """A run of a callable in the trace's fake ``mode`` that records nothing (its proxy
    tracers set aside; functionalization, which the traced values need, stays), with
    the real tensors it closes over as fakes."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is mode
    no_pre_dispatch = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch))
    with (
        disable_proxy_modes_tracing(),
        no_pre_dispatch,
        contextlib.nullcontext() if active else mode,
        _isolated(),
        _no_module_hooks(),
        _FakeClosures(mode),
    ):
        yield


def _to_fake(mode: FakeTensorMode, x: _Tensor) -> _Tensor:
    if not _is_wrapped(x):
        return mode.from_tensor(x, static_shapes=True)
    with mode:  # no requires_grad: functorch forbids setting it inside a transform
        return torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)


# Note [validation is invisible]
# The validate-once run executes the user's callables on fake tensors inside the
# caller's ambient state; nothing of it may be seen but the error it raises:
# - tensors the callables close over are real: a torch-function mode hands every
#   torch call fake copies of them (memoized, so a write is seen by later reads),
#   or FakeTensorMode would run ops with only real inputs for real (an in-place
#   update of a closed-over counter would land);
# - autocast stays on (so dtypes are checked as they will run) but its cast cache
#   is off, or fake casts of real weights would be served to later real ops;
# - saved-tensor hooks (torch.utils.checkpoint counts saved tensors) and the JIT
#   tracer must not see the run;
# - a callable that calls its own operator recursively (a factorial) cannot be
#   checked ahead of time: past a nesting depth the run gives up, as for a
#   data-dependent callable (NotValidatable), and the real call decides;
# - module forward hooks (Note [module hooks do not see validation]) and
#   parametrize.cached()'s cache (a fake weight would be served to the real call);
# - torch's fake-tensor logger reports failing meta kernels; the failure is the
#   verdict here, so a filter of hop's own drops those records in this thread
#   only (the logger's level, a process-wide setting, is never touched).


_MAX_NESTING = 16
_LOCAL = threading.local()


@contextlib.contextmanager
def _saved_tensors_hooks_set_aside() -> Iterator[None]:
    # An empty stack, not identity hooks on top of it: torch.func.grad inside a
    # callable refuses to run while any saved-tensor hooks are pushed.
    autograd: Any = torch._C._autograd
    stack = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    tracing_state = torch._C._get_tracing_state()
    cast_cache = torch.is_autocast_cache_enabled()
    set_tracing_state: Callable[[Any], None] = torch._C._set_tracing_state  # type: ignore[attr-defined]
    set_tracing_state(None)
    torch.set_autocast_cache_enabled(False)
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        with _saved_tensors_hooks_set_aside():
            yield
    finally:
        _LOCAL.depth -= 1
        torch.set_autocast_cache_enabled(cast_cache)
        set_tracing_state(tracing_state)


class _QuietWhileValidating(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_LOCAL, "depth", 0)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietWhileValidating())


_REAL = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


class _FakeClosures(torch.overrides.TorchFunctionMode):
    """Every real tensor a torch call receives becomes its fake copy (Note [validation is invisible])."""

    supports_higher_order_operators = True  # not a user mode: it rewrites an operator's callables

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        self.nesting = 0
        self.wrapped: dict[int, tuple[_Tensor, _Tensor]] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        hop_op = isinstance(func, torch._ops.HigherOrderOperator)

        def fake(x: Any) -> Any:
            if type(x) in _REAL and not x.is_meta:
                return self._fake(x)
            if hop_op and callable(x) and not isinstance(x, torch.Tensor):
                return self._inside(x)  # a nested operator's callables close over real tensors too
            return x

        real_self = args[0] if args and type(args[0]) in _REAL else None
        args, kwargs = pytree.tree_map(fake, (tuple(args), kwargs or {}))
        if not hop_op:
            out = func(*args, **kwargs)
            # an in-place op returns its input: the real one, so that ``self.count += 1``
            # assigns the module's own tensor back, never its fake copy
            return real_self if real_self is not None and out is args[0] else out
        if self.nesting >= _MAX_NESTING:
            raise NotValidatable(f"hop operators nested more than {_MAX_NESTING} deep")
        self.nesting += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.nesting -= 1

    def _fake(self, x: _Tensor) -> _Tensor:
        """The fake copy of ``x``, the same one on every use (a write is seen by later reads)."""
        if not _is_wrapped(x):
            return self.mode.from_tensor(x, static_shapes=True)  # memoized by the mode
        if id(x) not in self.wrapped:
            self.wrapped[id(x)] = (x, _to_fake(self.mode, x))  # x kept: its id stays its own
        return self.wrapped[id(x)][1]

    def _inside(self, fn: Fn) -> Fn:
        def in_mode(*a: Any) -> Any:
            with self:
                return fn(*a)

        return functools.wraps(fn)(in_mode) if isinstance(fn, FunctionType) else in_mode


# Note [module hooks do not see validation]
# A module's forward (pre-)hooks belong to the module, often to a framework:
# FSDP2 all-gathers parameters and steps a state machine in them, activation
# checkpointing and weight_norm swap tensors, profilers count calls. A user reads
# hop.cond as a Python ``if``: the hooks of the taken branch's modules fire once,
# in the real call. Running them on fake tensors corrupts such state, and running
# the module without them would check a different function (hooks may cast
# dtypes, FSDP2's mixed precision does, then the per-call check would report a
# false mismatch). So a fake run never calls a hooked module: it gives up
# (NotValidatable) as for a data-dependent callable, and that callable is checked
# by its real call (Note [outputs are checked on every call]) instead.
# - While a fake run is on, a global forward pre-hook of hop's, placed before any
#   other, raises NotValidatable in the validating thread when a module about to
#   run has forward hooks of its own (or global ones exist): before any of them
#   fires. Other threads pass through it.
# - Forward hooks registered with ``always_call=True`` still run when a module's
#   forward raises, so a callable that reaches such a module (through closures,
#   defaults, globals it names, bound ``self``, partials, containers and module
#   trees) or any global always-call hook is not run on fake tensors at all
#   (:func:`check_hooks`).
# Backward hooks are left alone: a fake run never runs a backward. A scan or map
# over a length-0 dimension learns its outputs' sizes from a fake run alone: with
# a hooked module in its function it raises (HookedModule says why).


def check_hooks(*fns: Any) -> None:
    """Raise HookedModule when running ``fns`` on fake tensors could fire a forward
    hook that raising cannot stop (Note [module hooks do not see validation])."""
    if nn_module._global_forward_hooks_always_called:
        raise HookedModule("a global forward hook is registered with always_call=True")
    for m in _reached_modules(fns):
        if m._forward_hooks_always_called:
            raise HookedModule(f"{type(m).__name__} has a forward hook registered with always_call=True")


_MAX_REACH = 10_000
_ATOMS = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), type, ModuleType, CodeType)


def _reached_modules(fns: Sequence[Any]) -> Iterator[torch.nn.Module]:
    """The modules ``fns`` can reach (looking at most at _MAX_REACH objects)."""
    todo, seen = list(fns), set[int]()
    while todo and len(seen) < _MAX_REACH:
        obj = todo.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            yield obj
        todo.extend(referents(obj))


def referents(obj: Any) -> list[Any]:
    """What calling ``obj`` may read: a function's closure, defaults and named globals,
    a method's function and self, a partial's parts, a container's items, a module's
    submodules and public attributes, another object's attributes."""
    if type(obj) is FunctionType:
        named = [obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
        return [*_cell_values(obj), *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values(), *named]
    if type(obj) is MethodType:
        return [obj.__func__, obj.__self__]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    if isinstance(obj, torch.nn.Module):
        return [*obj._modules.values(), *(v for k, v in attrs.items() if not k.startswith("_"))]
    return list(attrs.values())


def _cell_values(fn: FunctionType) -> list[Any]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not assigned yet
            continue
    return values


@functools.lru_cache(maxsize=256)
def _names(code: CodeType) -> frozenset[str]:
    """The global names ``code`` and the code nested in it may read."""
    nested = (_names(c) for c in code.co_consts if isinstance(c, CodeType))
    return frozenset(code.co_names).union(*nested)


def _refuse_hooked(module: torch.nn.Module, args: Any) -> None:
    """hop's global forward pre-hook while a fake run is on (Note [module hooks do not see validation])."""
    if not getattr(_LOCAL, "depth", 0):
        return  # another thread's module
    if module._forward_pre_hooks or module._forward_hooks:
        raise HookedModule(f"{type(module).__name__} has forward hooks")
    if nn_module._global_forward_hooks or any(h is not _refuse_hooked for h in _global_pre_hooks().values()):
        raise HookedModule("global module forward hooks are registered")


def _global_pre_hooks() -> Any:
    return nn_module._global_forward_pre_hooks


@contextlib.contextmanager
def _no_module_hooks() -> Iterator[None]:
    handle = nn_module.register_module_forward_pre_hook(_refuse_hooked)
    _global_pre_hooks().move_to_end(handle.id, last=False)  # before any other global hook
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _no_parametrization_cache() -> Iterator[None]:
    """Entries a fake run adds to parametrize.cached()'s cache are fake: drop them."""
    before = set(parametrize._cache) if parametrize._cache_enabled else None
    try:
        yield
    finally:
        if before is not None:
            for k in [k for k in parametrize._cache if k not in before]:
                del parametrize._cache[k]
