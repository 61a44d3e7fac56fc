"""A traced loop body as a lean Python function, for the eager run of a traced program.

Note [running a traced body per step]
When an exported program (``ep.module()``) or a ``make_fx`` graph runs eagerly, a
traced loop calls its body and condition ``GraphModule``s once per iteration. Their
FX-generated ``forward`` pays, per node, a Python frame of ``OpOverload.__call__``
(which only calls the dispatcher entry ``OpOverload._op``), and keeps every node,
also those whose value nothing reads: the trace records ``.item()`` of a counter the
body never looks at, and the ``scalar_tensor`` that turns ``i + 1`` back into a tensor.
For a small body that is several times the cost of the ops themselves.

``step_function`` writes, once per graph (cached on the ``GraphModule`` until it is
recompiled), a Python function that computes the same outputs: each ``OpOverload``
called through its ``_op``, nodes that nothing reads and that have no effect dropped
(mutating, random, effectful and ``_assert*`` ops, ops that return nothing, and every op
outside ``aten`` always run), and optionally

- some outputs left out (their computation dropped with them), and
- some 0-dim integer tensor inputs passed as Python ints instead: every ``.item()``
  of such an input is the int itself. Only inputs that the rest of the graph reads
  through ``.item()`` alone qualify.

``counted_loop`` uses both for the loops fori_loop traces (and the trip counter
while_loop's reverse mode adds): a carry that the body increments by one and that
only ``.item()`` reads is a counter, and a condition ``counter < bound`` fixes the
number of iterations before the loop starts. The runner then counts in Python, and
runs neither the condition nor the counter's tensor arithmetic per step: the values
equal the graphs' (each iteration's body gets the same int its ``.item()`` would
read). Graphs it does not understand (a ``call_module`` node, pytree codegen, a
counter read as a tensor) run their own ``forward``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

__all__ = ["CountedLoop", "counted_loop", "step_function"]

Fn = Callable[..., Any]
_Node = torch.fx.Node
_aten = torch.ops.aten
_ITEM = (_aten._local_scalar_dense.default, _aten.item.default)
_SCALAR_TENSOR = _aten.scalar_tensor.default
_SYM_SIZE = _aten.sym_size.int
_ADD_TENSOR = (_aten.add.Tensor, _aten.add.Scalar)
_LT_TENSOR = (_aten.lt.Scalar, _aten.lt.Tensor)
_PURE_PYTHON = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.mod,
        operator.neg,
        operator.pow,
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
        operator.eq,
        operator.ne,
        operator.getitem,
    }
)
_LITERALS = (int, bool, str, type(None))


def _pure(node: _Node) -> bool:
    """Whether dropping ``node`` when nothing reads it changes nothing but time."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if node.is_impure():  # FX's view: effectful (torch's registry), mutating, random, asserts
        return False
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        name = schema.name
        if target.namespace != "aten":  # a custom op may have effects its schema does not declare
            return False
        return not (
            not schema.returns  # run for its effect only (aten._linalg_check_errors raises)
            or schema.is_mutable
            or torch.Tag.nondeterministic_seeded in target.tags
            or "_assert" in name
            or "constrain" in name
            or name.startswith("aten::_print")
        )
    return target in _PURE_PYTHON


# --- the code -----------------------------------------------------------------------------------


