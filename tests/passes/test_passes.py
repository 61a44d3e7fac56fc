"""hop.passes: each pass returns a new, smaller program with the same results."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from passes_helpers import agree, codes, count, hop_nodes, inputs, saved_and_loaded, work
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.passes import PASSES, fold_constant_selectors, optimize, remove_dead_outputs
from hop.testing import check
from hop.testing import strategies as st

MODES = ["real", "fake", "symbolic"]


def constant_selectors(x: torch.Tensor) -> torch.Tensor:
    """A cond on a comparison of a tensor constant, a switch on a constant index (with its
    range assert), both folded; a cond on data, kept."""
    a = hop.cond(torch.tensor(2.0) > 1, lambda v: v.exp(), lambda v: v * 2, (x,))
    b = hop.switch(torch.tensor(1), [lambda v: v + 1, lambda v: v - 1, lambda v: v * 3], (x,))
    c = hop.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))
    return a + b + c


def dead_outputs(x: torch.Tensor) -> torch.Tensor:
    """Output 1 of the cond and outputs 0 and 2 of the switch are never read."""
    a, _ = hop.cond(x.sum() > 0, lambda v: (v.sin(), v.cos() * 2), lambda v: (v * 2, v + 1), (x,))
    branches = [lambda v: (v.exp(), v + 1, v.abs()), lambda v: (v * 3, v - 1, v.neg())]
    _, b, _ = hop.switch((x.sum() > 1).long(), branches, (x,))
    return a + b


@pytest.mark.parametrize("mode", MODES)
def test_fold_constant_selectors_inlines_the_chosen_branch(mode: str) -> None:
    gm = make_fx(constant_selectors, tracing_mode=mode)(torch.randn(3))
    before = codes(gm)
    folded = fold_constant_selectors(gm)
    assert hop_nodes(gm) == ["cond", "cond", "switch"]
    assert hop_nodes(folded) == ["cond"]
    assert count(folded) < count(gm)
    assert codes(gm) == before, "the pass edited its argument"
    assert "exp" in folded.code and "aten.sub" in folded.code  # the chosen branches' bodies
    assert "_assert_async" not in folded.code  # the index is known to be in range
    agree(constant_selectors, folded, inputs() if mode == "symbolic" else inputs()[:3])


@pytest.mark.parametrize("mode", MODES)
def test_remove_dead_outputs_prunes_node_and_branches(mode: str) -> None:
    gm = make_fx(dead_outputs, tracing_mode=mode)(torch.randn(3))
    before = codes(gm)
    pruned = remove_dead_outputs(gm)
    assert codes(gm) == before, "the pass edited its argument"
    nodes = {n.target: n for n in pruned.graph.nodes if n.op == "call_function"}
    cond, switch = nodes[torch.ops.hop.cond], nodes[torch.ops.hop.switch]
    assert isinstance(cond.meta["val"], torch.Tensor)  # one output left: hop's single-value layout
    assert all(u.target is not operator.getitem for u in cond.users)
    assert isinstance(switch.meta["val"], torch.Tensor)
    branch_code = "".join(codes(pruned)[1:])
    assert "cos" not in branch_code and "exp" not in branch_code and "abs" not in branch_code
    assert count(pruned) < count(gm)
    agree(dead_outputs, pruned, inputs() if mode == "symbolic" else inputs()[:3])


def test_remove_dead_outputs_keeps_a_tuple_and_renumbers() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        a, _, c = hop.cond(x.sum() > 0, lambda v: (v.sin(), v.cos(), v.tan()), lambda v: (v, v + 1, v + 2), (x,))
        return a * c

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    pruned = remove_dead_outputs(gm)
    (cond,) = [n for n in pruned.graph.nodes if n.target is torch.ops.hop.cond]
    assert len(cond.meta["val"]) == 2
    assert sorted(u.args[1] for u in cond.users) == [0, 1]
    agree(f, pruned, inputs())


def test_shared_branch_graphs_are_pruned_separately() -> None:
    """Two nodes reading one subgraph attribute: pruning one must not change the other."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda v: (v.sin(), v.cos()), lambda v: (v, v + 1), (x,))[0]

    gm = make_fx(f)(torch.randn(3))
    (cond,) = [n for n in gm.graph.nodes if n.target is torch.ops.hop.cond]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        twin = gm.graph.call_function(torch.ops.hop.cond, cond.args)
        second = gm.graph.call_function(operator.getitem, (twin, 1))
    twin.meta["val"] = cond.meta["val"]
    out.args = ((out.args[0], second),)
    gm.recompile()
    pruned = remove_dead_outputs(gm)
    agree(gm, pruned, inputs()[:3])
    first, second = [n for n in pruned.graph.nodes if n.target is torch.ops.hop.cond]
    assert "sin" in getattr(pruned, first.args[1].target).code  # type: ignore[union-attr]
    assert "cos" not in getattr(pruned, first.args[1].target).code  # type: ignore[union-attr]
    assert "sin" not in getattr(pruned, second.args[1].target).code  # type: ignore[union-attr]


