"""hop under Dynamo: torch.compile(fullgraph=True) and torch.export(strict=True) (hop.compile.dynamo).

A recording backend keeps the graphs Dynamo hands to the compiler: they must hold
hop's ``torch.ops.hop.*`` nodes, never torch's ``torch.ops.higher_order.*`` of the
same name, and give eager's results (and, through aot_eager, eager's gradients).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch._dynamo.utils import counters
from torch.export import Dim

import hop
from hop.errors import CompileUnsupported, HopError, OutputMismatchError

Fn = Callable[..., Any]


class Recorder:
    """A backend that keeps each graph Dynamo compiles and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Fn:
        self.graphs.append(gm)
        return gm.forward  # type: ignore[no-any-return]

    def ops(self) -> list[str]:
        return hop_ops(self.graphs)


def hop_ops(graphs: list[torch.fx.GraphModule]) -> list[str]:
    """The higher-order operators called in ``graphs`` and their subgraphs, by qualified name."""
    found = []
    for root in graphs:
        for gm in root.modules():
            if isinstance(gm, torch.fx.GraphModule):
                found += [
                    f"{n.target.__module__}.{n.target.__name__}"
                    for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
                ]
    return sorted(found)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(fn: Fn, backend: Any, **options: Any) -> Fn:
    return torch.compile(fn, backend=backend, fullgraph=True, **options)  # type: ignore[no-any-return]


def assert_close(actual: Any, expected: Any) -> None:
    a, a_spec = pytree.tree_flatten(actual)
    e, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec
    for x, y in zip(a, e, strict=True):
        torch.testing.assert_close(x, y)


# --- one program per operator, closing over a parameter and a buffer ---------------------------------------


class Programs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.register_buffer("b", torch.tensor([1.0, 0.25, -0.5]))

    def cond(self, x: torch.Tensor) -> Any:
        return hop.cond(
            x.sum() > 0, lambda a: {"y": a.sin() * self.w}, lambda a: {"y": a.cos() * self.w + self.b}, (x,)
        )

    def switch(self, x: torch.Tensor) -> Any:
        index = (x.sum() > 0).long() + 1
        return hop.switch(index, [lambda a: a, lambda a: a * self.w, lambda a: a.sin() * self.w + self.b], [x])

    def while_loop(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, c: i < 3, lambda i, c: (i + 1, c * self.w + self.b), (0, x))

    def fori_loop(self, x: torch.Tensor) -> Any:
        return hop.fori_loop(0, 3, lambda i, c: c * self.w + i, x)

    def map(self, x: torch.Tensor) -> Any:
        return hop.map(lambda r, s: r * self.w + s, x, self.b)

    def scan(self, x: torch.Tensor) -> Any:
        return hop.scan(lambda c, r: (c * self.w + r, {"s": (c * self.b).sum()}), torch.zeros(3), x)

    def associative_scan(self, x: torch.Tensor) -> Any:
        return hop.associative_scan(lambda p, q: p * q, x * self.w, 0)


OPS = ["cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan"]
RAW = {"fori_loop": "while_loop"}  # fori_loop is a while_loop


