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
need ``unbacked_bindings`` (:func:`_bind_item_symbols`); a loop's gradient carry
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

import contextlib
import functools
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from hop.compile import (
    _aoti_refusals,  # noqa: F401  (AOTInductor raises hop's refusals as themselves)
    _torch_api,
)
from hop.compile import _inductor_rewrites as rw
from hop.compile._hooks import on_import
from hop.compile._inductor_decomposed import inline_decompositions
from hop.compile._inductor_in_place import DONATED, donate_written_inputs, write_carries_in_place
from hop.compile._inductor_scatter import dense_bases
from hop.errors import HopRuntimeError, format_message
from hop.ops.cond import cond_op
from hop.ops.scan import scan_op
from hop.ops.while_loop import while_loop_op

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
    for op in rw.REWRITES:
        lowering.register_lowering(op, type_promotion_kind=None)(_not_rewritten(op.name()))
    _install_pass()  # again: a pass set since the config loaded goes after hop's
    # Inductor's fake-tensor updater warns for every HOP whose layout it does not
    # know; hop's subgraphs need no update there (Inductor then updates them all).
    names = "|".join(op.name() for op in (cond_op, while_loop_op, *rw.REWRITES))
    warnings.filterwarnings("ignore", f"Please add support for subgraph args to function ({names})!")


