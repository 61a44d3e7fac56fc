"""``hop.while_loop`` and its raw op ``torch.ops.hop.while_loop``.

The raw op is ``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)``
(torch's layout): both functions take ``(*carried, *additional)``; additional
inputs are what the functions close over, lifted when traced. Rules in hop's
fixed order: dense, autograd, grad / jvp, vmap, functionalize, fake, proxy.

Note [loops run inline]
As for cond (Note [eager branches run inline]), a loop whose carries are real
tensors while nothing traces runs as plain Python at the current level:
autograd, grad, jvp see every iteration's ops (exact derivatives of any order,
O(iterations) memory, gradients to closed-over tensors). A condition batched by
an enclosing vmap is read element-wise: the loop runs while any element is
active and finished elements are frozen with ``torch.where`` (the masked loop),
so each element equals its own Python loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from hop import _reference, _subgraph, _transforms
from hop import _validation as validation
from hop._operator import HigherOrderOperator
from hop._unbacked import assert_ranges, assume_range, carry_ranges, generalize_carries, recording
from hop.errors import HopRuntimeError, HopTypeError, HopValueError, MutationError, format_message
from hop.ops import _checkpoint
from hop.ops._branching import as_tuple, like, no_alias

__all__ = ["while_loop", "while_loop_op"]

Fn = Callable[..., Any]
_Tensor = torch.Tensor
_NAME = "while_loop"


def while_loop(
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: tuple[Any, ...] | list[Any],
    *,
    checkpoint: bool = False,
) -> Any:
    """Run ``body_fn`` while ``cond_fn`` holds; return the final carries.

    Equivalent Python::

        def reference_while_loop(cond_fn, body_fn, carried_inputs):
            carry = carried_inputs
            while cond_fn(*carry):
                carry = body_fn(*carry)
            return carry

    Args:
        cond_fn: ``(*carry) -> `` a Python bool or a one-element bool tensor.
        body_fn: ``(*carry) -> `` the next carry: the same pytree structure,
            with the same dtype, device and rank per tensor leaf (sizes may change
            between iterations: growing carries).
        carried_inputs: a tuple or list of pytrees of tensors, ints and SymInts.
        checkpoint: reverse mode with bounded memory: keep about sqrt(n) carries
            and recompute the iterations between them in the backward pass,
            instead of every iteration's intermediates (eager only).

    Eager calls run the Python loop (the functions are checked once per
    signature on fake tensors). Autograd, torch.func and vmap (also with a
    batched condition: the loop runs while any element is active, finished
    elements are frozen) work; make_fx and torch.export keep one
    ``torch.ops.hop.while_loop`` node, int carries becoming unbacked SymInts.
    """
    if _reference.ACTIVE and _reference.here():  # hop.testing.reference()
        return _reference.reference_while_loop(cond_fn, body_fn, carried_inputs)
    if _transforms.is_dynamo_compiling():
        return _transforms.outside_dynamo(
            lambda *a: while_loop(*a, checkpoint=checkpoint), cond_fn, body_fn, carried_inputs
        )
    _check_arguments(cond_fn, body_fn, carried_inputs)
    leaves, spec = _subgraph.flatten(tuple(carried_inputs))
    flat_cond, flat_body = _flat_functions(cond_fn, body_fn, spec)
    if _transforms.in_plain_eager() and all(map(_plain_leaf, leaves)):
        key = validation.signature(_NAME, (cond_fn, body_fn), tuple(carried_inputs), leaves, spec)
        if not validation.is_known(key):
            _validate(flat_cond, flat_body, leaves, (cond_fn, body_fn))
            validation.remember(key)
        if checkpoint:
            out = _checkpoint.run(flat_cond, flat_body, leaves, _subgraph.closure_tensors((cond_fn, body_fn)))
            return _subgraph.unflatten(list(out), spec)
        return _run_eager(cond_fn, body_fn, carried_inputs, leaves)
    if checkpoint:
        raise HopRuntimeError(
            format_message(_NAME, "checkpoint=True runs in eager only (real tensors, no transform or tracing)"),
            op=_NAME,
        )
    out = while_loop_op(flat_cond, flat_body, tuple(leaves), ())
    return _subgraph.unflatten(list(as_tuple(out)) if len(leaves) != 1 else [out], spec)


def _run_eager(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], leaves: list[Any]) -> Any:
    """Note [loops run inline], for a validated signature: the user's functions, as is.

    Nothing is checked per iteration (the signature was checked once); a body may
    return a bare value for a single carry.
    """
    carry = tuple(carried_inputs)
    while cond_fn(*carry):
        out = body_fn(*carry)
        carry = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    flat, spec = _subgraph.flatten(carry)
    out_tree = _subgraph.unflatten(_subgraph.clone_aliases(flat, leaves), spec)
    return out_tree if type(carried_inputs) is tuple else list(out_tree)


def _check_arguments(cond_fn: Any, body_fn: Any, carried_inputs: Any) -> None:
    for role, fn in (("cond_fn", cond_fn), ("body_fn", body_fn)):
        if not callable(fn):
            raise HopTypeError(
                format_message(_NAME, f"{role} must be callable, got {type(fn).__name__}"), op=_NAME, role=role
            )
    if not isinstance(carried_inputs, (tuple, list)):
        raise HopTypeError(
            format_message(
                _NAME,
                f"carried_inputs must be a tuple or list, got {type(carried_inputs).__name__}",
                fix="Pass carried_inputs=(x,) for a single carry.",
            ),
            op=_NAME,
            role="carried_inputs",
        )
    for path, leaf in zip(
        _subgraph.leaf_paths(tuple(carried_inputs), "carried_inputs"),
        _subgraph.flatten(tuple(carried_inputs))[0],
        strict=True,
    ):
        if not isinstance(leaf, (torch.Tensor, int, torch.SymInt)) or isinstance(leaf, bool):
            raise HopTypeError(
                format_message(_NAME, f"{path} must be a tensor or an int, got {type(leaf).__name__}"),
                op=_NAME,
                role="carried_inputs",
                path=path,
            )


def _plain_leaf(x: Any) -> bool:
    return _transforms.is_plain_tensor(x) or type(x) is int


def _flat_functions(cond_fn: Fn, body_fn: Fn, spec: Any) -> tuple[Fn, Fn]:
    """cond and body on flat carries; body checks its output against the carry."""

    def flat_cond(*leaves: Any) -> Any:
        return cond_fn(*_subgraph.unflatten(leaves, spec))

    def flat_body(*leaves: Any) -> tuple[Any, ...]:
        carry = _subgraph.unflatten(leaves, spec)
        out = body_fn(*carry)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        _subgraph.check_same_outputs(
            _NAME, ("carried_inputs", "body_fn"), (tuple(carry), tuple(out)), root="carry", fns=(None, body_fn)
        )
        return tuple(_subgraph.flatten(tuple(out))[0])

    flat_cond.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    flat_body.__wrapped__ = body_fn  # type: ignore[attr-defined]
    return flat_cond, flat_body


def _validate(flat_cond: Fn, flat_body: Fn, leaves: list[Any], fns: tuple[Fn, Fn]) -> None:
    """One iteration on fake tensors: cond returns one bool, body keeps the carry's kind."""
    with validation.fake_inputs(leaves) as fake:
        try:
            _truth(flat_cond(*fake), fns[0])
            flat_body(*fake)
        except validation.CANNOT_FAKE:
            return


