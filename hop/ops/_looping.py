"""What scan and map share: the body convention, the eager loops, the checks and every rule.

The raw ops take flat leaves::

    torch.ops.hop.scan(body, init, xs, additional_inputs, reverse)
    torch.ops.hop.map(body, xs, additional_inputs)          # a scan without carry

``body(*carry, *x, *additional_inputs) -> (*next_carry, *y)`` (a bare tensor
for one leaf), where ``x`` holds one slice along dim 0 of every leaf of ``xs``.
The output is ``(*final_carry, *ys)``, a bare tensor for one leaf, with ``ys``
stacked along dim 0 in the order of ``xs`` (also when ``reverse``). Each rule
is written once against a :class:`Looping` and registered on both raw ops by
``scan.py`` and ``map.py``; both ops differentiate through ``scan``.

Note [scans run inline]
As for cond (Note [eager branches run inline]), a scan over real tensors (real
under every functorch wrapper, nothing tracing) runs as the plain Python loop at
the current level: autograd, grad, jvp and vmap see each iteration's ops, which
gives exact derivatives of every order, gradients to what the body closes over,
and no compile step. Only a scan over fake, functional or symbolic values keeps
the operator as one node, whose derivatives are scans again (:class:`_ScanFunction`)
and whose batched version is a scan of the vmapped body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch._C._functorch import _add_batch_dim

from hop import _subgraph, _transforms, _validation
from hop._operator import HigherOrderOperator
from hop._subgraph import flatten_dropping_none, leaf_paths_dropping_none
from hop._unbacked import assert_ranges, per_step_sizes, rebind_sizes, recording, run_in_subgraph
from hop.errors import (
    HopRuntimeError,
    HopTypeError,
    HopValueError,
    OutputMismatchError,
    format_message,
    type_name,
)
from hop.ops import _common, _graph_step
from hop.ops._branching import as_tuple
from hop.ops._common import check_effects, differentiable, differentiable_at, save_operands, saved_operands

LENGTH = "the number of steps is the length of xs, which the trace fixes"  # Note [the legacy ONNX exporter]

Fn = Callable[..., Any]
_Tensor = torch.Tensor
_PAIR = (tuple, list)
_check: Callable[..., None] = torch._check  # untyped in torch


@dataclasses.dataclass(frozen=True)
class Looping:
    """How one looping operator (scan or map) names its parts and calls its raw op."""

    name: str
    op: HigherOrderOperator
    role: str  # the callable's parameter name: "combine_fn" or "f"
    # the raw op from (body, init, xs, additional, reverse), and its node's arguments
    call: Callable[[Fn, Sequence[Any], Sequence[Any], Sequence[Any], bool], Any]
    node_args: Callable[[Any, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...], bool], tuple[Any, ...]]
    scan: HigherOrderOperator  # the raw scan its reverse mode runs (map's too: its derivative is a scan)


def pack(flat: Sequence[Any]) -> Any:
    """The raw ops' output convention: a bare value for one leaf, else a tuple."""
    return flat[0] if len(flat) == 1 else tuple(flat)


# --- argument checks -----------------------------------------------------------------------------


def check_callable(name: str, role: str, fn: Any) -> None:
    if not callable(fn):
        raise HopTypeError(format_message(name, f"{role} must be callable, got {type_name(fn)}"), op=name, role=role)


def check_leaves(name: str, root: str, tree: Any, leaves: Sequence[Any], *, ints: bool = False) -> None:
    """Every leaf is a tensor (or an int / SymInt when ``ints``)."""
    kinds = (torch.Tensor, int, torch.SymInt) if ints else (torch.Tensor,)
    for path, leaf in zip(leaf_paths_dropping_none(tree, root), leaves, strict=True):
        if not isinstance(leaf, kinds) or isinstance(leaf, bool):
            what = "a tensor or an int" if ints else "a tensor"
            raise HopTypeError(
                format_message(
                    name,
                    f"must be {what}, got {type_name(leaf)}",
                    path=path,
                    fix=f"Close over other values in the function instead of passing them in {root}.",
                ),
                op=name,
                role=root,
                path=path,
            )