def test_nested_selectors_fold_inside_bodies() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        def body(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return hop.cond(torch.tensor(0) > 1, lambda a: a * 5, lambda a: (a + i).tanh(), (h,))

        return hop.fori_loop(0, 3, body, x)

    def g(x: torch.Tensor) -> torch.Tensor:
        inner = lambda v: hop.cond(torch.tensor(2) > 1, lambda a: a.sin(), lambda a: a * 5, (v,))  # noqa: E731
        return hop.cond(x.sum() > 0, inner, lambda v: v.cos(), (x,))

    for fn, outer in ((f, "while_loop"), (g, "cond")):
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(3))
        folded = optimize(gm)
        assert "cond" in hop_nodes(gm) and hop_nodes(folded) == [outer]
        agree(fn, folded, inputs()[:3])


def test_python_constant_selector_and_out_of_range_index() -> None:
    """A selector that is a Python value folds; a constant index out of range is left to its assert."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.switch(x.sum().long().clamp(0, 1), [lambda v: v + 1, lambda v: v * 2], (x,))

    gm = make_fx(f)(torch.randn(3))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.hop.switch]
    node.args = (1, *node.args[1:])
    gm.recompile()
    folded = fold_constant_selectors(gm)
    assert hop_nodes(folded) == []
    agree(lambda x: x * 2, folded, inputs()[:3])
    node.args = (5, *node.args[1:])
    gm.recompile()
    assert hop_nodes(fold_constant_selectors(gm)) == ["switch"]


def test_folding_keeps_the_subgraphs_of_other_nodes() -> None:
    """Regression (found by the property test): cleaning up after a fold must not strip a
    loop body of the branch graphs nested in it."""

    def f(x: torch.Tensor) -> torch.Tensor:
        inner = lambda a: hop.cond(a.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (a,))  # noqa: E731
        looped = hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, inner(a)), (0, x))[1]
        return looped + hop.cond(torch.tensor(True), lambda v: v * 2, lambda v: v, (x,))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3))
    opt = optimize(gm)
    assert hop_nodes(opt) == ["cond", "while_loop"]
    agree(f, opt, inputs()[:3])


def test_parameters_are_not_constants() -> None:
    """make_fx stores a module's parameters as attributes; training changes them: not folded."""

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return hop.cond(self.gate > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))

    model = Gated()
    gm = make_fx(model)(torch.randn(3))
    folded = optimize(gm)
    assert hop_nodes(folded) == ["cond"]
    with torch.no_grad():
        folded.get_parameter(next(n for n, _ in folded.named_parameters())).fill_(-1.0)
    agree(lambda x: x.cos(), folded, inputs()[:2])


