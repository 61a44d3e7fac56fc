"""hop's Inductor post-grad pass (``torch._inductor.config.post_grad_custom_pre_pass``):
users' operators inlined, dense bases for overlapping scatters, then ``switch``,
``map``, ``scan`` and ``associative_scan`` rewritten into torch's cond / while_loop and
plain ops (the rewrites: ``hop.compile._inductor_rewrites``), carries donated and
written in place where nothing else reads them. ``hop.compile.inductor`` installs it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from hop.compile import _inductor_rewrites as rw
from hop.compile import _inductor_scans as scans
from hop.compile._inductor_decomposed import inline_decompositions
from hop.compile._inductor_in_place import donate_written_inputs, write_carries_in_place
from hop.compile._inductor_scatter import dense_bases
from hop.compile._inductor_subgraphs import no_donated_buffers
from hop.errors import HopRuntimeError, format_message
from hop.ops.branching.cond import cond_op
from hop.ops.branching.switch import switch_op
from hop.ops.scanning.associative_scan import associative_scan_op
from hop.ops.scanning.map import map_op
from hop.ops.scanning.scan import scan_op
from hop.ops.while_loops.while_loop import while_loop_op

__all__ = ["POST_GRAD_PASS", "REWRITES", "PostGradPass", "chain", "install_pass"]

Fn = Callable[..., Any]

# The operators the pass rewrites into torch's cond / while_loop and plain ops (cond
# and while_loop are lowered as they are; a cond with int outputs is rewritten too).
REWRITES: dict[Any, Fn] = {
    switch_op: rw.rewrite_switch,
    map_op: scans.rewrite_map,
    scan_op: scans.rewrite_scan,
    associative_scan_op: scans.rewrite_associative_scan,
}


def install_pass() -> None:
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
        ours = [n for n in graph.nodes if n.op == "call_function" and n.target in (cond_op, while_loop_op, *REWRITES)]
        if ours:
            no_donated_buffers()
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
            if node.target in REWRITES:
                _rewrite(node, REWRITES[node.target])

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
    resized = rw.resized_carries(carried, rw.node_outputs(node))
    if resized:
        raise rw.growing_carries("while_loop", resized)


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
    vals = rw.node_outputs(node)
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
