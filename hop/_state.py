"""State inside control flow: a traced callable that writes what it reads, made pure.

Note [state inside control flow]
A branch, a loop body or a scan step may write a tensor in place: one of its
operands or carries, or a tensor it closes over (a module's buffer: a KV cache, a
ring buffer, a running statistic). Eager runs the Python, which writes it. A traced
subgraph must stay a pure function, so when a proxy rule finds a callable writing
one of its placeholders (:func:`hop.ops._common.trace_callables`) it raises
:class:`StateWrites` instead of recording anything, and the first hop frame of the
call (``hop._dispatch.call``, at the layer the user's program runs: autograd,
functionalization, export's handlers) calls :func:`rewrite`, which makes the same
call again with

- every written tensor (an operand, an additional input, a closed-over tensor) made
  *state*: the callables take it as an input, write a clone of it and return the
  clone as an extra output; a loop carries it (its condition reads the current
  value), a branching operator returns it from every branch (an untaken branch
  returns it unchanged);
- a carry written in place and returned as the same carry, as Python passes one
  object from step to step: the body writes a clone, which it returns;
- after the call, ``tensor.copy_(new_value)`` on every written tensor: an ordinary
  in-place write at the caller's layer, which export records as a buffer or input
  mutation, autograd differentiates and functionalization turns into a copy.

So after the call every written tensor holds what the Python ``if`` / ``while`` /
``for`` would have left in it, and every subgraph is pure. What cannot be kept so is
refused before anything runs (a ``MutationError`` naming the callable, the tensor and
the fix): a write to a slice of ``xs``, a write in a loop's condition, a carry written
and then replaced by another tensor (Python would have written only the first
step's object), a write in ``map`` or ``associative_scan`` (their calls have no
order), and a write to a closed-over tensor the static closure search cannot name.

The layout of the operator's node (``hop._spec.Layout``) says what each placeholder
of a subgraph is (carries, slices of ``xs``, inputs, then lifted closures), so one
rewrite serves every operator, a user's HOP with a layout included.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _closures, _spec
from hop._fake_run import referents
from hop._output_checks import describe_fn, name_in, storage_id
from hop.errors import MutationError, format_message

__all__ = ["StateWrites", "Written", "catching", "entry", "rewrite", "user_code"]

Fn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Written:
    """What one traced callable writes.

    Attributes:
        role: the callable's role (``body_fn``, ``true_fn``).
        fn: the callable as the rule got it.
        mutated: indices of the placeholders written in place.
        aliased: (output leaf, placeholder) pairs sharing memory.
        value_of: the traced value of each placeholder written (to name it).
    """

    role: str
    fn: Fn
    mutated: tuple[int, ...]
    aliased: tuple[tuple[int, int], ...]
    value_of: dict[int, Any]


class StateWrites(Exception):
    """A proxy rule found callables writing their inputs (Note [state inside control
    flow]); ``refusal`` is the error to raise where no rewrite can take it."""

    def __init__(self, op: str, written: list[Written], lifted: list[Any], refusal: Exception, n_explicit: int) -> None:
        super().__init__(str(refusal))
        self.op, self.written, self.lifted, self.refusal = op, written, lifted, refusal
        self.n_explicit = n_explicit  # placeholders before the lifted ones

    def reindexed(
        self, n_explicit: int, where: Callable[[int], int | torch.Tensor], outputs_first: int = 0
    ) -> StateWrites:
        """The same writes for a call whose explicit placeholders differ: a rule that
        calls its operator with another signature (a trip counter carried first,
        closures as inputs) says where each of its placeholders is in its caller's,
        ``where(i)``: an index there, or the closed-over tensor it passes; its callables
        return ``outputs_first`` outputs of its own before the caller's."""
        lifted = list(self.lifted)
        moved: dict[int, int] = {}
        for i in {i for w in self.written for i in (*w.mutated, *(p for _, p in w.aliased))}:
            if i >= self.n_explicit:
                moved[i] = n_explicit + i - self.n_explicit
                continue
            to = where(i)
            if isinstance(to, torch.Tensor):
                lifted.append(to)
                moved[i] = n_explicit + len(lifted) - 1
            else:
                moved[i] = to
        written = [
            Written(
                w.role,
                w.fn,
                tuple(moved[i] for i in w.mutated),
                tuple((j - outputs_first, moved[i]) for j, i in w.aliased if j >= outputs_first),
                {moved[i]: v for i, v in w.value_of.items() if i in moved},
            )
            for w in self.written
        ]
        return StateWrites(self.op, written, lifted, self.refusal, n_explicit)


