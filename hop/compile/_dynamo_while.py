"""Dynamo's handler of ``hop.while_loop`` / ``hop.fori_loop`` and the raw while_loop (:mod:`hop.compile.dynamo`).

One node ``while_loop(cond_graph, body_graph, carried, additional)``, ``carried``
the carries' leaves (a Python int carry stays an int), ``additional`` followed by
what the functions lift. fori_loop is the while_loop over ``(i, val)`` it is
built on, with fori_loop's checks and messages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._dynamo.variables import TupleVariable
from torch._dynamo.variables.builder import SourcelessBuilder
from torch._dynamo.variables.lists import BaseListVariable

from hop import _output_checks, _state
from hop._unbacked import trial_run
from hop._unbacked_loops import changed_dims, generic_carry
from hop.compile import _inductor_rewrites as rw
from hop.compile._dynamo_capture import (
    HopVariable,
    Subgraph,
    bare_single_output,
    check_spec_order,
    compiles_with_inductor,
    emit,
    install,
    output_items,
    share_lifted,
    speculate,
)
from hop.compile._dynamo_errors import as_graph_break, unsupported
from hop.compile._dynamo_values import (
    BATCHED_EXAMPLE,
    VT,
    Spec,
    callable_stand_in,
    constant,
    example,
    example_tree,
    flatten,
    fresh,
    fresh_input,
    items,
    method,
    proxies,
    python_spec,
    shown,
    unbound_dims,
    unflatten,
)
from hop.errors import HopTypeError, format_message, type_name
from hop.ops.while_loops import _checkpoint, _checks, _int_carries
from hop.ops.while_loops import fori_loop as fori_module
from hop.ops.while_loops import while_loop as while_module

__all__ = ["HANDLERS"]

Check = Callable[[Any, Any], None]

# Note [while_loop carries in Dynamo]
# Dynamo bakes into a graph every Python value it computes from an example: an int
# carry ``i`` traced as 0 makes ``i + 1`` the constant 1, a carry of static size 3
# makes ``x.shape[0]`` the constant 3. The body and condition are therefore traced
# on generalized carries: every int carry, and every tensor dimension the body
# changes (found by tracing the body until no new dimension changes, as hop's fake
# rule does), becomes an unbacked SymInt. hop's own rules later generalize the
# traced graphs again, on the carries' real ranges.


def _generic_carries(tx: Any, leaves: Sequence[Any], varying: list[set[int]]) -> list[VT]:
    shape_env = tx.output.shape_env
    with tx.fake_mode, shape_env.ignore_fresh_unbacked_symbols():
        generic = [generic_carry(shape_env, c, v) for c, v in zip(leaves, varying, strict=True)]
    return fresh(tx, generic)


def _refuse_checkpoint(checkpoint: VT) -> None:
    """Compiled reverse mode has no checkpointed schedule: refuse rather than keep every step."""
    _checkpoint.check_flag(example(checkpoint))
    if example(checkpoint):
        raise unsupported(
            "while_loop",
            "checkpoint=True (reverse mode with bounded memory)",
            fix="Leave checkpoint out under torch.compile, or call this loop outside the compiled function.",
        )


class WhileLoopVariable(HopVariable):
    _HOP_NAME = "hop.while_loop"
    _RAW_KEYWORDS = frozenset({"checkpoint"})

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        if public == "fori_loop":
            return self.fori_loop(tx, params["lower"], params["upper"], params["body_fn"], params["init_val"])
        cond_fn, body_fn, carried = params["cond_fn"], params["body_fn"], params["carried_inputs"]
        checkpoint = params["checkpoint"]
        fns = (callable_stand_in(tx, cond_fn), callable_stand_in(tx, body_fn))
        listed = isinstance(carried, BaseListVariable)
        _checks.check_arguments(*fns, example_tree(tx, carried) if listed else shown(carried))
        _refuse_checkpoint(checkpoint)

        def check(carry: Any, out: Any) -> None:
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            _output_checks.check_same_outputs(
                "while_loop", ("carried_inputs", "body_fn"), (tuple(carry), out), root="carry", fns=(None, fns[1])
            )

        _, spec = flatten(tx, carried)
        out = self.loop(tx, cond_fn, body_fn, items(tx, carried), [], fns, check)
        return unflatten(tx, out, spec)

    def raw_call(self, tx: Any, args: list[VT], checkpoint: VT | None = None) -> VT:
        if checkpoint is not None:  # a traced graph's node (ep.module()), Note [the checkpoint keyword]
            _refuse_checkpoint(checkpoint)
        cond_fn, body_fn, carried, additional = args
        fns = (callable_stand_in(tx, cond_fn), callable_stand_in(tx, body_fn))
        out = self.loop(tx, cond_fn, body_fn, items(tx, carried), items(tx, additional), fns, _no_check)
        return out[0] if len(out) == 1 else TupleVariable(out)

    def fori_loop(self, tx: Any, lower: VT, upper: VT, body_fn: VT, init_val: VT) -> VT:
        """``hop.fori_loop``: the while_loop over ``(i, val)`` it is built on."""
        fn = callable_stand_in(tx, body_fn)
        if not callable(fn):
            raise HopTypeError(
                format_message("fori_loop", f"body_fn must be callable, got {type_name(fn)}"),
                op="fori_loop",
                role="body_fn",
            )
        fori_module.check_bound("lower", example(lower))
        fori_module.check_bound("upper", example(upper))
        leaves, _ = flatten(tx, init_val)
        fori_module._check_init_val(example_tree(tx, init_val), [example(leaf) for leaf in leaves])
        if upper.is_tensor() and not lower.is_tensor():  # the counter is a tensor when a bound is
            lower = method(tx, method(tx, upper, "new_zeros", ()), "__add__", lower)

        def check(carry: Any, out: Any) -> None:
            _output_checks.check_same_outputs(
                "fori_loop", ("init_val", "body_fn"), (carry[1], out[1]), root="val", fns=(None, fn)
            )

        build = SourcelessBuilder.create(tx, functools.partial)
        cond_fn = build.call_function(tx, [SourcelessBuilder.create(tx, _fori_cond), upper], {})
        counted = build.call_function(tx, [SourcelessBuilder.create(tx, _fori_body), body_fn], {})
        out = self.loop(tx, cond_fn, counted, [lower, init_val], [], (None, fn), check)
        carry_tree = SourcelessBuilder.create(tx, (lower, init_val))
        return items(tx, unflatten(tx, out, flatten(tx, carry_tree)[1]))[1]

    def loop(
        self,
        tx: Any,
        cond_fn: VT,
        body_fn: VT,
        carried: list[VT],
        additional: list[VT],
        fns: tuple[Any, Any],
        check: Check,
    ) -> list[VT]:
        """One while_loop node; its final carry's leaves."""
        leaves, spec = flatten(tx, TupleVariable(list(carried)))
        values = [example(leaf) for leaf in leaves]
        if tx.export:
            name = "while_loop" if fns[0] is not None else "fori_loop"
            _int_carries.refuse_batched(values, [example(a) for a in additional], name)
        py_spec = python_spec(spec)
        varying = [set() if isinstance(v, torch.Tensor) else {0} for v in values]
        on_tensors = False  # Note [int carries in a traced condition] (hop.ops.while_loops._int_carries)
        for _ in range(8):  # Note [while_loop carries in Dynamo]
            generic = _generic_carries(tx, values, varying)
            body, on_tensors = self.trace_body(tx, body_fn, generic, spec, additional, on_tensors)
            outs = [example(o) for o in body.outputs]
            check(pytree.tree_unflatten(values, py_spec), pytree.tree_unflatten(outs, body.out_spec()))
            grew = [changed_dims(example(g), o) - v for g, o, v in zip(generic, outs, varying, strict=True)]
            if not any(grew):
                break
            varying = [v | g for v, g in zip(varying, grew, strict=True)]
        check_spec_order("while_loop", [py_spec, body.out_spec()], "carried_inputs and body_fn's output")
        _check_inductor_carries(tx, "while_loop" if fns[0] is not None else "fori_loop", values, varying)
        generic = _generic_carries(tx, values, varying)  # fresh values: no fake-tensor memo shared with body_fn
        cond = self.trace_cond(tx, cond_fn, generic, spec, additional)
        _checks.truth(pytree.tree_unflatten([example(o) for o in cond.outputs], cond.out_spec()), fns[0])
        bare_single_output(cond.graph, tensors_only=False)
        lifted = share_lifted([cond, body])
        if tx.export:  # a batched tensor the callables close over batches the loop too
            closed = [p.node.meta.get(BATCHED_EXAMPLE, p.node.meta.get("example_value")) for p in lifted]
            _int_carries.refuse_batched(values, closed, "while_loop" if fns[0] is not None else "fori_loop")
        graphs = (install(tx, "hop_while_loop_cond", cond.graph), install(tx, "hop_while_loop_body", body.graph))
        inits = tuple(leaf.as_proxy() for leaf in leaves)
        args = while_module.SPEC.node_args(subgraphs=graphs, carries=inits, inputs=(*proxies(additional), *lifted))
        out = emit(tx, self.value, args)
        return output_items(out)

    def trace_cond(self, tx: Any, cond_fn: VT, generic: list[VT], spec: Spec, additional: list[VT]) -> Subgraph:
        """cond_fn traced on SymInt int carries or, where it cannot be, on 0-dim int64
        tensors (Note [int carries in a traced condition], hop.ops.while_loops._int_carries)."""
        slots = tuple(k for k, g in enumerate(generic) if isinstance(example(g), torch.SymInt))
        try:
            with trial_run() if slots else nullcontext():
                return self.trace(tx, "cond_fn", cond_fn, generic, spec, additional)
        except Exception as e:
            if not slots or not _data_dependent(e):
                raise
        partial = SourcelessBuilder.create(tx, functools.partial)
        tensors = partial.call_function(tx, [SourcelessBuilder.create(tx, _tensor_ints), constant(slots), cond_fn], {})
        return self.trace(tx, "cond_fn", tensors, generic, spec, additional)

    def trace_body(
        self, tx: Any, body_fn: VT, generic: list[VT], spec: Spec, additional: list[VT], on_tensors: bool
    ) -> tuple[Subgraph, bool]:
        """body_fn traced on SymInt int carries or, where it cannot be (or could not be in
        an earlier pass, ``on_tensors``), given them as 0-dim int64 tensors, its int outputs
        read back with ``.item()`` (Note [int carries in a traced condition], hop.ops.while_loops._int_carries).
        Returns the subgraph and whether it took tensors."""
        slots = tuple(k for k, g in enumerate(generic) if isinstance(example(g), torch.SymInt))
        if not on_tensors:
            try:
                return self.trace(tx, "body_fn", body_fn, generic, spec, additional), False
            except Exception as e:
                if not slots or not _data_dependent(e):
                    raise
        partial = SourcelessBuilder.create(tx, functools.partial)
        on_tensors_fn = SourcelessBuilder.create(tx, _int_carries.body_on_tensors)
        wrapped = partial.call_function(tx, [on_tensors_fn, constant(slots), body_fn], {})
        return self.trace_items(tx, wrapped, generic, spec, additional), True

    def trace_items(self, tx: Any, fn: VT, generic: list[VT], spec: Spec, additional: list[VT]) -> Subgraph:
        """``fn`` traced where ``.item()`` is captured as a SymInt (not a graph break)."""
        fake_mode = tx.output.fake_mode
        allowed = fake_mode.allow_scalar_outputs
        fake_mode.allow_scalar_outputs = True
        try:
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                return self.trace(tx, "body_fn", fn, generic, spec, additional)
        finally:
            fake_mode.allow_scalar_outputs = allowed

    def trace(self, tx: Any, role: str, fn: VT, generic: list[VT], spec: Spec, additional: list[VT]) -> Subgraph:
        """``fn`` traced on generalized carries: their unbacked sizes are read from the
        carries inside the subgraph (Note [while_loop carries in Dynamo])."""
        reads = [(k, d) for k, g in enumerate(generic) for d in unbound_dims(example(g))]
        sizes = [fresh_input(tx, example(generic[k]).shape[d]) for k, d in reads]
        traced = _with_leading_sizes(tx, fn, len(sizes)) if sizes else fn
        sub = speculate(tx, self.value, role, traced, [*sizes, *items(tx, unflatten(tx, generic, spec)), *additional])
        if reads:
            _bind_sizes(sub.graph, reads)
        return sub


