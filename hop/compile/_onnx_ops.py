"""The ONNX translations of hop's operators (loaded by :mod:`hop.compile.onnx` when the exporter loads).

torch's exporter turns every subgraph of an exported program into an ONNX local
function (an ``ir.Function``) and hands it to the translation of the node that uses
it, in place of the ``get_attr`` argument; tensors and SymInts arrive as
``ir.Value`` s. Each translation here builds ONNX control flow whose subgraphs call
those functions:

- ``cond``: ``If``;
- ``switch``: a chain of ``If`` on ``index == k``, after a range check that makes
  onnxruntime fail for an index out of range (Note [switch's range check]);
- ``while_loop`` (and ``fori_loop``, a while_loop in the graph): ``Loop`` without a
  trip count, the condition evaluated before the first step and after each;
- ``scan`` and ``map`` (a scan without carries): ``Loop`` over the length of xs,
  the ys its scan outputs (Note [scans as ONNX loops]);
- ``associative_scan``: with ``combine_mode="pointwise"`` a parallel prefix, one
  ``Loop`` of ceil(log2 n) steps (Note [a pointwise associative_scan in ONNX]);
  ``"generic"``: the sequential scan it equals (one combine per element), under an
  ``If`` for a length of 0 or 1.

The nodes go to the exporter's recorder (``_core.current_tracer``), as torch's
own translations of its control flow do; their subgraphs read outer values by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from hop.errors import CompileUnsupported, format_message
from hop.ops.branching.cond import cond_op
from hop.ops.branching.switch import switch_op
from hop.ops.scanning.associative_scan import associative_scan_op
from hop.ops.scanning.map import map_op
from hop.ops.scanning.scan import scan_op
from hop.ops.while_loops.while_loop import while_loop_op

__all__ = ["TRANSLATIONS"]

Outputs = ir.Value | Sequence[ir.Value]
_IDS = itertools.count()  # value names unique across nested subgraphs (onnxruntime wants unique names)
_INT64_MAX = np.iinfo(np.int64).max


def _name(role: str) -> str:
    return f"hop_{role}_{next(_IDS)}"


def _recorder() -> Any:
    """The exporter's recorder of the node being translated."""
    from torch.onnx._internal.exporter import _core

    tracer = _core.current_tracer
    if tracer is None:
        raise CompileUnsupported(format_message("onnx", "a translation ran outside torch.onnx.export"), op="onnx")
    return tracer


class _Nodes:
    """Nodes being built: for the exporter's graph (``outer``) or for one subgraph."""

    def __init__(self, *, outer: bool = False) -> None:
        self.nodes: list[ir.Node] = _recorder().nodes if outer else []
        self.version: int = _recorder().opset.version

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], n: int = 1, **attrs: Any) -> Sequence[ir.Value]:
        node = ir.Node(
            "", op_type, inputs, attributes=[_attr(k, v) for k, v in attrs.items()], num_outputs=n, version=self.version
        )
        return self._add(node, op_type.lower())

    def call(self, fn: ir.Function, inputs: Sequence[ir.Value]) -> Sequence[ir.Value]:
        """A call of the subgraph ``fn``, its outputs typed as ``fn`` declares them."""
        node = ir.Node(fn.domain, fn.name, inputs, num_outputs=len(fn.outputs), overload=fn.overload)
        for out, declared in zip(node.outputs, fn.outputs, strict=True):
            out.shape, out.type = declared.shape, declared.type
        return self._add(node, fn.name)

    def const(self, value: Any, dtype: Any = np.int64) -> ir.Value:
        return self.op("Constant", [], value=ir.tensor(np.asarray(value, dtype=dtype)))[0]

    def graph(self, inputs: Sequence[ir.Value], outputs: Sequence[ir.Value], role: str) -> ir.Graph:
        return ir.Graph(inputs, outputs, nodes=self.nodes, name=_name(role))

    def _add(self, node: ir.Node, role: str) -> Sequence[ir.Value]:
        for out in node.outputs:
            out.name = _name(role)
        self.nodes.append(node)
        return node.outputs