# --- where a call starts ---------------------------------------------------------------
# The first hop frame of a call is the one that rewrites it: ``depth`` counts the hop
# frames on the stack below the user's code (rules calling the operator one level
# down), and is 0 again while a rule runs a user's callable (a nested operator's call
# starts there).

_LOCAL = threading.local()


def depth() -> int:
    return int(getattr(_LOCAL, "depth", 0))


class entry:
    """``with entry() as first:`` around a hop frame; ``first``: nothing below the user's code."""

    def __enter__(self) -> bool:
        self.saved = depth()
        _LOCAL.depth = self.saved + 1
        return self.saved == 0

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.depth = self.saved


class user_code:
    """Around a rule running a user's callable: an operator called there starts a call."""

    def __enter__(self) -> None:
        self.saved = depth()
        _LOCAL.depth = 0

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.depth = self.saved


def catching() -> bool:
    """Whether a hop frame above will rewrite a :class:`StateWrites` (else refuse at once)."""
    return depth() > 0


# --- the rewrite ---------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """Where the written tensors are, in the call's arguments."""

    carries: set[int] = dataclasses.field(default_factory=set)  # carries written and returned
    inputs: list[int] = dataclasses.field(default_factory=list)  # positions in the layout's inputs
    closed: list[torch.Tensor] = dataclasses.field(default_factory=list)  # closed-over tensors


def rewrite(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], writes: StateWrites) -> Any:
    """``op(*args, **kwargs)`` with pure callables, then the writes applied (Note [state
    inside control flow]); a refusal where Python's semantics could not be kept."""
    spec = _spec.spec_of(op.name())
    layout = spec.layout if spec is not None else None
    if spec is None or layout is None or (layout.selector is None and layout.carries is None):
        raise _refused(writes, None, "its calls run in no fixed order, so what a write leaves would not be Python's")
    positions = layout.subgraph_positions(args)
    fns = [args[p] for p in positions]
    carries = list(args[layout.carries]) if layout.carries is not None else []
    xs = list(args[layout.xs]) if layout.xs is not None else []
    inputs = list(args[layout.inputs]) if layout.inputs is not None else []
    plan = _plan(writes, spec, positions, fns, len(carries), len(xs), inputs)
    state = [inputs[j] for j in plan.inputs] + plan.closed
    n_state = len(state)
    slots: dict[int, list[Any]] = {}
    reached = _closures.closure_tensors(fns, slots=slots)
    written = [*(carries[k] for k in sorted(plan.carries)), *state]
    _refuse_shared_memory(writes, written, [*carries, *xs, *inputs], reached)
    # an autograd node keeps what it is given for its backward: give it copies of what is
    # written back, or the write-back would change a saved tensor
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (*carries, *xs, *inputs, *reached)
    ):
        given = {id(t): _kept_copy(t) for t in (*state, *(carries[k] for k in plan.carries))}
    else:
        given = {}

    def passed(t: Any) -> Any:
        return given.get(id(t), t)

    new_args = list(args)
    if layout.carries is not None:
        new_args[layout.carries] = tuple(passed(t) for t in (*carries, *state))
        if layout.inputs is not None:  # read by no callable now (the state carry stands for them)
            new_args[layout.inputs] = tuple(passed(t) for t in inputs)
        for p, fn in zip(positions, fns, strict=True):
            new_args[p] = _loop_callable(fn, plan, slots, (len(carries), len(xs), n_state), body=p == layout.body)
        out = op(*new_args, **kwargs)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        n_c = len(carries)
        final_state = flat[n_c : n_c + n_state]
        result = [*flat[:n_c], *flat[n_c + n_state :]]
        for k in sorted(plan.carries):
            carries[k].copy_(result[k])
        _write_back(state, final_state)
        if not isinstance(out, (tuple, list)) or (len(result) == 1 and layout.xs is None):
            return result[0]
        return type(out)(result) if isinstance(out, tuple) else result
    assert layout.inputs is not None  # a branching operator's operands
    new_args[layout.inputs] = tuple(passed(t) for t in (*inputs, *plan.closed))
    kinds: list[Any] = []
    for p, fn in zip(positions, fns, strict=True):
        new_args[p] = _branch_callable(fn, plan, slots, len(inputs), kinds)
    out = op(*new_args, **kwargs)
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    _write_back(state, flat[len(flat) - n_state :])
    kept = iter(flat[: len(flat) - n_state])
    kind, nones = kinds[0]
    leaves = [None if none else next(kept) for none in nones]
    return leaves[0] if kind is None else kind(leaves)  # the branches' own form: a raw op's is flat


