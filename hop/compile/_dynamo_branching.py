"""Dynamo's handlers of ``hop.cond`` / ``hop.switch`` and their raw ops (:mod:`hop.compile.dynamo`).

Both trace every branch on the operands' leaves and emit one node, in the raw
layouts ``cond(pred, true_graph, false_graph, operands)`` and
``switch(index, operands, *branch_graphs)``, ``operands`` being the operands'
leaves followed by what the branches lift. A Python bool ``pred`` or int
``index`` runs the branch inline, as eager does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._dynamo.variables import ConstantVariable
from torch._dynamo.variables.lists import BaseListVariable

from hop import _output_checks
from hop.compile._dynamo_capture import (
    HopVariable,
    bare_single_output,
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
    example,
    example_tree,
    flatten,
    items,
    method,
    shown,
    unflatten,
)
from hop.errors import HopTypeError, HopValueError, format_message, not_a_sequence, type_name
from hop.ops.branching import _record
from hop.ops.branching import cond as cond_module
from hop.ops.branching import switch as switch_module

__all__ = ["HANDLERS"]


class _BranchingVariable(HopVariable):
    branching: _record.Branching

    def capture(self, tx: Any, sel: VT, branches: Sequence[VT], operands: VT) -> VT:
        """One node running the branch ``sel`` picks (``sel`` checked by the caller)."""
        name = self.branching.name
        roles = self.branching.roles(len(branches))
        fns = [callable_stand_in(tx, fn) for fn in branches]
        _check_call(name, roles, fns, operands)
        leaves, _ = flatten(tx, operands)
        _record._check_leaves(name, example_tree(tx, operands), [example(leaf) for leaf in leaves])
        subs = [
            speculate(tx, self.value, role, fn, items(tx, operands)) for role, fn in zip(roles, branches, strict=True)
        ]
        outs = [pytree.tree_unflatten([example(o) for o in s.outputs], s.out_spec()) for s in subs]
        _output_checks.check_same_outputs(name, roles, outs, fns=fns)
        check_spec_order(name, [s.out_spec() for s in subs], "branches returning")
        n = len(subs[0].outputs)
        lone_int = n == 1 and not subs[0].outputs[0].is_tensor()
        kept = leaves
        for s in subs:
            kept = drop_constant_inputs(s.graph, leaves)  # the same leaves for every branch
            if lone_int:
                _add_empty_output(tx, s.graph)
            else:
                bare_single_output(s.graph)
        inputs = [leaf.as_proxy() for leaf in kept]
        lifted = share_lifted(subs, inputs)
        graphs = tuple(install(tx, f"hop_{name}_branch{k}", s.graph) for k, s in enumerate(subs))
        args = (*inputs, *lifted)
        out = emit(tx, self.value, self.branching.node_args(sel.as_proxy(), graphs, args))
        return unflatten(tx, output_items(out)[:n], subs[0].spec)


def _check_call(name: str, roles: Sequence[str], fns: Sequence[Any], operands: VT) -> None:
    """The checks of ``_record.call``, with the same messages."""
    for role, fn in zip(roles, fns, strict=True):
        if not callable(fn):
            raise HopTypeError(
                format_message(name, f"{role} must be callable, got {type_name(fn)}"), op=name, role=role
            )
    if not isinstance(operands, BaseListVariable) or operands.python_type() not in (tuple, list):
        raise not_a_sequence(name, "operands", type_name(shown(operands)))


def _add_empty_output(tx: Any, graph: torch.fx.Graph) -> None:
    """A lone int output travels beside an empty tensor (see ``_record.flat_branches``)."""
    out = next(n for n in graph.nodes if n.op == "output")
    (values,) = out.args
    with graph.inserting_before(out):
        empty = graph.call_function(torch.empty, ((0,),))
    with tx.fake_mode:
        empty.meta["example_value"] = torch.empty(0)
    out.args = ((values[0], empty),)


class CondVariable(_BranchingVariable):
    _HOP_NAME = "hop.cond"
    branching = cond_module.COND

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        return self.raw_call(tx, [params["pred"], params["true_fn"], params["false_fn"], params["operands"]])

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        pred, true_fn, false_fn, operands = args
        if isinstance(pred, ConstantVariable):
            value = pred.value
            if type(value) is bool or cond_module._is_numpy_bool(value):  # the branch just runs, as in eager
                return (true_fn if value else false_fn).call_function(tx, items(tx, operands), {})
        value = example(pred)
        cond_module.check_pred(value)
        if isinstance(value, torch.Tensor) and value.dtype is not torch.bool:
            pred = method(tx, pred, "__ne__", 0)  # a number's truth, as hop.cond does
        return self.capture(tx, pred, [true_fn, false_fn], operands)


class SwitchVariable(_BranchingVariable):
    _HOP_NAME = "hop.switch"
    branching = switch_module.SWITCH

    def public_call(self, tx: Any, public: str, params: dict[str, VT]) -> VT:
        index, branches, operands = params["index"], params["branches"], params["operands"]
        if not isinstance(branches, BaseListVariable) or not branches.items:
            raise HopValueError(
                format_message(
                    "switch", f"branches must be a non-empty list or tuple of callables, got {example(branches)!r}"
                ),
                op="switch",
                role="branches",
            )
        return self.select(tx, index, items(tx, branches), operands)

    def raw_call(self, tx: Any, args: list[VT]) -> VT:
        index, operands, *branches = args
        return self.select(tx, index, branches, operands)

    def select(self, tx: Any, index: VT, branches: list[VT], operands: VT) -> VT:
        value = example(index)
        switch_module.check_index(value)
        if type(value) is int:  # a Python int: that branch just runs, as in eager
            fns = [callable_stand_in(tx, fn) for fn in branches]
            _check_call("switch", self.branching.roles(len(branches)), fns, operands)
            k = switch_module._index(value, len(branches))
            return branches[k].call_function(tx, items(tx, operands), {})
        return self.capture(tx, index, branches, operands)


HANDLERS: dict[Any, type[HopVariable]] = {
    cond_module.cond_op: CondVariable,
    switch_module.switch_op: SwitchVariable,
}
