"""Dynamo's handlers of ``hop.scan``, ``hop.map``, ``hop.associative_scan`` and their raw ops.

- ``scan`` -> ``scan(body_graph, init, xs, additional, reverse)``;
- ``map`` -> ``map(body_graph, xs, additional)``;
- ``associative_scan`` -> ``associative_scan(combine_graph, xs, additional, combine_mode)``;

``xs`` the leaves moved so that the scanned dimension is dim 0 (and flipped for a
reverse associative_scan), ``additional`` followed by what the function lifts.
The function is traced on fresh values: the carry, one slice of each leaf of
``xs`` (see :mod:`hop.compile.dynamo`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.utils._pytree as pytree
from torch._dynamo.variables import TupleVariable
from torch._dynamo.variables.builder import SourcelessBuilder

from hop.compile._dynamo_capture import (
    HopVariable,
    Subgraph,
    check_spec_order,
    drop_constant_inputs,
    emit,
    install,
    output_items,
    share_lifted,
    speculate,
)
from hop.compile._dynamo_values import (
    VT,
    callable_stand_in,
    drop_none_outputs,
    example,
    example_tree,
    flatten,
    fresh,
    fresh_input,
    is_none,
    items,
    method,
    proxies,
    python_spec,
    unflatten,
    with_none,
    without_none,
)
from hop.errors import HopTypeError, format_message
from hop.ops.scanning import _checks, _values
from hop.ops.scanning import associative_scan as associative_scan_module
from hop.ops.scanning import map as map_module
from hop.ops.scanning import scan as scan_module

__all__ = ["HANDLERS"]


def _slices(tx: Any, xs: Sequence[VT]) -> list[VT]:
    """Fresh values shaped like one slice along dim 0 of each of ``xs``."""
    with tx.fake_mode:
        slices = _values.empty_slices([example(x) for x in xs], [0] * len(xs))
    return [fresh_input(tx, s) for s in slices]


class ScanVariable(HopVariable):
    _HOP_NAME = "hop.scan"

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        combine_fn, init, xs = params["combine_fn"], params["init"], params["xs"]
        dim_vt, reverse_vt = params["dim"], params["reverse"]
        fn = callable_stand_in(tx, combine_fn)
        _checks.check_callable("scan", "combine_fn", fn)
        reverse, dim = example(reverse_vt), example(dim_vt)
        if type(reverse) is not bool:
            raise HopTypeError(
                format_message("scan", f"reverse must be a bool, got {type(reverse).__name__}"),
                op="scan",
                role="reverse",
            )
        init_all, init_spec = flatten(tx, init)
        xs_all, xs_spec = flatten(tx, xs)
        init_leaves, xs_leaves = without_none(init_all), without_none(xs_all)
        init_values = [example(leaf) for leaf in init_leaves]
        _checks.check_leaves("scan", "init", example_tree(tx, init), init_values)
        if not xs_leaves and type(dim) is int:  # nothing to scan over
            no_steps: VT = SourcelessBuilder.create(tx, scan_module.no_steps)
            return no_steps.call_function(tx, [init, xs], {})
        dims, _ = _checks.check_xs("scan", example_tree(tx, xs), [example(x) for x in xs_leaves], dim)
        moved = [method(tx, x, "movedim", d, 0) if d else x for x, d in zip(xs_leaves, dims, strict=True)]
        carry = unflatten(tx, with_none(fresh(tx, init_values), init_all), init_spec)
        x = unflatten(tx, with_none(_slices(tx, moved), xs_all), xs_spec)
        body = speculate(tx, self.value, "combine_fn", combine_fn, [carry, x])
        y_spec = _check_scan_body(fn, example_tree(tx, init), body, dim)
        drop_constant_inputs(body.graph, [*init_all, *xs_all])  # the None leaves' placeholders
        drop_none_outputs(body.graph)
        out = self.emit(tx, body, init_leaves, moved, [], reverse)
        nc = len(init_leaves)  # the carry takes init's structure, as in eager
        carry = unflatten(tx, with_none(out[:nc], init_all), init_spec)
        ys = with_none(out[nc:], body.outputs[body.out_spec().children()[0].num_leaves :])
        return TupleVariable([carry, unflatten(tx, [_unmove(tx, y, dim) for y in ys], y_spec)])

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        body_fn, init, xs, additional, reverse = args
        init_leaves, xs_leaves, extra = items(tx, init), items(tx, xs), items(tx, additional)
        examples = [*fresh(tx, [example(c) for c in init_leaves]), *_slices(tx, xs_leaves)]
        body = speculate(tx, self.value, "body", body_fn, [*examples, *extra])
        return _pack(self.emit(tx, body, init_leaves, xs_leaves, extra, example(reverse)))

    def emit(self, tx: Any, body: Subgraph, init: list[VT], xs: list[VT], extra: list[VT], reverse: bool) -> list[VT]:
        lifted = share_lifted([body])
        graph = install(tx, "hop_scan_body", body.graph)
        inputs = (*proxies(extra), *lifted)
        args = scan_module.SPEC.node_args(
            subgraphs=(graph,), carries=tuple(proxies(init)), xs=tuple(proxies(xs)), inputs=inputs, rest=(reverse,)
        )
        return output_items(emit(tx, self.value, args))


def _unmove(tx: Any, y: VT, dim: int) -> VT:
    """A leaf of ys, stacked along dim 0 by the node, moved to ``dim`` (``None`` stays)."""
    if not dim or is_none(y):
        return y
    return method(tx, y, "movedim", 0, _values.stack_dim(dim, example(y).dim() - 1))


def _check_scan_body(fn: Any, init: Any, body: Subgraph, dim: int) -> pytree.TreeSpec:
    """scan's checks of what ``combine_fn`` returns (eager's messages); the structure of y."""
    spec = body.out_spec()
    outs = [example(o) for o in body.outputs]
    if spec.type not in (tuple, list) or spec.num_children != 2:
        raise _checks.not_a_pair(scan_module.SCAN, fn, pytree.tree_unflatten(outs, spec))
    carry_spec, y_spec = spec.children()
    nc = carry_spec.num_leaves
    _checks.check_carry(scan_module.SCAN, fn, init, pytree.tree_unflatten(outs[:nc], carry_spec))
    error = _checks.ys_error(scan_module.SCAN, fn, [pytree.tree_unflatten(outs[nc:], y_spec)], dim, "y")
    if error is not None:
        raise error
    check_spec_order("scan", [pytree.tree_structure(init), carry_spec], "init and next_carry")
    return y_spec


def _pack(out: list[VT]) -> VT:
    """The raw ops' convention: a bare value for one leaf, else a tuple."""
    return out[0] if len(out) == 1 else TupleVariable(out)