def _data_dependent(error: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, GuardOnDataDependentSymNode) or "data-dependent expression" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _tensor_ints(slots: tuple[int, ...], fn: Any, *args: Any) -> Any:
    return fn(*(torch.scalar_tensor(a, dtype=torch.int64) if k in slots else a for k, a in enumerate(args)))


def _check_inductor_carries(tx: Any, op: str, values: Sequence[Any], varying: Sequence[set[int]]) -> None:
    """Under Inductor, a loop whose tensor carries change size breaks the graph (and runs
    eagerly) instead of failing later in the backend (``rw.growing_carries``)."""
    # fori_loop's carries are (counter, *leaves of init_val): name the user's leaves.
    first, what = (1, "init_val leaf") if op == "fori_loop" else (0, "carry")
    resized = [
        f"{what} {k - first}, dim {d}"
        for k, v in enumerate(values)
        if isinstance(v, torch.Tensor)
        for d in sorted(varying[k])
    ]
    if resized and compiles_with_inductor(tx):
        raise as_graph_break(rw.growing_carries(op, resized))


def _no_check(carry: Any, out: Any) -> None:
    pass


def _fori_cond(upper: Any, i: Any, val: Any) -> Any:
    return i < upper


def _fori_body(body_fn: Callable[..., Any], i: Any, val: Any) -> Any:
    return i + 1, body_fn(i, val)


