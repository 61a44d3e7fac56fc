"""A user's operator defined by its decomposition: the rules derived from it.

Note [an operator from its decomposition]
``hop.HigherOrderOperator(name, decomposition=fn)``: ``fn`` has the operator's
signature and is written with torch ops and hop's operators, each of which has every
rule. Where the operator has no rule of its own for a route (a dispatch key, a
functorch transform, a mode, a tensor subclass), hop's dispatcher runs ``fn`` at that
level: the operators inside meet the same transform, mode or key and take their own
rules. So the dense kernel, autograd, grad / jvp, vmap, functionalization
(AOTAutograd's included, whose graphs then hold hop's operators), fake tensors and
any other tracing mode come from them, and a rule the user registers overrides the
derived one for its route.

One route is the operator's own: make_fx and torch.export (whose tracer is a
ProxyTorchDispatchMode) record one node of it, so an exported program keeps the
operator (:meth:`Decomposition.proxy`). Its callables become subgraphs, traced on
the arguments the decomposition calls them with (recorded by running it on the fake
values), and what they close over is lifted into the node's keyword
``hop_closures``: a node reads ``op(*args, hop_closures=(c0, c1, ...))``, each
callable a graph taking its arguments then every lifted value. Every route binds
that keyword back first (:func:`bound`), so a rule registered for the operator sees
its callables as the user passed them. ``torch.compile`` and strict export inline
``fn`` (``hop.compile``): their graphs hold hop's operators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from hop import _lifting, _tracing
from hop._effects import clone_aliases
from hop._output_checks import describe_fn
from hop.errors import HopTypeError, HopValueError, format_message

__all__ = ["CLOSURES", "Decomposition", "bound", "inlined", "node_call"]

Fn = Callable[..., Any]

# The keyword of a recorded node holding what its callables close over.
CLOSURES = "hop_closures"
_SEQUENCES = (tuple, list)
_INLINE: list[bool] = []


@contextmanager
def inlined() -> Iterator[None]:
    """While active, make_fx and torch.export trace the decomposition of a user's
    operator in place of a node of it (for a backend with no rule for the node: ONNX)."""
    _INLINE.append(True)
    try:
        yield
    finally:
        _INLINE.pop()


def _is_fn(value: Any) -> bool:
    return callable(value) and not isinstance(value, torch.Tensor)


def _map_fns(args: Sequence[Any], fn: Callable[[Any], Any]) -> tuple[Any, ...]:
    """``args`` with ``fn`` applied to each callable, also those one sequence deep
    (a list of branches)."""
    out = []
    for a in args:
        if _is_fn(a):
            a = fn(a)
        elif type(a) in _SEQUENCES and any(_is_fn(x) for x in a):
            a = type(a)(fn(x) if _is_fn(x) else x for x in a)
        out.append(a)
    return tuple(out)


def bound(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call in a node's form as the user made it: each callable reads the lifted
    closures of ``hop_closures`` again (Note [an operator from its decomposition])."""
    if CLOSURES not in kwargs:
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    closures = tuple(kwargs.pop(CLOSURES))
    if not closures:
        return tuple(args), kwargs
    return _map_fns(args, lambda fn: _reading(fn, closures)), kwargs