def _attr(name: str, value: Any) -> ir.Attr:
    if isinstance(value, ir.Graph):
        return ir.AttrGraph(name, value)
    if isinstance(value, bool | int):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, list | tuple):
        return ir.AttrInt64s(name, [int(v) for v in value])
    return ir.AttrTensor(name, value)


def _fresh(template: Sequence[ir.Value], role: str) -> list[ir.Value]:
    """New inputs of a loop's body, typed as ``template`` (a traced subgraph's inputs: a
    carry that grows has a symbolic size there)."""
    return [ir.Value(name=_name(role), shape=v.shape, type=v.type) for v in template]


def _scalar(role: str, dtype: ir.DataType) -> ir.Value:
    return ir.Value(name=_name(role), shape=ir.Shape([]), type=ir.TensorType(dtype))


def _pack(outputs: Sequence[ir.Value]) -> Outputs:
    """The raw ops' output convention: a bare value for one output, else a sequence."""
    return outputs[0] if len(outputs) == 1 else list(outputs)


def _values(nodes: _Nodes, args: Sequence[Any], fn: ir.Function, first: int, op: str) -> list[ir.Value]:
    """``args`` as ONNX values: a Python number (a constant the program kept) becomes a
    constant of the dtype of ``fn``'s matching input (from position ``first``)."""
    out = []
    for k, a in enumerate(args):
        if isinstance(a, ir.Value):
            out.append(a)
        elif isinstance(a, bool | int | float):
            dtype = fn.inputs[first + k].dtype
            np_dtype = dtype.numpy() if dtype is not None else np.asarray(a).dtype
            out.append(nodes.const(a, np_dtype))
        else:
            raise CompileUnsupported(
                format_message(op, f"ONNX export: an input of type {type(a).__name__} is not supported"), op=op
            )
    return out


def _calling(fn: ir.Function, inputs: Sequence[ir.Value], role: str) -> ir.Graph:
    """A graph without inputs that calls ``fn`` on outer values (a branch of ``If``)."""
    body = _Nodes()
    return body.graph([], body.call(fn, inputs), role)


# --- cond and switch -------------------------------------------------------------------------


def translate_cond(pred: Any, true_fn: ir.Function, false_fn: ir.Function, operands: Sequence[Any]) -> Outputs:
    nodes = _Nodes(outer=True)
    args = _values(nodes, operands, true_fn, 0, "cond")
    if not isinstance(pred, ir.Value):
        pred = nodes.const(bool(pred), np.bool_)
    then, other = _calling(true_fn, args, "then"), _calling(false_fn, args, "else")
    return _pack(nodes.op("If", [pred], len(true_fn.outputs), then_branch=then, else_branch=other))


# Note [switch's range check]
# An index out of range raises in eager (and an exported program asserts it, an
# assertion torch's exporter drops): the ONNX graph must not run some branch
# instead. ONNX has no assert; Gather fails on an index out of range, but accepts
# [-m, m) for m entries. So the chain reads the index through a Gather of an m = n
# entry table at 2 * index - (n - 1), in range exactly when 0 <= index < n, and adds
# the (zero) entry to the index, so that no optimizer drops the check.


def translate_switch(index: Any, operands: Sequence[Any], *branches: ir.Function) -> Outputs:
    nodes = _Nodes(outer=True)
    args = _values(nodes, operands, branches[0], 0, "switch")
    n = len(branches)
    if not isinstance(index, ir.Value):
        index = nodes.const(int(index))
    index = nodes.op("Cast", [index], to=ir.DataType.INT64)[0]
    probe = nodes.op("Sub", [nodes.op("Mul", [index, nodes.const(2)])[0], nodes.const(n - 1)])[0]
    zero = nodes.op("Gather", [nodes.const(np.zeros(n)), probe])[0]
    index = nodes.op("Add", [index, zero])[0]
    return _pack(_switch_chain(nodes, index, args, branches, 0))


