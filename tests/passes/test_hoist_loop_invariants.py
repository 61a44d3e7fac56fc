"""hoist_loop_invariants: what a loop body computes from closed-over tensors alone runs once."""

from __future__ import annotations

import pytest
import torch
from passes_helpers import agree, called, codes, hop_nodes, saved_and_loaded
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.passes import hoist_loop_invariants, optimize

MODES = ["fake", "symbolic"]  # real tracing needs no ShapeEnv-free int carry: hop refuses it


def loops(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A fori_loop, a scan and a map whose bodies each compute something of ``w`` only."""
    r = hop.fori_loop(0, 3, lambda i, h: (h @ (w.t() @ w)).tanh(), x)
    c, ys = hop.scan(lambda c, row: (c + w.sin().sum() * row, c * 2), x[0], x)
    m = hop.map(lambda row: row * w.cos().sum(), x)
    return r, c, ys, m


def body_code(gm: torch.fx.GraphModule) -> str:
    return "".join(codes(gm)[1:])


@pytest.mark.parametrize("mode", MODES)
def test_invariants_leave_while_scan_and_map(mode: str) -> None:
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(loops, tracing_mode=mode)(x, w)
    before = codes(gm)
    hoisted = hoist_loop_invariants(gm)
    assert codes(gm) == before, "the pass edited its argument"
    assert hop_nodes(hoisted) == hop_nodes(gm)
    for op in ("aten.t.default", "aten.sin", "aten.cos"):
        assert op in body_code(gm) and op not in body_code(hoisted) and op in hoisted.code
    assert "aten.mm.default(arg1_1" in body_code(hoisted)  # h @ p stays: it reads the carry
    agree(loops, hoisted, [(x, w), (torch.randn(3, 3), torch.randn(3, 3))])
    if mode == "symbolic":
        agree(loops, hoisted, [(torch.randn(5, 3), torch.randn(3, 3))])


def test_nothing_that_can_raise_leaves_a_loop_that_may_not_run() -> None:
    """An index read in a body that runs zero times never happens: it must not move out."""

    def f(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(0, n, lambda i, h: h + w[k].exp().sum(0), x)

    args = (torch.randn(3), torch.randn(4, 3), torch.tensor([1]), torch.tensor(2))
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    hoisted = hoist_loop_invariants(gm)
    assert "aten.index.Tensor" in body_code(hoisted) and "aten.index" not in hoisted.code
    assert "aten.exp" in body_code(hoisted)  # it reads the index: stays too
    bad = (torch.randn(3), torch.randn(4, 3), torch.tensor([9]), torch.tensor(0))  # index out of range, never read
    agree(gm, hoisted, [args, bad])


def test_random_in_place_and_returned_values_stay() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        noisy = hop.fori_loop(0, 2, lambda i, h: h + torch.rand_like(w), x)  # a fresh sample each iteration
        carried = hop.while_loop(lambda i, a, b: i < 2, lambda i, a, b: (i + 1, w.sin(), b + a), (0, x, x))
        return noisy.shape[0] + carried[1] + carried[2]

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3), torch.randn(3))
    hoisted = hoist_loop_invariants(gm)
    assert "rand_like" not in hoisted.code and "rand_like" in body_code(hoisted)
    assert "sin" not in hoisted.code  # returned as a carry: stays in the body
    x, w = torch.randn(3), torch.randn(3)
    torch.manual_seed(0)
    expected = gm(x, w)
    torch.manual_seed(0)
    torch.testing.assert_close(hoisted(x, w), expected)


def test_nested_loops_hoist_to_the_top() -> None:
    """An inner body's invariant of the outer loop's closed-over tensor reaches the top graph."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def outer(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return hop.fori_loop(0, 2, lambda j, g: g @ w.exp() + h, h)

        return hop.fori_loop(0, 2, outer, x)

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    hoisted = hoist_loop_invariants(gm)
    assert "aten.exp" in hoisted.code and "aten.exp" not in body_code(hoisted)
    assert hop_nodes(hoisted) == ["while_loop", "while_loop"]
    agree(f, hoisted, [(x, w), (-x, w * 2)])


class Decoder(torch.nn.Module):
    """A decoding loop whose projection of the weights is the same at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        def step(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            proj = (self.w * self.scale).t() @ self.w  # depends on no carry
            return (h @ proj).tanh()

        return hop.fori_loop(0, steps, step, x)


def test_exported_decoder_loop() -> None:
    model, x = Decoder(), torch.randn(4, 8)
    steps = torch.tensor(3)
    ep = torch.export.export(model, (x, steps), dynamic_shapes=({0: torch.export.Dim("n")}, None))
    for program, additional in ((hoist_loop_invariants(ep), 4), (optimize(ep), 2)):
        assert isinstance(program, torch.export.ExportedProgram)
        (loop,) = called(program.graph_module, torch.ops.hop.while_loop)
        assert len(loop.args[3]) == additional  # optimize drops w and scale: the loop reads steps and proj
        assert "aten.matmul" in program.graph_module.code
        body = getattr(program.graph_module, loop.args[1].target)  # type: ignore[union-attr]
        assert body.code.count("aten.matmul") == 1  # h @ proj, not proj's own
        cases = [(x, steps), (torch.randn(6, 8), torch.tensor(0)), (x, torch.tensor(5))]
        with torch.no_grad():
            agree(model, program.module(), cases)
            agree(model, saved_and_loaded(program).module(), cases)
            agree(model, program.run_decompositions().module(), cases[:1])
