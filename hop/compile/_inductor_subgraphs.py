"""What a branch or loop body's subgraph and operands need before Inductor lowers
them with torch's lowerings of cond and while_loop (``hop.compile.inductor``): operands
in their traced strides and simplest sizes, constants written into the subgraphs,
int reads bound to their symbols and run first, and buffers no backward may donate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from hop.compile import _torch_api

__all__ = [
    "bind_item_symbols",
    "inline_constant_inputs",
    "no_donated_buffers",
    "own_buffers",
    "reads_first",
    "retrace",
    "simplest_sizes",
    "traced_strides",
    "tuple_outputs",
    "writes_in_carry_order",
]


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


def simplest_sizes(node: torch.fx.Node, position: int, values: Sequence[Any]) -> list[Any]:
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


def traced_strides(values: Sequence[Any], traced: Any) -> list[Any]:
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


def tuple_outputs(*graphs: torch.fx.GraphModule) -> None:
    """Make branch subgraphs that return one output bare return a 1-tuple: torch's
    lowering (``ir.Switch`` from torch 2.14) reads the branches' outputs as a sequence.
    Idempotent: two cond nodes may share a branch subgraph."""
    for gm in graphs:
        out = gm.graph.output_node()
        if not isinstance(out.args[0], (tuple, list)):
            out.args = ((out.args[0],),)
            gm.recompile()


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


def reads_first(operations: Sequence[Any]) -> None:
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


def inline_constant_inputs(
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


def no_donated_buffers() -> None:
    """Note [donated buffers and subgraphs], at pass time."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if getattr(meta, "bw_donated_idxs", None):
        meta.bw_donated_idxs = []  # type: ignore[union-attr]  # AOTAutograd's "none donated"


@contextlib.contextmanager
def writes_in_carry_order() -> Iterator[None]:
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
def own_buffers() -> Iterator[None]:
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


def bind_item_symbols(*graphs: torch.fx.GraphModule) -> set[Any]:
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


def retrace(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
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
