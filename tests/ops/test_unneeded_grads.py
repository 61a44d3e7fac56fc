"""A traced backward computes only the gradients autograd asks for; a traced jvp only
the tangents it is given.

Each operator's reverse mode is an op of its own in a traced or compiled training
graph, whose subgraphs compute everything they return: a gradient for data that
needs none (the input batch, a closed-over mask) is work done and thrown away (a
whole matmul per step in a linear layer's backward). These programs read
``x @ w`` with ``x`` (3, 4) needing no gradient and ``w`` (4, 5) needing one: the
gradient of ``x`` would be the only matmul with a (3, 4) result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx.experimental.proxy_tensor import make_fx

import hop

X_SHAPE = (3, 4)

PROGRAMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cond": lambda x, xs, w: hop.cond(x.sum() > 0, lambda a: a @ w, lambda a: (a @ w).sin(), (x,)),
    "switch": lambda x, xs, w: hop.switch((x.sum() > 0).long(), [lambda a: a @ w, lambda a: (a @ w).cos()], (x,)),
    "scan": lambda x, xs, w: hop.scan(lambda c, xi: (c + (xi @ w).tanh(), c.sum()), torch.zeros(3, 5), xs)[0],
    "map": lambda x, xs, w: hop.map(lambda xi: (xi @ w).sin(), xs),
    "while_loop": lambda x, xs, w: hop.while_loop(
        lambda i, c: i < 3, lambda i, c: (i + 1, c + (x @ w).tanh() * c), (torch.tensor(0), torch.ones(3, 5))
    )[1],
    "fori_loop": lambda x, xs, w: hop.fori_loop(0, 3, lambda i, c: c + (x @ w).tanh() * c, torch.ones(3, 5)),
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(X_SHAPE), torch.randn(2, *X_SHAPE), torch.randn(4, 5, requires_grad=True)


def _grad_of_w(program: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def step(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
        return torch.autograd.grad(program(x, xs, w).sum(), [w])

    return step


def _matmul_results(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    shapes = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
                shapes.append(tuple(node.meta["val"].shape))
    return shapes


def _compiled_keeping_graphs(program: Callable[..., Any]) -> tuple[Callable[..., Any], list[torch.fx.GraphModule]]:
    """``program`` compiled by AOTAutograd, and the list its forward and backward graphs go to."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(g: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(g)
        return make_boxed_func(g)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    return torch.compile(program, backend=backend, fullgraph=True), graphs


