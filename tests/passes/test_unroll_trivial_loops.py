"""unroll_trivial_loops: a loop known to run zero times or once is its input or its body."""

from __future__ import annotations

import pytest
import torch
from passes_helpers import agree, codes, hop_nodes, inputs, saved_and_loaded
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.passes import optimize, unroll_trivial_loops

MODES = ["fake", "symbolic"]  # real tracing refuses a fori_loop's int counter (no ShapeEnv)


def trips(x: torch.Tensor) -> torch.Tensor:
    once = hop.fori_loop(0, 1, lambda i, h: (h + i).sin(), x)
    never = hop.fori_loop(2, 2, lambda i, h: (h + i).cos(), x)
    thrice = hop.fori_loop(0, 3, lambda i, h: (h + i).tanh(), x)
    return once + never * 2 + thrice


@pytest.mark.parametrize("mode", MODES)
def test_loops_of_zero_and_one_trips_are_unrolled(mode: str) -> None:
    gm = make_fx(trips, tracing_mode=mode)(torch.randn(3))
    before = codes(gm)
    unrolled = unroll_trivial_loops(gm)
    assert codes(gm) == before, "the pass edited its argument"
    assert hop_nodes(gm) == ["while_loop"] * 3 and hop_nodes(unrolled) == ["while_loop"]
    assert "aten.sin" in unrolled.code and "aten.cos" not in "".join(codes(unrolled))  # body inlined; never run
    assert "aten.clone" in unrolled.code  # the zero-trip loop's result is a copy of its input, not an alias
    agree(trips, unrolled, inputs() if mode == "symbolic" else inputs()[:3])
    assert "_assert_scalar" in unrolled.code  # the counter's range asserts stay, for optimize to fold
    assert optimize(gm).code.count("aten._assert_scalar") == 1  # only the three-trip loop's


def test_unknown_trip_counts_stay() -> None:
    def f(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = hop.fori_loop(0, n, lambda i, h: h * 2, x)
        b = hop.while_loop(lambda c: c.sum() < 10, lambda c: c + 1, (x,))[0]
        return a + b

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3), torch.tensor(1))
    assert hop_nodes(unroll_trivial_loops(gm)) == ["while_loop", "while_loop"]


def test_a_constant_single_carry_loop() -> None:
    """A while_loop whose one carry is a tensor constant: its condition is known."""

    def f(x: torch.Tensor) -> torch.Tensor:
        never = hop.while_loop(lambda c: c.sum() > 5, lambda c: c - 1, (torch.ones(2),))[0]
        once = hop.while_loop(lambda c: c.sum() < 1, lambda c: c + 1, (torch.zeros(2),))[0]
        return x + never.sum() + once.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3))
    unrolled = unroll_trivial_loops(gm)
    assert hop_nodes(unrolled) == []
    agree(f, unrolled, inputs()[:3])


def test_nested_in_a_branch() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        inner = lambda v: hop.fori_loop(0, 1, lambda i, h: h * 3 + i, v)  # noqa: E731
        return hop.cond(x.sum() > 0, inner, lambda v: v.cos(), (x,))

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    opt = optimize(gm)
    assert hop_nodes(opt) == ["cond"]
    agree(f, opt, inputs())


class Refine(torch.nn.Module):
    """A refinement loop configured for a single step, and one for none."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = hop.fori_loop(0, 1, lambda i, h: self.lin(h).tanh(), x)
        return hop.fori_loop(0, 0, lambda i, h: self.lin(h).relu(), x)


def test_exported_refinement_loop() -> None:
    model, x = Refine(), torch.randn(2, 4)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n")},))
    for program in (unroll_trivial_loops(ep), optimize(ep)):
        assert isinstance(program, torch.export.ExportedProgram)
        assert hop_nodes(program.graph_module) == []
        cases = [(x,), (torch.randn(5, 4),)]
        with torch.no_grad():
            agree(model, program.module(), cases)
            agree(model, saved_and_loaded(program).module(), cases)
            agree(model, program.run_decompositions().module(), cases[:1])
    assert "_assert_scalar" not in optimize(ep).graph_module.code


def scans(x: torch.Tensor, empty: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A scan and a map over one slice, and over none."""
    c, ys = hop.scan(lambda c, r: (c + r, (c * r).sin()), x[0], x[:1])
    m = hop.map(lambda r: (r.exp(), r * 2), x[:1])
    c0, y0 = hop.scan(lambda c, r: (c + r, (c * r).sin()), x[0], empty)
    return c, ys, *m, c0, y0, hop.map(lambda r: r.cos(), empty)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_scans_and_maps_of_length_zero_and_one(mode: str) -> None:
    args = (torch.randn(3, 2), torch.randn(0, 2))
    gm = make_fx(scans, tracing_mode=mode)(*args)
    unrolled = unroll_trivial_loops(gm)
    assert hop_nodes(gm) == ["map", "map", "scan", "scan"] and hop_nodes(unrolled) == []
    assert "aten.cos" not in unrolled.code and "aten.empty" in unrolled.code  # zero slices: never run
    assert unrolled.code.count("aten.unsqueeze") == 3  # one slice: its per-step outputs, stacked
    agree(scans, unrolled, [args, (torch.randn(3, 2), torch.randn(0, 2))])


def test_symbolic_lengths_stay() -> None:
    """``x[:1]`` has length 1 whatever x's size; ``empty``'s length is a symbol: kept."""
    gm = make_fx(scans, tracing_mode="symbolic")(torch.randn(3, 2), torch.randn(0, 2))
    unrolled = unroll_trivial_loops(gm)
    assert hop_nodes(unrolled) == ["map", "scan"]
    agree(scans, unrolled, [(torch.randn(4, 2), torch.randn(3, 2)), (torch.randn(2, 2), torch.randn(0, 2))])


def test_exported_scans_of_length_zero_and_one() -> None:
    class Scans(torch.nn.Module):
        def forward(self, x: torch.Tensor, empty: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return scans(x, empty)

    args = (torch.randn(3, 2), torch.randn(0, 2))
    ep = torch.export.export(Scans(), args)
    opt = optimize(ep)
    assert hop_nodes(opt.graph_module) == []
    agree(ep.module(), opt.module(), [args])
    agree(ep.module(), saved_and_loaded(opt).module(), [args])