_state.COUNTED_FRAMES[_fori_body.__name__] = "fori_loop"  # its capture's writes read as fori_loop's


def _with_leading_sizes(tx: Any, fn: VT, n: int) -> VT:
    """``fn`` preceded by ``n`` ignored arguments: the sizes a subgraph binds first
    (:func:`hop.compile._dynamo_values.unbound_dims`), turned into ``sym_size`` reads by :func:`_bind_sizes`."""
    partial = SourcelessBuilder.create(tx, functools.partial)
    return partial.call_function(tx, [SourcelessBuilder.create(tx, _drop_leading), constant(n), fn], {})


def _drop_leading(n: int, fn: Any, *args: Any) -> Any:
    return fn(*args[n:])


def _bind_sizes(graph: torch.fx.Graph, reads: Sequence[tuple[int, int]]) -> None:
    """Replace the first ``len(reads)`` placeholders (sizes) by ``sym_size(input, dim)``
    reads of the inputs that follow them, so the subgraph takes only those inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sizes, inputs = placeholders[: len(reads)], placeholders[len(reads) :]
    with graph.inserting_after(placeholders[-1]):
        for size, (k, d) in zip(sizes, reads, strict=True):
            read = graph.call_function(torch.ops.aten.sym_size.int, (inputs[k], d))
            read.meta["example_value"] = size.meta["example_value"]
            size.replace_all_uses_with(read)
            graph.erase_node(size)


HANDLERS: dict[Any, type[HopVariable]] = {while_module.while_loop_op: WhileLoopVariable}