def check_xs(name: str, xs: Any, leaves: Sequence[torch.Tensor], dim: Any) -> tuple[list[int], Any]:
    """Each leaf's scanned dimension (``dim`` made non-negative per leaf) and the common length."""
    if type(dim) is not int:
        raise HopTypeError(format_message(name, f"dim must be an int, got {type_name(dim)}"), op=name, role="dim")
    if not leaves:
        raise HopValueError(
            format_message(name, "xs must contain at least one tensor: the length of the loop is read from it"),
            op=name,
            role="xs",
        )
    check_leaves(name, "xs", xs, leaves)
    paths = leaf_paths_dropping_none(xs, "xs")
    dims: list[int] = []
    for path, x in zip(paths, leaves, strict=True):
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise HopValueError(
                format_message(
                    name,
                    f"dim {dim} is out of range for a tensor of rank {x.dim()}",
                    path=path,
                    fix=f"Pass a dim in [-{x.dim()}, {x.dim() - 1}]." if x.dim() else "Pass tensors of rank >= 1.",
                ),
                op=name,
                role="dim",
                path=path,
            )
        dims.append(dim % x.dim())
    n = leaves[0].shape[dims[0]]
    if type(n) is not int:
        _common.refuse_legacy_onnx(name, LENGTH)
        n = _common.static_size(n)  # Note [sizes under jit.trace]
    for path, x, d in zip(paths[1:], leaves[1:], dims[1:], strict=True):
        if not _lengths_agree(x.shape[d], n, f"hop.{name}: {path} and {paths[0]} must have the same length"):
            raise HopValueError(
                format_message(
                    name,
                    f"has length {x.shape[d]} along dim {dim}, but {paths[0]} has length {n}",
                    path=path,
                    fix=f"Give every leaf of xs the same length along dim {dim}.",
                ),
                op=name,
                role="xs",
                path=path,
            )
    return dims, n


