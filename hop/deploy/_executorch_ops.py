"""hop's operators written with torch's own control flow, for ExecuTorch.

Each ``as_<op>`` takes a hop node's arguments (its subgraphs as callables) and returns
what the node returns, computed with ``torch.cond`` and torch's ``scan`` only: ExecuTorch
runs those and no other control flow. They run inside a ``torch.export`` trace
(hop.deploy._executorch), which records torch's nodes in their place.

Note [checks that survive to_executorch]: ExecuTorch's ``to_executorch`` removes every
assert, so a check a deployed program must keep (a switch's index range, a loop that
would run past ``max_steps``) is written as data: an ``index_select`` whose index is
out of range exactly when the check fails, feeding a value the program returns.
ExecuTorch's kernel (and torch's) fails on such an index; it never wraps it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._higher_order_ops.scan import scan as torch_scan

Fn = Callable[..., Any]
aten = torch.ops.aten


def _leaves(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _aliasing_outputs(gm: torch.fx.GraphModule) -> list[bool]:
    """Which outputs of ``gm`` are one of its inputs, a view, or an output seen before:
    torch's control flow refuses those, so they are returned as dense copies."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = _leaves(output.args[0])
    seen: set[Any] = set()
    marks = []
    for out in outs:
        # a view of anything: torch's cond takes dense outputs only (a slice is not)
        view = isinstance(out, torch.fx.Node) and out.op == "call_function" and _is_view(out.target)
        alias = view or (isinstance(out, torch.fx.Node) and out.op == "placeholder") or (out in seen)
        marks.append(alias)
        if isinstance(out, torch.fx.Node):
            seen.add(out)
    return marks


def _is_view(target: Any) -> bool:
    return bool(getattr(target, "is_view", False)) or target is operator.getitem


# Note [ints as tensors in a deployed subgraph]: hop's subgraphs read an int carry (a
# counter) with item() and compute with Python ints. Inside torch's cond and scan, each
# item() makes an unbacked symbol that ExecuTorch's re-trace (to_edge) finds pending and
# refuses; so the subgraph runs with item() returning the 0-d tensor itself and the int
# arithmetic on it done by tensor ops, in int64, or float64 where Python's would be a float.
_INT_OPS: dict[Any, Fn] = {
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.floordiv: operator.floordiv,
    operator.mod: operator.mod,
    operator.truediv: operator.truediv,
    operator.neg: operator.neg,
    operator.lt: operator.lt,
    operator.le: operator.le,
    operator.gt: operator.gt,
    operator.ge: operator.ge,
    operator.eq: operator.eq,
    operator.ne: operator.ne,
    operator.and_: torch.logical_and,
    operator.or_: torch.logical_or,
    torch.sym_not: torch.logical_not,
    torch.sym_max: torch.maximum,
    torch.sym_min: torch.minimum,
}