def _lower_cond(torch_cond: Fn, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    """torch's lowering; a single output is a 1-tuple while it runs (torch's conditional
    zips the node's ``meta["val"]`` with the branches' outputs, which it reads as a
    sequence)."""
    from torch._inductor.virtualized import V

    _bind_item_symbols(true_fn.graph_module, false_fn.graph_module)
    node = V.graph.current_node
    operands = _inline_constant_inputs(node, (true_fn.graph_module, false_fn.graph_module), 3, 0, operands)
    operands = _simplest_sizes(node, 3, operands)
    operands = _traced_strides(operands, node.args[-1])
    val, bindings = node.meta["val"], node.meta.get("unbacked_bindings")
    if isinstance(val, (tuple, list)):
        with _own_buffers():
            return torch_cond(pred, true_fn, false_fn, operands)
    _tuple_outputs(true_fn.graph_module, false_fn.graph_module)
    node.meta["val"] = (val,)
    if bindings:
        node.meta["unbacked_bindings"] = {s: (pytree.SequenceKey(0), *p) for s, p in bindings.items()}
    try:
        with _own_buffers():
            return torch_cond(pred, true_fn, false_fn, operands)[0]
    finally:
        node.meta["val"] = val
        if bindings:
            node.meta["unbacked_bindings"] = bindings


# Note [operands keep their traced strides]
# A branch or loop body is lowered as a graph of its own, compiled for inputs with
# the strides its FX node's inputs had when traced (their meta["val"]). Inductor may
# lay an operand out otherwise in the parent graph: a tensor that also feeds a
# torch.cat is written straight into the cat's buffer, a view with the cat's row
# stride. torch's lowerings pass such an operand as it is, so the subgraph's stride
# assert fails under torch.compile, and an AOTInductor package (which has no such
# asserts) reads it with the wrong strides: wrong values, silently. Each operand is
# first made to have exactly its traced strides (a copy where it does not).
# A view of a value not yet computed (a reshape of a gather) has its storage
# computed first, so that the copy reads a buffer: copied straight from the
# unrealized value, the copy's kernel would inline the whole chain of index
# arithmetic, which Inductor's C++ codegen fails on under dynamic shapes (torch
# fails so on ``reshape(gather(x)) * 0.5`` alone, with no control flow).


# Note [a size operand is passed in its simplest form]
# Dynamo gives each input's size a symbol of its own and records that two are
# equal as a replacement (a[:-1] and b[:-1], both marked dynamic: s97 -> s52).
# torch's lowering builds a subgraph from its FX node's operands' meta, binding a
# size input to the symbol it was traced as (s97), while the subgraph's tensors'
# sizes read the replacement (s52 - 1): the codegen failed ("expected [s52] to have
# been codegen-ed"). torch's cond passes every size symbol, so one of them is s52;
# hop's Dynamo capture passes one per value. A size operand whose symbol has been
# replaced is therefore passed as the graph input traced as the replacement, where
# there is one (else as it was: the same loud failure). At run time the two hold the
# same value: they were found equal.


def _simplest_sizes(node: torch.fx.Node, position: int, values: Sequence[Any]) -> list[Any]:
    """Note [a size operand is passed in its simplest form]; ``values`` are the lowered
    forms of ``node.args[position]``."""
    import sympy

    def symbol_of(n: Any, raw: bool) -> Any:
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        if not isinstance(val, torch.SymInt):
            return None
        expr = val.node._expr if raw else val.node.expr
        return expr if isinstance(expr, sympy.Symbol) else None

    inputs = {symbol_of(p, True): p for p in node.graph.find_nodes(op="placeholder")}
    traced, out = list(node.args[position]), list(values)  # type: ignore[arg-type]
    for j, arg in enumerate(traced[: len(out)]):
        raw, simplest = symbol_of(arg, True), symbol_of(arg, False)
        if raw is not None and simplest is not None and raw != simplest and simplest in inputs:
            traced[j], out[j] = inputs[simplest], simplest
    node.args = (*node.args[:position], tuple(traced), *node.args[position + 1 :])
    return out


def _traced_strides(values: Sequence[Any], traced: Any) -> list[Any]:
    """Note [operands keep their traced strides]."""
    from torch._inductor import ir

    nodes = list(traced) if isinstance(traced, (tuple, list)) else [traced]
    out = list(values)
    for k, (value, node) in enumerate(zip(out, nodes, strict=False)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and isinstance(value, ir.Constant):
            # a 0-dim tensor constant (an exported jvp's tangent) Inductor folded to a
            # scalar, which torch's lowerings of cond and while_loop cannot take: a buffer
            value = out[k] = ir.ExternKernel.realize_input(value)
        if isinstance(val, torch.Tensor) and isinstance(value, ir.IRNode):
            if isinstance(value, ir.TensorBox) and isinstance(value.data, ir.BaseView):
                storage = value.unwrap_view()
                if isinstance(storage, ir.StorageBox):
                    storage.realize()
            out[k] = ir.ExternKernel.require_exact_strides(value, val.stride(), allow_padding=False)
    return out


def _tuple_outputs(*graphs: torch.fx.GraphModule) -> None:
    """Make branch subgraphs that return one output bare return a 1-tuple: torch's
    lowering (``ir.Switch`` from torch 2.14) reads the branches' outputs as a sequence.
    Idempotent: two cond nodes may share a branch subgraph."""
    for gm in graphs:
        out = gm.graph.output_node()
        if not isinstance(out.args[0], (tuple, list)):
            out.args = ((out.args[0],),)
            gm.recompile()


def _lower_while(
    torch_while: Fn, cond_fn: Any, body_fn: Any, carried_inputs: Any, additional_inputs: Any, checkpoint: bool = False
) -> Any:
    """torch's lowering; a single carry is returned bare, as the op does. ``checkpoint``
    chose the reverse mode, which is already in the graph (Note [the checkpoint keyword])."""
    from torch._inductor.virtualized import V

    node = V.graph.current_node
    graphs = (cond_fn.graph_module, body_fn.graph_module)
    # first: a retraced condition takes its inputs from the placeholders' meta, which a constant's lacks
    additional_inputs = _inline_constant_inputs(node, graphs, 3, len(node.args[2]), additional_inputs)  # type: ignore[arg-type]
    defined = _bind_item_symbols(body_fn.graph_module)
    if defined & _bind_item_symbols(cond_fn.graph_module):
        # The C++ wrapper declares the condition's and the body's reads in one
        # block: the condition must define symbols of its own.
        cond_fn.graph_module = _retrace(cond_fn.graph_module)
        _bind_item_symbols(cond_fn.graph_module)
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
    carried_inputs = _traced_strides(carried_inputs, node.args[2])
    additional_inputs = _simplest_sizes(node, 3, additional_inputs)
    additional_inputs = _traced_strides(additional_inputs, node.args[3])
    with _own_buffers():
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

    return torch_cond(pred, true_fn, false_fn, _traced_strides(operands, V.graph.current_node.args[-1]))


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
    with _writes_in_carry_order():
        out = torch_while(*args, **kwargs)
    _reads_first(V.graph.operations[known_operations:])
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


# Note [a subgraph reads its inputs first]
# A loop body reads its int carries with ``.item()`` (so do a condition that reads
# them and the loops the rewrites make, their counter): each read is an
# ``ir.DynamicScalar`` that defines an unbacked symbol, and Inductor's scheduler
# orders a kernel after the read only if the kernel declares that it uses the symbol.
# Some do not: a scatter (``index_copy`` / ``index_put`` at a position made from the
# counter, ``torch.full((1,), t)``) computes where it writes from the symbol but
# declares only the symbols of the values it writes. Nothing then keeps the read
# before that kernel: the scheduler's reorderings (for peak memory) may emit the
# read after it, or drop a read no kernel declares. The Python wrapper fails at run
# time (``UnboundLocalError: ... 'u10'``), the C++ one does not compile (``'u9' was
# not declared``): a greedy decoder writing the token it picks at ``t + 1``. So every
# other operation of a loop's subgraphs depends on the subgraph's reads of its
# inputs: they depend on nothing, so running them first costs no memory and
# prevents no fusion.


def _reads_first(operations: Sequence[Any]) -> None:
    """Note [a subgraph reads its inputs first]: for the subgraphs of ``operations`` (just lowered)."""
    from torch._inductor import ir

    for operation in operations:
        for subgraph in operation.get_subgraphs():
            graph = subgraph.graph
            if graph is None:
                continue
            reads = [
                op.get_name()
                for op in graph.operations
                if isinstance(op, ir.DynamicScalar)
                and all(isinstance(i, ir.IRNode) and i.get_name() in graph.graph_inputs for i in op.inputs)
            ]
            deps = _torch_api.ordering_deps(graph)
            for op in graph.operations if reads else ():
                if not isinstance(op, ir.DynamicScalar):
                    deps[op.get_operation_name()].update(reads)


def _inline_constant_inputs(
    node: torch.fx.Node, graphs: Sequence[torch.fx.GraphModule], position: int, first: int, values: Sequence[Any]
) -> list[Any]:
    """Write the constants among the inputs ``node.args[position]`` (a float Dynamo lifted,
    which Inductor made a constant) into the subgraphs, where they are the placeholders
    from ``first`` on; return ``values`` without them. torch's lowerings take tensors:
    its cond's reads every operand's device, its while_loop's (from 2.15) every input's
    FX ``meta``."""
    traced = list(node.args[position])  # type: ignore[arg-type]
    constant = [j for j, a in enumerate(traced) if not isinstance(a, torch.fx.Node)]
    if not constant:
        return list(values)
    for gm in graphs:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for j in constant:
            _replace_input(gm.graph, placeholders[first + j], traced[j])
        gm.recompile()
    kept = tuple(a for j, a in enumerate(traced) if j not in constant)
    node.args = (*node.args[:position], kept, *node.args[position + 1 :])
    return [a for j, a in enumerate(values) if j not in constant]


def _replace_input(graph: torch.fx.Graph, placeholder: torch.fx.Node, value: Any) -> None:
    """Every use of ``placeholder`` reads the constant ``value`` instead; the input goes."""

    def swap(arg: torch.fx.Node) -> Any:
        return value if arg is placeholder else arg

    for user in list(placeholder.users):
        user.args, user.kwargs = torch.fx.node.map_arg((user.args, user.kwargs), swap)
    graph.erase_node(placeholder)


# Note [donated buffers and subgraphs]
# AOTAutograd lets the compiled backward graph reuse the memory of saved tensors
# it is the last user of ("donated buffers", by input position). Inductor lowers
# a loop body or branch with a GraphLowering of its own that reads the same
# positions and applies them to the *subgraph's* inputs: a loop body would reuse
# a carry or an input that later iterations read (wrong gradients). So a graph
# holding hop's control flow donates nothing: hop's pass clears the positions
# before Inductor lowers it (a memory optimization lost, not a result), and
# hop's lowerings hide them while the subgraphs are created (in case the pass
# did not run).


def _no_donated_buffers() -> None:
    """Note [donated buffers and subgraphs], at pass time."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if getattr(meta, "bw_donated_idxs", None):
        meta.bw_donated_idxs = []  # type: ignore[union-attr]  # AOTAutograd's "none donated"


@contextlib.contextmanager
def _writes_in_carry_order() -> Iterator[None]:
    """Before torch 2.15, Inductor's while loop paired the carries a body writes in
    place, in carry order, with the list of written inputs in the order the body
    writes them: a body writing carry 2 before carry 0 (a scan's body writing a buffer
    it closes over, then the rewrite's stacked outputs) got their outputs swapped
    (a loud size mismatch, or silently wrong values where the sizes agree). The list
    is handed over sorted for the lowering's call."""
    if _torch_api.at_least(2, 15):
        yield
        return
    import torch._higher_order_ops.utils as utils

    original = utils.check_input_alias_and_mutation

    def in_carry_order(*args: Any, **kwargs: Any) -> Any:
        *maps, written = original(*args, **kwargs)
        return (*maps, sorted(set(written)))

    utils.check_input_alias_and_mutation = in_carry_order
    try:
        yield
    finally:
        utils.check_input_alias_and_mutation = original


@contextlib.contextmanager
def _own_buffers() -> Iterator[None]:
    """Note [donated buffers and subgraphs], while a lowering creates subgraphs."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    donated = getattr(meta, "bw_donated_idxs", None)
    if donated:
        meta.bw_donated_idxs = []  # type: ignore[union-attr]
    try:
        yield
    finally:
        if donated:
            meta.bw_donated_idxs = donated  # type: ignore[union-attr]


def _bind_item_symbols(*graphs: torch.fx.GraphModule) -> set[Any]:
    """Mark each ``.item()`` of the subgraphs as the definition of its unbacked
    symbol; return those symbols.

    hop traces an int carry (or an int a branch reads) as a 0-dim int64 tensor that
    the functions read with ``.item()``, under ``ignore_fresh_unbacked_symbols``:
    the nodes may carry no ``unbacked_bindings``, which Inductor's lowering of
    ``_local_scalar_dense`` needs to emit the read. A float read gets a symbol of its
    own when it has none.
    """
    from torch._inductor.virtualized import V
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    items = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)
    symbols: set[Any] = set()
    for gm in graphs:
        renamed: dict[Any, Any] = {}
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.target in items and isinstance(val, (torch.SymInt, torch.SymFloat)):
                symbol = val.node.expr
                if isinstance(val, torch.SymFloat) and "unbacked_bindings" not in node.meta:
                    # a read of the float input Dynamo made of a global gives its input's
                    # symbol (torch before 2.15 reads it in the subgraph), which the
                    # subgraph's kernels are not passed: the read defines a symbol of its own
                    shape_env = V.graph.sizevars.shape_env
                    with shape_env.ignore_fresh_unbacked_symbols():
                        val = shape_env.create_unbacked_symfloat()
                    renamed[symbol] = val.node.expr
                    node.meta["val"], symbol = val, val.node.expr
                if symbol.is_Symbol and free_unbacked_symbols(symbol):
                    node.meta.setdefault("unbacked_bindings", {symbol: ()})
                    symbols.add(symbol)
            elif renamed and isinstance(val, (torch.SymInt, torch.SymFloat)):
                # arithmetic on the read (``0.5 * EPS``) names the read's new symbol too
                expr = val.node.expr.xreplace(renamed)
                if expr != val.node.expr:
                    shape_env = V.graph.sizevars.shape_env
                    make = (
                        shape_env.create_symfloatnode
                        if isinstance(val, torch.SymFloat)
                        else shape_env.create_symintnode
                    )
                    node.meta["val"] = make(expr, hint=None)
    return symbols


def _retrace(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` traced again on fresh fake inputs: its ``.item()`` reads get new symbols."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    def fresh(val: Any) -> Any:
        if not isinstance(val, FakeTensor):
            return val
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)

    with V.fake_mode:
        inputs = [fresh(n.meta["val"]) for n in gm.graph.find_nodes(op="placeholder")]
    with enable_python_dispatcher(), V.fake_mode:
        return make_fx(gm, tracing_mode="real")(*inputs)


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


# --- the post-grad pass ----------------------------------------------------------------


def _install_pass() -> None:
    """Make hop's pass the first of ``post_grad_custom_pre_pass``, keeping the user's.

    Inductor's config values are context variables: a value set here would be
    unset in another thread. hop's pass becomes the entry's *default* (seen by every
    context that sets nothing) and, where a pass is already set, goes first in a
    list with it. A pass a user sets later replaces hop's (see ``_not_rewritten``).
    """
    from torch._inductor import config

    current = config.post_grad_custom_pre_pass
    config._config["post_grad_custom_pre_pass"].default = POST_GRAD_PASS  # type: ignore[attr-defined]
    if current is not None:
        config.post_grad_custom_pre_pass = chain(current)


def chain(passes: Any) -> list[Any]:
    """``passes`` (a pass, a list of them or None) with hop's pass first, once:
    ``config.post_grad_custom_pre_pass = hop.compile.inductor.chain(my_pass)``. A list
    that holds hop's pass already is kept as it is (``hop.passes.inductor`` puts its
    optimize pass before it, on purpose)."""
    listed = [] if passes is None else list(passes) if isinstance(passes, (list, tuple)) else [passes]
    if POST_GRAD_PASS in listed:
        return listed
    return [POST_GRAD_PASS, *listed]


# Note [a subgraph's outputs are distinct buffers]
# A branch or loop body that returns one value twice (the gradients of ``x + a`` with
# respect to both, one tensor; a carry returned as two) hands out one buffer as two
# outputs: Inductor's cond and while_loop pass a subgraph's outputs by reference. The
# parent graph takes them for two buffers and may write one in place (``g + 2 * y``
# accumulated into the gradient of ``a``), and the other changes with it: the
# gradient of ``x`` came out as ``y``'s, silently. torch's own cond never returns
# such a pair (its backward clones them). So every output of hop's subgraphs that
# shares storage with an earlier one is cloned before lowering.


def _distinct_outputs(gm: Any) -> None:
    """Note [a subgraph's outputs are distinct buffers], in ``gm`` and the subgraphs it holds."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if not isinstance(gm, torch.fx.GraphModule):
        return
    for child in gm.children():
        _distinct_outputs(child)
    out = gm.graph.output_node()
    values = out.args[0]
    flat = list(values) if isinstance(values, (tuple, list)) else [values]
    seen: set[Any] = set()
    changed = False
    for k, value in enumerate(flat):
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        storage = StorageWeakRef(val.untyped_storage())  # type: ignore[no-untyped-call]
        if storage in seen:
            with gm.graph.inserting_before(out):
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
            copy.meta["val"] = val.clone()
            flat[k], changed = copy, True
        else:
            seen.add(storage)
    if changed:
        out.args = (type(values)(flat) if isinstance(values, (tuple, list)) else flat[0],)
        gm.recompile()


class PostGradPass:
    """Rewrites ``switch``, ``map``, ``scan`` and ``associative_scan`` nodes into
    torch's cond / while_loop and plain ops (a ``post_grad_custom_pre_pass``); gives
    a scatter into an overlapping tensor a dense base first. A node of a user's
    operator with a decomposition is replaced by its trace first.

    A virtual subclass of Inductor's ``CustomGraphPass`` (registered with the
    lowerings, so that defining it does not import Inductor): its :meth:`uuid`
    keys Inductor's FX graph cache, which would otherwise be bypassed.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        if inline_decompositions(graph):  # users' operators: their decompositions' hop nodes follow
            graph.lint()
        if dense_bases(graph):  # Note [a scatter's base is dense] (every graph, hop's or not)
            graph.lint()
        ours = [
            n for n in graph.nodes if n.op == "call_function" and n.target in (cond_op, while_loop_op, *rw.REWRITES)
        ]
        if ours:
            _no_donated_buffers()
            root = graph.owning_module
            for node in ours:
                for arg in node.args:
                    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and root is not None:
                        _distinct_outputs(getattr(root, str(arg.target)))
        for node in ours:
            if node.target is while_loop_op:
                _check_fixed_carries(node)
                _donate_while_inputs(node)
            elif node.target is cond_op and rw.cond_needs_rewrite(node):
                _rewrite(node, rw.rewrite_cond)
            if node.target is scan_op:
                _donate_scan_inputs(node)
            if node.target in rw.REWRITES:
                _rewrite(node, rw.REWRITES[node.target])

    def __deepcopy__(self, memo: dict[int, Any]) -> PostGradPass:
        return self  # Inductor's config copies a default it hands out; one pass is enough

    def uuid(self) -> Any:
        """Keys Inductor's FX graph cache and AOTAutograd's (which hashes Inductor's
        passes too): Note [hop in the compile caches]."""
        return _source_hash()


# Note [hop in the compile caches]: hop's operators are cacheable, so a second
# process that compiles the same program loads its code from the FX graph and
# AOTAutograd caches instead of compiling again. A cache key covers the graph's
# code and its subgraphs' (a branch that changes misses), torch's version and
# config, and the uuid of each custom pass: ours hashes every source file of hop,
# because the compiled code depends on more than the rewrites (the autograd and
# functionalization rules that build the joint graph, the Dynamo handlers, the
# lowerings), so a hop that changes never loads code an older one compiled.
# An operator users define with hop.HigherOrderOperator stays uncacheable unless
# they say otherwise: its rules are theirs, outside this hash.
@functools.cache
def _source_hash() -> bytes:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    package = Path(__file__).resolve().parent.parent
    return get_hash_for_files(tuple(str(p) for p in sorted(package.rglob("*.py"))))


def _donate_while_inputs(node: torch.fx.Node) -> None:
    """Note [a written graph input is the loop's own carry]."""
    root = node.graph.owning_module
    cond_fn, body_fn, carries, additional = node.args[:4]
    if root is None or not all(isinstance(g, torch.fx.Node) and g.op == "get_attr" for g in (cond_fn, body_fn)):
        return
    cond_gm, body_gm = (getattr(root, str(g.target)) for g in (cond_fn, body_fn))  # type: ignore[union-attr]
    carries, additional = list(carries), list(additional)  # type: ignore[arg-type]
    written = write_carries_in_place(body_gm, carries)
    subgraphs = [(cond_gm, len(carries)), (body_gm, len(carries))]
    donate_written_inputs(node, carries, additional, subgraphs, written)


def _donate_scan_inputs(node: torch.fx.Node) -> None:
    """Note [a written graph input is the loop's own carry], for the loop a scan becomes."""
    root = node.graph.owning_module
    body_fn, init, xs, additional = node.args[:4]
    if root is None or not (isinstance(body_fn, torch.fx.Node) and body_fn.op == "get_attr"):
        return
    body_gm = getattr(root, str(body_fn.target))
    init, xs, additional = list(init), list(xs), list(additional)  # type: ignore[arg-type]
    written = write_carries_in_place(body_gm, init)
    donate_written_inputs(node, init, additional, [(body_gm, len(init) + len(xs))], written)


def _check_fixed_carries(node: torch.fx.Node) -> None:
    """Refuse a loop whose carries change size (see ``rw.growing_carries``), before
    Inductor's lowering fails on it with an assertion of its own."""
    carried = [c.meta.get("val") if isinstance(c, torch.fx.Node) else c for c in node.args[2]]  # type: ignore[union-attr]
    resized = rw.resized_carries(carried, _flat_outputs(node))
    if resized:
        raise rw.growing_carries("while_loop", resized)


def _flat_outputs(node: torch.fx.Node) -> list[Any]:
    val = node.meta["val"]
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _rewrite(node: torch.fx.Node, rewrite: Fn) -> None:
    """Replace ``node`` by the trace of ``rewrite(node, inputs, *args)``: its subgraph
    arguments resolved to GraphModules, ``inputs`` the traced values of the node's
    inputs and of the nodes that define the symbols in their sizes.

    A match of Inductor's pattern matcher made by hand: its ``PatternMatcherPass``
    would skip nodes of some dtypes (complex) that hop's rewrite handles.
    """
    from torch._inductor.pattern_matcher import CallFunctionVarArgs

    root = node.graph.owning_module
    resolved = [_graph_module(root, a) for a in node.args]
    flat, spec = pytree.tree_flatten(resolved)
    inputs = [a for a in flat if isinstance(a, torch.fx.Node)]

    def replacement(*values: Any) -> Any:
        it = iter(values)
        full = [next(it) if isinstance(a, torch.fx.Node) else a for a in flat]
        return rewrite(node, values, *pytree.tree_unflatten(full, spec))

    _allow_scalar_outputs()
    # Only the branching rewrites read int outputs back (a scan's int carry is a loop output).
    bound = rw.bound_int_outputs(node) if rewrite in (rw.rewrite_cond, rw.rewrite_switch) else {}
    vals = _flat_outputs(node)
    match: Any = CallFunctionVarArgs(node.target).match(node)
    added = match.replace_by_example(
        replacement, [*inputs, *_symbol_sources(node, inputs)], run_functional_passes=False
    )
    _rebind_items(added, node, {k: (symbol, vals[k]) for k, symbol in sorted(bound.items())})


def _rebind_items(added: Sequence[torch.fx.Node], node: torch.fx.Node, bound: dict[int, Any]) -> None:
    """Note [int outputs of branches]: the rewrite read each int output the hop node
    defined (``bound``: output position -> (its symbol, its value)) with one
    ``.item()``; that read now defines the node's symbol instead of a fresh one. Each
    read is found by the symbol it returned in the rewrite's trace (recorded under
    ``rw.INT_READS``): a switch of one branch is inlined, and that branch's own reads
    sit among them."""
    items = [n for n in added if n.target is torch.ops.aten._local_scalar_dense.default]
    recorded: dict[int, set[Any]] = node.meta.pop(rw.INT_READS, {})

    def symbol_of(item: torch.fx.Node) -> Any:
        val = item.meta.get("val")
        return val.node.expr if isinstance(val, torch.SymInt) else None

    reads = set()
    for k, (symbol, val) in bound.items():
        found = [n for n in items if symbol_of(n) in recorded.get(k, ())]
        if len(found) != 1:
            what = f"Inductor: output {k}, an int the branches return, was read {len(found)} times, not once"
            raise HopRuntimeError(format_message("compile", what), op="compile")
        found[0].meta["val"] = val
        found[0].meta["unbacked_bindings"] = {symbol: ()}
        reads.add(found[0])
    # The inlined branch's own reads: the retrace gave each a fresh symbol but no
    # binding, and Inductor's fake-tensor update, rerunning them, could not tell the
    # new symbol for the old one (it fails comparing the conditions that use them).
    for item in items:
        symbol = symbol_of(item)
        if item not in reads and symbol is not None and symbol.is_Symbol and "unbacked_bindings" not in item.meta:
            item.meta["unbacked_bindings"] = {symbol: ()}


def _allow_scalar_outputs() -> None:
    """Let the rewritten loops read their counter with ``.item()``.

    The fake mode of a ``torch.compile`` refuses ``.item()`` unless Dynamo's
    ``capture_scalar_outputs`` is set (torch's own scan lowering then fails). The
    rewrite traces such reads, and Inductor's later passes re-run the loops' fake
    rules, so the compilation's fake mode allows them from here on (Dynamo has
    finished tracing: only Inductor's own fake propagation is affected).
    """
    from torch._inductor.virtualized import V

    if not getattr(V.fake_mode, "allow_scalar_outputs", True):
        V.fake_mode.allow_scalar_outputs = True


def _symbol_sources(node: torch.fx.Node, inputs: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """Earlier nodes whose value is, or has a size that is, a symbol the inputs' sizes
    use but do not hold as a size of their own (``n`` for an input of length ``n - 1``)."""
    vals = [i.meta.get("val") for i in inputs]
    missing = rw.free_symbols(vals) - rw.plain_symbols(vals).keys()
    sources = []
    for earlier in node.graph.nodes:
        if earlier is node or not missing:
            break
        found = rw.plain_symbols([earlier.meta.get("val")]).keys() & missing
        if found:
            sources.append(earlier)
            missing -= found
    return sources


def _graph_module(root: Any, arg: Any) -> Any:
    """``arg``, or the GraphModule it names if it is a get_attr node (a subgraph)."""
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        return operator.attrgetter(str(arg.target))(root)
    return arg


POST_GRAD_PASS = PostGradPass()

on_import("torch._inductor.lowering", _register)
# As soon as the config exists: a user's config.patch(post_grad_custom_pre_pass=...)
# then saves and restores a value that holds hop's pass (installed at the first
# compile instead, inside such a patch, it would be lost when the patch ends).
on_import("torch._inductor.config", lambda config: _install_pass())