def test_data_dependent_sizes_are_not_folded_away() -> None:
    """A fresh unbacked symbol is bound to the node's output: the node stays."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.cond(torch.tensor(True), lambda v: v[v > 0], lambda v: v[v < 0], (x,)).sum()

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5))
    assert any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes if n.target is torch.ops.hop.cond)
    folded = optimize(gm)
    assert hop_nodes(folded) == ["cond"]
    agree(f, folded, inputs(5)[:3])


class Decoder(torch.nn.Module):
    """A decoder-like block: config flags traced as tensor constants, an attention that also
    returns weights nobody reads, a gated MLP whose gate is data-dependent."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def attention(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = (self.q(h) @ self.k(h).transpose(-1, -2)).softmax(-1)
        return self.o(w @ self.v(h)), w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_norm = torch.tensor(True)  # a config flag: constant in the traced program
        act = torch.tensor(2)  # 0: relu, 1: gelu, 2: silu
        h = hop.cond(use_norm, lambda v: torch.nn.functional.layer_norm(v, v.shape[-1:]), lambda v: v.clone(), (x,))
        attn, _weights = hop.cond(h.mean() > 0, self.attention, lambda v: (v, v @ v.transpose(-1, -2)), (h,))
        x = x + attn
        acts = [lambda v: v.relu(), lambda v: torch.nn.functional.gelu(v), lambda v: torch.nn.functional.silu(v)]
        return x + self.down(hop.switch(act, acts, (self.up(x),)))


def decoder_programs() -> tuple[Decoder, torch.Tensor]:
    torch.manual_seed(0)
    return Decoder().eval(), torch.randn(4, 8)


@pytest.mark.parametrize("mode", MODES)
def test_optimize_decoder(mode: str) -> None:
    model, x = decoder_programs()
    params = dict(model.named_parameters())

    def run(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,))  # type: ignore[no-any-return]

    with torch.no_grad():
        gm = make_fx(run, tracing_mode=mode)(params, x)
        opt = optimize(gm)
        assert hop_nodes(gm) == ["cond", "cond", "switch"] and hop_nodes(opt) == ["cond"]
        assert count(opt) < count(gm)
        agree(run, opt, [(params, x), (params, -x), (params, torch.randn(4, 8))])


def test_passes_on_an_exported_program() -> None:
    model, x = decoder_programs()
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n")},))
    opt = optimize(ep)
    assert isinstance(opt, torch.export.ExportedProgram)
    assert hop_nodes(ep.graph_module) == ["cond", "cond", "switch"] and hop_nodes(opt.graph_module) == ["cond"]
    assert count(opt.graph_module) < count(ep.graph_module)
    with torch.no_grad():
        agree(ep.module(), opt.module(), [(x,), (-x,), (torch.randn(6, 8),)])
        agree(ep.module(), saved_and_loaded(opt).module(), [(x,), (-x,)])
        agree(ep.module(), opt.run_decompositions().module(), [(x,), (-x,)])
        again = torch.export.export(opt.module(), (x,), dynamic_shapes=({0: torch.export.Dim("n")},))
        agree(ep.module(), again.module(), [(x,), (torch.randn(6, 8),)])  # the result exports again
    for each in (fold_constant_selectors, remove_dead_outputs):
        assert count(each(ep).graph_module) < count(ep.graph_module)


def test_optimize_reaches_a_fixed_point() -> None:
    """Folding a selector can leave another node's outputs dead: one call does both."""

    def f(x: torch.Tensor) -> torch.Tensor:
        a, b = hop.cond(x.sum() > 0, lambda v: (v.sin(), v.cos()), lambda v: (v, v + 1), (x,))
        return hop.cond(torch.tensor(1) > 0, lambda p, q: p * 2, lambda p, q: p + q, (a, b))

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    opt = optimize(gm)
    assert "cos" not in "".join(codes(opt))
    assert codes(optimize(opt)) == codes(opt)
    agree(f, opt, inputs())