class MapVariable(HopVariable):
    _HOP_NAME = "hop.map"

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        f, xs, f_args = params["f"], params["xs"], params["args"]
        fn = callable_stand_in(tx, f)
        _checks.check_callable("map", "f", fn)
        xs_all, xs_spec = flatten(tx, xs)
        args_all, _ = flatten(tx, f_args)
        xs_leaves, arg_leaves = without_none(xs_all), without_none(args_all)
        _checks.check_xs("map", example_tree(tx, xs), [example(x) for x in xs_leaves], 0)
        _checks.check_leaves("map", "args", example_tree(tx, f_args), [example(a) for a in arg_leaves], ints=True)
        x = unflatten(tx, with_none(_slices(tx, xs_leaves), xs_all), xs_spec)
        body = speculate(tx, self.value, "f", f, [x, *items(tx, f_args)])
        outs = [example(o) for o in body.outputs]
        error = _checks.ys_error(map_module.MAP, fn, [pytree.tree_unflatten(outs, body.out_spec())], 0, "output")
        if error is not None:
            raise error
        extra = without_none(drop_constant_inputs(body.graph, [*xs_all, *args_all]))[len(xs_leaves) :]
        drop_none_outputs(body.graph)
        return unflatten(tx, with_none(self.emit(tx, body, xs_leaves, extra), body.outputs), body.spec)

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        body_fn, xs, additional = args
        xs_leaves, extra = items(tx, xs), items(tx, additional)
        body = speculate(tx, self.value, "body", body_fn, [*_slices(tx, xs_leaves), *extra])
        return _pack(self.emit(tx, body, xs_leaves, extra))

    def emit(self, tx: Any, body: Subgraph, xs: list[VT], extra: list[VT]) -> list[VT]:
        lifted = share_lifted([body])
        graph = install(tx, "hop_map_body", body.graph)
        args = map_module.SPEC.node_args(subgraphs=(graph,), xs=tuple(proxies(xs)), inputs=(*proxies(extra), *lifted))
        return output_items(emit(tx, self.value, args))


