"""The rules cond and switch share, each registered on both raw ops.

dense, autograd, grad / jvp, vmap, fake and proxy, in hop's fixed order
(functionalize is every operator's one rule, ``hop._effects.functionalize_rule``),
written once against a :class:`~hop.ops.branching._record.Branching`; a concrete selector
runs the chosen branch inline (Note [eager branches run inline] in ``branching._record``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hop import _closures, _effects, _lifting, _observe, _output_checks, _pytree, _tracing, _transforms
from hop._unbacked import Unifier, dense_order, unrecorded_symbols
from hop.errors import HopValueError, format_message
from hop.ops._common import (
    Vmapped,
    Writes,
    as_tuple,
    differentiable,
    lower_vmap,
    no_alias,
    record_node,
    refuse_legacy_onnx,
    reverse_tracked,
    same_form,
    save_operands,
    saved_operands,
    select,
    trace_callables,
)
from hop.ops.branching._record import Branching, Fn
from hop.ops.branching._untaken_grads import only_vmap_levels, zero_untaken

_SINKS = _observe.SINKS
_grad_enabled = torch.is_grad_enabled


def dense(branching: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Run the chosen branch; a meta selector runs all and needs them to agree."""
    if isinstance(sel, torch.Tensor) and sel.is_meta:
        if any(isinstance(x, torch.Tensor) and not x.is_meta for x in operands):
            raise _meta_selector(branching, operands)
        return _run_all_and_merge(branching, branches, operands, None)
    return inline(branching, sel, branches, operands)


def _meta_selector(branching: Branching, operands: Sequence[Any]) -> HopValueError:
    """A meta selector has no value: with real operands no branch can be chosen."""
    device = next(x.device for x in operands if isinstance(x, torch.Tensor) and not x.is_meta)
    role = branching.selector
    return HopValueError(
        format_message(
            branching.name,
            f"{role} is on the meta device (it has no value) but the operands are on {device}: no branch can be chosen",
            fix=f"Put {role} on the operands' device, or make every operand a meta tensor for metadata only.",
        ),
        op=branching.name,
        role=role,
    )


def _run_all_and_merge(branching: Branching, branches: Sequence[Fn], operands: Sequence[Any], shape_env: Any) -> Any:
    """Run every branch; one output whose differing sizes are unified (see hop._unbacked)."""
    ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else nullcontext()
    with ignore:  # symbols made inside the branches are bound in their subgraphs
        raw = [fn(*operands) for fn in branches]
    outs = [as_tuple(r) for r in raw]
    roles = branching.roles(len(branches))
    _output_checks.check_same_outputs(branching.name, roles, outs, fns=branches)
    merged = Unifier(branching.name, roles, shape_env).outputs(outs)
    return same_form(raw[0], _effects.clone_aliases(list(merged), operands))