class _Writer:
    """Python source for a graph's nodes, with the values it needs bound as globals."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm  # not in env: the cache would keep it alive
        self.env: dict[str, Any] = {}
        self.names: dict[_Node, str] = {}

    def bind(self, value: Any) -> str:
        name = f"_g{len(self.env)}"
        self.env[name] = value
        return name

    def arg(self, a: Any) -> str:
        if isinstance(a, _Node):
            return self.names[a]
        if type(a) in (tuple, list) or isinstance(a, torch.fx.immutable_collections.immutable_list):
            inner = "".join(f"{self.arg(x)}, " for x in a)
            return f"({inner})" if type(a) is tuple else f"[{inner}]"
        if isinstance(a, dict) and all(type(k) is str for k in a):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if type(a) in _LITERALS or (type(a) is float and math.isfinite(a)):
            return repr(a)
        return self.bind(a)  # dtypes, devices, layouts, slices, non-finite floats, ...

    def call(self, node: _Node) -> str | None:
        args = [self.arg(a) for a in node.args]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        target = node.target
        if node.op == "call_function":
            fn = (
                target._op if type(target) is torch._ops.OpOverload else target
            )  # Note [running a traced body per step]
            return f"{self.bind(fn)}({', '.join(args)})"
        if node.op == "call_method" and isinstance(target, str) and target.isidentifier() and node.args:
            return f"{args[0]}.{target}({', '.join(args[1:])})"
        if node.op == "get_attr" and isinstance(target, str):  # a subgraph or a constant, read once
            value: Any = self.gm
            for part in target.split("."):
                value = getattr(value, part)
            return self.bind(value)
        return None


def _contiguous(v: Any) -> Any:
    return v.contiguous() if isinstance(v, torch.Tensor) else v


def _compile(
    gm: torch.fx.GraphModule,
    *,
    ints: frozenset[int] = frozenset(),
    drop: frozenset[int] = frozenset(),
    first: tuple[int, ...] = (),
    contiguous: bool = False,
) -> tuple[Fn, tuple[int, ...]] | None:
    """The step function and which of the inputs ``first`` it takes (in front of the
    others, which it always takes: those of ``first`` that nothing reads are left out).
    ``contiguous``: the outputs, a tuple, made contiguous (Note [traced bodies see
    contiguous values] in scanning._rules)."""
    graph = gm.graph
    if type(graph._codegen) is not torch.fx.graph.CodeGen:  # pytree in/out specs: the module's own forward
        return None
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if any(n.args for n in inputs) or nodes[-1].op != "output":  # default values, or no output
        return None
    result = nodes[-1].args[0]
    if drop or contiguous:
        if not isinstance(result, (tuple, list)):
            if drop:
                return None
            result = (result,)
        result = tuple(r for k, r in enumerate(result) if k not in drop)
    live: set[_Node] = set()
    torch.fx.node.map_arg(result, live.add)
    for node in reversed(nodes[:-1]):
        if node in live or not _pure(node):
            live.add(node)
            torch.fx.node.map_arg((node.args, node.kwargs), live.add)
    w = _Writer(gm)
    for k, node in enumerate(inputs):
        w.names[node] = f"a{k}"
        if k in ints:  # passed as an int: every live reader must be an .item() of it
            for user in node.users:
                if user in live:
                    if user.target not in _ITEM:
                        return None
                    w.names[user] = f"a{k}"
    lines = []
    for k, node in enumerate(nodes[:-1]):
        if node.op == "placeholder" or node not in live or node in w.names:
            continue
        code = w.call(node)
        if code is None:
            return None
        w.names[node] = f"v{k}"
        lines.append(f"    v{k} = {code}")
    if contiguous:
        outs = []
        for r in result:
            val = r.meta.get("val") if isinstance(r, _Node) else r
            if isinstance(val, torch.Tensor):
                outs.append(f"{w.arg(r)}.contiguous()")
            elif isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
                outs.append(w.arg(r))
            else:
                outs.append(f"{w.bind(_contiguous)}({w.arg(r)})")
        lines.append(f"    return ({', '.join(outs)},)" if outs else "    return ()")
    else:
        lines.append(f"    return {w.arg(result)}")

    kept = tuple(k for k in first if k not in ints or any(u in live for u in inputs[k].users))
    params = [f"a{k}" for k in (*kept, *(k for k in range(len(inputs)) if k not in first))]
    source = f"def step({', '.join(params)}):\n" + "\n".join(lines) + "\n"
    exec(compile(source, f"<hop step of {type(gm).__name__}>", "exec"), w.env)
    return w.env["step"], kept


_CACHE: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict[Any, tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def step_function(gm: torch.fx.GraphModule, *, contiguous: bool = False) -> Fn | None:
    """Note [running a traced body per step]: a function computing ``gm``'s outputs from its
    inputs (``contiguous``: a tuple of contiguous outputs), or None where ``gm`` has what
    it does not handle. Cached until ``gm`` is recompiled."""
    key = ("step", contiguous)
    version = type(gm).__dict__.get("forward")  # GraphModule.recompile() writes a new one
    per_gm = _CACHE.setdefault(gm, {})
    hit = per_gm.get(key)
    if hit is not None and hit[0] is version:
        return hit[1]  # type: ignore[no-any-return]
    made = _compile(gm, contiguous=contiguous)
    fn = None if made is None else made[0]
    per_gm[key] = (version, fn)
    return fn


# --- counted loops ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CountedLoop:
    """Note [running a traced body per step]: a traced loop whose trip count its condition
    ``carry[slot] < bound`` fixes. ``counters``: the carries the body increments by one
    (``slot`` among them); ``step``: the body on the counters it reads (``reads``, as
    ints) then the other carries and the additional inputs, returning the other carries
    (contiguous)."""

    slot: int
    bound: int | tuple[int] | tuple[int, int]  # an int in the graph, (k,): input k, (k, d): its size d
    counters: tuple[int, ...]
    reads: tuple[int, ...]
    step: Fn


def _input_index(node: Any, inputs: list[_Node]) -> int | None:
    return inputs.index(node) if isinstance(node, _Node) and node in inputs else None


def _incremented(out: Any, inputs: list[_Node]) -> int | None:
    """The input ``out`` is that plus one: ``scalar_tensor(item(x) + 1)`` or ``x + 1`` on tensors."""
    if not isinstance(out, _Node) or out.op != "call_function":
        return None
    if out.target is _SCALAR_TENSOR and len(out.args) == 1 and isinstance(out.args[0], _Node):
        total = out.args[0]
        if total.target is operator.add and len(total.args) == 2:
            a, b = total.args
            item = a if b == 1 and type(b) is int else b if a == 1 and type(a) is int else None
            if isinstance(item, _Node) and item.target in _ITEM:
                return _input_index(item.args[0], inputs)
        return None
    one = len(out.args) == 2 and type(out.args[1]) is int and out.args[1] == 1 and out.kwargs.get("alpha", 1) == 1
    if out.target in _ADD_TENSOR and one:
        return _input_index(out.args[0], inputs)
    return None


def _bound(
    cond: torch.fx.GraphModule, body: torch.fx.GraphModule, n: int
) -> tuple[int, int | tuple[int] | tuple[int, int]] | None:
    """``(slot, bound)`` where the condition is ``item(carry[slot]) < bound`` (or on tensors)
    and the bound is the same every iteration: an int, an additional input, or a size of
    one that the body keeps (``x.shape[0]`` of the carry it loops over)."""
    inputs = [x for x in cond.graph.nodes if x.op == "placeholder"]
    nodes = list(cond.graph.nodes)
    if nodes[-1].op != "output" or not isinstance(nodes[-1].args[0], _Node):
        return None
    pred = nodes[-1].args[0]
    if pred.op != "call_function" or len(pred.args) != 2 or pred.kwargs:
        return None
    if pred.target is operator.lt:
        lhs, rhs = pred.args
    elif pred.target is operator.gt:
        rhs, lhs = pred.args
    elif pred.target in _LT_TENSOR:
        lhs, rhs = pred.args
        lhs = lhs if isinstance(lhs, _Node) and lhs.op == "placeholder" else None
    else:
        return None
    if isinstance(lhs, _Node) and lhs.target in _ITEM:
        lhs = lhs.args[0]
    slot = _input_index(lhs, inputs)
    if slot is None or slot >= n:
        return None
    if type(rhs) is int:
        return slot, rhs
    k = _input_index(rhs, inputs)
    if k is not None:
        return (slot, (k,)) if k >= n else None  # a carry as the bound changes
    if not (isinstance(rhs, _Node) and rhs.target is _SYM_SIZE and len(rhs.args) == 2 and type(rhs.args[1]) is int):
        return None
    k, d = _input_index(rhs.args[0], inputs), rhs.args[1]
    if k is None:
        return None
    return (slot, (k, d)) if k >= n or _keeps_size(body, k, d) else None


def _keeps_size(body: torch.fx.GraphModule, k: int, d: int) -> bool:
    """Whether the body's output ``k`` has the size ``d`` of its input ``k`` (the same symbol)."""
    inputs = [x for x in body.graph.nodes if x.op == "placeholder"]
    result = next(iter(reversed(body.graph.nodes))).args[0]
    out = result[k] if isinstance(result, (tuple, list)) and k < len(result) else None
    before = inputs[k].meta.get("val") if k < len(inputs) else None
    after = out.meta.get("val") if isinstance(out, _Node) else None
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    if d >= before.dim() or before.dim() != after.dim():
        return False
    a, b = before.shape[d], after.shape[d]
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)  # the same expression, not a guess about its value
    return False