def prepare(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a hop subgraph as torch's control flow takes it: returning a flat tuple,
    of fresh tensors (a copy where it would return an input, a view of one or one value
    twice), its item()s kept as tensors (Note [ints as tensors in a deployed subgraph]).
    A GraphModule made ahead, not a wrapper: torch's cond and scan trace their callables
    with Dynamo, which does not look into fx graphs."""
    aliasing = _aliasing_outputs(gm)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    kept: set[torch.fx.Node] = set()  # gm's nodes whose value, a number, is a 0-d tensor

    def new(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    def number(a: Any) -> Any:  # a kept value where only a number goes
        return torch.fx.node.map_arg(
            a, lambda n: graph.call_function(aten.item.default, (env[n],)) if n in kept else env[n]
        )

    for node in gm.graph.nodes:
        holds = any(a in kept for a in node.all_input_nodes)
        if node.op == "output":
            outs = [number(o) for o in _leaves(node.args[0])]
            fresh = [
                graph.call_function(aten.clone.default, (o,), {"memory_format": torch.contiguous_format})
                if copy and isinstance(o, torch.fx.Node)
                else o
                for o, copy in zip(outs, aliasing, strict=True)
            ]
            graph.output(tuple(fresh))
        elif node.target is aten.item.default and _zero_dim(node.args[0]):
            env[node] = env[node.args[0]]
            kept.add(node)
        elif holds and node.target in _INT_OPS:
            args = new(node.args)
            floats = node.target is operator.truediv or any(isinstance(a, float) for a in node.args)
            if floats:
                args = tuple(_float64(graph, a) if isinstance(a, torch.fx.Node) else a for a in args)
            env[node] = graph.call_function(_INT_OPS[node.target], args)
            kept.add(node)
        elif holds and node.target is aten.scalar_tensor.default:
            dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
            env[node] = graph.call_function(aten._to_copy.default, (env[node.args[0]],), {"dtype": dtype})
        elif holds and node.target is aten.full.default and node.args[1] in kept:
            dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
            env[node] = graph.call_function(_filled, (new(node.args[0]), env[node.args[1]], dtype))
        elif holds and _tensor_overload(node.target) is not None:  # le.Scalar(x, i): le.Tensor(x, i)
            env[node] = graph.call_function(_tensor_overload(node.target), new(node.args), number(node.kwargs))
        elif holds:
            env[node] = graph.call_function(node.target, _tensor_slots(node, new, number), number(node.kwargs))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph)


def _filled(size: Any, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.full(size, value)`` for a 0-d tensor ``value``."""
    return value.to(dtype).expand(size).clone()


def _tensor_overload(target: Any) -> Any:
    """The ``.Tensor`` overload of a ``.Scalar`` one (``aten.le.Scalar``), else None."""
    if not isinstance(target, torch._ops.OpOverload) or target._overloadname != "Scalar":
        return None
    return getattr(target.overloadpacket, "Tensor", None)


def _zero_dim(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _float64(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float64})


def _tensor_slots(node: torch.fx.Node, new: Fn, number: Fn) -> tuple[Any, ...]:
    """``node``'s arguments, a kept value passed as its tensor where the schema takes a
    Tensor (``aten.add.Tensor(x, i)``), as a number elsewhere."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return tuple(number(node.args))
    out = []
    for k, a in enumerate(node.args):
        takes_tensor = k < len(schema.arguments) and str(schema.arguments[k].type) == "Tensor"
        out.append(new(a) if takes_tensor else number(a))
    return tuple(out)


def fail_unless(ok: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, through a read that fails where ``ok`` is false (Note [checks that
    survive to_executorch])."""
    bad = torch.logical_not(ok.reshape(1)).to(torch.int64)
    gate = torch.ones(1, dtype=torch.bool, device=value.device).index_select(0, bad).reshape(())
    return torch.where(gate, value, value)


# Note [a cond's outputs copied at once]: ExecuTorch 1.5.1 plans the outputs of two
# torch.cond calls of one program into one buffer, so the second overwrites the
# first's values while they are still to be read (two conds on scalars, in a loop's
# body or not, gave the second's value for both: silently). A copy made right after each
# cond, before anything else runs, keeps the values; it costs one copy of the outputs.
def _cond(pred: Any, true_fn: Fn, false_fn: Fn, operands: tuple[Any, ...]) -> tuple[Any, ...]:
    out = torch.cond(pred, true_fn, false_fn, operands)
    return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)


def as_cond(pred: Any, true_fn: Fn, false_fn: Fn, operands: Sequence[Any], single: bool) -> Any:
    out = _cond(pred, true_fn, false_fn, tuple(operands))
    return out[0] if single else tuple(out)


def as_switch(index: torch.Tensor, operands: Sequence[Any], branches: Sequence[Fn], single: bool) -> Any:
    n = len(branches)
    # index_select fails on an index outside [0, n), negative ones included
    k = torch.arange(n, device=index.device).index_select(0, index.reshape(1).to(torch.int64)).reshape(())
    fns = list(branches)

    def from_(j: int) -> Fn:
        """``(k, *operands)`` -> the outputs of branch ``k``, for ``k >= j``: nested conds,
        each branch taking the same inputs."""
        if j == n - 1:
            return lambda _k, *ops: fns[j](*ops)
        rest = from_(j + 1)
        return lambda k_, *ops: _cond(k_ == j, lambda _k, *o: fns[j](*o), rest, (k_, *ops))

    out = from_(0)(k, *operands)
    return out[0] if single else tuple(out)