def inline(branching: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Note [eager branches run inline]: run the chosen branch at the current level."""
    if isinstance(sel, torch.Tensor):  # Note [the legacy ONNX exporter]
        refuse_legacy_onnx(branching.name, f"which branch runs depends on {branching.selector}, a tensor")
    k = branching.index(sel, len(branches))
    if _SINKS:
        _observe.note(branching.name, branch=k)
    return no_alias(branches[k](*operands), operands)


def autograd(branching: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Concrete selector: inline (Note [untaken branches get zero gradients] outside
    torch.func transforms, which give unused inputs zeros themselves). Otherwise one
    node whose backward / jvp are the op again."""
    if _transforms.is_concrete(sel):
        out = inline(branching, sel, branches, operands)
        if _grad_enabled() and _transforms.functorch_level() is None:
            out = zero_untaken(out, branches, _pytree.flatten(tuple(operands))[0])
        return out
    return _as_node(branching, sel, branches, operands)


def _vjp_branch(fn: Fn, diff: Sequence[int], present: Sequence[int], n: int, name: str) -> Fn:
    """``(*operands, *cotangents of the outputs at positions present) -> grads of the
    operands at positions diff``."""
    slot = {j: k for k, j in enumerate(present)}

    def vjp_branch(*args: Any) -> Any:
        primals, given = list(args[:n]), args[n:]
        kept: list[int] = []  # the differentiable outputs with a cotangent: vjp refuses integer ones

        def on_diff(*d: Any) -> Any:
            out = as_tuple(fn(*_transforms.place(primals, diff, d)))
            kept[:] = [i for i, o in enumerate(out) if differentiable(o) and i in slot]
            return tuple(out[i] for i in kept) or (torch.zeros(()),)

        with _transforms.torch_ops_without_rules(name, "a branch"):
            out, vjp_fn = torch.func.vjp(on_diff, *[primals[i] for i in diff])[:2]
            cts = tuple(given[slot[i]] for i in kept) or (None,)
            grads = vjp_fn(tuple(ct if ct is not None else torch.zeros_like(o) for o, ct in zip(out, cts, strict=True)))
        return grads[0] if len(grads) == 1 else tuple(grads)

    vjp_branch.__qualname__ = f"vjp_{getattr(fn, '__qualname__', 'branch')}"
    return vjp_branch


def _jvp_branch(fn: Fn, diff: Sequence[int], n: int) -> Fn:
    """``(*operands, *tangents of the operands at positions diff) -> (*outputs, *tangents
    of the tensor outputs)``: an int output has no tangent."""

    def jvp_branch(*args: Any) -> Any:
        primals, tangents = list(args[:n]), args[n:]

        def on_diff(*d: Any) -> Any:
            return as_tuple(fn(*_transforms.place(primals, diff, d)))

        out, tout = _transforms.jvp(on_diff, [primals[i] for i in diff], tangents)
        return (*out, *[t for o, t in zip(out, tout, strict=True) if isinstance(o, torch.Tensor)])

    jvp_branch.__qualname__ = f"jvp_{getattr(fn, '__qualname__', 'branch')}"
    return jvp_branch


class _Branches:
    """The branches as one argument of :class:`_BranchFunction` that pytrees do not
    flatten: torch's generated vmap rule for a jvp flattens the inputs and pairs their
    leaves with the tangents, which a tuple of callables put out of step."""

    __slots__ = ("fns",)

    def __init__(self, fns: tuple[Fn, ...]) -> None:
        self.fns = fns


class _BranchFunction(torch.autograd.Function):
    """cond/switch as one autograd node: backward and jvp are cond/switch of the branches' vjp/jvp."""

    generate_vmap_rule = True

    @staticmethod
    def forward(branching: Branching, sel: Any, branches: _Branches, *operands: Any) -> Any:
        return branching.call(sel, branches.fns, operands)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        branching, sel, branches, *operands = inputs
        ctx.branching, ctx.branches, ctx.n = branching, branches.fns, len(operands)
        ctx.single = not isinstance(output, tuple)
        ctx.tensor_out = [isinstance(o, torch.Tensor) for o in as_tuple(output)]
        # None, not zeros, for an output without a cotangent and an operand without a
        # tangent: the derivatives leave them out rather than compute with zeros
        ctx.set_materialize_grads(False)
        save_operands(ctx, (sel, *operands))

    @staticmethod
    def _inputs(ctx: Any) -> tuple[Any, list[Any]]:
        sel, *operands = saved_operands(ctx)
        return sel, operands

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        sel, operands = _BranchFunction._inputs(ctx)
        # only the operands autograd asks for: a traced backward computes what its
        # branches return, used or not (data that needs no gradient, say)
        diff = [i for i, x in enumerate(operands) if differentiable(x) and ctx.needs_input_grad[3 + i]]
        if not diff:
            return (None,) * (3 + ctx.n)
        present = [j for j, g in enumerate(grads) if g is not None]
        bw = [_vjp_branch(fn, diff, present, ctx.n, ctx.branching.name) for fn in ctx.branches]
        out = as_tuple(ctx.branching.call(sel, bw, (*operands, *[grads[j] for j in present])))
        by_position = dict(zip(diff, out, strict=True))
        return (None, None, None, *[by_position.get(i) for i in range(ctx.n)])

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        sel, operands = _BranchFunction._inputs(ctx)
        # only the operands that carry a tangent: a zero tangent is work a traced jvp
        # would do and add nothing with (the data, with respect to the weights)
        at = [i for i, x in enumerate(operands) if differentiable(x)]
        diff = [i for i in at if tangents[3 + i] is not None] or at[:1]
        diff_t = [torch.zeros_like(operands[i]) if tangents[3 + i] is None else tangents[3 + i] for i in diff]
        fw = [_jvp_branch(fn, diff, ctx.n) for fn in ctx.branches]
        with unrecorded_symbols(diff_t):  # an int output, unified again, has no tangent
            out = as_tuple(ctx.branching.call(sel, fw, (*operands, *diff_t)))
        given = iter(out[len(ctx.tensor_out) :])
        touts = [next(given) if is_tensor else None for is_tensor in ctx.tensor_out]
        return touts[0] if ctx.single else tuple(touts)


def _as_node(
    branching: Branching,
    sel: Any,
    branches: Sequence[Fn],
    operands: Sequence[Any],
    level: int | None = None,
    *,
    batched_at: int | None = None,
) -> Any:
    """One autograd node; tensors the branches read from their closures and that need
    grad (or are batched at the vmap level ``batched_at``) become inputs too (Note
    [closure conversion] in hop._closures)."""
    branches, captured = _closures.convert_closures(branches, operands, level, batched_at=batched_at)
    operands = (*operands, *captured)
    return _BranchFunction.apply(branching, sel, _Branches(tuple(branches)), *operands)  # type: ignore[no-untyped-call]


def grad_or_jvp(
    branching: Branching, interpreter: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]
) -> Any:
    """torch.func.grad / jvp: inline for a concrete selector, else the autograd node."""
    if _transforms.is_concrete(sel):
        return inline(branching, sel, branches, operands)
    return _as_node(branching, sel, branches, operands, interpreter.level())