class One(torch.nn.Module):
    """``Programs().<op>`` as a module's forward (for torch.export)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.programs = Programs()
        self.op = op

    def forward(self, x: torch.Tensor) -> Any:
        return getattr(self.programs, self.op)(x)


def op_name(op: str) -> str:
    return f"torch.ops.hop.{RAW.get(op, op)}"


X = torch.tensor([[0.5, -0.25, 1.0], [0.75, 0.5, -1.0], [0.25, 0.125, 0.5], [-0.5, 1.5, 0.25]])


# --- torch.compile(fullgraph=True) ------------------------------------------------------------------------


def outputs_and_gradients(model: Programs, fn: Fn, x: torch.Tensor) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """``fn(x)``, and the gradients of its weighted output leaves for the parameter and ``x``."""
    x = x.clone().requires_grad_()
    out = fn(x)
    leaves = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
    loss = sum((leaf * (k + 1)).sum() for k, leaf in enumerate(leaves))
    return out, torch.autograd.grad(loss, [model.w, x])  # type: ignore[arg-type]


@pytest.mark.parametrize("op", OPS)
def test_public_functions_are_captured_as_hop_nodes(op: str) -> None:
    model = Programs()
    rec = Recorder()
    fn = compiled(getattr(model, op), rec, dynamic=True)
    for x in (X, -X[:3]):  # two sizes, one compile: the graph is dynamic
        assert_close(outputs_and_gradients(model, fn, x), outputs_and_gradients(model, getattr(model, op), x))
    assert len(rec.graphs) == 1
    assert rec.ops() == [op_name(op)]


@pytest.mark.parametrize("op", OPS)
def test_training_through_aot_eager_gives_eager_gradients(op: str) -> None:
    model = Programs()
    fn = compiled(getattr(model, op), "aot_eager")
    assert_close(outputs_and_gradients(model, fn, X), outputs_and_gradients(model, getattr(model, op), X))


@pytest.mark.parametrize("op", OPS)
def test_raw_ops_of_an_exported_program_are_captured(op: str) -> None:
    module = One(op)
    ep = torch.export.export(module, (X,))
    rec = Recorder()
    assert_close(compiled(ep.module(), rec)(X), module(X))
    assert rec.ops() == [op_name(op)]


def test_raw_ops_called_in_user_code() -> None:
    def f(x: torch.Tensor) -> Any:
        picked = torch.ops.hop.switch((x.sum() > 0).long(), (x,), lambda a: a.cos(), lambda a: a.sin())
        return torch.ops.hop.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (picked,))

    rec = Recorder()
    assert_close(compiled(f, rec)(X), f(X))
    assert rec.ops() == ["torch.ops.hop.cond", "torch.ops.hop.switch"]


# (public function, its arguments): compiled as the function itself, torch.compile(hop.cond)
DIRECT: dict[str, tuple[Fn, tuple[Any, ...]]] = {
    "cond": (hop.cond, (X.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (X,))),
    "switch": (hop.switch, (torch.tensor(1), [lambda a: a + 1, lambda a: a * 2, lambda a: a - 1], (X,))),
    "while_loop": (hop.while_loop, (lambda i, a: i < 3, lambda i, a: (i + 1, a * 1.5), (torch.tensor(0), X))),
    "fori_loop": (hop.fori_loop, (0, 4, lambda i, a: a + i, X)),
    "map": (hop.map, (lambda r, w: r * w, X, X[0])),
    "scan": (hop.scan, (lambda c, r: (c + r, c * r), X[0], X)),
    "associative_scan": (hop.associative_scan, (lambda a, b: a + b, X, 0)),
}


@pytest.mark.parametrize("op", OPS)
def test_compiling_a_public_function_itself_compiles_one_frame(op: str) -> None:
    # torch.compile(hop.cond): its frame was skipped, so nothing compiled ("found no compiled frames")
    fn, args = DIRECT[op]
    rec = Recorder()
    assert_close(compiled(fn, rec)(*args), fn(*args))
    assert len(rec.graphs) == 1 and op_name(op) in rec.ops()


def test_torch_cond_keeps_torchs_handler() -> None:
    rec = Recorder()
    f = compiled(lambda x: torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,)), rec)
    torch.testing.assert_close(f(X), X.sin())
    assert rec.ops() == ["torch.ops.higher_order.cond"]


# --- what eager supports works compiled -------------------------------------------------------------------


def check(fn: Fn, *args: Any, ops: list[str]) -> None:
    rec = Recorder()
    assert_close(compiled(fn, rec, dynamic=True)(*args), fn(*args))
    assert rec.ops() == ops


def test_int_and_symint_outputs() -> None:
    def f(x: torch.Tensor) -> Any:
        n = hop.cond(x.sum() > 0, lambda a: a.shape[0] + 1, lambda a: 2 * a.shape[0], (x,))
        return n, hop.switch((x.sum() > 0).long(), [lambda a: (a.cos(), 3), lambda a: (a.sin(), 3)], (x,))

    check(f, X, ops=["torch.ops.hop.cond", "torch.ops.hop.switch"])


def test_branches_returning_an_operand_or_a_view_of_one() -> None:
    def f(x: torch.Tensor) -> Any:
        out = hop.cond(x.sum() > 0, lambda a: a, lambda a: a[1:], (x,))
        out.add_(1)  # a copy: the operand is untouched, as in eager
        return out, x

    check(f, X, ops=["torch.ops.hop.cond"])


def test_data_dependent_sizes_unify_across_branches() -> None:
    def f(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a.nonzero(), lambda a: (a > 0.3).nonzero(), (x,))

    check(f, X, ops=["torch.ops.hop.cond"])


def test_growing_carries_and_int_carries() -> None:
    def f(x: torch.Tensor) -> Any:
        return hop.while_loop(lambda c, n: c.shape[0] < 8, lambda c, n: (torch.cat([c, c[-1:] * 2]), n + 1), (x, 0))

    check(f, X[0], ops=["torch.ops.hop.while_loop"])


def test_symbolic_predicate_and_tensor_bounds() -> None:
    def f(x: torch.Tensor, n: torch.Tensor) -> Any:
        y = hop.cond(x.shape[0] > 2, lambda a: a + 1, lambda a: a - 1, (x,))
        return hop.fori_loop(0, n, lambda i, v: v + i, y)

    check(f, X, torch.tensor(3), ops=["torch.ops.hop.cond", "torch.ops.hop.while_loop"])


def test_batched_predicate_under_vmap() -> None:
    def f(x: torch.Tensor) -> Any:
        return torch.vmap(lambda r: hop.cond(r.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (r,)))(x)

    check(f, X, ops=["torch.ops.hop.cond"])


def test_nested_operators_and_scan_options() -> None:
    def f(x: torch.Tensor) -> Any:
        def step(c: torch.Tensor, r: torch.Tensor) -> Any:
            return hop.cond(r.sum() > 0, lambda p, q: p + q, lambda p, q: p - q, (c, r)), c * 2

        return hop.scan(step, torch.zeros(4), x, dim=1, reverse=True)

    check(f, X, ops=["torch.ops.hop.cond", "torch.ops.hop.scan"])


def test_map_over_an_empty_dimension() -> None:
    check(lambda x: hop.map(lambda r: r * 2, x[:0]), X, ops=["torch.ops.hop.map"])


# --- what the compiled path cannot capture: CompileUnsupported, or a graph break --------------------------


def checkpointed(x: torch.Tensor) -> Any:
    return hop.while_loop(lambda c: c.sum() < 10, lambda c: (c + 1,), (x,), checkpoint=True)[0] * 2


def branches_on_data(x: torch.Tensor) -> Any:
    return hop.cond(x.sum() > 0, lambda a: a + 1 if a.max() > 0.5 else a - 1, lambda a: a, (x,)) * 2


UNSUPPORTED = [
    (
        checkpointed,
        "hop.while_loop: checkpoint=True (reverse mode with bounded memory) runs in eager but torch.compile "
        "cannot capture it. Leave checkpoint out under torch.compile, or call this loop outside the compiled function.",
    ),
    (branches_on_data, "hop.cond: true_fn, which Dynamo cannot trace into one graph ("),
]


@pytest.mark.parametrize(("fn", "message"), UNSUPPORTED)
def test_unsupported_raises_with_fullgraph_and_breaks_the_graph_without(fn: Fn, message: str) -> None:
    with pytest.raises(CompileUnsupported) as info:
        compiled(fn, "eager")(torch.ones(3))
    assert str(info.value).startswith(message)
    torch._dynamo.reset()
    x, y = torch.ones(3), torch.ones(3)
    assert_close(torch.compile(fn, backend="eager")(x), fn(y))
    assert_close(x, y)  # the in-place write happened once, as in eager
    assert any(reason.startswith(message) for reason in counters["graph_break"])


def test_a_traced_checkpointed_loop_is_refused_like_the_public_call() -> None:
    """Note [the checkpoint keyword]: ep.module() holds the raw op with checkpoint=True;
    compiling it refuses as compiling the public call does, and breaks the graph without
    fullgraph."""

    class Loop(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return checkpointed(x)

    module = torch.export.export(Loop(), (torch.ones(3),)).module()
    message = UNSUPPORTED[0][1]
    with pytest.raises(CompileUnsupported) as info:
        compiled(module, "eager")(torch.ones(3))
    assert str(info.value).startswith(message)
    torch._dynamo.reset()
    assert_close(torch.compile(module, backend="eager")(torch.ones(3)), checkpointed(torch.ones(3)))


def test_user_mistakes_raise_eagers_error() -> None:
    def f(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a, lambda a: a.double(), (x,))

    with pytest.raises(OutputMismatchError) as eager:
        f(X)
    with pytest.raises(OutputMismatchError) as full:
        compiled(f, "eager")(X)
    assert str(full.value).startswith(str(eager.value))
    torch._dynamo.reset()
    with pytest.raises(OutputMismatchError) as broken:
        torch.compile(f, backend="eager")(X)
    assert str(broken.value) == str(eager.value)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: hop.cond(x.sum() > 0, 3, lambda a: a, (x,)),
        lambda x: hop.cond(x.sum() > 0, lambda a: a, lambda a: a, x),
        lambda x: hop.cond(x, lambda a: a, lambda a: a, (x,)),
        lambda x: hop.while_loop(lambda c: c.sum() < 1, lambda c: (c + 1,), x),
        lambda x: hop.while_loop(lambda c: c < 1, lambda c: (c + 1,), (x,)),
        lambda x: hop.switch(x.sum().long(), [], (x,)),
        lambda x: hop.scan(lambda c, r: c, torch.zeros(3), x),
        lambda x: hop.map(lambda r: r, (x, x[:2])),
        lambda x: hop.associative_scan(lambda p, q: p + q, x, 2),
        lambda x: hop.fori_loop(0, 2.5, lambda i, v: v, x),
    ],
)
def test_argument_checks_give_eagers_message(call: Fn) -> None:
    with pytest.raises((HopError, TypeError)) as eager:
        call(X)
    with pytest.raises(type(eager.value)) as full:
        compiled(call, "eager")(X)
    assert str(full.value).startswith(str(eager.value))


# --- torch.export(strict=True) ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_strict_export_gives_non_strict_exports_program(op: str) -> None:
    module = One(op)
    dims = {"x": {0: Dim("n", min=2)}}
    strict = torch.export.export(module, (X,), dynamic_shapes=dims, strict=True)
    non_strict = torch.export.export(module, (X,), dynamic_shapes=dims, strict=False)
    assert hop_ops([strict.graph_module]) == hop_ops([non_strict.graph_module]) == [op_name(op)]
    buffer = io.BytesIO()
    torch.export.save(strict, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    decomposed = strict.run_decompositions()
    assert hop_ops([decomposed.graph_module]) == [op_name(op)]
    other = -X[:3]  # another size
    for ep in (strict, loaded, decomposed):
        assert_close(ep.module()(other), module(other))


# --- None leaves: an empty subtree, as in eager ---------------------------------------------------------


NONE_PROGRAMS: dict[str, Fn] = {
    "scan/y_tuple": lambda w, x: hop.scan(lambda c, r: (c + r * w, (c * r, None)), torch.zeros(3), x),
    "scan/y_dict": lambda w, x: hop.scan(lambda c, r: (c * w + r, {"y": c * r, "z": None}), torch.zeros(3), x),
    "scan/carry": lambda w, x: hop.scan(lambda c, r: ((c[0] + r, None), r * w), (torch.zeros(3), None), x),
    "map/output": lambda w, x: hop.map(lambda r: (r * w, None), x),
    "map/arg": lambda w, x: hop.map(lambda r, z: r * w, x, None),
    "associative_scan/xs": lambda w, x: hop.associative_scan(lambda p, q: (p[0] + q[0], None), (x * w, None), 0),
}


class WithNone(torch.nn.Module):
    """scan and map with ``None`` in what the function returns or takes."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.name = name

    def forward(self, x: torch.Tensor) -> Any:
        return NONE_PROGRAMS[self.name](self.w, x)


