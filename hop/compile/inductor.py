"""hop's operators in Inductor (``torch.compile``) and AOTInductor.

What reaches Inductor is a post-grad FX graph holding ``torch.ops.hop.*`` nodes
(from ``torch.export`` then ``aoti_compile_and_package``, or from
``torch.compile``). Each operator ends up in Inductor's own IR, so the generated
code (C++ or Triton, Python or C++ wrapper) has native ``if`` / ``while`` and
never calls back into hop: an AOTInductor package runs where hop is not installed.

- ``cond``, ``while_loop`` (and ``fori_loop``, which is a while_loop): lowered
  by Inductor's lowerings of ``torch.ops.higher_order.cond`` / ``while_loop``
  (``ir.Conditional``, ``ir.WhileLoop``); the node layout is torch's. One
  adaptation: hop returns a bare tensor for a single output, torch a list. A cond
  with int outputs (or None operands, from a backward graph) is first rewritten by
  the pass (Note [int outputs of branches]): Inductor's conditional holds tensors only.
- ``switch``, ``map``, ``scan``, ``associative_scan``: rewritten by a post-grad
  pass (:class:`PostGradPass`, before Inductor's own passes; the rewrites are in
  :mod:`hop.compile._inductor_rewrites`) into torch's cond / while_loop and plain
  ops, then lowered as above:

  - ``switch(index, operands, *branches)``: nested conds on ``index == k``,
    after an ``_assert_async`` that fails for an index out of range (it is
    never clamped);
  - ``map`` / ``scan``: a while_loop over a counter that writes each step's
    outputs into preallocated buffers (Note [scans as while loops]);
  - ``associative_scan``: for a static length, hop's own O(log n) algorithm
    traced into plain ops; for a symbolic length, the sequential scan it equals.

Three traps of Inductor's control-flow lowering are handled here: a backward
graph's donated buffers must not reach loop bodies (Note [donated buffers and
subgraphs]); hop's int carries are read with ``.item()`` in subgraphs whose nodes
need ``unbacked_bindings`` (:func:`bind_item_symbols`); a loop's gradient carry
may be stride-0 (made contiguous by the rewrites).

Registration is lazy (``import hop`` does not import Inductor): when torch
imports ``torch._inductor.lowering``, :func:`_register` adds the lowerings and
installs the pass in ``torch._inductor.config.post_grad_custom_pre_pass``,
ahead of any pass already there (a user who sets a pass later writes
``hop.compile.inductor.chain(my_pass)``; without it the lowering explains).

Private torch internals touched here and in the rewrites (each listed, with the releases it was checked on, in
:mod:`hop.compile._torch_api`):

- ``torch._inductor.lowering``: ``lowerings``, ``register_lowering``; the
  ``Subgraph`` arguments' ``graph_module``;
- ``torch._inductor.virtualized.V``: ``graph.current_node`` (its ``meta["val"]``
  and ``unbacked_bindings``), ``graph.sizevars``, ``fake_mode``;
- ``torch._inductor.config.post_grad_custom_pre_pass`` (its value, and the
  ``default`` of its ``_config`` entry) and
  ``torch._inductor.custom_graph_pass.CustomGraphPass`` / ``get_hash_for_files``;
- ``torch._inductor.pattern_matcher``: ``CallFunctionVarArgs(op).match(node)`` and
  ``Match.replace_by_example``;
- ``torch._guards.TracingContext.fw_metadata.bw_donated_idxs`` (AOTAutograd);
- ``torch.ops.higher_order.cond`` / ``while_loop`` called under ``make_fx``;
- ``torch.utils._sympy.interp.sympy_interp`` and ``reference.PythonReferenceAnalysis``
  (symbolic buffer sizes as expressions of the inputs' sizes);
- the warning text of ``torch._inductor.fx_utils`` for HOPs it does not know.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.utils._pytree as pytree

from hop.compile import _aoti_refusals  # noqa: F401  (AOTInductor raises hop's refusals as themselves)
from hop.compile._hooks import on_import
from hop.compile._inductor_in_place import DONATED, write_carries_in_place
from hop.compile._inductor_pass import POST_GRAD_PASS, REWRITES, PostGradPass, chain, install_pass
from hop.compile._inductor_subgraphs import (
    bind_item_symbols,
    inline_constant_inputs,
    own_buffers,
    reads_first,
    retrace,
    simplest_sizes,
    traced_strides,
    tuple_outputs,
    writes_in_carry_order,
)
from hop.errors import HopRuntimeError, format_message
from hop.ops.branching.cond import cond_op
from hop.ops.while_loops.while_loop import while_loop_op

__all__ = ["POST_GRAD_PASS", "PostGradPass", "chain"]

Fn = Callable[..., Any]


# --- lowerings ---------------------------------------------------------------------------


def _register(lowering: ModuleType) -> None:
    """Runs once torch has imported ``torch._inductor.lowering``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(PostGradPass)
    torch_cond = lowering.lowerings[torch.ops.higher_order.cond]
    torch_while = lowering.lowerings[torch.ops.higher_order.while_loop]
    lowering.register_lowering(cond_op, type_promotion_kind=None)(functools.partial(_lower_cond, torch_cond))
    lowering.register_lowering(while_loop_op, type_promotion_kind=None)(functools.partial(_lower_while, torch_while))
    lowering.register_lowering(torch.ops.higher_order.while_loop, type_promotion_kind=None)(
        functools.partial(_lower_torch_while, torch_while)
    )
    lowering.register_lowering(torch.ops.higher_order.cond, type_promotion_kind=None)(
        functools.partial(_lower_torch_cond, torch_cond)
    )
    for op in REWRITES:
        lowering.register_lowering(op, type_promotion_kind=None)(_not_rewritten(op.name()))
    install_pass()  # again: a pass set since the config loaded goes after hop's
    # Inductor's fake-tensor updater warns for every HOP whose layout it does not
    # know; hop's subgraphs need no update there (Inductor then updates them all).
    names = "|".join(op.name() for op in (cond_op, while_loop_op, *REWRITES))
    warnings.filterwarnings("ignore", f"Please add support for subgraph args to function ({names})!")