def _lengths_agree(a: Any, b: Any, message: str) -> bool:
    """Whether two leaves of xs have the same length: known equal, or symbols the trace
    may take as equal (a Dim shared by two inputs is two symbols until something
    guards their equality: this does, as torch's own ops do for the shapes they
    combine; a data-dependent length gets a runtime assert instead)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_or_false

    if _same_size(a, b) or guard_or_false(a == b):
        return True
    if free_unbacked_symbols(a) or free_unbacked_symbols(b):
        _check(a == b, lambda: message)
        return True
    return False


def _same_size(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a is b:
        return True
    if type(a) is int and type(b) is int:
        return a == b
    a, b = _common.static_size(a), _common.static_size(b)  # Note [sizes under jit.trace]
    return bool(statically_known_true(a == b))


def runs_inline(n: Any, *groups: Sequence[Any]) -> bool:
    """Note [scans run inline]: real values, nothing tracing, a known length (an empty
    scan needs fake tensors for its output metadata, so only in plain eager). Under
    torch.jit.trace ``n`` is a tensor: the loop is unrolled (Note [sizes under jit.trace])."""
    if type(n) is not int:
        n = _common.static_size(n)
    if type(n) is not int or (n == 0 and _transforms.functorch_level() is not None):
        return False
    return _common.runs_inline(*groups)


# --- output checks -------------------------------------------------------------------------------


def not_a_pair(L: Looping, fn: Fn, out: Any) -> HopTypeError:
    got = f"a {type(out).__name__} of length {len(out)}" if isinstance(out, _PAIR) else type_name(out)
    return HopTypeError(
        format_message(
            L.name,
            f"{L.role} must return a (next_carry, y) pair, got {got} ({L.role} is {_subgraph.describe_fn(fn)})",
            fix="Return a tuple (next_carry, y); use () or None for an empty carry or no y.",
        ),
        op=L.name,
        role=L.role,
    )


def check_carry(L: Looping, fn: Fn, init: Any, carry: Any) -> list[Any]:
    """``carry``'s leaves, after checking it has ``init``'s structure, dtypes, devices and shapes."""
    fix = f"{L.role} must return a next_carry with the structure, dtypes, devices and shapes of init."
    return check_like(L.name, L.role, fn, init, carry, "carry", "init and next_carry", fix)


def check_like(name: str, role: str, fn: Fn, ref: Any, out: Any, root: str, pair: str, fix: str = "") -> list[Any]:
    """``out``'s leaves, after checking it has ``ref``'s structure and, per tensor leaf,
    dtype, device and shape; errors name ``root``-based paths and ``pair`` ("init and next_carry")."""
    leaves, spec = flatten_dropping_none(out)
    ref_leaves, ref_spec = flatten_dropping_none(ref)
    where = f"({role} is {_subgraph.describe_fn(fn)})"
    fix = fix or f"{role} must return values with the structure, dtypes, devices and shapes of its inputs."
    if spec != ref_spec:
        raise OutputMismatchError(
            format_message(
                name,
                f"{pair} differ: structure {_spec_str(ref_spec)} vs {_spec_str(spec)} {where}",
                role=role,
                path=root,
                fix=fix,
            ),
            op=name,
            role=role,
            path=root,
        )
    paths = leaf_paths_dropping_none(ref, root)
    found = _common.untraced(_first_difference, paths, ref_leaves, leaves)  # Note [sizes under jit.trace]
    if found is not None:
        path, diff = found
        raise OutputMismatchError(
            format_message(name, f"{pair} differ: {diff} {where}", role=role, path=path, fix=fix),
            op=name,
            role=role,
            path=path,
        )
    return leaves


def _first_difference(paths: Sequence[str], refs: Sequence[Any], leaves: Sequence[Any]) -> tuple[str, str] | None:
    """The path of the first of ``leaves`` that differs from its ``refs``, and how."""
    for path, a, b in zip(paths, refs, leaves, strict=True):
        diff = leaf_difference(a, b)
        if diff is not None:
            return path, diff
    return None


def _spec_str(spec: Any) -> str:
    return str(optree.tree_unflatten(spec, ["*"] * spec.num_leaves)).replace("'*'", "*")


def leaf_difference(a: Any, b: Any) -> str | None:
    """How tensor ``b`` differs from tensor ``a`` in kind, dtype, device or shape (None if it does not)."""
    if not isinstance(b, _Tensor):
        return f"Tensor vs {type_name(b)}"
    if a.dtype != b.dtype:
        return f"dtype {_dtype(a)} vs {_dtype(b)}"
    if a.device != b.device:
        return f"device {a.device} vs {b.device}"
    if a.dim() != b.dim():
        return f"rank {a.dim()} vs {b.dim()} (shapes {tuple(a.shape)} vs {tuple(b.shape)})"
    if not all(_same_size(p, q) for p, q in zip(a.shape, b.shape, strict=True)):
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def stack_ys(L: Looping, fn: Fn, ys: Sequence[Any], dim: int, root: str) -> Any:
    """The outputs of every iteration, each leaf stacked along ``dim``."""
    try:
        if isinstance(ys[0], _Tensor):
            return torch.stack(_same_dtype(ys), dim)
        return optree.tree_map(
            lambda *col: torch.stack(_same_dtype(col), dim), *ys, none_is_leaf=False, namespace="torch"
        )
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise ys_error(L, fn, ys, dim, root) or e from None


def _same_dtype(col: Sequence[Any]) -> list[Any]:
    """``col``, whose tensors share one dtype: torch.stack would promote silently."""
    dtype = getattr(col[0], "dtype", None)
    for y in col:
        if getattr(y, "dtype", None) is not dtype:
            raise TypeError("iterations return different dtypes")
    return list(col)


def ys_error(L: Looping, fn: Fn, ys: Sequence[Any], dim: int, root: str) -> HopValueError | None:
    """Why the outputs of the iterations cannot be stacked along ``dim``."""
    where = f"({L.role} is {_subgraph.describe_fn(fn)})"
    first, spec = flatten_dropping_none(ys[0])
    for path, leaf in zip(leaf_paths_dropping_none(ys[0], root), first, strict=True):
        if not isinstance(leaf, _Tensor):
            return _ys_fail(L, f"must be a tensor, got {type_name(leaf)} {where}", path, "Return tensors.")
        if not -leaf.dim() - 1 <= dim <= leaf.dim():
            return _ys_fail(
                L,
                f"a tensor of rank {leaf.dim()} cannot be stacked along dim {dim} {where}",
                path,
                f"Return tensors of rank >= {dim if dim >= 0 else -dim - 1} or scan along another dim.",
            )
    for i, y in enumerate(ys[1:], start=1):
        leaves, other = flatten_dropping_none(y)
        if other != spec:
            return _ys_fail(
                L,
                f"iterations 0 and {i} return different structures: {_spec_str(spec)} vs {_spec_str(other)} {where}",
                root,
                "Return the same structure in every iteration.",
            )
        for path, a, b in zip(leaf_paths_dropping_none(ys[0], root), first, leaves, strict=True):
            diff = leaf_difference(a, b)
            if diff is not None:
                return _ys_fail(
                    L,
                    f"iterations 0 and {i} differ: {diff} {where}",
                    path,
                    "Every iteration must return tensors of the same dtype, device and shape.",
                )
    return None


def _ys_fail(L: Looping, what: str, path: str, fix: str) -> HopValueError:
    return HopValueError(
        format_message(L.name, what, role=L.role, path=path, fix=fix), op=L.name, role=L.role, path=path
    )


def stack_dim(dim: int, rank: int) -> int:
    """``dim`` as a non-negative position in a stack of tensors of rank ``rank``."""
    return dim if dim >= 0 else dim + rank + 1


def slices(xs: Any, leaves: Sequence[torch.Tensor], spec: Any, dims: Sequence[int]) -> Sequence[Any]:
    """The slices of ``xs`` along ``dims``, as pytrees shaped like ``xs``."""
    if isinstance(xs, _Tensor):
        return xs.unbind(dims[0])
    columns = [x.unbind(d) for x, d in zip(leaves, dims, strict=True)]
    return [optree.tree_unflatten(spec, list(col)) for col in zip(*columns, strict=True)]


def empty_slices(leaves: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """Uninitialized tensors shaped like one slice of each leaf (to trace or run on fake tensors)."""
    return [
        torch.empty([s for k, s in enumerate(x.shape) if k != d], dtype=x.dtype, device=x.device)
        for x, d in zip(leaves, dims, strict=True)
    ]


def no_alias(leaves: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``leaves`` with every tensor that is or views an input cloned."""
    if any(isinstance(o, _Tensor) and (o._is_view() or any(o is x for x in inputs)) for o in leaves):
        return _subgraph.clone_aliases(leaves, inputs)
    return list(leaves)