@pytest.mark.parametrize("name", list(NONE_PROGRAMS))
def test_none_leaves_compile_forward_and_backward(name: str) -> None:
    model = WithNone(name)
    rec = Recorder()
    assert_close(compiled(model, rec, dynamic=True)(X), model(X))
    assert rec.ops() == [f"torch.ops.hop.{name.split('/')[0]}"]  # NONE_PROGRAMS's keys: op/case
    torch._dynamo.reset()
    expected = outputs_and_gradients(model, model, X)  # type: ignore[arg-type]
    assert_close(outputs_and_gradients(model, compiled(model, "aot_eager"), X), expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(NONE_PROGRAMS))
def test_none_leaves_strict_export_gives_the_non_strict_program(name: str) -> None:
    model = WithNone(name)
    strict = torch.export.export(model, (X,), strict=True)
    non_strict = torch.export.export(model, (X,), strict=False)
    assert hop_ops([strict.graph_module]) == hop_ops([non_strict.graph_module])
    assert_close(strict.module()(X), model(X))


# --- torch.func transforms of loops inside torch.compile --------------------------------------------------


def counted_loss(x: torch.Tensor) -> torch.Tensor:
    out = hop.while_loop(lambda u, n: n < 3, lambda u, n: (u.sin() * (n + 1), n + 1), (x, torch.tensor(0)))
    return out[0].sum()