def _lower_cond(torch_cond: Fn, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    """torch's lowering; a single output is a 1-tuple while it runs (torch's conditional
    zips the node's ``meta["val"]`` with the branches' outputs, which it reads as a
    sequence)."""
    from torch._inductor.virtualized import V

    bind_item_symbols(true_fn.graph_module, false_fn.graph_module)
    node = V.graph.current_node
    operands = inline_constant_inputs(node, (true_fn.graph_module, false_fn.graph_module), 3, 0, operands)
    operands = simplest_sizes(node, 3, operands)
    operands = traced_strides(operands, node.args[-1])
    val, bindings = node.meta["val"], node.meta.get("unbacked_bindings")
    if isinstance(val, (tuple, list)):
        with own_buffers():
            return torch_cond(pred, true_fn, false_fn, operands)
    tuple_outputs(true_fn.graph_module, false_fn.graph_module)
    node.meta["val"] = (val,)
    if bindings:
        node.meta["unbacked_bindings"] = {s: (pytree.SequenceKey(0), *p) for s, p in bindings.items()}
    try:
        with own_buffers():
            return torch_cond(pred, true_fn, false_fn, operands)[0]
    finally:
        node.meta["val"] = val
        if bindings:
            node.meta["unbacked_bindings"] = bindings


def _lower_while(
    torch_while: Fn, cond_fn: Any, body_fn: Any, carried_inputs: Any, additional_inputs: Any, checkpoint: bool = False
) -> Any:
    """torch's lowering; a single carry is returned bare, as the op does. ``checkpoint``
    chose the reverse mode, which is already in the graph (Note [the checkpoint keyword])."""
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    graphs = (cond_fn.graph_module, body_fn.graph_module)
    # first: a retraced condition takes its inputs from the placeholders' meta, which a constant's lacks
    additional_inputs = inline_constant_inputs(node, graphs, 3, len(node.args[2]), additional_inputs)  # type: ignore[arg-type]
    defined = bind_item_symbols(body_fn.graph_module)
    if defined & bind_item_symbols(cond_fn.graph_module):
        # The C++ wrapper declares the condition's and the body's reads in one
        # block: the condition must define symbols of its own.
        cond_fn.graph_module = retrace(cond_fn.graph_module)
        bind_item_symbols(cond_fn.graph_module)
    written = write_carries_in_place(body_fn.graph_module, node.args[2])  # type: ignore[arg-type]
    donated = node.meta.get(DONATED, frozenset())  # Note [a written graph input is the loop's own carry]
    if not donated <= set(written):
        raise AssertionError(f"hop: carries {sorted(donated)} lost their write-back but are not written in place")
    if written:  # Note [a written carry is written in place]
        from torch._inductor import ir
        from torch._inductor.lowering import clone

        carried_inputs = [
            clone(c) if k in written and k not in donated and isinstance(c, ir.TensorBox) else c
            for k, c in enumerate(carried_inputs)
        ]
    carried_inputs = traced_strides(carried_inputs, node.args[2])
    additional_inputs = simplest_sizes(node, 3, additional_inputs)
    additional_inputs = traced_strides(additional_inputs, node.args[3])
    with own_buffers():
        out = _lower_torch_while(torch_while, cond_fn, body_fn, carried_inputs, additional_inputs)
    return out[0] if len(carried_inputs) == 1 else out


# Note [a loop's buffers are never reused]
# Two traps of the C++ wrapper's while loop (AOTInductor, cpp_wrapper=True), whose
# memory planner knows less than the loop's code does:
# - A loop that runs no step returns its carried inputs themselves (the Python
#   wrapper clones them; the C++ one hands out the same storage). The planner takes
#   a carried input as dead after the loop and lets a later kernel write into it,
#   in place or as a "reused" buffer: the loop's output then holds that kernel's
#   values, silently (a zero-trip fori_loop returned another output's value).
# - hop's rewrites of scan, map and associative_scan write their stacked outputs
#   into carried buffers, in place. Inductor names a MutationOutput per such carry,
#   which the C++ wrapper declares before the loop and nothing reads afterwards: a
#   later buffer of the same layout "reuses" it by declaring it again, and the
#   package fails to compile (``redeclaration of buf5``).
# So a loop's carried inputs, its outputs and its mutation outputs are never offered
# for reuse: a later buffer allocates its own memory. No value changes.
# - An additional input that is a view of a computed buffer (the slices a scan over
#   dim -1 reads: a permute of its xs) gets one raw tensor handle before the loop,
#   which the C++ wrapper wraps in a temporary owning handle at each use inside the
#   loop: the first use frees it, the next reads freed memory (a segfault). Such an
#   input is copied into a buffer of its own before the loop.


def _lower_torch_cond(torch_cond: Fn, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    """torch's lowering of its cond (the one hop's rewrites of switch make), with each
    operand in the strides its branches were compiled for (Note [operands keep their
    traced strides]): a ``r * 1.0`` of a map's transposed slice kept its transposed
    layout and failed the branch's stride assert."""
    from torch._inductor.virtualized import V

    return torch_cond(pred, true_fn, false_fn, traced_strides(operands, V.graph.current_node.args[-1]))


def _lower_torch_while(torch_while: Fn, *args: Any, **kwargs: Any) -> Any:
    """Note [a loop's buffers are never reused]."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    if V.graph.cpp_wrapper and len(args) >= 4:
        copied = [
            ir.ExternKernel.copy_input(a) if isinstance(a, ir.TensorBox) and isinstance(a.data, ir.BaseView) else a
            for a in args[3]
        ]
        args = (*args[:3], type(args[3])(copied), *args[4:])  # a list or a tuple, as given
    known_buffers, known_operations = len(V.graph.buffers), len(V.graph.operations)
    with writes_in_carry_order():
        out = torch_while(*args, **kwargs)
    reads_first(V.graph.operations[known_operations:])
    never = V.graph.never_reuse_buffers
    for buffer in V.graph.buffers[known_buffers:]:
        if isinstance(buffer, ir.MutationOutput):
            never.add(buffer.get_name())
    for operation in V.graph.operations[known_operations:]:
        if isinstance(operation, ir.WhileLoop):
            loop_values: list[Any] = [*(operation.carried_inputs or ()), *(operation.outputs or ())]
            for value in loop_values:
                if isinstance(value, ir.IRNode):
                    never.add(value.get_name())
    for value in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(value, ir.IRNode):
            never.add(value.get_name())
    return out


def _not_rewritten(name: str) -> Fn:
    """The lowering of an operator that hop's pass should have rewritten: say why not."""

    def lower(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config

        passes = config.post_grad_custom_pre_pass
        if POST_GRAD_PASS is passes or (isinstance(passes, (list, tuple)) and POST_GRAD_PASS in passes):
            what = "the pass did not run on this graph"
            fix = "Check that torch._inductor.config.use_post_grad_passes is on."
        else:
            what = "torch._inductor.config.post_grad_custom_pre_pass was set without hop's pass"
            fix = "Set it to hop.compile.inductor.chain(your_pass), which runs hop's pass, then yours."
        what = f"Inductor reached this operator before hop's post-grad pass rewrote it: {what}"
        raise HopRuntimeError(format_message(name, what, fix=fix), op=name)

    return lower


on_import("torch._inductor.lowering", _register)
# As soon as the config exists: a user's config.patch(post_grad_custom_pre_pass=...)
# then saves and restores a value that holds hop's pass (installed at the first
# compile instead, inside such a patch, it would be lost when the patch ends).
on_import("torch._inductor.config", lambda config: install_pass())