# --- associative_scan ------------------------------------------------------------------------


class AssociativeScanVariable(HopVariable):
    _HOP_NAME = "hop.associative_scan"

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        combine_fn, xs, dim_vt = params["combine_fn"], params["xs"], params["dim"]
        reverse_vt, mode_vt = params["reverse"], params["combine_mode"]
        name = "associative_scan"
        fn = callable_stand_in(tx, combine_fn)
        mode, reverse, dim = example(mode_vt), example(reverse_vt), example(dim_vt)
        associative_scan_module.check_options(fn, reverse, mode)
        leaves_all, spec = flatten(tx, xs)
        leaves = without_none(leaves_all)
        dims, _ = _checks.check_xs(name, example_tree(tx, xs), [example(x) for x in leaves], dim)
        moved = [method(tx, x, "movedim", d, 0) if d else x for x, d in zip(leaves, dims, strict=True)]
        moved = [method(tx, x, "flip", 0) for x in moved] if reverse else moved
        lhs, rhs = (with_none(_slices(tx, moved), leaves_all) for _ in range(2))
        body = speculate(tx, self.value, "combine_fn", combine_fn, [unflatten(tx, lhs, spec), unflatten(tx, rhs, spec)])
        py_spec = python_spec(spec)
        out_tree = pytree.tree_unflatten([example(o) for o in body.outputs], body.out_spec())
        lhs_tree = pytree.tree_unflatten([example(x) for x in lhs], py_spec)
        _checks.check_like(name, "combine_fn", fn, lhs_tree, out_tree, "output", "xs and the output")
        check_spec_order(name, [py_spec, body.out_spec()], "xs and combine_fn's output")
        drop_constant_inputs(body.graph, [*leaves_all, *leaves_all])  # the None leaves' placeholders
        drop_none_outputs(body.graph)
        out = self.emit(tx, body, moved, [], mode)
        out = [method(tx, o, "flip", 0) for o in out] if reverse else out
        out = [method(tx, o, "movedim", 0, d) if d else o for o, d in zip(out, dims, strict=True)]
        return unflatten(tx, with_none(out, leaves_all), spec)

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        combine_fn, xs, additional, mode = args
        xs_leaves, extra = items(tx, xs), items(tx, additional)
        body = speculate(
            tx, self.value, "combine_fn", combine_fn, [*_slices(tx, xs_leaves), *_slices(tx, xs_leaves), *extra]
        )
        return _pack(self.emit(tx, body, xs_leaves, extra, example(mode)))

    def emit(self, tx: Any, body: Subgraph, xs: list[VT], extra: list[VT], mode: str) -> list[VT]:
        lifted = share_lifted([body])
        graph = install(tx, "hop_associative_scan_combine", body.graph)
        inputs = (*proxies(extra), *lifted)
        spec = associative_scan_module.SPEC
        args = spec.node_args(subgraphs=(graph,), xs=tuple(proxies(xs)), inputs=inputs, rest=(mode,))
        return output_items(emit(tx, self.value, args))


HANDLERS: dict[Any, type[HopVariable]] = {
    scan_module.scan_op: ScanVariable,
    map_module.map_op: MapVariable,
    associative_scan_module.associative_scan_op: AssociativeScanVariable,
}