def int_counted_loss(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda u, n: n < 3, lambda u, n: (u.cos() + n, n + 1), (x, 0))[0].sum()


def fori_loss(x: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, torch.tensor(3), lambda i, u: u.sin() * (i + 1), x).sum()


def int_fori_loss(x: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, 3, lambda i, u: u.sin() * (i + 1), x).sum()


def carry_condition_loss(x: torch.Tensor) -> torch.Tensor:
    # a condition on the carry: under vmap each row has its own trip count
    return hop.while_loop(lambda u: u.sum() < 10, lambda u: (u * 1.5 + 0.5,), (x,))[0].sum()


LOSSES = [counted_loss, int_counted_loss, fori_loss, int_fori_loss, carry_condition_loss]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda f: f.__name__)
def test_compiled_func_grad_of_a_loop(loss: Fn) -> None:
    # the backward's trip count is an unbacked size internal to autograd.grad's node
    x = X[0] + 0.5
    assert_close(compiled(torch.func.grad(loss), "aot_eager")(x), torch.func.grad(loss)(x))


@pytest.mark.parametrize("loss", [counted_loss, fori_loss, carry_condition_loss], ids=lambda f: f.__name__)
def test_compiled_vmap_of_func_grad_of_a_loop(loss: Fn) -> None:
    per_row = torch.vmap(torch.func.grad(loss))
    assert_close(compiled(per_row, "aot_eager")(X), per_row(X))