def _refuse_shared_memory(
    writes: StateWrites, written: Sequence[torch.Tensor], passed: Sequence[Any], reached: Sequence[torch.Tensor]
) -> None:
    """A written tensor that the call can also read another way (an operand the branch
    also closes over, a view of a buffer it reads) would be two tensors once its writes
    are made pure: each would miss the other's writes, silently. Refused."""
    entries = [*(t for t in passed if isinstance(t, torch.Tensor)), *reached]  # each way in, once
    for w in written:
        if sum(_shares_memory(w, e) for e in entries) > 1:
            raise _refused(
                writes,
                None,
                "that tensor shares memory with another one the call receives or reads (an operand it also "
                "closes over, a view of a buffer it reads), and the two would be separate values once traced",
                fix="Pass the tensor once: as an operand or carry, or read it only through the closure.",
            )


def _shares_memory(a: Any, b: Any) -> bool:
    if a is b:
        return True
    sa = storage_id(_inner(a) if _inner(a) is not None else a)
    sb = storage_id(_inner(b) if _inner(b) is not None else b)
    return sa is not None and sa == sb


def _kept_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that Inductor keeps: it removes a clone of a clone of a graph input
    (its no-op clone pass), and the copy an autograd node saved would then be the input
    itself, which the program's write-back changes before the backward reads it."""
    return t.clone() if t.dtype is torch.bool else t * 1


def _write_back(state: Sequence[torch.Tensor], values: Sequence[Any]) -> None:
    for t, v in zip(state, values, strict=True):
        t.copy_(v)


def _plan(
    writes: StateWrites,
    spec: _spec.OpSpec,
    positions: Sequence[int],
    fns: Sequence[Fn],
    n_c: int,
    n_x: int,
    inputs: Sequence[Any],
) -> _Plan:
    plan, layout = _Plan(), spec.layout
    assert layout is not None
    n_explicit = n_c + n_x + len(inputs)
    if writes.n_explicit != n_explicit:  # a rule below changed the signature without saying how
        raise writes.refusal
    roles = list(spec.role_names(len(fns)))
    for w in writes.written:
        k = roles.index(w.role) if w.role in roles else None
        p = positions[k] if k is not None else None
        for i in w.mutated:
            if p is not None and p == layout.condition:
                raise _refused(writes, w, "a loop's condition runs before every step and must not write", i)
            if i < n_c:
                if p != layout.body or (i, i) not in w.aliased:
                    raise _refused(
                        writes,
                        w,
                        "the body returns another tensor for that carry, so Python would have written only "
                        "the first step's carry",
                        i,
                        what=f"carry {i}",
                        fix="Return the written carry itself, or write a clone of it.",
                    )
                plan.carries.add(i)
            elif i < n_c + n_x:
                why = "a step reads its slice of xs, never writes it"
                raise _refused(writes, w, why, i, what=f"slice {i - n_c} of xs")
            elif i < n_explicit:
                j = i - n_c - n_x
                if j not in plan.inputs:
                    plan.inputs.append(j)
            else:
                lifted = writes.lifted[i - n_explicit]
                found = _closed_over(fns, lifted)
                if found is None:
                    raise writes.refusal
                if not any(found is c for c in plan.closed):
                    plan.closed.append(found)
    return plan