# --- reading the condition --------------------------------------------------------------------


def _truth(pred: Any, fn: Any = None) -> Any:
    """A Python bool, or a tensor that is batched (the masked loop) or cannot be read."""
    if type(pred) is bool:
        return pred
    if isinstance(pred, torch.SymBool):
        return pred
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool or pred.numel() != 1:
        what = (
            f"a tensor of dtype {str(pred.dtype).removeprefix('torch.')} and shape {tuple(pred.shape)}"
            if isinstance(pred, torch.Tensor)
            else type(pred).__name__
        )
        where = f" ({_subgraph.describe_fn(fn)})" if fn is not None else ""
        raise HopTypeError(
            format_message(
                _NAME,
                f"cond_fn{where} must return a Python bool or a one-element bool tensor, got {what}",
                fix="Reduce it, e.g. return (err > tol).any().",
            ),
            op=_NAME,
            role="cond_fn",
        )
    return pred


def _run(cond_fn: Fn, body_fn: Fn, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...]:
    """Note [loops run inline]: the Python loop at the current level, masked where the
    condition is batched by an enclosing vmap."""
    carry = tuple(carry)
    if isinstance(body_fn, torch.fx.GraphModule):  # Note [traced bodies see contiguous values] (_looping)
        carry = _contiguous(carry)
        body = body_fn
        body_fn = lambda *a: _contiguous(as_tuple(body(*a)))  # noqa: E731
    while True:
        pred = _truth(cond_fn(*carry, *additional))
        if type(pred) is bool or not _is_batched(pred):
            if not pred:
                return carry
            carry = as_tuple(body_fn(*carry, *additional))
            continue
        if not _any(pred):
            return carry
        new = as_tuple(body_fn(*carry, *additional))
        carry = tuple(_freeze(pred, n, o) for n, o in zip(new, carry, strict=True))