def counted_loop(cond: torch.fx.GraphModule, body: torch.fx.GraphModule, n: int) -> CountedLoop | None:
    """Note [running a traced body per step]: the counted form of the traced loop ``cond`` /
    ``body`` over ``n`` carries, or None. Cached on the body until either is recompiled."""
    key = ("counted", n)
    version = (cond, type(cond).__dict__.get("forward"), type(body).__dict__.get("forward"))
    per_gm = _CACHE.setdefault(body, {})
    hit = per_gm.get(key)
    if hit is not None and hit[0][0] is cond and hit[0][1:] == version[1:]:
        return hit[1]  # type: ignore[no-any-return]
    found = _counted(cond, body, n)
    per_gm[key] = (version, found)
    return found


def _counted(cond: torch.fx.GraphModule, body: torch.fx.GraphModule, n: int) -> CountedLoop | None:
    inputs = [x for x in body.graph.nodes if x.op == "placeholder"]
    c_inputs = [x for x in cond.graph.nodes if x.op == "placeholder"]
    result = next(iter(reversed(body.graph.nodes))).args[0]
    if len(inputs) != len(c_inputs) or not isinstance(result, (tuple, list)) or len(result) != n:
        return None
    counters = tuple(k for k in range(n) if _incremented(result[k], inputs) == k)
    found = _bound(cond, body, n)
    if found is None or found[0] not in counters:
        return None
    slot, bound = found
    if not all(_pure(x) for x in cond.graph.nodes if x.op != "output"):
        return None  # the condition does more than compare: run it
    made = _compile(body, ints=frozenset(counters), drop=frozenset(counters), first=counters, contiguous=True)
    if made is None:
        return None
    step, reads = made
    return CountedLoop(slot, bound, counters, reads, step)