def _closed_over(fns: Sequence[Fn], traced: Any) -> torch.Tensor | None:
    """The closed-over tensor of ``fns`` that the traced value ``traced`` stands for:
    itself, or the tensor a functionalization wrapper holds. The static closure search
    first; then every object the callables reach (a library's cache object holding its
    tensors in a list of layers), as a bounded walk: this looks for one known tensor."""
    for t in _closures.closure_tensors(fns):
        if _stands_for(t, traced):
            return t
    todo: collections.deque[Any] = collections.deque(fns)
    seen: set[int] = set()
    while todo and len(seen) < _MAX_WALK:
        obj = todo.popleft()  # nearest first
        if id(obj) in seen or isinstance(obj, _NOT_WALKED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if _stands_for(obj, traced):
                return obj
            continue
        if isinstance(obj, torch.nn.Module):
            todo.extend(t for t in (*obj._parameters.values(), *obj._buffers.values()) if t is not None)
        todo.extend(referents(obj))
    return None


_MAX_WALK = 20000
_NOT_WALKED = (str, bytes, int, float, bool, type(None), type, types.ModuleType)


def _stands_for(t: torch.Tensor, traced: Any) -> bool:
    seen = 0
    while isinstance(t, torch.Tensor) and seen < 4:
        if t is traced:
            return True
        inner = _inner(t)
        if inner is None:
            return False
        t, seen = inner, seen + 1
    return False


def _inner(t: torch.Tensor) -> torch.Tensor | None:
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t, FunctionalTensor):
        return torch._from_functional_tensor(t.elem)
    if torch._is_functional_tensor(t):
        return torch._from_functional_tensor(t)
    return None


def _loop_callable(fn: Fn, plan: _Plan, slots: dict[int, list[Any]], sizes: tuple[int, int, int], *, body: bool) -> Fn:
    """A loop's condition or body reading the state as carries ``n_c..n_c+n_state``; the
    body writes clones of the state and the carries it writes, and returns the state
    after its carries."""
    converted = _closures.with_closure_as_inputs(fn, plan.closed, slots=slots) if plan.closed else fn
    n_c, n_x, n_state = sizes
    n_inputs_state = len(plan.inputs)

    def pure(*args: Any) -> Any:
        carries, state, rest = list(args[:n_c]), list(args[n_c : n_c + n_state]), list(args[n_c + n_state :])
        if body:
            state = [s.clone() for s in state]
            for k in plan.carries:
                carries[k] = carries[k].clone()
        # rest: the slices of xs, then the layout's inputs (whose written ones the state replaces)
        for s, j in zip(state[:n_inputs_state], plan.inputs, strict=True):
            rest[n_x + j] = s
        out = converted(*carries, *rest, *state[n_inputs_state:])
        if not body:
            return out
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        return (*flat[:n_c], *state, *flat[n_c:])

    pure.__wrapped__ = fn  # type: ignore[attr-defined]
    pure.__qualname__ = getattr(fn, "__qualname__", "body")
    return pure