def _contiguous(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(v.contiguous() if isinstance(v, torch.Tensor) else v for v in values)


def _is_batched(t: torch.Tensor) -> bool:
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return True
        t = torch._C._functorch.get_unwrapped(t)
    return False


def _any(pred: torch.Tensor) -> bool:
    """Whether any batch element of a vmap-batched condition holds."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    raw = pred
    while torch._C._functorch.is_functorch_wrapped_tensor(raw):
        raw = torch._C._functorch.get_unwrapped(raw)
    with temporarily_clear_interpreter_stack():
        return bool(raw.any())


def _freeze(pred: torch.Tensor, new: Any, old: Any) -> Any:
    if not isinstance(old, torch.Tensor):
        if new != old:
            raise HopValueError(
                format_message(
                    _NAME,
                    "with a condition batched by vmap, int carries cannot change (each element would need its own)",
                    fix="Carry the counter as a tensor, e.g. torch.tensor(0).",
                ),
                op=_NAME,
            )
        return old
    if new.shape != old.shape:
        raise HopValueError(
            format_message(
                _NAME,
                f"with a condition batched by vmap, carries cannot change size ({tuple(old.shape)} -> "
                f"{tuple(new.shape)}): finished elements are frozen element-wise",
            ),
            op=_NAME,
        )
    return torch.where(pred.reshape(()), new, old)


def _loop_is_concrete(carried: Sequence[Any], additional: Sequence[Any]) -> bool:
    """Real tensors under every functorch wrapper, nothing tracing: run inline."""
    return _transforms.no_modes() and all(_transforms.is_real(x) for x in (*carried, *additional))


def _inline_or_node(
    cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any], level: int | None = None
) -> Any:
    """Autograd, grad and jvp: Note [loops run inline] when concrete, else one autograd node."""
    if _loop_is_concrete(carried, additional):
        return while_loop_dense(cond_fn, body_fn, carried, additional)
    return _as_node(cond_fn, body_fn, carried, additional, level)


# --- the raw op and its rules -----------------------------------------------------------------

while_loop_op = HigherOrderOperator("while_loop")


@while_loop_op.py_impl(DispatchKey.CompositeExplicitAutograd)
def while_loop_dense(cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    out = _run(cond_fn, body_fn, carried_inputs, additional_inputs)
    return no_alias(like(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


@while_loop_op.py_autograd_impl
def while_loop_autograd(
    cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs)


@while_loop_op.py_impl(TransformType.Grad)
def while_loop_grad(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, interpreter.level())


@while_loop_op.py_impl(TransformType.Jvp)
def while_loop_jvp(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    return _inline_or_node(cond_fn, body_fn, carried_inputs, additional_inputs, interpreter.level())


@while_loop_op.py_impl(TransformType.Vmap)
def while_loop_vmap(
    interpreter: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    """Concrete: the masked loop inline. Traced: one loop a level down that runs while
    any element is active and freezes finished ones."""
    if _loop_is_concrete(carried_inputs, additional_inputs):
        return while_loop_dense(cond_fn, body_fn, carried_inputs, additional_inputs)
    level, size = interpreter.level(), interpreter.batch_size()
    carried, c_dims = _transforms.unwrap_batched(carried_inputs, level)
    extra, e_dims = _transforms.unwrap_batched(additional_inputs, level)
    if any(not isinstance(c, torch.Tensor) for c in carried):
        raise HopValueError(
            format_message(_NAME, "under vmap, traced loops carry tensors only", fix="Carry counters as tensors."),
            op=_NAME,
        )
    carried = [
        c.movedim(d, 0) if d is not None else c.expand(size, *c.shape) for c, d in zip(carried, c_dims, strict=True)
    ]
    in_dims = (0,) * len(carried) + tuple(e_dims)
    randomness = interpreter.randomness()
    vcond = torch.vmap(cond_fn, in_dims=in_dims, randomness=randomness)
    vbody = torch.vmap(body_fn, in_dims=in_dims, randomness=randomness)

    def any_active(*args: Any) -> Any:
        return vcond(*args).reshape(size).any()

    def masked_body(*args: Any) -> tuple[Any, ...]:
        active = vcond(*args).reshape(size)
        new = as_tuple(vbody(*args))
        return tuple(
            torch.where(active.reshape(size, *[1] * (o.dim() - 1)), n, o)
            for n, o in zip(new, args[: len(new)], strict=True)
        )

    with interpreter.lower():
        out = while_loop_op(any_active, masked_body, tuple(carried), tuple(extra))
    return like(out, _transforms.add_batch_dims(as_tuple(out), level))


@while_loop_op.py_functionalize_impl
def while_loop_functionalize(
    ctx: Any, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    carried, extra = ctx.unwrap_tensors(list(carried_inputs)), ctx.unwrap_tensors(list(additional_inputs))
    with ctx.redispatch_to_next():
        out = while_loop_op(ctx.functionalize(cond_fn), ctx.functionalize(body_fn), tuple(carried), tuple(extra))
    return ctx.wrap_tensors(out)


@while_loop_op.py_impl(FakeTensorMode)
def while_loop_fake(
    mode: FakeTensorMode, cond_fn: Fn, body_fn: Fn, carried_inputs: Sequence[Any], additional_inputs: Sequence[Any]
) -> Any:
    """The final carry: what stays fixed across iterations keeps its size; what changes
    (int carries, growing dimensions) becomes a fresh unbacked size."""
    with mode:
        out = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), mode.shape_env, fresh=True
        )
    return no_alias(like(tuple(carried_inputs), out) if len(out) != 1 else out[0], carried_inputs)


@while_loop_op.py_impl(ProxyTorchDispatchMode)
def while_loop_proxy(
    mode: ProxyTorchDispatchMode,
    cond_fn: Fn,
    body_fn: Fn,
    carried_inputs: Sequence[Any],
    additional_inputs: Sequence[Any],
) -> Any:
    """Trace cond and body on carries generalized to every iteration's sizes; one node."""
    fake_mode = torch._guards.detect_fake_mode([*carried_inputs, *additional_inputs])
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    if shape_env is not None and any(type(c) is int for c in carried_inputs):
        return _ints_as_tensors(mode, cond_fn, body_fn, carried_inputs, additional_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        templates = generalize_carries(
            _NAME, body_fn, tuple(carried_inputs), tuple(additional_inputs), shape_env, fresh=False
        )
        # fresh tensors: a body may also read the tensor the loop starts from (a closure)
        templates = tuple(
            torch.empty_like(t, memory_format=torch.contiguous_format) if isinstance(t, torch.Tensor) else t
            for t in templates
        )
    (cond_graph, body_graph), lifted = _subgraph.trace_branches([cond_fn, body_fn], (*templates, *additional_inputs))
    _check_cond_graph(cond_graph, cond_fn)
    _check_body_graph(body_graph, body_fn)
    extra = (*additional_inputs, *lifted)
    with recording() as fresh:
        out = while_loop_op(cond_graph, body_graph, tuple(carried_inputs), extra)
    result = _subgraph.emit(mode, while_loop_op, (cond_graph, body_graph, tuple(carried_inputs), extra), out)
    assert_ranges(mode, _NAME, as_tuple(result), fresh, root="carry", why=_DERIVED)
    return result


def _ints_as_tensors(
    mode: ProxyTorchDispatchMode, cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any]
) -> Any:
    """Python-int carries travel as 0-dim tensors through the node (an exported node
    cannot mix ints and tensors in one list); inside, ``.item()`` makes them SymInts."""
    n, slots = len(carried), [i for i, c in enumerate(carried) if type(c) is int]

    def as_ints(args: Sequence[Any]) -> list[Any]:
        return [a.item() if i in slots else a for i, a in enumerate(args)]

    def cond_t(*args: Any) -> Any:
        return cond_fn(*as_ints(args[:n]), *args[n:])

    def body_t(*args: Any) -> tuple[Any, ...]:
        out = as_tuple(body_fn(*as_ints(args[:n]), *args[n:]))
        return tuple(torch.scalar_tensor(o, dtype=torch.int64) if i in slots else o for i, o in enumerate(out))

    cond_t.__wrapped__ = cond_fn  # type: ignore[attr-defined]
    body_t.__wrapped__ = body_fn  # type: ignore[attr-defined]
    fake_mode = torch._guards.detect_fake_mode([*carried, *additional])
    assert fake_mode is not None and fake_mode.shape_env is not None  # the caller checked
    with fake_mode:
        ranges = carry_ranges(_NAME, body_fn, tuple(carried), tuple(additional), fake_mode.shape_env)
    with mode:
        carried_t = [torch.scalar_tensor(c, dtype=torch.int64) if i in slots else c for i, c in enumerate(carried)]
        out = as_tuple(while_loop_op(cond_t, body_t, tuple(carried_t), tuple(additional)))
        result = as_ints(out)
    fresh = [assume_range(r, *rng, size=False) for r, rng in zip(result, ranges, strict=True) if rng and _symbolic(r)]
    assert_ranges(mode, _NAME, tuple(result), fresh, root="carry", why=_DERIVED)
    return result[0] if n == 1 else tuple(result)


_DERIVED = "the range derived from the initial value and body_fn"


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt) and value.node.expr.is_Symbol


