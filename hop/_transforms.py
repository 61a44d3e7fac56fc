"""Small helpers the operators' rules share for functorch levels and eager checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch._C._functorch import is_batchedtensor as _is_batched
from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped
from torch._C._functorch import maybe_current_level as _functorch_level

from hop.errors import HopRuntimeError, format_message

__all__ = [
    "in_plain_eager",
    "is_plain_leaf",
    "nothing_active",
    "no_modes",
    "is_user_mode",
    "is_user_function_mode",
    "only_user_modes",
    "only_user_function_modes",
    "is_default_device",
    "callers_rewrites",
    "rewrites_reentered",
    "note_rule_for",
    "is_real",
    "is_concrete",
    "unwrap_batched",
    "batched_inside",
    "add_batch_dims",
    "is_plain_tensor",
    "mode_stack_len",
    "functorch_level",
    "tf_mode_enabled",
    "is_included",
    "PRE_DISPATCH",
    "is_dynamo_compiling",
    "DYNAMO_CALL",
    "place",
    "jvp",
]

_Tensor = torch.Tensor
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
PLAIN_TYPES = _PLAIN_TYPES  # the types of plain tensors, for checks elsewhere
# The 0.05 us checks an eager fast path makes (inline them: a call costs as much).
mode_stack_len = torch._C._len_torch_dispatch_stack
tf_mode_enabled = torch._C._is_torch_function_mode_enabled
is_included = torch._C._dispatch_tls_is_dispatch_key_included
functorch_level = _functorch_level
PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def batched_inside(x: Any) -> bool:
    """Whether a BatchedTensor is among the functorch wrappers of ``x`` (under
    ``vmap(grad(f))`` a grad wrapper holds it)."""
    while isinstance(x, torch.Tensor) and _is_wrapped(x):
        if _is_batched(x):
            return True
        x = torch._C._functorch.get_unwrapped(x)
    return False


def is_plain_tensor(x: Any) -> bool:
    """A dense real tensor (or Parameter) that no mode or wrapper stands behind."""
    return type(x) in _PLAIN_TYPES and not x.is_meta and not torch._is_functional_tensor(x)


def is_plain_leaf(x: Any) -> bool:
    """A leaf an operator can run on directly in plain eager: a plain tensor or an int."""
    return is_plain_tensor(x) or type(x) is int


def nothing_active() -> bool:
    """No dispatch mode, no functorch transform, no torch-function mode: the cheap
    first half of :func:`in_plain_eager` (three 0.05 us checks), which the
    dispatcher's shortcut to a backend kernel also takes."""
    return not mode_stack_len() and _functorch_level() is None and not tf_mode_enabled()


def no_modes() -> bool:
    """Nothing traces: no dispatch mode and no torch-function mode but user ones (Note
    [user modes]), no pre-dispatch tracer."""
    return (
        (not mode_stack_len() or only_user_modes())
        and (not tf_mode_enabled() or only_user_function_modes())
        and not is_included(PRE_DISPATCH)
    )


# Note [user modes]
# A TorchDispatchMode that no hop operator has a rule for, and that does not set
# ``supports_higher_order_operators``, is a user mode: one that logs, counts, caches
# or checks aten ops (selective checkpointing's caching modes, a user's op logger).
# A TorchFunctionMode is a user mode unless it sets ``supports_higher_order_operators``
# (hop's own closure-rebinding and fake-closure modes do: they rewrite an operator's
# callables) or torch defines it (torch.export's and make_fx's tracers), except
# ``torch.device(...)`` used as a context manager, a user's default device.
# hop treats a program under user modes only as plain eager (Note [plain eager]):
# selectors are concrete, the public functions validate (with the user modes out of
# the way, so that validation stays invisible to them; a default device stays, so
# that the fake run makes what the real one makes) and the rules run the callables
# inline, so the modes see the aten ops (torch functions) of what runs, as under a
# Python ``if`` or loop. A raw op that reaches the Python key there runs its backend
# kernel with the modes still active (``hop._dispatch``); a raw op called under a
# torch-function mode is one torch function to it, as ``torch.add`` is. Below a
# tracing mode (fake, make_fx, export, functionalization) a user mode is stepped
# over: the op reaches the tracing mode whole, and the user mode sees nothing of
# what it traces.