# torch.func.jvp taken inside the compiled function: Dynamo's graph enters forward AD's
# dual level through torch._C, and each operator's jvp runs a jvp of its callables
# inside it (Note [a jvp inside an active dual level]); an int output or counter is
# made again by that jvp and has no tangent (nothing binds its unbacked symbol).
_W = torch.tensor([[0.5, -1.0], [0.25, 0.75], [1.0, 0.5]])
JVP_PROGRAMS: dict[str, Fn] = {
    "cond": lambda x, w: hop.cond(x.sum() > 0, lambda a: a @ w, lambda a: (a @ w).sin(), (x,)),
    "cond, an int output": lambda x, w: hop.cond(x.sum() > 0, lambda a: (a @ w, 1), lambda a: (a @ w, 2), (x,))[0],
    "switch": lambda x, w: hop.switch((x.sum() > 0).long(), [lambda a: a @ w, lambda a: (a @ w).cos()], (x,)),
    "while_loop": lambda x, w: hop.while_loop(
        lambda i, c: i < 3, lambda i, c: (i + 1, c + (x @ w).tanh() * c), (torch.tensor(0), torch.ones(4, 2))
    )[1],
    "fori_loop": lambda x, w: hop.fori_loop(0, 3, lambda i, c: c + (x @ w).tanh() * c * i, torch.ones(4, 2)),
    "scan": lambda x, w: hop.scan(lambda c, xi: (c + (xi @ w).tanh(), c.sum()), torch.zeros(2), x)[0],
    "map": lambda x, w: hop.map(lambda xi: (xi @ w).sin(), x),
    "associative_scan": lambda x, w: hop.associative_scan(lambda a, b: a + b + w.sum(), x, 0),  # associative
}


