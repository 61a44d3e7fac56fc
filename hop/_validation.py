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
import threading
from collections.abc import Callable, Iterator, Sequence
from types import BuiltinFunctionType, CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
import torch.nn.modules.module as nn_module
import torch.nn.utils.parametrize as parametrize
import torch.utils._pytree as pytree
from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._python_dispatch import _disable_current_modes

from hop import _closures, _observe, _pytree, _transforms, config
from hop.errors import HopTypeError, HopValueError, format_message, type_name

__all__ = [
    "CANNOT_FAKE",
    "flat_signature",
    "signature",
    "is_known",
    "remember",
    "fake_inputs",
    "check_hooks",
]

Fn = Callable[..., Any]
_Tensor = torch.Tensor


class NotValidatable(Exception):
    """The callables cannot be checked ahead of time (recursion through hop operators,
    modules with forward hooks: Note [module hooks do not see validation])."""


class HookedModule(NotValidatable):
    """A fake run would call a module with forward hooks (Note [module hooks do not see validation])."""


# Errors that mean "this callable cannot run on fake tensors", not "it is wrong".
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
# Per operator, the inline cache of validated eager calls (Note [the eager inline
# cache] in hop.ops._inline): each entry holds a verdict, and goes with it.
INLINE: dict[str, dict[Any, Any]] = {"cond": {}, "switch": {}}  # key -> hop.ops._inline.Entry
# Verdicts whose fake run saw a callable return a tensor sharing memory with an
# operand without being it or a view of it (x.detach(), x.data); their calls are
# not cached inline, so each gets the general path's data-pointer check.
ALIASING: set[Any] = set()


def value_key(v: Any) -> Any:
    """What a verdict depends on of a closed-over value or a leaf. A number counts by
    its type only: a loop counter a branch closes over changes on every call, and
    what a new value could change of the output is caught by the per-call output
    check (Note [outputs are checked on every call]), not by validating again."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.ndim, v.get_device())
    if type(v) in (int, float, bool):
        return type(v)
    if v is None or type(v) is str:
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
    partials by function and arguments, builtin methods by name and owner's kind,
    anything else (builtins such as torch.tanh, modules) by identity."""
    if type(fn) is MethodType:
        return (callable_key(fn.__func__), id(fn.__self__))
    if type(fn) is FunctionType:
        return flat_signature("", (fn,), ())
    if isinstance(fn, functools.partial):
        kwargs = tuple(sorted((k, value_key(v)) for k, v in fn.keywords.items()))
        return (callable_key(fn.func), *map(value_key, fn.args), kwargs)
    if type(fn) is BuiltinFunctionType and not _closures.is_inert(fn):
        # w.mul: a method object made per access, whose address a later one reuses
        # after it is freed (an id would find another method's verdict)
        return ("builtin method", fn.__name__, type(fn.__self__), value_key(fn.__self__))
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


def fakeable(leaves: Sequence[Any]) -> bool:
    """Whether fake tensors can stand for every tensor of ``leaves`` (not a quantized one)."""
    return not any(isinstance(x, torch.Tensor) and x.is_quantized for x in leaves)


@contextlib.contextmanager
def fake_inputs(leaves: Sequence[Any]) -> Iterator[list[Any]]:
    """Static-shape fake copies of ``leaves``, inside their fake mode, isolated from
    the caller's world (Note [validation is invisible]). Callers check
    :func:`fakeable` first."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
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
_hooks_enabled: Callable[[], bool] = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]
_LOCAL = threading.local()


def _identity(x: Any) -> Any:
    return x


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    tracing_state = torch._C._get_tracing_state()
    cast_cache = torch.is_autocast_cache_enabled()
    set_tracing_state: Callable[[Any], None] = torch._C._set_tracing_state  # type: ignore[attr-defined]
    set_tracing_state(None)
    torch.set_autocast_cache_enabled(False)
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        # torch.func transforms disable saved-tensor hooks (then no checkpoint can count either)
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
            if _hooks_enabled()
            else contextlib.nullcontext()
        )
        with hooks:
            yield
    finally:
        _LOCAL.depth -= 1
        torch.set_autocast_cache_enabled(cast_cache)
        set_tracing_state(tracing_state)


class _QuietWhileValidating(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_LOCAL, "depth", 0)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietWhileValidating())


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
            if type(x) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not x.is_meta:
                return self._fake(x)
            if hop_op and callable(x) and not isinstance(x, torch.Tensor):
                return self._inside(x)  # a nested operator's callables close over real tensors too
            return x

        args, kwargs = pytree.tree_map(fake, (tuple(args), kwargs or {}))
        if not hop_op:
            return func(*args, **kwargs)
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
        todo.extend(_referents(obj))


def _referents(obj: Any) -> list[Any]:
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