def on_fake(L: Looping, fn: Fn, leaves: Sequence[Any], make: Callable[[list[Any]], Any]) -> Any:
    """``make(fake leaves)`` on static fake copies of ``leaves``: the output metadata of an empty loop."""
    with _validation.fake_inputs(leaves) as fake:
        try:
            _validation.check_hooks(fn)
            return make(fake)
        except _validation.CANNOT_FAKE as e:
            raise _no_empty_metadata(L, fn, e) from e


def _no_empty_metadata(L: Looping, fn: Fn, e: Exception) -> HopRuntimeError:
    """The error for an empty loop whose function cannot run on fake tensors."""
    hooked = isinstance(e, _validation.HookedModule)  # Note [module hooks do not see validation]
    why = f"{type(e).__name__} ({e})" if hooked else type(e).__name__
    avoid = "calling modules with forward hooks" if hooked else "data-dependent shapes"
    return _empty_loop_error(
        L,
        f"the shapes of the outputs cannot be found without running {L.role} ({_subgraph.describe_fn(fn)}), "
        f"which fails on fake tensors: {why}",
        f"Scan over a non-empty dimension, or avoid {avoid} in the function.",
    )


def _empty_loop_error(L: Looping, what: str, fix: str, path: str | None = None) -> HopRuntimeError:
    """``xs has length 0, and <what>``: the outputs of an empty loop cannot be built."""
    return HopRuntimeError(
        format_message(L.name, f"xs has length 0, and {what}", fix=fix), op=L.name, role=L.role, path=path
    )


# --- rules -------------------------------------------------------------------------------------