def _branch_callable(fn: Fn, plan: _Plan, slots: dict[int, list[Any]], n_inputs: int, kinds: list[Any]) -> Fn:
    """A branch taking the closed-over state as extra operands, writing clones of the
    state, and returning its outputs (a raw op's branches return a flat tuple), then
    the state; ``kinds`` learns the form of the outputs."""
    converted = _closures.with_closure_as_inputs(fn, plan.closed, slots=slots) if plan.closed else fn

    def pure(*args: Any) -> Any:
        operands, closed = list(args[:n_inputs]), [c.clone() for c in args[n_inputs:]]
        for j in plan.inputs:
            operands[j] = operands[j].clone()
        out = converted(*operands, *closed)
        leaves = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if not kinds:  # Nones are put back after the call: Inductor's cond holds tensors only
            kinds.append((type(out) if isinstance(out, (tuple, list)) else None, [v is None for v in leaves]))
        return (*[v for v in leaves if v is not None], *[operands[j] for j in plan.inputs], *closed)

    pure.__wrapped__ = fn  # type: ignore[attr-defined]
    pure.__qualname__ = getattr(fn, "__qualname__", "branch")
    return pure


def _refused(
    writes: StateWrites,
    w: Written | None,
    why: str,
    placeholder: int | None = None,
    fix: str | None = None,
    what: str | None = None,
) -> MutationError:
    w = w if w is not None else (writes.written[0] if writes.written else None)
    role = w.role if w is not None else "a callable"
    where = f"{role} ({describe_fn(w.fn)})" if w is not None else role
    if w is not None and placeholder is None and w.mutated:
        placeholder = w.mutated[0]
    if what is None:
        what = _name(writes, w, placeholder) if w is not None and placeholder is not None else "a tensor"
    op = writes.op
    public = counted_as(w.fn) if w is not None else None
    if public is not None:  # a public function's body behind a loop's, counting: the user's names
        op, what = public, re.sub(r"^carry (\d+)$", lambda m: f"val (leaf {int(m[1]) - 1})", what)
    return MutationError(
        format_message(
            op,
            f"{where} writes {what} in place, which hop cannot keep as Python would: {why}",
            fix=fix or "Return the new value instead of writing in place (index_copy, index_put, scatter).",
        ),
        op=op,
        role=role,
    )


# Loop bodies that a public function builds around the user's, with a trip count as
# carry 0: the name of the public function, by the wrapper's ``__hop_counted__``, or
# (a graph Dynamo traced) by the frame its capture records. Filled by the functions.
COUNTED_FRAMES: dict[str, str] = {}


def counted_as(fn: Any) -> str | None:
    """The public function whose counted body ``fn`` is, or None."""
    seen = 0
    while seen < 16:
        name = getattr(fn, "__hop_counted__", None)
        if isinstance(name, str):
            return name
        if isinstance(fn, torch.fx.GraphModule):
            traces = [n.meta.get("stack_trace") or "" for n in fn.graph.nodes]
            return next((op for frame, op in COUNTED_FRAMES.items() for t in traces if f"in {frame}\n" in t), None)
        if not hasattr(fn, "__wrapped__"):
            return None
        fn, seen = fn.__wrapped__, seen + 1
    return None


def _name(writes: StateWrites, w: Written, i: int) -> str:
    """What the user calls placeholder ``i`` of ``w``'s callable: ``self.cache``, ``buf``,
    or its position (``input 2``), as the layout numbers placeholders."""
    k = i - writes.n_explicit
    value = writes.lifted[k] if 0 <= k < len(writes.lifted) else w.value_of.get(i)
    named = name_in(w.fn, value) if isinstance(value, torch.Tensor) else None
    return named or _placeholder_name(w.fn, i) or f"its input {i}"


def _placeholder_name(fn: Fn, i: int) -> str | None:
    """The source name Dynamo gave placeholder ``i`` of a graph it traced: ``l_self_buffers_cache_``
    reads ``self.cache``; None for a callable that is no such graph."""
    while hasattr(fn, "__wrapped__") and not isinstance(fn, torch.fx.GraphModule):
        fn = fn.__wrapped__
    if not isinstance(fn, torch.fx.GraphModule):
        return None
    names = [str(n.name) for n in fn.graph.find_nodes(op="placeholder")]
    if i >= len(names) or not names[i].lower().startswith("l_"):
        return None  # a value of the graph itself (a carry), not a source
    name = names[i][2:].rstrip("_")
    for kind in ("_buffers_", "_parameters_", "_modules_"):
        name = name.replace(kind, ".")
    return name