def _node_value(out: Any) -> Any:
    """What a node returns for the output ``out``: its leaves, one tensor bare (a
    1-tuple does not survive torch.export's save and load)."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], torch.Tensor) else tuple(leaves)


def _reading(fn: Fn, closures: tuple[Any, ...]) -> Fn:
    def call(*args: Any) -> Any:
        return fn(*args, *closures)

    call.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def node_call(fn: Fn, *args: Any, **kwargs: Any) -> Any:
    """A recorded node's call of decomposition ``fn``, as plain Python for Dynamo to
    inline (aliases are AOTAutograd's to handle there)."""
    closures = tuple(kwargs.pop(CLOSURES))
    args = _map_fns(args, lambda g: _reading(g, closures)) if closures else tuple(args)
    return _node_value(fn(*args, **kwargs))


class _Recorder:
    """A callable that remembers the arguments of each call, for tracing it later."""

    def __init__(self, op: str, fn: Fn) -> None:
        self.op = op
        self.fn = fn
        self.calls: list[tuple[Any, ...]] = []
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(args)
        if kwargs:
            raise HopTypeError(
                format_message(
                    self.op,
                    f"its decomposition called the callable {describe_fn(self.fn)} with keyword arguments "
                    f"({', '.join(kwargs)}), which a recorded node's subgraph cannot take",
                    fix="Call it with positional arguments.",
                ),
                op=self.op,
            )
        return self.fn(*args)


class Decomposition:
    """The rules an operator derives from its decomposition ``fn``."""

    def __init__(self, name: str, fn: Fn) -> None:
        if not callable(fn):
            raise HopTypeError(
                format_message(name, f"decomposition must be a callable, got {type(fn).__name__}"),
                role="decomposition",
            )
        self.name = name
        self.fn = fn

    def run(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The decomposition at the current level, its outputs never aliasing its inputs
        (an operator's outputs are new tensors, as every HOP's)."""
        node = CLOSURES in kwargs  # a recorded node's call: it returns the output's leaves
        args, kwargs = bound(args, kwargs)
        out = self.fn(*args, **kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        leaves, spec = torch.utils._pytree.tree_flatten(out)
        out = torch.utils._pytree.tree_unflatten(clone_aliases(leaves, inputs), spec)
        return _node_value(out) if node else out

    def functionalize(self, op: Any, ctx: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """A user's call runs the decomposition at the functional level; a recorded node
        stays one node (``run_decompositions`` keeps it; Inductor inlines it), its
        callables functionalized: their closures are its ``hop_closures``, which are
        unwrapped here with its other tensors (a closure read inside a body would still
        be a functional tensor of this level)."""
        if CLOSURES not in kwargs or _INLINE:
            with getattr(ctx, "mode", None) or nullcontext():  # the Python API's mode is popped
                return self.run(args, kwargs)
        unwrapped = _map_fns(ctx.unwrap_tensors(tuple(args)), ctx.functionalize)
        unwrapped_kwargs = ctx.unwrap_tensors(dict(kwargs))
        with ctx.redispatch_to_next():
            out = op(*unwrapped, **unwrapped_kwargs)
        return ctx.wrap_tensors(out)

    def proxy(self, op: Any, mode: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Record one node of ``op`` in ``mode``'s graph (the mode is popped here), its
        callables traced on the arguments the decomposition gives them."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        if _INLINE:
            with mode:
                return self.run(args, kwargs)
        node = CLOSURES in kwargs  # a recorded node traced again: it returns the output's leaves
        args, kwargs = bound(args, kwargs)
        recorders: list[_Recorder] = []

        def recording(fn: Fn) -> _Recorder:
            recorders.append(_Recorder(self.name, fn))
            return recorders[-1]

        recorded = _map_fns(args, recording)

        out_spec: list[Any] = []

        def first_run() -> Any:
            leaves, spec = torch.utils._pytree.tree_flatten(self.fn(*recorded, **kwargs))
            out_spec.append(spec)
            return leaves

        shape_env = _shape_env(args)
        ignore = shape_env.ignore_fresh_unbacked_symbols() if isinstance(shape_env, ShapeEnv) else nullcontext()
        with ignore:  # traced into a graph that is dropped: for the arguments the callables get
            _lifting.trace_each([first_run], [[]])
        examples = [self._examples(r) for r in recorders]
        graphs, lifted = _lifting.trace_each([r.fn for r in recorders], examples)
        made = iter(graphs)
        node_args = _map_fns(args, lambda fn: next(made))
        node_kwargs = {**kwargs, CLOSURES: tuple(lifted)}
        out = op(*node_args, **node_kwargs)  # the proxy mode is popped: the next mode's route
        value = _tracing.emit(mode, op, node_args, out, node_kwargs)
        if node:
            return value
        leaves = [value] if isinstance(value, torch.Tensor) else list(value)
        return torch.utils._pytree.tree_unflatten(leaves, out_spec[0])

    def _examples(self, recorder: _Recorder) -> list[Any]:
        """What a callable is traced on: fresh values of its first call's arguments
        (a loop's carries change, so a known value must not be baked in). A callable
        the decomposition never calls, or calls with Python values that differ between
        calls (a subgraph would bake in the first), cannot be recorded."""
        fn = recorder.fn
        if not recorder.calls:
            raise HopValueError(
                format_message(
                    self.name,
                    f"its decomposition never called the callable {describe_fn(fn)}, so the recorded node "
                    "cannot hold it as a subgraph",
                    fix="Call every callable argument in the decomposition, or pass values instead of callables.",
                ),
                op=self.name,
            )
        first = recorder.calls[0]
        for call in recorder.calls[1:]:
            if len(call) != len(first):
                raise self._unrecordable(fn, f"with {len(first)} and with {len(call)} arguments")
            for k, (a, b) in enumerate(zip(first, call, strict=True)):
                if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
                    raise self._unrecordable(fn, f"with a tensor and a {type(b).__name__} as argument {k}")
                if not isinstance(a, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) and a != b:
                    raise self._unrecordable(fn, f"with argument {k} {a!r} and {b!r}")
                if isinstance(a, torch.Tensor) and not _same_meta(a, b):
                    what = f"with argument {k} of {_meta(a)} and of {_meta(b)} (a subgraph bakes in the first)"
                    fix = (
                        "Call each callable with tensors of one size and dtype at every call (slice or pad inside it)."
                    )
                    raise self._unrecordable(fn, what, fix)
        for k, a in enumerate(first):
            if not isinstance(a, (torch.Tensor, int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
                what = f"with argument {k} a {type(a).__name__} (a subgraph takes tensors and numbers)"
                raise self._unrecordable(fn, what)
        return [_tracing.trace_example(a) for a in first]

    def _unrecordable(
        self, fn: Fn, what: str, fix: str = "Pass varying numbers as tensors, and pytrees as their leaves."
    ) -> HopValueError:
        return HopValueError(
            format_message(
                self.name,
                f"its decomposition called the callable {describe_fn(fn)} {what}: a recorded node's subgraph "
                "takes the same kinds of arguments at every call",
                fix=fix,
            ),
            op=self.name,
        )


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` provably have one dtype, device and size: a graph traced on
    one gives the other's values (with static sizes it bakes ``t.shape[0]`` in)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))


def _meta(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _shape_env(args: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)])
    return None if mode is None else mode.shape_env