@pytest.mark.parametrize("name", list(JVP_PROGRAMS))
def test_compiled_func_jvp(name: str) -> None:
    program, t = JVP_PROGRAMS[name], torch.ones_like(_W)

    def tangent(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Any:
        return torch.func.jvp(lambda w: program(x, w), (w,), (t,))

    for x in (X, -X):
        assert_close(compiled(tangent, "aot_eager")(x, _W, t), tangent(x, _W, t))
    # nothing of forward AD is left behind: an eager jvp still works
    assert_close(tangent(X, _W, t), torch.func.jvp(lambda w: program(X, w), (_W,), (t,)))


@pytest.mark.parametrize("loss", [int_counted_loss, int_fori_loss], ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_vmap_of_a_loop_with_int_carries(loss: Fn, backend: str) -> None:
    # the int carry stays one int for the batch (the condition reads only it)
    per_row = torch.vmap(torch.func.grad(loss))
    assert_close(compiled(per_row, backend)(X), per_row(X))
    assert_close(compiled(torch.vmap(loss), backend)(X), torch.vmap(loss)(X))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_branch_returning_a_closed_over_tensor_that_is_also_the_operand(backend: str) -> None:
    # found by the compiled property tests: the other branch was given a second input of the
    # same name ("SyntaxError: duplicate argument 'l_x_' in function definition")
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda a: y * 2, lambda a: x, (x,))

    g = compiled(f, backend)
    for x in (X, -X):
        assert_close(g(x, X * 3), f(x, X * 3))


@pytest.mark.parametrize("strict", [False, True])
def test_a_branch_returning_a_closed_over_operand_exports(strict: bool) -> None:
    # strict export named both subgraph inputs after the one value the node took twice
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return hop.cond(x.sum() > 0, lambda a: y * 2, lambda a: x, (x,))

    ep = torch.export.export(M(), (X, X * 3), strict=strict)
    for x in (X, -X):
        assert_close(ep.module()(x, X * 3), M()(x, X * 3))


_RETURN_INPUT = {
    "cond": lambda v: hop.cond(v.sum() > 0, lambda a: a, lambda a: a * 2, (v,)),
    "switch": lambda v: hop.switch((v.sum() > 0).long(), [lambda a: a, lambda a: a * 2], (v,)),
    "while_loop": lambda v: hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a), (torch.zeros(()), v))[1],
    "scan": lambda v: hop.scan(lambda c, e: (c, e), v, v)[1],
    "map": lambda v: hop.map(lambda e, w: w, v, v),
}


@pytest.mark.parametrize("name", _RETURN_INPUT)
def test_vmap_of_a_callable_returning_its_input(name: str) -> None:
    """Under torch.vmap a callable that returns an input as it is (an identity branch, a
    carry left alone) returns a placeholder, whose value hop's checks read with the batch
    dimension and refused (rank 1 vs 2); compiled and strictly exported it now matches."""
    fn = _RETURN_INPUT[name]
    x = torch.randn(4, 3)
    expected = torch.vmap(fn)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(torch.vmap(fn), backend="aot_eager", fullgraph=True)(x), expected)

    class M(torch.nn.Module):
        def forward(self, v: torch.Tensor) -> Any:
            return torch.vmap(fn)(v)

    ep = torch.export.export(M(), (x,), strict=True)
    torch.testing.assert_close(ep.module()(x), expected)
    torch._dynamo.reset()