def _switch_chain(
    nodes: _Nodes, index: ir.Value, args: Sequence[ir.Value], branches: Sequence[ir.Function], k: int
) -> Sequence[ir.Value]:
    """Branch ``k`` if ``index == k``, else the chain from ``k + 1`` (the last: itself)."""
    if k == len(branches) - 1:
        return nodes.call(branches[k], args)
    rest = _Nodes()
    other = rest.graph([], _switch_chain(rest, index, args, branches, k + 1), f"switch_{k + 1}")
    is_k = nodes.op("Equal", [index, nodes.const(k)])[0]
    then = _calling(branches[k], args, f"switch_{k}")
    return nodes.op("If", [is_k], len(branches[k].outputs), then_branch=then, else_branch=other)


# --- while_loop --------------------------------------------------------------------------------


def translate_while_loop(
    cond_fn: ir.Function,
    body_fn: ir.Function,
    carries: Sequence[Any],
    additional: Sequence[Any],
    checkpoint: bool = False,
) -> Outputs:
    """A ``Loop``; ``checkpoint`` only chose a reverse mode (Note [the checkpoint keyword])."""
    nodes = _Nodes(outer=True)
    init = _values(nodes, carries, body_fn, 0, "while_loop")
    extra = _values(nodes, additional, body_fn, len(init), "while_loop")
    (go,) = nodes.call(cond_fn, [*init, *extra])
    body = _Nodes()
    step, going = _scalar("step", ir.DataType.INT64), _scalar("going", ir.DataType.BOOL)  # a Loop body's first inputs
    inputs = _fresh(body_fn.inputs[: len(init)], "carry")
    new = body.call(body_fn, [*inputs, *extra])
    (again,) = body.call(cond_fn, [*new, *extra])
    graph = body.graph([step, going, *inputs], [again, *new], "while_body")
    return _pack(nodes.op("Loop", [None, go, *init], len(init), body=graph))


# --- scan, map, associative_scan ------------------------------------------------------------


# Note [scans as ONNX loops]
# A scan is a Loop over the length of xs: step i gathers slice i (n - 1 - i for
# reverse) of each xs, calls the body, and the ys are the Loop's scan outputs,
# stacked along a new dim 0 (reversed at the end for reverse). ONNX's Scan would
# read better but fails in onnxruntime for a length of 0; a Loop of no steps gives
# its scan outputs the shape [0, *the body's declared output shape], with 0 for each
# dim the body does not declare statically. So each y's output is declared with
# the body function's static shape, and where one is not static, a length of 0 makes
# onnxruntime fail (a Gather out of range, as in Note [switch's range check])
# rather than return a tensor of the wrong shape.


Step = Callable[["_Nodes", Sequence[ir.Value], Sequence[ir.Value]], Sequence[ir.Value]]


def _calls(fn: ir.Function, additional: Sequence[ir.Value]) -> Step:
    """A scan's step that calls ``fn(*carries, *slices, *additional) -> (*carries, *ys)``."""
    return lambda body, states, slices: body.call(fn, [*states, *slices, *additional])


def _scan(
    nodes: _Nodes,
    init: Sequence[ir.Value],
    xs: Sequence[ir.Value],
    step_fn: Step,
    carries: Sequence[ir.Value],
    ys: Sequence[ir.Value],
    reverse: bool,
    op: str,
) -> list[ir.Value]:
    """Note [scans as ONNX loops]: ``step_fn`` returns the new carries, then the ys;
    ``carries`` and ``ys`` are values typed as they are in the body."""
    if not xs:
        raise CompileUnsupported(format_message(op, "ONNX export of a scan over no xs"), op=op)
    length = _length(nodes, xs[0])
    k = len(init)
    for x in xs[1:]:  # equal when traced, unless a trace left it to run time (ONNX has no assert)
        if not _same_static_length(x, xs[0]):
            length = _fail_if(nodes, length, nodes.op("Not", [nodes.op("Equal", [length, _length(nodes, x)])[0]])[0])
    if not all(_static(y.shape) for y in ys):
        length = _fail_if(nodes, length, nodes.op("Equal", [length, nodes.const(0)])[0])
    body = _Nodes()
    step, going = _scalar("step", ir.DataType.INT64), _scalar("going", ir.DataType.BOOL)  # a Loop body's first inputs
    states = _fresh(carries, "carry")
    at = body.op("Sub", [body.op("Sub", [length, body.const(1)])[0], step])[0] if reverse else step
    slices = [body.op("Gather", [x, at], axis=0)[0] for x in xs]
    outs = step_fn(body, states, slices)
    graph = body.graph([step, going, *states], [body.op("Identity", [going])[0], *outs], f"{op}_body")
    always = nodes.const(True, np.bool_)  # (an omitted condition input would drop off a Loop without carries)
    result = list(nodes.op("Loop", [length, always, *init], len(outs), body=graph))
    if reverse:
        flip = [nodes.const([-1]), nodes.const([-_INT64_MAX]), nodes.const([0]), nodes.const([-1])]
        result[k:] = [nodes.op("Slice", [y, *flip])[0] for y in result[k:]]
    return result