def vmap(branching: Branching, interpreter: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Batched selector: every branch runs on the batch, outputs selected by torch.where.
    Unbatched: inline when concrete, else the op one level down on vmapped branches."""
    level = interpreter.level()
    (sel_u,), (sel_dim,) = _transforms.unwrap_batched([sel], level)
    if sel_dim is not None:
        # Note [finished elements are not differentiated] (hop.ops.while_loops._run): the
        # node selects each element's gradient from its own branch
        if reverse_tracked([*operands, *_closures.closure_tensors(branches)]):
            return _as_node(branching, sel, branches, operands, batched_at=level)
        # Note [size reads in a vmapped graph] (hop._tracing): they run on batched tensors
        return _select_batched(branching, sel, [_tracing.per_element_sizes(b) for b in branches], operands)
    if _transforms.is_concrete(sel):
        out = inline(branching, sel, [_tracing.per_element_sizes(b) for b in branches], operands)
        if _grad_enabled() and only_vmap_levels():  # Note [untaken branches get zero gradients]
            out = zero_untaken(out, branches, _pytree.flatten(tuple(operands))[0])
        return out

    def batched(values: list[list[Any]], dims: list[list[int | None]], size: int, vmapped: Vmapped) -> Any:
        (unwrapped,), (in_dims,) = values, dims
        fns = [vmapped(fn, tuple(in_dims)) for fn in branches]
        return lambda: branching.call(sel_u, fns, unwrapped), lambda k: 0

    return lower_vmap(interpreter, [operands], lambda ops: branching.call(sel_u, branches, ops), batched)


def _select_batched(branching: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Every branch on the whole batch, each on its own copy of the operands; outputs
    and in-place updates of operands are selected per element by the masks."""
    n = len(branches)
    masks = [m.reshape(()) for m in branching.masks(sel, n)]
    copies = [[x.clone() if isinstance(x, torch.Tensor) else x for x in operands] for _ in branches]
    versions = [[_version(x) for x in c] for c in copies]
    with _internal_symbols(operands):
        raw = [fn(*c) for fn, c in zip(branches, copies, strict=True)]
    for i, x in enumerate(operands):
        written = [k for k in range(n) if _version(copies[k][i]) != versions[k][i]]
        if written:
            x.copy_(_where_chain(masks, [copies[k][i] if k in written else x for k in range(n)]))
    outs = [as_tuple(r) for r in raw]
    roles = branching.roles(n)
    selected = []
    for i, col in enumerate(zip(*outs, strict=True)):
        if not isinstance(col[0], torch.Tensor):
            if any(v != col[0] for v in col):
                raise _batched_mismatch(branching, roles, i, col)
            selected.append(col[0])
        elif any(c.shape != col[0].shape for c in col):
            raise _batched_mismatch(branching, roles, i, col)
        else:
            selected.append(_where_chain(masks, col))
    return same_form(raw[0], selected)


def _internal_symbols(operands: Sequence[Any]) -> Any:
    """Where a trace has a ShapeEnv (torch.compile's fake run of the call), the unbacked
    symbols the branches make and do not return (a nested loop's counter read with
    .item()) are the call's own: not symbols its output must bind."""
    if not torch._C._len_torch_dispatch_stack():  # eager vmap: nothing traces
        return nullcontext()
    fake_mode = torch._guards.detect_fake_mode(list(_pytree.flatten(tuple(operands))[0]))
    if fake_mode is None or fake_mode.shape_env is None:
        return nullcontext()
    return fake_mode.shape_env.ignore_fresh_unbacked_symbols()


def _version(x: Any) -> int:
    """The version counter of the tensor under every functorch wrapper (wrappers keep 0)."""
    if not isinstance(x, torch.Tensor):
        return 0
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return int(x._version)


def _where_chain(masks: Sequence[Any], values: Sequence[Any]) -> Any:
    """``values[k]`` where ``masks[k]`` holds (the masks partition the batch)."""
    acc = values[-1]
    for k in range(len(values) - 2, -1, -1):
        acc = select(masks[k], values[k], acc)
    return acc


def _batched_mismatch(branching: Branching, roles: Sequence[str], i: int, col: Sequence[Any]) -> HopValueError:
    shapes = " vs ".join(str(tuple(c.shape)) if isinstance(c, torch.Tensor) else repr(c) for c in col)
    return HopValueError(
        format_message(
            branching.name,
            f"under vmap with a batched selector every branch runs on the batch and the outputs are selected "
            f"element-wise, so {', '.join(roles)} must return equal sizes at output[{i}]: {shapes}",
            fix="Make the branches return the same sizes, or keep the selector unbatched.",
        ),
        op=branching.name,
        path=f"output[{i}]",
    )


def fake(branching: Branching, mode: FakeTensorMode, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Output metadata: run every branch on fake tensors and unify what differs."""
    with mode:
        if type(sel) in (bool, int):
            return dense(branching, sel, branches, operands)
        return _run_all_and_merge(branching, branches, operands, mode.shape_env)


_WRITES = Writes("operand", "operands", "Return the updated value from the branch instead of writing the operand.")


def proxy(branching: Branching, mode: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Trace every branch on the operands and record one node (hop.ops._common's skeleton)."""
    roles = branching.roles(len(branches))
    graphs, lifted = trace_callables(branching.name, roles, branches, operands, _WRITES)
    graphs, all_operands = _lifting.distinct_inputs(graphs, (*operands, *lifted))

    def run() -> Any:
        out = branching.call(sel, graphs, all_operands)
        for gm in graphs:
            _match_layout(gm, as_tuple(out))
        return out

    return record_node(mode, branching.name, branching.op, branching.node_args(sel, graphs, all_operands), run)


def _match_layout(gm: torch.fx.GraphModule, merged: Sequence[Any]) -> None:
    """Make a branch graph return contiguous tensors where the unified output claims
    contiguity but the branch is laid out otherwise (hop._unbacked.Unifier): code
    traced after the op relies on the claimed strides (a reshape becomes a view)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(as_tuple(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],))
    changed = False
    for i, (node, claim) in enumerate(zip(flat, merged, strict=True)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(claim, torch.Tensor):
            continue
        order = dense_order(claim)
        if order != tuple(range(claim.dim())) or dense_order(val) == order:
            continue
        with gm.graph.inserting_before(out_node):
            flat[i] = gm.graph.call_function(
                torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
            )
        flat[i].meta["val"] = val.clone(memory_format=torch.contiguous_format)
        changed = True
    if changed:
        single = not isinstance(out_node.args[0], (tuple, list))
        out_node.args = (flat[0] if single else tuple(flat),)
        gm.recompile()