def _int_scalar(v: Any) -> bool:
    """A 0-dim integer tensor that needs no grad: its ``<`` and ``+ 1`` are those of ints."""
    if not isinstance(v, torch.Tensor) or v.dim() != 0 or v.requires_grad:
        return False
    return not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)


def run_counted(loop: CountedLoop, carry: Sequence[Any], additional: Sequence[Any]) -> tuple[Any, ...] | None:
    """The loop in Python (Note [running a traced body per step]), or None when the values
    are not what the counted form needs (a counter that is not a 0-dim integer tensor, a
    bound that is not an int)."""
    where = loop.bound
    if isinstance(where, int):
        bound: Any = where
    else:
        bound = (*carry, *additional)[where[0]]
        if len(where) == 2:
            bound = bound.shape[where[1]] if isinstance(bound, torch.Tensor) else None
        elif _int_scalar(bound):  # while_loop's `i < n` with a tensor n: read once
            bound = int(bound.item())
    if type(bound) is not int:
        return None
    counts = {}
    for k in loop.counters:
        c = carry[k]
        if not _int_scalar(c):
            return None
        counts[k] = int(c.item())
    start = counts[loop.slot]
    trips = max(bound - start, 0)
    if trips == 0:
        return tuple(carry)
    counted = set(loop.counters)
    others = tuple(
        v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in enumerate(carry) if k not in counted
    )
    step = loop.step
    if not loop.reads:  # the body reads no counter: fori_loop's body that ignores i
        for _ in range(trips):
            others = step(*others, *additional)
    elif len(loop.reads) == 1:
        first = counts[loop.reads[0]]
        for j in range(first, first + trips):
            others = step(j, *others, *additional)
    else:
        offsets = [counts[k] - start for k in loop.reads]
        for j in range(start, bound):
            others = step(*[j + d for d in offsets], *others, *additional)
    final = iter(others)
    return tuple(
        torch.full((), counts[k] + trips, dtype=c.dtype, device=c.device) if k in counted else next(final)
        for k, c in enumerate(carry)
    )