def _pred(value: Any) -> Any:
    return value.reshape(()) if isinstance(value, torch.Tensor) else value


def as_while_loop(
    cond_fn: Fn, body_fn: Fn, carries: Sequence[Any], additional: Sequence[Any], steps: int, exact: bool
) -> tuple[Any, ...]:
    """A scan of ``steps`` steps. ``exact``: the loop runs exactly that many (a counted
    loop with constant bounds), each step its body. Otherwise each step runs the body
    only while ``cond_fn`` holds (a step past the end keeps the carries), and a loop
    still running after ``steps`` steps fails (Note [checks that survive to_executorch])."""
    body, add, n = body_fn, tuple(additional), len(carries)
    if steps == 0:
        return tuple(carries)

    def keep(*a: Any) -> tuple[Any, ...]:
        return tuple(t.clone() for t in a[:n])

    def step(c: list[Any], _i: torch.Tensor) -> tuple[list[Any], list[Any]]:
        if exact:
            return list(body(*c, *add)), []
        go = _pred(cond_fn(*c, *add)[0])
        return list(_cond(go, body, keep, (*c, *add))), []

    counter = torch.arange(steps, device=_device(carries))
    final, _ = torch_scan(step, _dense(carries), [counter])
    if not exact:
        running = _pred(cond_fn(*final, *add)[0])
        stopped = torch.logical_not(torch.as_tensor(running))
        final = [fail_unless(stopped, v) for v in final]  # each: the program may return any one
    return tuple(final)


def _dense(carries: Sequence[Any]) -> list[Any]:
    """Initial carries laid out as the body's outputs will be: torch's scan wants one
    layout for both (a slice or a vmapped carry is strided)."""
    return [c.contiguous() if isinstance(c, torch.Tensor) else c for c in carries]


def _device(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def as_scan(
    body_fn: Fn, init: Sequence[Any], xs: Sequence[Any], additional: Sequence[Any], reverse: bool
) -> tuple[Any, ...]:
    body, add, n = body_fn, tuple(additional), len(init)
    # torch's scan needs a carry: a loop without one carries a dummy
    dummy = [] if n else [torch.zeros((), device=_device(xs))]

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = body(*c[len(dummy) :], *x, *add)
        return [d.clone() for d in c[: len(dummy)]] + list(out[:n]), list(out[n:])

    final, ys = torch_scan(step, dummy + _dense(init), list(xs), reverse=reverse)
    # Note [a scan's stacked outputs copied]: ExecuTorch 1.5.1 refuses a view of a scan's
    # ys ("Guard shape_dynamism_eq_base failed": the view is planned static, its base not);
    # a copy is an ordinary tensor to view
    return (*final[len(dummy) :], *(y.clone() for y in ys))


def as_map(body_fn: Fn, xs: Sequence[Any], additional: Sequence[Any], single: bool) -> Any:
    out = as_scan(body_fn, (), xs, additional, False)
    return out[0] if single else out


def as_associative_scan(combine_fn: Fn, xs: Sequence[Any], additional: Sequence[Any], single: bool) -> Any:
    """The sequential scan it equals: one ``combine_fn`` per slice (where the log-depth
    form makes about two per slice in log2(n) rounds)."""
    combine, add = combine_fn, tuple(additional)

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        t, *row = x
        out = combine(*c, *row, *add)
        # the first slice is its own prefix: the combine made there is dropped
        new = [torch.where(t == 0, r, o) for r, o in zip(row, out, strict=True)]
        return new, [v.clone() for v in new]

    first = [x[0].clone(memory_format=torch.contiguous_format) for x in xs]
    position = torch.arange(xs[0].shape[0], device=xs[0].device)
    _, ys = torch_scan(step, first, [position, *xs])
    return ys[0] if single else tuple(ys)