def dense(
    L: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """The loop over dim 0 of ``xs``, at the current level (Note [scans run inline])."""
    # Note [traced bodies see contiguous values]
    traced = isinstance(body, torch.fx.GraphModule)
    columns = [(x.contiguous() if traced else x).unbind(0) for x in xs]
    n = len(columns[0])  # an int also under torch.jit.trace (Note [sizes under jit.trace])
    _common.refuse_legacy_onnx(L.name, LENGTH)
    if n == 0:
        return _empty(L, body, init, xs, additional)
    nc = len(init)
    # a traced body has no module hooks: skip nn.Module's call path (Note [running a traced body per step])
    step = (_graph_step.step_function(body) or body.forward) if isinstance(body, torch.fx.GraphModule) else body
    carry: Sequence[Any] = tuple(c.contiguous() for c in init) if traced else tuple(init)
    ys: list[Any] = [None] * n
    for i in range(n - 1, -1, -1) if reverse else range(n):
        out = as_tuple(step(*carry, *[c[i] for c in columns], *additional))
        carry, ys[i] = (tuple(c.contiguous() for c in out[:nc]) if traced else out[:nc]), out[nc:]
    stacked = [torch.stack(col) for col in zip(*ys, strict=True)]
    carry = [c.contiguous() for c in carry]  # as the fake rule says
    return pack([*no_alias(carry, [*init, *xs, *additional]), *stacked])


def _empty(L: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> Any:
    """A loop of length 0: ``init`` (cloned) and empty ``ys`` shaped by one fake run of the body."""
    nc = len(init)

    def run(fake: list[Any]) -> list[Any]:
        out = as_tuple(body(*fake[:nc], *empty_slices(xs, [0] * len(xs)), *fake[nc:]))
        check_static(L, body, out[nc:], [f"ys[{i}]" for i in range(len(out) - nc)])
        return [(y.shape, y.dtype, y.device) for y in out[nc:]]

    metas = on_fake(L, body, [*init, *additional], run)
    ys = [torch.empty((0, *shape), dtype=dtype, device=device) for shape, dtype, device in metas]
    return pack([*(c.clone(memory_format=torch.contiguous_format) for c in init), *ys])


def autograd(
    L: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """Inline for real tensors (Note [scans run inline]), else one node differentiated by scans;
    what the body closes over and needs grad for becomes additional inputs of the node
    (Note [closure conversion] in hop._subgraph: a node differentiates its inputs only)."""
    if runs_inline(xs[0].shape[0], init, xs, additional):
        return dense(L, body, init, xs, additional, reverse)
    (body,), captured = _subgraph.convert_closures([body], [*init, *xs, *additional])
    additional = (*additional, *captured)
    counts = (len(init), len(xs), len(additional))
    return _ScanFunction.apply(L, body, reverse, counts, *init, *xs, *additional)  # type: ignore[no-untyped-call]


def transform(
    L: Looping,
    interpreter: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """torch.func.grad / jvp: as :func:`autograd`, with the tensors this transform tracks that
    the body closes over made explicit inputs of the node (see :func:`lift_transform_closures`)."""
    n = xs[0].shape[0]
    if not runs_inline(n, init, xs, additional):
        body, extra = lift_transform_closures(body, interpreter.level())
        additional = (*additional, *extra)
        if type(n) is int and n == 0:
            return _empty_here(L, body, init, xs, additional)
    return autograd(L, body, init, xs, additional, reverse)


def check_static(L: Looping, fn: Fn, ys: Sequence[Any], paths: Sequence[str]) -> None:
    """The ``ys`` of a loop of length 0, run once on fake tensors: their sizes must not
    depend on data, since no step gives them (and torch.empty cannot take a symbol)."""
    for path, y in zip(paths, ys, strict=True):
        if not all(type(s) is int for s in y.shape):
            raise _empty_loop_error(
                L,
                f"{L.role} ({_subgraph.describe_fn(fn)}) returns {path} of a data-dependent shape "
                f"{tuple(y.shape)}: the shape of the empty output cannot be known",
                f"Loop over a non-empty dimension, or make the shapes of {L.role}'s outputs data-independent.",
                path,
            )


def _empty_here(L: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> Any:
    """A loop of length 0 at this transform's level: the carries pass through (their
    tangents and gradients with them) and the empty ``ys`` are shaped by the body
    itself, run on plain stand-ins (never on its derivative, which may not fake)."""

    def stand_ins(values: Sequence[Any]) -> list[Any]:
        return [torch.empty(v.shape, dtype=v.dtype, device=v.device) if isinstance(v, _Tensor) else v for v in values]

    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():  # the stand-ins are plain: so is their run
        shaped = as_tuple(_empty(L, body, stand_ins(init), stand_ins(xs), stand_ins(additional)))
    return pack([*(c.clone() for c in init), *shaped[len(init) :]])


def lift_transform_closures(body: Fn, level: int) -> tuple[Fn, list[Any]]:
    """The tensors wrapped by the torch.func grad / jvp transform at ``level`` that ``body``
    closes over, and ``body`` taking them as extra trailing inputs that replace them
    (:func:`hop._subgraph.convert_closures`). A traced node is differentiated with respect
    to its inputs only: without this, their gradients would silently be zero."""
    (body,), found = _subgraph.convert_closures([body], (), level)
    return body, found


def lift_closures(body: Fn, examples: Callable[[], Sequence[Any]]) -> tuple[Fn, list[Any]]:
    """Under make_fx with grad enabled: ``body`` traced on ``examples()`` with what it closes
    over lifted to extra inputs (Note [closure lifting]), so that autograd sees those too
    (a closed-over tensor that requires grad is invisible to the dispatcher).

    Under C++ functionalization (``torch._enable_functionalization``) the values are
    functional wrappers, which the tracer below them does not know: a trace here would
    bake their contents into the graph. The closures are then found statically
    (:func:`hop._subgraph.convert_closures`); the op's functionalize rule traces the body."""
    from torch.fx.experimental import proxy_tensor

    if (
        proxy_tensor._CURRENT_MAKE_FX_TRACER is None
        or not torch.is_grad_enabled()
        or _transforms.functorch_level() is not None
    ):
        return body, []
    with proxy_tensor.disable_proxy_modes_tracing():
        values = list(examples())
        if any(isinstance(v, _Tensor) and torch._is_functional_tensor(v) for v in values):
            (converted,), captured = _subgraph.convert_closures([body], values)
            return converted, captured
        (gm,), lifted = _subgraph.trace_branches([body], values)
    if not lifted:
        return body, []
    gm.__wrapped__ = body  # type: ignore[assignment]  # names the function in errors
    return gm, lifted


def vmap(
    L: Looping,
    interpreter: Any,
    body: Fn,
    init: Sequence[Any],
    xs: Sequence[Any],
    additional: Sequence[Any],
    reverse: bool,
) -> Any:
    """Inline for real tensors; else the op one level down on the vmapped body.

    The carry always gets the batch (at dim 0), each batched leaf of ``xs`` has it
    moved to dim 1 (dim 0 is scanned), ``ys`` come back batched at dim 1.
    """
    if runs_inline(xs[0].shape[0], init, xs, additional):
        return dense(L, body, init, xs, additional, reverse)
    level = interpreter.level()
    init_u, init_d = _transforms.unwrap_batched(init, level)
    xs_u, xs_d = _transforms.unwrap_batched(xs, level)
    add_u, add_d = _transforms.unwrap_batched(additional, level)
    if all(d is None for d in (*init_d, *xs_d, *add_d)):
        with interpreter.lower():
            return L.call(body, init_u, xs_u, add_u, reverse)
    size = interpreter.batch_size()
    init_b = [
        v.unsqueeze(0).expand(size, *v.shape) if d is None else v.movedim(d, 0)
        for v, d in zip(init_u, init_d, strict=True)
    ]
    xs_b = [v if d is None else v.movedim(d, 1) for v, d in zip(xs_u, xs_d, strict=True)]
    in_dims = (*[0] * len(init), *[None if d is None else 0 for d in xs_d], *add_d)
    batched = torch.vmap(body, in_dims=in_dims, randomness=interpreter.randomness())
    with interpreter.lower():
        out = as_tuple(L.call(batched, init_b, xs_b, add_u, reverse))
    nc = len(init)
    return pack([_add_batch_dim(o, 0 if k < nc else 1, level) for k, o in enumerate(out)])


def functionalize(
    L: Looping, ctx: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """Functionalize the body and call the op on the unwrapped operands."""
    init_u, xs_u, add_u = (ctx.unwrap_tensors(list(v)) for v in (init, xs, additional))
    with ctx.redispatch_to_next():
        out = L.call(_subgraph.functionalize_body(ctx, body, L.name, L.role), init_u, xs_u, add_u, reverse)
    return ctx.wrap_tensors(out)


def fake(
    L: Looping, mode: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """Output metadata: the body once on fake slices; ``ys`` get the scanned length in front."""
    with mode:
        shape_env = mode.shape_env
        nc = len(init)
        out, local = run_in_subgraph(
            shape_env, lambda: as_tuple(body(*init, *empty_slices(xs, [0] * len(xs)), *additional))
        )
        check_carry(L, body, list(init), list(out[:nc]))
        if any(isinstance(s, torch.SymInt) and s.node.expr.free_symbols & local for y in out[nc:] for s in y.shape):
            _check_same_size_every_step(L, body, init, xs, additional, len(out))
        n = xs[0].shape[0]
        ys = [rebind_sizes(y.new_empty((n, *y.shape)), shape_env, local) for y in out[nc:]]
        return pack([*(torch.empty_like(c, memory_format=torch.contiguous_format) for c in init), *ys])


def _check_same_size_every_step(
    L: Looping, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], n_out: int
) -> None:
    """Refuse ys whose size is computed from the carry or the slices: it may differ
    between steps. A size computed from the other inputs alone is the same in every step."""
    gm = body if isinstance(body, torch.fx.GraphModule) else None
    gm = gm or _subgraph.trace_subgraph(body, examples(init, xs, additional))
    found = per_step_sizes(gm, len(init) + len(xs), range(len(init), n_out))
    if found:
        k, d, sym = found[0]
        path = f"ys[{k - len(init)}]"
        raise HopValueError(
            format_message(
                L.name,
                f"the size {d} of this output is data dependent ({sym}) and computed from the "
                f"{'carry or the ' if init else ''}slice of xs, so it may differ between steps and the outputs "
                "cannot be stacked",
                role=L.role,
                path=path,
                fix="Pad to a fixed size (and return the length separately), or compute the size from tensors that "
                "are not scanned.",
            ),
            op=L.name,
            role=L.role,
            path=path,
        )


# Note [traced bodies see contiguous values]
# A body traced into a graph bakes in the layout of the values it was traced on:
# `reshape` becomes `view` on a contiguous carry. It is traced on contiguous carries
# and slices, and when the dense rule runs a traced body (an exported program) it
# hands it contiguous carries and slices too, whatever layout the previous
# iteration produced. A Python body needs neither (nothing is baked in).


def examples(init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any]) -> list[Any]:
    """Fresh values to trace a body on (the carry must not alias closed-over tensors, nor
    two carries each other), and the additional inputs. Real values are copies of the
    initial carry and the first slice (Note [bodies are traced on values they can see]
    in hop._subgraph); a real xs of length 0 has no slice: zeros stand in for one."""
    carries = [_subgraph.trace_example(c) for c in init]
    slices = [_example_slice(x, e) for x, e in zip(xs, empty_slices(xs, [0] * len(xs)), strict=True)]
    return [*carries, *slices, *additional]


def _example_slice(x: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    if not _transforms.is_plain_tensor(x):
        return empty  # fake, meta: no data to copy
    return _subgraph.trace_example(x.select(0, 0)) if x.shape[0] else torch.zeros_like(empty)


def proxy(
    L: Looping, mode: Any, body: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Any:
    """Trace the body on fresh example values (lifting what it closes over) and record one node."""
    (gm,), lifted = _subgraph.trace_branches([body], examples(init, xs, additional))
    check_body_effects(L.name, L.role, body, gm)
    all_additional = (*additional, *lifted)
    with recording() as fresh:
        out = L.call(gm, init, xs, all_additional, reverse)  # the proxy mode is popped: this reaches the fake rule
    result = _subgraph.emit(mode, L.op, L.node_args(gm, tuple(init), tuple(xs), all_additional, reverse), out)
    assert_ranges(mode, L.name, result, fresh, why=f"the range {L.role} gives it")
    return result


def check_body_effects(name: str, role: str, fn: Fn, gm: torch.fx.GraphModule) -> None:
    """Refuse a body or combine_fn that writes its inputs; clone outputs that alias them."""
    check_effects(
        name,
        role,
        fn,
        gm,
        what="its input",
        updates="the carry, xs or closed-over tensors",
        fix="Return the updated value instead of writing the input.",
    )


# --- derivatives: scans of the body's vjp and jvp ---------------------------------------------------------


def _scatter(n: int, at: Sequence[int], values: Sequence[Any]) -> list[Any]:
    return _transforms.place([None] * n, at, values)


class _ScanFunction(torch.autograd.Function):
    """A scan (or map) as one autograd node: backward is a reverse scan of the body's vjp,
    jvp a scan of the body's jvp (Note [scans run inline] covers real tensors)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(L: Looping, body: Fn, reverse: bool, counts: tuple[int, int, int], *operands: Any) -> Any:
        init, xs, additional = _split(operands, counts)
        return L.call(body, init, xs, additional, reverse)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.L, ctx.body, ctx.reverse, ctx.counts, *operands = inputs
        ctx.out_diff = [differentiable(o) for o in as_tuple(output)]
        save_operands(ctx, operands)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        init, xs, additional = _split(saved_operands(ctx), ctx.counts)
        named = (ctx.L.name, ctx.L.role)
        grads_in = scan_vjp(ctx.L.scan, ctx.body, init, xs, additional, ctx.reverse, grads, ctx.out_diff, named=named)
        return (None, None, None, None, *grads_in)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        init, xs, additional = _split(saved_operands(ctx), ctx.counts)
        return scan_jvp(ctx.L.call, ctx.body, init, xs, additional, ctx.reverse, tangents[4:], ctx.out_diff)


def _split(operands: Sequence[Any], counts: tuple[int, int, int]) -> tuple[list[Any], list[Any], list[Any]]:
    nc, nx, _ = counts
    return list(operands[:nc]), list(operands[nc : nc + nx]), list(operands[nc + nx :])


def scan_vjp(
    scan_op: HigherOrderOperator,
    body: Fn,
    init: list[Any],
    xs: list[Any],
    additional: list[Any],
    reverse: bool,
    grads: Sequence[Any],
    out_diff: Sequence[bool],
    *,
    named: tuple[str, str] = ("scan", "the body"),
) -> list[Any]:
    """Gradients of every operand: a scan in the other direction over the stacked input
    carries (recomputed by a forward scan), ``xs`` and the cotangents of ``ys``; its carry
    is the cotangent of the carry and the running sum of the gradients of the additional inputs.
    ``named``: the operator the user called and its callable, for errors (map, a loop's
    backward and associative_scan run this too)."""
    nc = len(init)
    dc, dx, da = differentiable_at(init), differentiable_at(xs), differentiable_at(additional)
    dy = [j for j in range(len(grads) - nc) if out_diff[nc + j]]
    carries: tuple[Any, ...] = ()
    if nc:
        carries = as_tuple(scan_op(_carries_body(body, nc), init, xs, additional, reverse))[nc:]
    step = _vjp_body(body, (nc, len(xs), len(additional)), dc, dx, da, dy, named)
    g_carry = [grads[i] for i in dc]
    g_ys = [grads[nc + j] for j in dy]
    zeros = [torch.zeros_like(additional[i]) for i in da]
    out = as_tuple(scan_op(step, (*g_carry, *zeros), (*carries, *xs, *g_ys), additional, not reverse))
    g_init, g_add, g_xs = out[: len(dc)], out[len(dc) : len(dc) + len(da)], out[len(dc) + len(da) :]
    return [*_scatter(nc, dc, g_init), *_scatter(len(xs), dx, g_xs), *_scatter(len(additional), da, g_add)]


def _carries_body(body: Fn, nc: int) -> Fn:
    """``body`` that also returns its input carry as a y, to stack every iteration's carry."""

    def carries(*args: Any) -> tuple[Any, ...]:
        return (*as_tuple(body(*args))[:nc], *args[:nc])

    return carries


def _vjp_body(
    body: Fn,
    counts: tuple[int, int, int],
    dc: list[int],
    dx: list[int],
    da: list[int],
    dy: list[int],
    named: tuple[str, str],
) -> Fn:
    """``(*g_carry, *g_add, *carry, *x, *g_y, *additional) -> (*g_carry_in, *g_add + step's, *g_x)``."""
    nc, nx, _ = counts

    def vjp_step(*args: Any) -> tuple[Any, ...]:
        g_carry, g_add = args[: len(dc)], args[len(dc) : len(dc) + len(da)]
        rest = args[len(dc) + len(da) :]
        carry, x = rest[:nc], rest[nc : nc + nx]
        g_y, additional = rest[nc + nx : nc + nx + len(dy)], rest[nc + nx + len(dy) :]

        def on_diff(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(carry, dc, d[: len(dc)])
            xx = _transforms.place(x, dx, d[len(dc) : len(dc) + len(dx)])
            out = as_tuple(body(*c, *xx, *_transforms.place(additional, da, d[len(dc) + len(dx) :])))
            return (*[out[i] for i in dc], *[out[nc + j] for j in dy])

        primals = [*[carry[i] for i in dc], *[x[i] for i in dx], *[additional[i] for i in da]]
        with _transforms.torch_ops_without_rules(*named):
            grads = torch.func.vjp(on_diff, *primals)[1]((*g_carry, *g_y))
        g_x, g_add_step = grads[len(dc) : len(dc) + len(dx)], grads[len(dc) + len(dx) :]
        return (*grads[: len(dc)], *[a + b for a, b in zip(g_add, g_add_step, strict=True)], *g_x)

    vjp_step.__qualname__ = f"vjp_{getattr(body, '__qualname__', 'body')}"
    return vjp_step


def scan_jvp(
    call: Callable[[Fn, Sequence[Any], Sequence[Any], Sequence[Any], bool], Any],
    body: Fn,
    init: list[Any],
    xs: list[Any],
    additional: list[Any],
    reverse: bool,
    tangents: Sequence[Any],
    out_diff: Sequence[bool],
) -> Any:
    """Output tangents: the op again on the body's jvp, carrying ``(carry, carry tangent)``."""
    nc, nx, na = len(init), len(xs), len(additional)
    dc, dx, da = differentiable_at(init), differentiable_at(xs), differentiable_at(additional)
    dy = [j for j in range(len(out_diff) - nc) if out_diff[nc + j]]
    values = [*init, *xs, *additional]

    def tangent(k: int) -> Any:
        return torch.zeros_like(values[k]) if tangents[k] is None else tangents[k]

    t_init, t_xs, t_add = ([tangent(off + i) for i in idx] for off, idx in ((0, dc), (nc, dx), (nc + nx, da)))
    step = _jvp_body(body, (nc, nx, na), dc, dx, da, dy)
    out = as_tuple(call(step, (*init, *t_init), (*xs, *t_xs), (*additional, *t_add), reverse))
    t_carry = _scatter(nc, dc, out[nc : nc + len(dc)])
    t_ys = _scatter(len(out_diff) - nc, dy, out[nc + len(dc) + len(out_diff) - nc :])
    return pack([*t_carry, *t_ys])


def _jvp_body(body: Fn, counts: tuple[int, int, int], dc: list[int], dx: list[int], da: list[int], dy: list[int]) -> Fn:
    """``(*carry, *t_carry, *x, *t_x, *additional, *t_add) -> (*next_carry, *t_next_carry, *y, *t_y)``."""
    nc, nx, na = counts

    def jvp_step(*args: Any) -> tuple[Any, ...]:
        carry, t_carry = args[:nc], args[nc : nc + len(dc)]
        rest = args[nc + len(dc) :]
        x, t_x = rest[:nx], rest[nx : nx + len(dx)]
        additional, t_add = rest[nx + len(dx) : nx + len(dx) + na], rest[nx + len(dx) + na :]

        def on_diff(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(carry, dc, d[: len(dc)])
            xx = _transforms.place(x, dx, d[len(dc) : len(dc) + len(dx)])
            return as_tuple(body(*c, *xx, *_transforms.place(additional, da, d[len(dc) + len(dx) :])))

        primals = (*[carry[i] for i in dc], *[x[i] for i in dx], *[additional[i] for i in da])
        out, t_out = _transforms.jvp(on_diff, primals, (*t_carry, *t_x, *t_add))
        return (*out[:nc], *[t_out[i] for i in dc], *out[nc:], *[t_out[nc + j] for j in dy])

    jvp_step.__qualname__ = f"jvp_{getattr(body, '__qualname__', 'body')}"
    return jvp_step