_RULE_MODE_TYPES: set[type] = set()  # mode types some hop operator has a rule for (HigherOrderOperator.py_impl)
_USER_MODE_TYPES: dict[type, bool] = {}  # cache of is_user_mode's answer per mode type


def note_rule_for(mode_type: type) -> None:
    """A hop operator registered a rule for ``mode_type``: neither it nor its subclasses are user modes."""
    _RULE_MODE_TYPES.add(mode_type)
    _USER_MODE_TYPES.clear()


def is_user_mode(mode: Any) -> bool:
    """Note [user modes]: no hop operator has a rule for ``mode`` and it takes no higher-order operators."""
    if getattr(mode, "supports_higher_order_operators", False):
        return False
    cls = type(mode)
    user = _USER_MODE_TYPES.get(cls)
    if user is None:
        user = _USER_MODE_TYPES[cls] = not any(base in _RULE_MODE_TYPES for base in cls.__mro__)
    return user


def only_user_modes() -> bool:
    """Every active dispatch mode is a user mode (Note [user modes])."""
    return all(is_user_mode(torch._C._get_dispatch_stack_at(i)) for i in range(mode_stack_len()))


_DEFAULT_DEVICE_MODE = "torch.utils._device.DeviceContext"  # torch.device(...) as a context manager


def is_default_device(mode: Any) -> bool:
    """``mode`` is ``torch.device(...)`` used as a context manager (or set_default_device)."""
    cls = type(mode)
    return f"{cls.__module__}.{cls.__qualname__}" == _DEFAULT_DEVICE_MODE


def is_user_function_mode(mode: Any) -> bool:
    """Note [user modes]: a torch-function mode that wants no higher-order operator
    whole: not hop's own, not one of torch's tracers (a default device is a user's)."""
    if getattr(mode, "supports_higher_order_operators", False):
        return False
    module = type(mode).__module__
    return not (module == "torch" or module.startswith("torch.")) or is_default_device(mode)


def only_user_function_modes() -> bool:
    """Every torch-function mode on the stack is a user mode (Note [user modes])."""
    stack_at = torch._C._get_function_stack_at
    return all(is_user_function_mode(stack_at(i)) for i in range(torch._C._len_torch_function_stack()))


# Note [rewriting torch-function modes]
# torch.export's non-strict tracer rewrites Python that its dispatch-level tracing
# cannot see (``w[k]`` with a SymInt ``k`` becomes ``w.select(0, k)``, torch.tensor
# of SymInts its Python twin) with a torch-function mode. A hop call reaches that mode
# as one torch function, and torch pops the mode while it handles the call: the
# callables hop traces below would run without it, and ``w[k]`` in a loop body
# would fail where the same line outside hop traces. The dispatcher notes such a
# mode when a hop call passes through it (:func:`callers_rewrites`), and the tracing
# rules run with it active again (:func:`rewrites_reentered`), so a body sees the
# rewrites its caller's code sees. Only stateless rewriting modes are so treated:
# a tracer's own torch-function modes record into the caller's graph.

_REWRITING_MODES = ("torch._export.non_strict_utils._NonStrictTorchFunctionHandler",)
_CALLERS_REWRITES: list[Any] = []  # the rewriting mode of each hop call being handled, innermost last


def _is_rewriting(mode: Any) -> bool:
    cls = type(mode)
    return f"{cls.__module__}.{cls.__qualname__}" in _REWRITING_MODES


@contextmanager
def callers_rewrites() -> Iterator[None]:
    """Note [rewriting torch-function modes]: while a hop call is handled by the
    torch-function modes on the stack, remember the rewriting one among them."""
    stack_at = torch._C._get_function_stack_at
    found = [m for m in map(stack_at, range(torch._C._len_torch_function_stack())) if _is_rewriting(m)]
    if not found:
        yield
        return
    _CALLERS_REWRITES.append(found[-1])
    try:
        yield
    finally:
        _CALLERS_REWRITES.pop()


@contextmanager
def rewrites_reentered() -> Iterator[None]:
    """Note [rewriting torch-function modes]: the caller's rewriting mode active again,
    if torch popped it to handle this call."""
    if not _CALLERS_REWRITES:
        yield
        return
    mode = _CALLERS_REWRITES[-1]
    stack_at = torch._C._get_function_stack_at
    if any(stack_at(i) is mode for i in range(torch._C._len_torch_function_stack())):
        yield
        return
    torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        popped = torch._C._pop_torch_function_stack()
        assert popped is mode, "a torch-function mode pushed inside a hop rule was left on the stack"