def _zeros_made(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """The shapes of the zero tensors a traced program's outer graph builds."""
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "call_function" and "zero" in str(n.target)]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_compiled_backward_computes_no_gradient_for_data(name: str) -> None:
    """torch.compile: AOTAutograd's backward graph holds the operator's backward, with
    the data as graph inputs (the loops' bodies read ``x`` as an additional input)."""
    program = PROGRAMS[name]
    x, xs, w = _inputs()
    compiled, graphs = _compiled_keeping_graphs(program)
    (got,) = _grad_of_w(compiled)(x, xs, w)
    torch.testing.assert_close(got, _grad_of_w(program)(x, xs, w)[0])
    assert len(graphs) == 2  # forward, backward
    assert X_SHAPE not in _matmul_results(graphs[1]), f"{name}: the backward computes a gradient nothing needs"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_data_that_needs_a_gradient_still_gets_one(name: str) -> None:
    program = PROGRAMS[name]
    x, xs, w = _inputs()
    x.requires_grad_(True)
    xs.requires_grad_(True)

    def step(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
        return torch.autograd.grad(program(x, xs, w).sum(), [x, xs, w], allow_unused=True, materialize_grads=True)

    gm = make_fx(step, tracing_mode="fake")(x, xs, w)
    for got, want in zip(gm(x, xs, w), step(x, xs, w), strict=True):
        torch.testing.assert_close(got, want)


def test_a_compiled_associative_scan_backward_computes_no_gradient_for_data() -> None:
    """associative_scan's combine_fn reads ``s`` (1, 5), data it closes over: its gradient
    would be the only value of that shape the backward computes."""
    torch.manual_seed(0)
    xs, s = torch.randn(6, 3, 5, requires_grad=True), torch.randn(1, 5)

    def program(xs: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return hop.associative_scan(lambda a, b: a + b + s, xs, 0)  # associative: a + b + c + 2s

    compiled, graphs = _compiled_keeping_graphs(program)
    (got,) = torch.autograd.grad(compiled(xs, s).sum(), [xs])
    (want,) = torch.autograd.grad(program(xs, s).sum(), [xs])
    torch.testing.assert_close(got, want)
    assert len(graphs) == 2  # forward, backward
    computed = [
        tuple(node.meta["val"].shape)
        for module in graphs[1].modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
    ]
    assert tuple(s.shape) not in computed, "the backward computes the gradient of s, which nothing needs"


# --- forward mode: the tangents that exist, not zeros ---------------------------------------------
# torch.func.jvp with respect to ``w`` only: ``x`` (and ``xs``) have no tangent. Were
# they given a zero one, the traced program would build a zeros tensor of their shape
# and pass it into the operator's jvp, whose subgraphs would compute with it.

_JVP_PROGRAMS = [name for name in PROGRAMS if name not in ("while_loop", "fori_loop")]  # loops: x is no input


@pytest.mark.parametrize("name", _JVP_PROGRAMS)
def test_a_traced_jvp_builds_no_zero_tangent_for_data(name: str) -> None:
    program = PROGRAMS[name]
    x, xs, w = _inputs()
    w = w.detach()

    def tangent_of_w(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> Any:
        return torch.func.jvp(lambda w: program(x, xs, w), (w,), (t,))

    t = torch.randn_like(w)
    gm = make_fx(tangent_of_w, tracing_mode="fake")(x, xs, w, t)
    for got, want in zip(gm(x, xs, w, t), tangent_of_w(x, xs, w, t), strict=True):
        torch.testing.assert_close(got, want)
    zeros = _zeros_made(gm)
    assert X_SHAPE not in zeros and tuple(xs.shape) not in zeros, f"{name}: a zero tangent for data: {zeros}"


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_traced_jvp_with_respect_to_data_and_weights(name: str) -> None:
    """Tangents for some operands and not others, in both orders of appearance."""
    program = PROGRAMS[name]
    x, xs, w = _inputs()
    w = w.detach()

    def tangents(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, tx: torch.Tensor, tw: torch.Tensor) -> Any:
        return torch.func.jvp(lambda x, w: program(x, xs, w), (x, w), (tx, tw))

    args = (x, xs, w, torch.randn_like(x), torch.randn_like(w))
    gm = make_fx(tangents, tracing_mode="fake")(*args)
    for got, want in zip(gm(*args), tangents(*args), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["cond", "scan", "associative_scan"])
def test_a_traced_backward_of_one_output_of_several(name: str) -> None:
    """An output nothing reads gets no cotangent (None, not zeros): the backward leaves it out."""
    x, xs, w = _inputs()

    def first(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if name == "cond":
            both = hop.cond(x.sum() > 0, lambda a: (a @ w, (a @ w).exp()), lambda a: ((a @ w).sin(), a @ w), (x,))
        elif name == "scan":
            both = hop.scan(lambda c, xi: (c + (xi @ w).tanh(), (c * 2, c.exp())), torch.zeros(3, 5), xs)[1]
        else:
            both = hop.associative_scan(lambda p, q: (p[0] + q[0] + w.sum(), p[1] * q[1]), (xs @ w, xs @ w), 0)
        return both[0]

    def step(x: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> Any:
        return torch.autograd.grad(first(x, xs, w).sum(), [w])

    gm = make_fx(step, tracing_mode="fake")(x, xs, w)
    torch.testing.assert_close(gm(x, xs, w), step(x, xs, w))
    reference = torch.func.grad(lambda w: first(x, xs, w).sum())(w.detach())
    torch.testing.assert_close(step(x, xs, w)[0], reference)


def test_a_traced_forward_ad_of_associative_scan_builds_no_zero_tangent_for_what_it_closes_over() -> None:
    """forward_ad's dual level around a traced call: ``s`` requires grad (so it is an input
    of the operator's node) but has no tangent."""
    torch.manual_seed(0)
    xs, t, s = torch.randn(6, 3, 5), torch.randn(6, 3, 5), torch.randn(1, 5, requires_grad=True)

    def tangent(xs: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> Any:
        with forward_ad.dual_level():
            out = hop.associative_scan(lambda a, b: a + b + s, forward_ad.make_dual(xs, t), 0)
            return forward_ad.unpack_dual(out).tangent

    gm = make_fx(tangent, tracing_mode="fake")(xs, t, s)
    torch.testing.assert_close(gm(xs, t, s), torch.cumsum(t, 0))
    zeros = _zeros_made(gm)
    assert tuple(s.shape) not in zeros, f"a zero tangent for s: {zeros}"