def _check_body_graph(gm: torch.fx.GraphModule, body_fn: Fn) -> None:
    effects = _subgraph.find_mutations_and_aliases(gm)
    if effects.mutated:
        raise MutationError(
            format_message(
                _NAME,
                f"body_fn ({_subgraph.describe_fn(body_fn)}) writes carry {effects.mutated[0]} in place; in-place "
                "updates of carries run in eager but cannot be traced (make_fx, torch.export)",
                fix="Return the new carry from body_fn instead of writing the old one.",
            ),
            op=_NAME,
            role="body_fn",
        )
    if effects.aliased:
        _subgraph.clone_aliased_outputs(gm, effects)


def _check_cond_graph(gm: torch.fx.GraphModule, cond_fn: Fn) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
    _truth(val, cond_fn)


# --- reverse mode when traced -------------------------------------------------------------------


class _LoopFunction(torch.autograd.Function):
    """A traced loop as one autograd node: forward mode is a loop over (carry,
    tangent); reverse mode is Note [reverse mode of a traced loop]."""

    generate_vmap_rule = True

    @staticmethod
    def forward(cond_fn: Fn, body_fn: Fn, n: int, *args: Any) -> Any:
        return while_loop_op(cond_fn, body_fn, tuple(args[:n]), tuple(args[n:]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.cond_fn, ctx.body_fn, ctx.n = inputs[0], inputs[1], inputs[2]
        ctx.args = inputs[3:]
        ctx.single = not isinstance(output, tuple)
        # saved through autograd, so that torch.func.grad hands them back at the right level
        ctx.save_for_backward(*[a for a in ctx.args if isinstance(a, torch.Tensor)])
        ctx.others = [a for a in ctx.args if not isinstance(a, torch.Tensor)]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        saved, others = iter(ctx.saved_tensors), iter(ctx.others)
        n, args = ctx.n, [next(saved) if isinstance(a, torch.Tensor) else next(others) for a in ctx.args]
        carried, extra = list(args[:n]), list(args[n:])
        d_carry = [i for i, x in enumerate(carried) if _differentiable(x)]
        d_extra = [i for i, x in enumerate(extra) if _differentiable(x)]
        g_carry = [torch.zeros_like(carried[i]) if grads[i] is None else grads[i] for i in d_carry]
        g_carry, g_extra = _reverse_sweep(ctx.cond_fn, ctx.body_fn, carried, extra, d_carry, d_extra, g_carry)
        full_c: list[Any] = _transforms.place([None] * n, d_carry, g_carry)
        full_e: list[Any] = _transforms.place([None] * len(extra), d_extra, g_extra)
        return (None, None, None, *full_c, *full_e)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        n, args = ctx.n, ctx.args
        carried, extra = args[:n], args[n:]
        diff = [i for i, x in enumerate(carried) if _differentiable(x)]
        t_carry = [torch.zeros_like(carried[i]) if tangents[3 + i] is None else tangents[3 + i] for i in diff]
        t_extra = [
            torch.zeros_like(x) if t is None else t
            for x, t in zip(extra, tangents[3 + n :], strict=True)
            if _differentiable(x)
        ]
        cond_fn, body_fn = ctx.cond_fn, ctx.body_fn
        k = len(diff)

        def jvp_cond(*a: Any) -> Any:
            return cond_fn(*a[:n], *a[n + k : n + k + len(extra)])

        def jvp_body(*a: Any) -> tuple[Any, ...]:
            primal, tan, ex, ex_t = a[:n], a[n : n + k], a[n + k : n + k + len(extra)], a[n + k + len(extra) :]
            d_extra = [i for i, x in enumerate(ex) if _differentiable(x)]

            def on_diff(*d: Any) -> tuple[Any, ...]:
                full, ext = list(primal), list(ex)
                for i, v in zip(diff, d[:k], strict=True):
                    full[i] = v
                for i, v in zip(d_extra, d[k:], strict=True):
                    ext[i] = v
                return as_tuple(body_fn(*full, *ext))

            out, t_out = _transforms.jvp(
                on_diff, (*[primal[i] for i in diff], *[ex[i] for i in d_extra]), (*tan, *ex_t)
            )
            return (*out, *[t_out[i] for i in diff])

        res = as_tuple(while_loop_op(jvp_cond, jvp_body, (*carried, *t_carry), (*extra, *t_extra)))
        t_full = [torch.zeros_like(x) if _differentiable(x) else None for x in res[:n]]
        for j, i in enumerate(diff):
            t_full[i] = res[n + j]
        return t_full[0] if ctx.single else tuple(t_full)


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


# Note [reverse mode of a traced loop]
# A traced loop's trip count is a run-time value, so its iterations cannot be
# stored in the graph. The backward is itself made of while_loops: one counts the
# trips n; then a sweep runs k = n .. 1, and step k recomputes carry k-1 from the
# initial carry (an inner loop of k-1 steps) and pulls the gradient through one
# body step with torch.func.vjp. Memory stays constant; time is O(n^2) body runs
# (eager reverse mode runs the loop inline and costs O(n): Note [loops run
# inline]). Carries must keep their shapes.


def _reverse_sweep(
    cond_fn: Fn,
    body_fn: Fn,
    carried: list[Any],
    extra: list[Any],
    d_carry: list[int],
    d_extra: list[int],
    g_carry: list[Any],
) -> tuple[list[Any], list[Any]]:
    """Gradients of the initial carry and the additional inputs (Note [reverse mode of a
    traced loop]). Tensors reach the inner functions as inputs, never by closure: under
    torch.func they live at a level the loops' bodies run below."""
    n, e, m = len(carried), len(extra), len(d_carry)
    zero = torch.zeros((), dtype=torch.int64, device=_device(carried))

    def count_cond(k: Any, *a: Any) -> Any:
        return cond_fn(*a)

    def count_body(k: Any, *a: Any) -> tuple[Any, ...]:
        return (k + 1, *as_tuple(body_fn(*a)))

    trips = as_tuple(while_loop_op(count_cond, count_body, (zero, *carried), tuple(extra)))[0]

    def sweep_cond(k: Any, *a: Any) -> Any:
        return k > 0

    def sweep(k: Any, *a: Any) -> tuple[Any, ...]:
        gs, init, ext = a[: m + len(d_extra)], a[-(n + e) : len(a) - e], a[len(a) - e :]

        def replay_cond(j: Any, *b: Any) -> Any:
            return j < b[-1]

        def replay_body(j: Any, *b: Any) -> tuple[Any, ...]:
            return (j + 1, *as_tuple(body_fn(*b[:n], *b[n : n + e])))

        replay = as_tuple(while_loop_op(replay_cond, replay_body, (torch.zeros_like(k), *init), (*ext, k - 1)))
        before = list(replay[1:])

        def one_step(*d: Any) -> tuple[Any, ...]:
            c = _transforms.place(before, d_carry, d[:m])
            out = as_tuple(body_fn(*c, *_transforms.place(list(ext), d_extra, d[m:])))
            return tuple(out[i] for i in d_carry)

        primals = (*[before[i] for i in d_carry], *[ext[i] for i in d_extra])
        pulled = torch.func.vjp(one_step, *primals)[1](tuple(gs[:m]))
        return (k - 1, *pulled[:m], *[a + b for a, b in zip(gs[m:], pulled[m:], strict=True)])

    init = (trips, *g_carry, *[torch.zeros_like(extra[i]) for i in d_extra])
    out = as_tuple(while_loop_op(sweep_cond, sweep, init, (*carried, *extra)))
    return list(out[1 : 1 + m]), list(out[1 + m :])


def _device(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def _as_node(
    cond_fn: Fn, body_fn: Fn, carried: Sequence[Any], additional: Sequence[Any], level: int | None = None
) -> Any:
    """One autograd node; what the functions close over and need grad for becomes
    additional inputs (Note [closure conversion] in hop._subgraph)."""
    (cond_fn, body_fn), captured = _subgraph.convert_closures([cond_fn, body_fn], [*carried, *additional], level)
    additional = (*additional, *captured)
    apply: Callable[..., Any] = _LoopFunction.apply
    return apply(cond_fn, body_fn, len(carried), *carried, *additional)