def is_real(x: Any) -> bool:
    """An int, or a tensor that is real under every functorch wrapper (batched ones too)."""
    if not isinstance(x, _Tensor):
        return type(x) is int
    while _is_wrapped(x):
        x = torch._C._functorch.get_unwrapped(x)
    return is_plain_tensor(x)


def in_plain_eager() -> bool:
    """Note [plain eager]: no functorch transform, and nothing traces (:func:`no_modes`).

    Note [plain eager]
    The one definition of plain eager, which every eager path of hop asks (the
    public functions and their long-hand fast paths, the rules' inline runs, the
    loops): no functorch transform, no pre-dispatch tracer, and no dispatch or
    torch-function mode but user modes (Note [user modes]). Under it a real selector
    is read and the callables run as plain Python, so a user's mode sees what runs,
    as under a Python ``if``. Two paths serve only the part of it where
    :func:`nothing_active` holds, which implies plain eager at a third of the cost:
    the inline cache (``hop.ops.branching._call_cache`` and ``hop._fastpath``, which reads the
    selector before it knows it has an entry: under a user mode a miss would make
    that read a second one) and the dispatcher's shortcut to a backend kernel (under
    user modes its full route reaches the same kernel). tests/test_plain_eager.py asks
    every definition in the same states.
    """
    if nothing_active():  # and so no pre-dispatch tracer: its torch-function mode would be active
        return True
    return _functorch_level() is None and no_modes()


def is_concrete(x: Any) -> bool:
    """Whether ``x`` (a predicate or index) can be read now to choose a branch.

    True for Python bools and ints, and for tensors that are real under every
    functorch wrapper while no dispatch mode is active (so nothing is tracing).
    SymBools, SymInts, fake, meta and functional tensors are not concrete.
    """
    if type(x) in (bool, int):
        return True
    if not isinstance(x, _Tensor) or not no_modes():
        return False
    while _is_wrapped(x):
        if _is_batched(x):  # one value per batch element: not one branch to choose
            return False
        x = torch._C._functorch.get_unwrapped(x)
    return is_plain_tensor(x)


is_dynamo_compiling = torch.compiler.is_dynamo_compiling  # False, except while Dynamo traces

DYNAMO_CALL = "hop: a public function's call, traced by Dynamo"
"""First argument of a raw op called by a public function under Dynamo: the public
function and its arguments follow, ``cond_op(DYNAMO_CALL, hop.cond, pred, ...)``.

Note [public functions under Dynamo]
Traced by Dynamo (``torch.compile``, ``torch.export(strict=True)``), a public
function passes its own arguments to its raw op, behind this marker, and does
nothing else: Dynamo's handler of the raw op (``hop.compile.dynamo``) does the
function's work (checks, pytrees, dimensions) at trace time and records one node.
If the handler cannot capture the call, Dynamo breaks the graph there and runs the
call eagerly: the raw op, seeing the marker, runs the public function, as plain
Python (Dynamo skips every frame under a raw op's ``__call__``).
"""


def unwrap_batched(values: Sequence[Any], level: int) -> tuple[list[Any], list[int | None]]:
    """Each tensor of ``values`` without its batch dimension at ``level``, and that dimension."""
    unwrapped: list[Any] = []
    dims: list[int | None] = []
    for v in values:
        if isinstance(v, _Tensor):
            u, d = _unwrap_batched(v, level)
            unwrapped.append(u)
            dims.append(d)
        else:
            unwrapped.append(v)
            dims.append(None)
    return unwrapped, dims


def add_batch_dims(values: Sequence[Any], level: int) -> list[Any]:
    """Re-wrap tensors whose leading dimension is the batch at ``level``."""
    return [_add_batch_dim(v, 0, level) if isinstance(v, _Tensor) else v for v in values]


def place(values: Sequence[Any], at: Sequence[int], new: Sequence[Any]) -> list[Any]:
    """``values`` with ``values[at[i]]`` replaced by ``new[i]`` (the differentiable ones, for a vjp or jvp)."""
    full = list(values)
    for i, v in zip(at, new, strict=True):
        full[i] = v
    return full


