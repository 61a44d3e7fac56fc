"""hoist_common_branch_prefix: what every branch starts with runs once, before the node."""

from __future__ import annotations

import pytest
import torch
from passes_helpers import agree, called, codes, hop_nodes, saved_and_loaded, work
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.passes import hoist_common_branch_prefix, optimize

MODES = ["real", "fake", "symbolic"]


def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Both branches of the cond start with ``x @ w``; every switch branch with ``x.sin()``,
    two with ``x.cos()`` (not hoisted: the third has none); different scalars are different."""
    a = hop.cond(x.sum() > 0, lambda v, m: (v @ m).relu() * 2, lambda v, m: (v @ m).sigmoid() * 3, (x, w))
    branches = [lambda v: v.sin().exp() + v.cos(), lambda v: v.sin() + v.cos(), lambda v: v.sin() * 3]
    return a + hop.switch((x.sum() > 1).long() + (x.sum() > 2).long(), branches, (x,))


def branch_code(gm: torch.fx.GraphModule) -> str:
    return "".join(codes(gm)[1:])


@pytest.mark.parametrize("mode", MODES)
def test_common_prefix_moves_before_cond_and_switch(mode: str) -> None:
    w = torch.randn(3, 3)
    gm = make_fx(gated, tracing_mode=mode)(torch.randn(3, 3), w)
    before = codes(gm)
    hoisted = hoist_common_branch_prefix(gm)
    assert codes(gm) == before, "the pass edited its argument"
    assert hoisted.code.count("aten.mm") == 1 and "aten.mm" not in branch_code(hoisted)
    assert hoisted.code.count("aten.sin") == 1 and "aten.sin" not in branch_code(hoisted)
    assert "aten.cos" not in hoisted.code and branch_code(hoisted).count("aten.cos") == 2
    assert branch_code(hoisted).count("aten.mul.Tensor") == 3  # * 2, * 3 and * 3: kept apart
    assert work(hoisted) == work(gm) - 3  # one mm and two sin fewer, across the branches
    cases = [(torch.randn(3, 3) + s, w) for s in (-2.0, 0.1, 0.3, 2.0)]
    agree(gated, hoisted, cases if mode != "real" else cases[:1])


def test_nothing_moves_without_a_common_prefix() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        noisy = hop.cond(x.sum() > 0, lambda v: v + torch.rand_like(v), lambda v: v - torch.rand_like(v), (x,))
        return noisy + hop.cond(x.sum() > 0, lambda v: v.sin() * 2, lambda v: (v * 2).sin(), (x,))

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    assert codes(hoist_common_branch_prefix(gm)) == codes(gm)


def test_a_returned_value_stays_in_its_branch() -> None:
    """Both branches return ``v.exp()`` as their first output: the result must not alias the operand."""

    def f(x: torch.Tensor) -> torch.Tensor:
        a, b = hop.cond(x.sum() > 0, lambda v: (v.exp(), v.exp() * 2), lambda v: (v.exp(), v.exp() - 1), (x,))
        return a + b

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    hoisted = hoist_common_branch_prefix(gm)
    (cond,) = called(hoisted, torch.ops.hop.cond)
    assert len(cond.args[3]) == 2  # one exp became an operand  # type: ignore[arg-type]
    assert branch_code(hoisted).count("aten.exp") == 2  # the returned one, in each branch
    agree(f, hoisted, [(torch.randn(3),), (-torch.rand(4) - 0.1,)])


def test_nested_prefix_then_loop_invariant() -> None:
    """A branch prefix inside a loop body that reads only closed-over tensors leaves the branch,
    then the loop."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def step(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return hop.cond(h.sum() > 0, lambda a, m: a @ m.t() + 1, lambda a, m: a @ m.t() - 1, (h, w))

        return hop.fori_loop(0, 3, step, x)

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    opt = optimize(gm)
    assert "aten.t.default" in opt.code and "aten.t.default" not in branch_code(opt)
    assert hop_nodes(opt) == ["cond", "while_loop"]
    agree(f, opt, [(x, w), (-x, w), (x * 3, -w)])


class Gated(torch.nn.Module):
    """A gated block whose two paths share their input projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def wide(v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(self.proj(v)) * 2

        def narrow(v: torch.Tensor) -> torch.Tensor:
            return self.proj(v).relu()

        return hop.cond(x.mean() > 0, wide, narrow, (x,))


def test_exported_gated_block() -> None:
    model, x = Gated(), torch.randn(4, 8)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n")},))
    for program, operands in ((hoist_common_branch_prefix(ep), 4), (optimize(ep), 1)):
        assert isinstance(program, torch.export.ExportedProgram)
        assert "aten.linear" in program.graph_module.code
        assert "aten.linear" not in branch_code(program.graph_module)
        (cond,) = called(program.graph_module, torch.ops.hop.cond)
        assert len(cond.args[3]) == operands  # optimize drops x, weight and bias: only the projection is read
        cases = [(x,), (-x,), (torch.randn(6, 8),)]
        with torch.no_grad():
            agree(model, program.module(), cases)
            agree(model, saved_and_loaded(program).module(), cases)
            agree(model, program.run_decompositions().module(), cases[:2])
