"""What every operator family shares: cond/switch (``branching._record``), scan/map
(``scanning._rules``), while_loop and associative_scan.

Each helper here was once written in several families; it lives here once, so a
fix reaches them all. Nothing here knows an operator by name: the differences
are arguments (the words of a message, the values to look at).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx
from torch._C._functorch import TransformType, _add_batch_dim

from hop import (
    _effects,
    _kernels,
    _lifting,
    _observe,
    _observe_calls,
    _output_checks,
    _reference,
    _state,
    _tracing,
    _transforms,
)
from hop._pytree import flatten as _flatten
from hop._unbacked import assert_ranges, recording
from hop.errors import CompileUnsupported, MutationError, format_message

__all__ = [
    "NOT_TAKEN",
    "Placement",
    "Vmapped",
    "Writes",
    "check_effects",
    "differentiable",
    "differentiable_at",
    "front",
    "lower_vmap",
    "record_node",
    "refuse_legacy_onnx",
    "runs_inline",
    "save_operands",
    "saved_operands",
    "static_size",
    "trace_callables",
    "untraced",
]

_Tensor = torch.Tensor
_T = TypeVar("_T")
_tracing_state: Callable[[], Any] = torch._C._get_tracing_state
_set_tracing_state: Callable[[Any], None] = torch._C._set_tracing_state  # type: ignore[attr-defined]


NOT_TAKEN = object()
"""What a path returns when it does not take the call: :func:`front` when the public
function is to run it, the eager fast paths (C and Python) when the general path must."""

_SINKS = _observe.SINKS


def front(
    name: str, public: Callable[..., Any], op: Any, reference: Callable[..., Any], args: tuple[Any, ...], **kwargs: Any
) -> Any:
    """Note [a public function's front]: before a public function does work of its own,
    the call may belong elsewhere, in this order: ``hop.testing.reference()`` runs the
    operator's reference semantics (``reference``); Dynamo, tracing, gets the raw op
    behind the marker (Note [public functions under Dynamo]); ``hop.debug.trace()``
    watches the call (Note [watching a call]). :data:`NOT_TAKEN` when none takes it."""
    if _reference.ACTIVE and _reference.here():
        return reference(*args, **kwargs)
    if _transforms.is_dynamo_compiling():
        return op(_transforms.DYNAMO_CALL, public, *args, **kwargs)
    if _SINKS and _observe.claim():
        return _observe_calls.watch(name, public, args, kwargs or None)
    if _subclass_without_rule(op, (args, kwargs)):  # Note [tensor subclasses run as Python]
        return reference(*args, **kwargs)
    return NOT_TAKEN


# Note [tensor subclasses run as Python]
# In plain eager, a call whose operands, carries, xs, predicate or index include an
# instance of a tensor subclass with its own __torch_dispatch__ (DTensor, TwoTensor, a
# quantized weight), and for whose class the raw op has no registered rule, runs as
# the plain Python program it stands for (the operator's reference): the callables
# see the instances, a predicate is read as a Python ``if`` reads it, and autograd
# records what runs. The raw op would reach the subclass's dispatch with hop's own
# operator, which the subclass does not know. A rule registered with
# ``op.py_impl(TheSubclass)`` takes such calls instead. Fake and functional tensors
# are tracing's, not users' subclasses: modes decide their route.


def _subclass_without_rule(op: Any, args: Any) -> bool:
    found = False
    for leaf in _flatten(args)[0]:
        cls = type(leaf)
        if cls in _transforms.PLAIN_TYPES or not isinstance(leaf, _Tensor):
            continue
        if cls.__torch_dispatch__ is _NO_DISPATCH:
            continue
        if isinstance(leaf, _tracing_tensor_types()) or _has_rule(op, cls):
            return False
        found = True
    return found and _transforms.in_plain_eager()


_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl


@functools.cache
def _tracing_tensor_types() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (FakeTensor, FunctionalTensor)


def _has_rule(op: Any, cls: type) -> bool:
    return _kernels.lookup_rule(op.python_key_table, cls) is not None


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def same_form(out: Any, flat: Sequence[Any]) -> Any:
    """``flat`` in the raw op's output convention: a bare value for one leaf, else a tuple."""
    return tuple(flat) if isinstance(out, tuple) else flat[0]


def no_alias(out: Any, operands: Sequence[Any]) -> Any:
    """``out`` with every leaf that shares memory with an operand cloned."""
    flat = as_tuple(out)
    suspect = any(_effects.may_alias(o, operands) for o in flat) or len(flat) > 1
    if not suspect:
        return out
    return same_form(out, _effects.clone_aliases(flat, operands))


def differentiable(x: Any) -> bool:
    """A floating or complex tensor: what autograd, vjp and jvp give a gradient or tangent."""
    return isinstance(x, _Tensor) and (x.is_floating_point() or x.is_complex())


def differentiable_at(values: Sequence[Any]) -> list[int]:
    """The positions of the :func:`differentiable` values."""
    return [i for i, v in enumerate(values) if differentiable(v)]


def runs_inline(*groups: Sequence[Any]) -> bool:
    """Real values under every functorch wrapper and nothing tracing: the rules of
    every family then run the callables as plain Python at the current level (Note
    [eager branches run inline], Note [scans run inline], Note [loops run inline])."""
    return _transforms.no_modes() and all(_transforms.is_real(v) for group in groups for v in group)


# Note [sizes under jit.trace]
# While torch.jit.trace runs, a tensor's sizes (``x.shape[0]``, ``x.size(0)``) are
# 0-dim tensors the tracer follows, not ints, so that a traced ``x.view(x.size(0), -1)``
# generalizes to other sizes. The loops of scan, map and associative_scan run inline
# there (the values are real) and are unrolled, as the Python loop they replace
# would be: their lengths and the sizes hop compares are constants of the trace.
# A length is taken with ``operator.index`` (as ``range(x.shape[0])`` takes it,
# without a TracerWarning); the eager paths read ints and test ``type(n) is int``
# before calling :func:`static_size`. The checks that compare the shapes of what a
# callable returned run with the tracer paused (:func:`untraced`): the values may be
# vmap's batched ones (associative_scan's generic mode), whose sizes the tracer
# cannot follow at all, and a check records nothing anyway.


def static_size(n: Any) -> Any:
    """A size read from a tensor: an int where torch.jit.trace gave a tensor (Note
    [sizes under jit.trace]), else ``n`` as it is (an int or a SymInt)."""
    return operator.index(n) if isinstance(n, _Tensor) else n


def untraced(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with torch.jit.trace's tracer paused, for a check that only reads
    sizes (Note [sizes under jit.trace]); outside a trace, just the call."""
    state = _tracing_state()
    if state is None:
        return fn(*args)
    _set_tracing_state(None)
    try:
        return fn(*args)
    finally:
        _set_tracing_state(state)


# Note [the legacy ONNX exporter]
# torch.onnx.export(..., dynamo=False) records what torch.jit.trace records: hop's
# operators run inline and are unrolled (Note [sizes under jit.trace]), so the .onnx
# file would hold the example's branch, trip count or length and be silently wrong
# on other inputs (with dynamic_axes, at other lengths). So under that exporter an
# operator whose branch, trip count or length comes from a tensor raises, pointing at
# dynamo=True, which writes ONNX If / Loop (hop/compile/onnx.py). A Python bool
# predicate, an int index or a Python-bool loop condition fixes the path for every
# input: those still unroll. Outside an ONNX export, torch.jit.trace keeps its unrolled
# trace (tests/test_jit_trace.py). The check costs one call of the tracer's state.


def refuse_legacy_onnx(op: str, what: str) -> None:
    """Note [the legacy ONNX exporter]: raise under torch.onnx.export(dynamo=False);
    ``what`` says what a tensor decides (``"pred is a tensor"``)."""
    if _tracing_state() is None:
        return
    onnx = sys.modules.get("torch.onnx")  # not loaded: no export runs (and a plain trace loads nothing)
    if onnx is not None and onnx.is_in_onnx_export():
        raise CompileUnsupported(
            format_message(
                op,
                f"torch.onnx.export(dynamo=False) traces the Python it runs, and {what}: the file would hold "
                "this input's path only and be silently wrong on others",
                fix="Export with torch.onnx.export(..., dynamo=True), which writes ONNX control flow (If, Loop).",
            ),
            op=op,
        )


def save_operands(ctx: Any, operands: Sequence[Any]) -> None:
    """Keep ``operands`` (tensors, ints, SymInts, None) on an autograd ``ctx`` for
    backward and jvp: tensors through autograd, so that torch.func transforms hand
    them back at the right level; the rest as they are."""
    tensors = [x for x in operands if isinstance(x, _Tensor)]
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)
    ctx.layout = [isinstance(x, _Tensor) for x in operands]
    ctx.others = [x for x in operands if not isinstance(x, _Tensor)]


def saved_operands(ctx: Any) -> list[Any]:
    """What :func:`save_operands` kept, in its order."""
    tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
    return [next(tensors) if is_tensor else next(others) for is_tensor in ctx.layout]


def check_effects(
    op: str, role: str, fn: Callable[..., Any], gm: torch.fx.GraphModule, *, what: str, updates: str, fix: str
) -> None:
    """Refuse a traced callable that writes one of its inputs in place (``what``:
    how the family calls that input; ``updates``: what such writes update), and make
    outputs that alias an input fresh tensors, as eager's outputs are."""
    effects = _effects.find_mutations_and_aliases(gm)
    if effects.mutated:
        k = effects.mutated[0]
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        name = _output_checks.name_in(fn, placeholders[k].meta.get("val")) if k < len(placeholders) else None
        if name is None:
            what_is_written, why, fix = f"{what} {k}", f"in-place updates of {updates}", fix
        else:
            what_is_written, why = f"{name}, a tensor it closes over,", "in-place updates of what it closes over"
            fix = (
                f"Pass {name} in as {'an' if what[0] in 'aeiou' else 'a'} {what} and return its new value, "
                "written out of place (index_copy, index_put, scatter instead of their in-place forms)."
            )
        raise MutationError(
            format_message(
                op,
                f"{role} ({_output_checks.describe_fn(fn)}) writes {what_is_written} in place; "
                f"{why} run in eager but cannot be traced (make_fx, torch.export)",
                fix=fix,
            ),
            op=op,
            role=role,
        )
    if effects.aliased:
        _effects.clone_aliased_outputs(gm, effects)


# --- the proxy rule's skeleton -----------------------------------------------------------
# Every operator's proxy rule is the same three steps: trace its callables on examples
# (:func:`trace_callables`), adjust what it must (an operator's own step: distinct
# inputs for branches, a fixpoint's generalized carries for while_loop), and record one
# node (:func:`record_node`). The examples are the operator's: branches see the
# operands, loop bodies a carry and one slice, combine_fn two slices.


@dataclasses.dataclass(frozen=True)
class Writes:
    """How an operator's messages name an in-place write of a callable's input."""

    what: str  # the input, as the family calls it ("operand", "carry")
    updates: str  # what such a write would update
    fix: str


def trace_callables(
    op: str,
    roles: Sequence[str],
    fns: Sequence[Callable[..., Any]],
    examples: Sequence[Any],
    writes: Writes,
    *,
    checked: Sequence[bool] | None = None,
) -> tuple[list[torch.fx.GraphModule], list[Any]]:
    """Trace each callable on ``examples`` (lifting what they close over: the second
    result) and refuse those that write their inputs (all, or where ``checked`` says)."""
    graphs, lifted = _lifting.trace_branches(fns, examples)
    written = []
    for role, fn, gm in zip(roles, fns, graphs, strict=True):
        effects = _effects.find_mutations_and_aliases(gm)
        if effects.mutated:
            vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
            written.append(_state.Written(role, fn, effects.mutated, effects.aliased, dict(enumerate(vals))))
    if written and _state.catching():  # Note [state inside control flow]
        try:
            w, gm = written[0], graphs[roles.index(written[0].role)]
            check_effects(op, w.role, w.fn, gm, what=writes.what, updates=writes.updates, fix=writes.fix)
        except MutationError as refusal:
            n = len(list(graphs[0].graph.find_nodes(op="placeholder"))) - len(lifted)
            raise _state.StateWrites(op, written, list(lifted), refusal, n) from None
    for i, (role, fn, gm) in enumerate(zip(roles, fns, graphs, strict=True)):
        if checked is None or checked[i]:
            check_effects(op, role, fn, gm, what=writes.what, updates=writes.updates, fix=writes.fix)
    return graphs, lifted


def reverse_tracked(values: Sequence[Any]) -> bool:
    """Whether reverse mode (autograd, or a torch.func grad / vjp level) tracks one of
    ``values`` beneath its functorch wrappers (a batched tensor reports
    ``requires_grad=False`` for what it wraps); a forward-mode (jvp) level does not count."""
    if not torch.is_grad_enabled():
        return False
    forward = {i.level() for i in torch._C._functorch.get_interpreter_stack() or () if i.key() == TransformType.Jvp}
    for t in values:
        while isinstance(t, _Tensor):
            wrapped = torch._C._functorch.is_functorch_wrapped_tensor(t)
            if t.requires_grad and not (wrapped and torch._C._functorch.maybe_get_level(t) in forward):
                return True
            t = torch._C._functorch.get_unwrapped(t) if wrapped else None
    return False


# Note [a traced loop's carries are dense]
# Inductor's while loop (hop's while_loop and fori_loop, and the loops scan and map
# are rewritten into) lays its outputs out as its carried inputs are and has the body
# write each iteration's carry into them. A carry whose elements overlap (stride 0:
# ``zeros(()).expand(n)``, what vmap makes of an unbatched initial carry, or hop's
# own trip counter broadcast for a batched backward) made the body store n values
# into one element: every element read back the last one, or the loop never ended,
# silently. The body is traced on contiguous carries anyway (Note [traced bodies see
# contiguous values] in ``scanning._rules``), so a traced node takes such a carry as a
# contiguous copy: one copy per call, before the loop, on every path that traces.


def select(mask: Any, a: Any, b: Any) -> Any:
    """``torch.where(mask, a, b)``; on bool values as logical ops, since onnxruntime's
    CPU provider has no bool ``Where`` (a vmapped loop's ``done`` flag exported to
    ONNX loaded nowhere). The values are the same."""
    if isinstance(a, _Tensor) and isinstance(b, _Tensor) and a.dtype == b.dtype == torch.bool:
        return (mask & a) | (~mask & b)
    return torch.where(mask, a, b)


def overlapping(x: Any) -> bool:
    """A tensor two of whose indices address one element (a stride 0 on a dimension
    longer than one; an unknown size counts as longer). One with no element does not
    (and ``contiguous()`` leaves it as it is)."""
    if not isinstance(x, _Tensor) or x.layout is not torch.strided:
        return False
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    if any(guard_or_false(size == 0) for size in x.shape):
        return False
    return any(
        guard_or_false(stride == 0) and not guard_or_false(size <= 1)
        for size, stride in zip(x.shape, x.stride(), strict=True)
    )


def dense_carries(mode: Any, carries: Sequence[Any]) -> tuple[Any, ...] | None:
    """Note [a traced loop's carries are dense]: ``carries`` with each overlapping one a
    contiguous copy recorded under ``mode``, or None when none overlaps."""
    if not any(overlapping(c) for c in carries):
        return None
    with mode:
        return tuple(c.contiguous() if overlapping(c) else c for c in carries)


def record_node(
    mode: Any,
    op: str,
    raw_op: Any,
    node_args: Sequence[Any],
    run: Callable[[], Any],
    *,
    kwargs: dict[str, Any] | None = None,
    root: str = "output",
    why: str = "the union of the branches' ranges",
    tupled: bool = False,
) -> Any:
    """Record one ``raw_op`` node of ``node_args`` whose value ``run`` computes (the
    proxy mode is popped there: the call reaches the fake rule), then a runtime assert
    for each bound of each fresh size it made, read from the result (as a tuple where
    ``tupled``: a while_loop's carries are named ``carry[i]`` however many)."""
    with recording() as fresh:
        out = run()
    result = _tracing.emit(mode, raw_op, node_args, out, kwargs)
    view = result if not tupled or isinstance(result, tuple) else (result,)
    assert_ranges(mode, op, view, fresh, root=root, why=why)
    return result


# --- the vmap rule's skeleton ------------------------------------------------------------
# Every operator's vmap rule, once its inline cases are out (real tensors run the
# callables as Python), lowers the same way: unwrap each argument group at the
# interpreter's level; if nothing is batched there, the op one level down on the
# unwrapped values; else the operator places the batch (where each value carries
# it, how the callables are vmapped: its own step), the op runs one level down, and
# each output gets its batch dimension back where the operator says.

Vmapped = Callable[..., Callable[..., Any]]
"""``vmapped(fn, in_dims, out_dims=0)``: ``fn`` under ``torch.vmap`` with the interpreter's
randomness (an output that is not a tensor, an int carry, needs an ``out_dims`` of None)."""
Placement = Callable[
    [list[list[Any]], list[list[int | None]], int, Vmapped], tuple[Callable[[], Any], Callable[[int], int]]
]
"""An operator's own step of its vmap rule: ``(values, dims, size, vmapped) -> (call, out_dim)``."""


# Note [vmapped outputs are batched at dim 0]
# A rule's output is wrapped with its batch moved to the front, as torch's own batching
# rules leave theirs. Under non-strict export, vmap's closing ``_remove_batch_dim`` runs
# with the pre-dispatch tracer on: a batch at any other dim makes it record a permute
# of the wrapped (untracked) tensor, which export then lifts as a fake constant.


def lower_vmap(
    interpreter: Any,
    groups: Sequence[Sequence[Any]],
    unbatched: Callable[..., Any],
    batched: Callable[
        [list[list[Any]], list[list[int | None]], int, Vmapped], tuple[Callable[[], Any], Callable[[int], int]]
    ],
) -> Any:
    """The op one level down under ``interpreter`` (a vmap level). ``unbatched(*groups)``
    runs it when no value is batched at this level; else ``batched(values, dims, size,
    vmapped)`` gives the call (values placed, callables vmapped) and, for output k,
    the dimension that holds its batch."""
    level = interpreter.level()
    pairs = [_transforms.unwrap_batched(g, level) for g in groups]
    values, dims = [v for v, _ in pairs], [d for _, d in pairs]
    if all(d is None for ds in dims for d in ds):
        with interpreter.lower():
            return unbatched(*values)

    def vmapped(fn: Callable[..., Any], in_dims: tuple[int | None, ...], out_dims: Any = 0) -> Callable[..., Any]:
        fn = _tracing.per_element_sizes(fn)  # Note [size reads in a vmapped graph]
        return torch.vmap(fn, in_dims=in_dims, out_dims=out_dims, randomness=interpreter.randomness())

    call, out_dim = batched(values, dims, interpreter.batch_size(), vmapped)
    with interpreter.lower():
        out = call()
        flat = out if isinstance(out, tuple) else (out,)
        # Note [vmapped outputs are batched at dim 0]
        front = [o.movedim(out_dim(k), 0) if isinstance(o, torch.Tensor) else o for k, o in enumerate(flat)]
    wrapped = [_add_batch_dim(o, 0, level) if isinstance(o, torch.Tensor) else o for o in front]
    return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]
