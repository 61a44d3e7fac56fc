"""Every operator traced by make_fx under C++ functionalization.

``torch._to_functional_tensor`` + ``torch._enable_functionalization`` is the path
older AOTAutograd code (and torch's own control-flow tests) use: the operator meets
``DispatchKey.Functionalize`` with plain ``FunctionalTensorWrapper`` tensors and a
``CppFunctionalizeAPI`` ctx, not ``FunctionalTensorMode``. A trace that looked at
the wrappers' contents instead of tracing below them would bake the inputs into
the graph as ``_tensor_constant`` attributes and silently return stale values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from harness import assert_close
from torch.fx.experimental.proxy_tensor import make_fx

import hop

Fn = Callable[..., Any]


def cpp_functionalized(fn: Fn) -> Fn:
    """``fn`` run on functional wrappers of its inputs with C++ functionalization enabled."""

    def unwrap(t: torch.Tensor) -> torch.Tensor:
        torch._sync(t)
        return torch._from_functional_tensor(t)

    def wrap(t: torch.Tensor) -> torch.Tensor:
        out = torch._to_functional_tensor(t)
        torch._mirror_autograd_meta_to(t, out)  # type: ignore[attr-defined]  # requires_grad too
        return out

    def run(*args: Any) -> Any:
        wrapped = pytree.tree_map_only(torch.Tensor, wrap, args)
        torch._enable_functionalization(reapply_views=True)
        try:
            out = fn(*wrapped)
        finally:
            torch._disable_functionalization()
        return pytree.tree_map_only(torch.Tensor, unwrap, out)

    return run


def tensor_constants(gm: torch.fx.GraphModule) -> list[str]:
    """The get_attr nodes of ``gm`` and its subgraphs that hold a tensor."""
    return [
        f"{name}.{node.target}"
        for name, module in gm.named_modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "get_attr" and isinstance(getattr(module, str(node.target), None), torch.Tensor)
    ]


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# (program, the raw op it must keep, trace inputs, other inputs)
PROGRAMS: dict[str, tuple[Fn, str, tuple[Any, ...], tuple[Any, ...]]] = {
    "map": (lambda xs, y: hop.map(lambda x, y: x * y + 1, xs, y), "map", (r(3, 2), r(2)), (r(3, 2), r(2))),
    "scan": (
        lambda c, xs: hop.scan(lambda c, x: (c + x, c * x), c, xs),
        "scan",
        (r(2), r(3, 2)),
        (r(2), r(3, 2)),
    ),
    "while_loop": (
        lambda i, x: hop.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (i, x)),
        "while_loop",
        (torch.tensor(0), r(2)),
        (torch.tensor(1), r(2)),
    ),
    "cond": (
        lambda p, x: hop.cond(p, lambda a: a.sin(), lambda a: a.cos(), (x,)),
        "cond",
        (torch.tensor(True), r(2)),
        (torch.tensor(False), r(2)),
    ),
    "switch": (
        lambda i, x: hop.switch(i, [lambda a: a.sin(), lambda a: a.cos(), lambda a: a + 1], (x,)),
        "switch",
        (torch.tensor(1), r(2)),
        (torch.tensor(2), r(2)),
    ),
    "associative_scan": (
        lambda xs: hop.associative_scan(lambda a, b: a + b, xs, 0),
        "associative_scan",
        (r(4, 2),),
        (r(4, 2),),
    ),
    "fori_loop": (  # a tensor bound: a counter that is a tensor traces in every mode
        lambda n, x: hop.fori_loop(0, n, lambda i, v: v * 2 + i, x),
        "while_loop",
        (torch.tensor(3), r(2)),
        (torch.tensor(5), r(2)),
    ),
}


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_make_fx_under_cpp_functionalization(name: str, mode: str) -> None:
    fn, op, trace_args, other_args = PROGRAMS[name]
    gm = make_fx(cpp_functionalized(fn), tracing_mode=mode)(*trace_args)
    assert any(n.target is getattr(torch.ops.hop, op) for n in gm.graph.nodes), gm.code
    assert tensor_constants(gm) == [], gm.code  # nothing of the inputs baked in
    for args in (trace_args, other_args):
        assert_close(gm(*args), fn(*args))


# programs whose callables read a weight from their closure
CLOSURES: dict[str, Fn] = {
    "map": lambda xs, w: hop.map(lambda x: x * w, xs),
    "scan": lambda xs, w: hop.scan(lambda c, x: (c + x * w, c * w), torch.zeros(2), xs)[1],
    "while_loop": lambda xs, w: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * w), (0, xs))[1],
    "cond": lambda xs, w: hop.cond(xs.sum() > 0, lambda a: a * w, lambda a: a + w, (xs,)),
    "switch": lambda xs, w: hop.switch(1, [lambda a: a * w, lambda a: a + w * 2], (xs,)),
    "fori_loop": lambda xs, w: hop.fori_loop(0, 3, lambda i, v: v * w, xs),
    "associative_scan": lambda xs, w: hop.associative_scan(lambda a, b: a * b * w, xs, 0),  # associative in a, b
}


@pytest.mark.parametrize("name", list(CLOSURES))
def test_gradient_of_a_closed_over_tensor_under_cpp_functionalization(name: str) -> None:
    program = CLOSURES[name]

    def grad_of_weight(xs: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(program(xs, w).sum(), w)

    xs, w = torch.rand(3, 2) + 0.5, torch.tensor([0.5, 2.0], requires_grad=True)
    assert_close(cpp_functionalized(grad_of_weight)(xs, w), grad_of_weight(xs, w))