def _length(nodes: _Nodes, x: ir.Value) -> ir.Value:
    """The size of ``x``'s dim 0, an int64 scalar."""
    return nodes.op("Gather", [nodes.op("Shape", [x])[0], nodes.const(0)], axis=0)[0]


def _static(shape: ir.Shape | None) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def _same_static_length(x: ir.Value, y: ir.Value) -> bool:
    return x.shape is not None and y.shape is not None and isinstance(x.shape[0], int) and x.shape[0] == y.shape[0]


def _fail_if(nodes: _Nodes, length: ir.Value, wrong: ir.Value) -> ir.Value:
    """``length``, read through a Gather that is out of range when ``wrong`` (a bool) holds."""
    index = nodes.op("Cast", [wrong], to=ir.DataType.INT64)[0]
    return nodes.op("Add", [length, nodes.op("Gather", [nodes.const([0]), index])[0]])[0]


def translate_scan(
    body_fn: ir.Function, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> Outputs:
    nodes = _Nodes(outer=True)
    carries = _values(nodes, init, body_fn, 0, "scan")
    extra = _values(nodes, additional, body_fn, len(carries) + len(xs), "scan")
    k = len(carries)
    step = _calls(body_fn, extra)
    return _pack(_scan(nodes, carries, list(xs), step, body_fn.inputs[:k], body_fn.outputs[k:], bool(reverse), "scan"))


def translate_map(body_fn: ir.Function, xs: Sequence[Any], additional: Sequence[Any]) -> Outputs:
    nodes = _Nodes(outer=True)
    extra = _values(nodes, additional, body_fn, len(xs), "map")
    return _pack(_scan(nodes, [], list(xs), _calls(body_fn, extra), [], body_fn.outputs, False, "map"))


def translate_associative_scan(
    combine_fn: ir.Function, xs: Sequence[Any], additional: Sequence[Any], combine_mode: str
) -> Outputs:
    """``out[0] = xs[0]``, ``out[i] = combine(out[i - 1], xs[i])``. Pointwise: a parallel
    prefix. Generic: a scan over ``xs[1:]`` from ``xs[0]`` whose ys are its carries; a
    length of 0 or 1 is its own result."""
    nodes = _Nodes(outer=True)
    xs = list(xs)
    extra = _values(nodes, additional, combine_fn, 2 * len(xs), "associative_scan")
    if combine_mode == "pointwise":
        return _pack(_parallel_prefix(nodes, xs, combine_fn, extra))
    short = nodes.op("LessOrEqual", [_length(nodes, xs[0]), nodes.const(1)])[0]
    ident = _Nodes()
    same = ident.graph([], [ident.op("Identity", [x])[0] for x in xs], "short")
    seq = _Nodes()
    zero, one, end = seq.const([0]), seq.const([1]), seq.const([_INT64_MAX])
    firsts = [seq.op("Slice", [x, zero, one, zero])[0] for x in xs]
    rests = [seq.op("Slice", [x, one, end, zero])[0] for x in xs]
    heads = [seq.op("Squeeze", [f, zero])[0] for f in firsts]

    def combine(body: _Nodes, acc: Sequence[ir.Value], x: Sequence[ir.Value]) -> Sequence[ir.Value]:
        new = body.call(combine_fn, [*acc, *x, *extra])
        copies = [body.op("Identity", [v])[0] for v in new]  # a graph's outputs are distinct values
        for copy, v in zip(copies, new, strict=True):
            copy.shape, copy.type = v.shape, v.type
        return [*new, *copies]

    accumulators, combined = combine_fn.inputs[: len(xs)], combine_fn.outputs
    ys = _scan(seq, heads, rests, combine, accumulators, combined, False, "associative_scan")[len(xs) :]
    outs = [seq.op("Concat", [f, y], axis=0)[0] for f, y in zip(firsts, ys, strict=True)]
    sequential = seq.graph([], outs, "sequential")
    return _pack(nodes.op("If", [short], len(xs), then_branch=same, else_branch=sequential))


# Note [a pointwise associative_scan in ONNX]
# A pointwise combine_fn takes batches of slices at once (as the dense rule calls it),
# so the scan is the Hillis-Steele prefix: for d = 1, 2, 4, ... while d < n,
# out = concat(out[:d], combine(out[:n - d], out[d:])). Each step combines every
# element with the one d before it, so after step k, out[i] combines the 2^k
# elements ending at i: ceil(log2 n) steps, one batched combine each, the same
# result as the sequential scan for an associative combine_fn. A length of 0 or 1
# runs no step. The shapes combine_fn's function declares (of one slice, for its
# inputs, outputs and every value inside) are dropped, since here it gets batches;
# the dtypes stay.


def _parallel_prefix(
    nodes: _Nodes, xs: Sequence[ir.Value], combine_fn: ir.Function, extra: Sequence[ir.Value]
) -> list[ir.Value]:
    one = nodes.const(1)
    start = nodes.op("Less", [one, _length(nodes, xs[0])])[0]
    body = _Nodes()
    step, going = _scalar("step", ir.DataType.INT64), _scalar("going", ir.DataType.BOOL)  # a Loop body's first inputs
    stride = _scalar("stride", ir.DataType.INT64)
    outs = _fresh(xs, "prefix")
    n = _length(body, outs[0])
    axis0, end = body.const([0]), body.const([_INT64_MAX])
    d = body.op("Unsqueeze", [stride, axis0])[0]
    n_d = body.op("Unsqueeze", [body.op("Sub", [n, stride])[0], axis0])[0]
    heads = [body.op("Slice", [o, axis0, d, axis0])[0] for o in outs]
    earlier = [body.op("Slice", [o, axis0, n_d, axis0])[0] for o in outs]
    later = [body.op("Slice", [o, d, end, axis0])[0] for o in outs]
    _untyped_shapes(combine_fn)
    combined = body.call(combine_fn, [*earlier, *later, *extra])
    new = [body.op("Concat", [h, c], axis=0)[0] for h, c in zip(heads, combined, strict=True)]
    doubled = body.op("Mul", [stride, body.const(2)])[0]
    again = body.op("Less", [doubled, n])[0]
    graph = body.graph([step, going, stride, *outs], [again, doubled, *new], "prefix_body")
    return list(nodes.op("Loop", [None, start, one, *xs], 1 + len(xs), body=graph))[1:]


def _untyped_shapes(fn: ir.Function) -> None:
    for value in [*fn.inputs, *fn.outputs, *(out for node in fn for out in node.outputs)]:
        value.shape = None


def _ops() -> dict[Any, Callable[..., Outputs]]:

    return {
        cond_op: translate_cond,
        switch_op: translate_switch,
        while_loop_op: translate_while_loop,
        scan_op: translate_scan,
        map_op: translate_map,
        associative_scan_op: translate_associative_scan,
    }


TRANSLATIONS: dict[Any, Callable[..., Outputs]] = _ops()
"""Each hop operator's translation (``fori_loop`` is a ``while_loop`` node)."""