@contextmanager
def torch_ops_without_rules(op: str, role: str) -> Iterator[None]:
    """Run a torch.func transform of ``role``: one of torch's own higher-order operators
    inside it (``torch.cond`` in a hop body) has no rule for the transform, and torch's
    dispatcher reports that as a bare ``KeyError: <TransformType.Grad: 2>``."""
    from torch._C._functorch import TransformType

    try:
        yield
    except RuntimeError as e:
        if "must override the setup_context staticmethod" not in str(e):
            raise
        what = (
            f"{role} runs an autograd.Function that torch.func cannot differentiate (no setup_context: "
            f"DTensor's redistribution is one), and hop differentiates a traced {role} with torch.func"
        )
        fix = "Differentiate it in eager, or compile the forward only (under torch.no_grad())."
        raise HopRuntimeError(format_message(op, what, fix=fix), op=op, role=role) from e
    except KeyError as e:
        if not (e.args and isinstance(e.args[0], TransformType)):
            raise

        transform = e.args[0].name.lower()
        what = (
            f"{role} calls one of torch's own control-flow operators (torch.cond, torch.ops.higher_order.*), "
            f"which has no rule for the torch.func {transform} transform hop differentiates {role} with"
        )
        fix = f"Use hop's operator in {role} (hop.cond for torch.cond, ...), or differentiate it outside torch.compile."
        raise HopRuntimeError(format_message(op, what, fix=fix), op=op, role=role) from e


# Note [a jvp inside an active dual level]
# torch.func.jvp enters forward AD's dual level only when it is the outermost jvp,
# which it reads from Python globals (eager_transforms.JVP_NESTING and
# forward_ad._current_level) that torch.func.jvp's own frames maintain. An operator's
# jvp runs the branches' or body's jvp while its caller's jvp is active; under
# torch.compile the caller's jvp is a replayed graph that entered the level through
# torch._C, leaving the globals at "none", and so does a user's
# forward_ad.dual_level() around a traced call: the nested torch.func.jvp would enter
# a second level ("Nested forward mode AD is not supported"). Where a level is active
# but the globals say none, they are set for the inner jvp to use that level (0,
# the only one torch supports), and restored after.


@contextmanager
def _within_an_active_dual_level() -> Iterator[None]:
    import torch._functorch.eager_transforms as eager_transforms
    import torch.autograd.forward_ad as forward_ad

    nesting, current = getattr(eager_transforms, "JVP_NESTING", None), getattr(forward_ad, "_current_level", None)
    if not isinstance(nesting, int) or not isinstance(current, int) or nesting > 0:
        yield  # torch.func.jvp's frames are active: they nest by themselves (or another torch)
        return
    active = current >= 0
    if not active:
        try:  # a probe: torch._C raises where a level is already active
            level = torch._C._enter_dual_level()
        except RuntimeError:
            active = True
        else:
            torch._C._exit_dual_level(level=level)
    if not active:
        yield
        return
    saved = eager_transforms.JVP_NESTING, forward_ad._current_level
    eager_transforms.JVP_NESTING, forward_ad._current_level = saved[0] + 1, 0
    try:
        yield
    finally:
        eager_transforms.JVP_NESTING, forward_ad._current_level = saved


def jvp(fn: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    """``torch.func.jvp`` of ``fn`` returning a tuple, with every output tangent in its
    output's dtype (torch gives ``x * 0.5`` on a 0-dim float32 ``x`` a float64 tangent,
    which would make branches or iterations disagree). An output that is not a tensor (a
    branch's int, a counted loop's int counter), which torch.func.jvp refuses, is
    returned as it is, its tangent None."""
    others: dict[int, Any] = {}
    count = [0]

    def tensors_only(*args: Any) -> tuple[Any, ...]:
        out = tuple(fn(*args))
        count[0] = len(out)
        others.clear()
        others.update((i, o) for i, o in enumerate(out) if not isinstance(o, torch.Tensor))
        return tuple(o for o in out if isinstance(o, torch.Tensor))

    with _within_an_active_dual_level():
        t_outs, t_tans = torch.func.jvp(tensors_only, tuple(primals), tuple(tangents))[:2]
    tensors, tans = iter(t_outs), iter(t_tans)
    out: list[Any] = []
    cast: list[Any] = []
    for i in range(count[0]):
        if i in others:
            out.append(others[i])
            cast.append(None)
            continue
        o, t = next(tensors), next(tans)
        out.append(o)
        cast.append(t.to(o.dtype) if isinstance(t, torch.Tensor) and t.dtype != o.dtype else t)
    return tuple(out), tuple(cast)