def _constant_selectors(gm: torch.fx.GraphModule, picks: list[int]) -> torch.fx.GraphModule:
    """``gm`` with each top-level cond/switch selector replaced by a tensor constant."""
    nodes = [n for n in gm.graph.nodes if n.target in (torch.ops.hop.cond, torch.ops.hop.switch)]
    for i, (node, pick) in enumerate(zip(nodes, picks, strict=False)):
        arity = 2 if node.target is torch.ops.hop.cond else len(node.args) - 2
        value = (
            torch.tensor(pick % arity == 0)
            if arity == 2 and node.target is torch.ops.hop.cond
            else torch.tensor(pick % arity)
        )
        gm.register_buffer(f"_picked_{i}", value)
        with gm.graph.inserting_before(node):
            node.args = (gm.graph.get_attr(f"_picked_{i}"), *node.args[1:])
    gm.recompile()
    return gm


def _traced(fn: Any, case: st.Case) -> torch.fx.GraphModule:
    """A drawn program traced with fake tensors; the constant tensors it closes over stay real."""
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*case.args)


@settings(
    max_examples=max(1, settings.default.max_examples // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    st.cases(ops=("cond", "switch", "while_loop", "map", "scan"), depth=2, min_rank=1),
    hs.lists(hs.integers(0, 5), min_size=4, max_size=4),
)
def test_optimize_agrees_on_random_programs(case: st.Case, picks: list[int]) -> None:
    fn = case.program.compile()
    gm = _traced(fn, case)
    constant = _constant_selectors(_traced(fn, case), picks)
    for program in (gm, constant):
        opt = optimize(program)
        assert work(opt) <= work(program)  # hoisting adds placeholders, unrolling views: never computations
        foldable = program is constant and any(
            n.target in (torch.ops.hop.cond, torch.ops.hop.switch) and not n.meta.get("unbacked_bindings")
            for n in program.graph.nodes
        )
        assert count(opt) < count(program) or not foldable
        perturbed = [case.args, tuple(-a for a in case.args), tuple(a * 0.5 + 1 for a in case.args)]
        agree(program, opt, perturbed)
        for each in PASSES:  # each alone, too: a pass must not rely on another running first
            agree(program, each(program), perturbed[:2])


def _has_asserts(gm: torch.fx.GraphModule) -> bool:
    return any(n.target is torch.ops.aten._assert_async.msg for m in gm.modules() for n in m.graph.nodes)


@settings(
    max_examples=max(1, settings.default.max_examples // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    st.cases(ops=("cond", "switch", "while_loop", "map", "scan"), depth=2, min_rank=1),
    hs.lists(hs.integers(0, 5), min_size=4, max_size=4),
    hs.sampled_from([*PASSES, optimize]),
)
def test_passes_agree_under_every_transform(case: st.Case, picks: list[int], graph_pass: Any) -> None:
    """hop.testing.check with the program before the pass as the oracle: the program after
    it agrees in eager, under autograd, jvp, vmap, fake tensors, make_fx and torch.export."""
    fn = case.program.compile()
    program = _constant_selectors(_traced(fn, case), picks)
    skip = dict(case.skips())
    if _has_asserts(program):  # a switch's range assert: torch has no batching rule for it
        skip["vmap"] = "aten._assert_async has no batching rule"
    report = check(graph_pass(program), *case.args, reference=program, skip=skip)
    assert {"eager", "autograd", "make_fx_symbolic", "export"} <= set(report.ran)


class Masked(torch.nn.Module):
    """Data-dependent sizes everywhere: a masked input carried by a loop with an invariant
    projection, a cond with a shared prefix whose output size is data-dependent, a constant switch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        pos = x[x.sum(-1) > 0]
        h = hop.fori_loop(0, 2, lambda i, h: h @ (self.w.t() @ self.w), pos)
        g = hop.cond(h.sum() > 0, lambda v: v.sin()[v.sin().sum(-1) > 0], lambda v: v.sin()[:1], (h,))
        k = hop.switch(torch.tensor(1), [lambda v: v + 1, lambda v: v * 2], (g,))
        return k.sum(0), h.shape[0]


def _free_unbacked(gm: torch.fx.GraphModule) -> set[Any]:
    symbols: set[Any] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            symbols |= {s for d in val.shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    return {s for s in symbols if str(s).startswith("u")}


def test_optimize_keeps_unbacked_sizes_bound_and_asserts() -> None:
    model = Masked()
    ep = torch.export.export(model, (torch.randn(6, 4),), dynamic_shapes=({0: torch.export.Dim("n")},))
    opt = optimize(ep)
    gm = opt.graph_module
    assert hop_nodes(gm) == ["cond", "while_loop"]  # the switch folded
    (loop,) = [n for n in gm.graph.nodes if n.target is torch.ops.hop.while_loop]
    assert "aten.matmul" in gm.code and getattr(gm, loop.args[1].target).code.count("aten.matmul") == 1
    bound = {s for n in gm.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})}
    assert _free_unbacked(gm) and _free_unbacked(gm) <= bound, "a data-dependent size lost the node that binds it"
    assert "hop.cond: output.size(0) must be >= 0" in gm.code  # the cond's range asserts stay
    cases = [(torch.randn(6, 4),), (torch.randn(9, 4),), (-torch.rand(3, 4),)]
    with torch.no_grad():
        agree(model, opt.module(), cases)
        agree(model, saved_and_loaded(opt).module(), cases)


def dead_loop_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Carry b of the while_loop feeds only itself; carry a is not read after the loop but
    feeds c. The scan's second carry and first ys, the map's first output: never read."""
    _, _, _, c = hop.while_loop(
        lambda i, a, b, c: i < 3, lambda i, a, b, c: (i + 1, a * 2, b @ w, c + a.sum()), (0, x, x, x)
    )
    carry, ys = hop.scan(lambda c, r: ((c[0] + r, c[1] * r), (r.sin(), (c[0] * r).cos())), (x[0], x[0]), x)
    _, m = hop.map(lambda r: (r.exp(), r.tanh()), x)
    return c, carry[0], ys[1], m


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_remove_dead_outputs_of_loops(mode: str) -> None:
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = make_fx(dead_loop_outputs, tracing_mode=mode)(x, w)
    pruned = remove_dead_outputs(gm)
    nodes = {n.target: n for n in pruned.graph.nodes if n.op == "call_function"}
    loop, scan, map_ = nodes[torch.ops.hop.while_loop], nodes[torch.ops.hop.scan], nodes[torch.ops.hop.map]
    assert len(loop.args[2]) == 3 and len(loop.meta["val"]) == 3  # the counter, a (feeds c) and c
    assert len(scan.args[1]) == 1 and len(scan.meta["val"]) == 2  # one carry, one ys
    assert isinstance(map_.meta["val"], torch.Tensor)  # one output left: hop's single-value layout
    body_code = "".join(codes(pruned)[1:])
    assert "aten.mm" not in body_code and "aten.sin" not in body_code and "aten.exp" not in body_code
    assert "aten.cos" in body_code and "aten.tanh" in body_code
    agree(dead_loop_outputs, pruned, [(x, w), (torch.randn(3, 3), -w)])
    if mode == "symbolic":
        agree(dead_loop_outputs, pruned, [(torch.randn(5, 3), w)])


def test_remove_dead_loop_outputs_exported() -> None:
    class Loops(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return dead_loop_outputs(x, w)

    args = (torch.randn(3, 3), torch.randn(3, 3))
    ep = torch.export.export(Loops(), args, dynamic_shapes=({0: torch.export.Dim("n")}, None))
    opt = remove_dead_outputs(ep)
    assert count(opt.graph_module) < count(ep.graph_module)
    cases = [args, (torch.randn(6, 3), args[1])]
    agree(ep.module(), opt.module(), cases)
    agree(ep.module(), saved_and_loaded(opt).module(), cases)


def test_misuse_raises_hop_errors() -> None:
    for each in (*PASSES, optimize):
        with pytest.raises(hop.errors.HopTypeError, match=r"takes a torch\.fx\.GraphModule or a torch\.export"):
            each(lambda x: x)  # type: ignore[type-var]
    gm = make_fx(lambda x: x.sin())(torch.randn(2))
    with pytest.raises(hop.errors.HopValueError, match="max_rounds must be a positive int"):
        optimize(gm, max_rounds=0)
