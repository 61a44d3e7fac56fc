"""hop.passes.inductor: optimize as Inductor's post-grad custom pre-pass, under torch.compile."""

from __future__ import annotations

import torch
import torch._inductor.config as config
from passes_helpers import called

import hop
from hop.compile.inductor import POST_GRAD_PASS
from hop.passes.inductor import OPTIMIZE_PASS, chain, enable


def model(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A loop with an invariant projection, a cond and a switch with common prefixes
    (the switch is rewritten by hop's own pre-pass, after this pass ran)."""
    h = hop.fori_loop(0, 3, lambda i, h: (h @ (w.t() @ w)).tanh(), x)
    g = hop.cond(h.sum() > 0, lambda v: v.sin() * 2, lambda v: v.sin() + 1, (h,))
    return hop.switch(k, [lambda v: v.cos() + 1, lambda v: v.cos().exp()], (g,))


def test_compiled_models_get_the_passes() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def user_pass(graph: torch.fx.Graph) -> None:  # a user's own pass: still runs, after hop's
        graphs.append(graph.owning_module)

    torch._dynamo.reset()
    with config.patch(post_grad_custom_pre_pass=chain(user_pass), fx_graph_cache=False):
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        g = torch.Generator().manual_seed(0)
        w = torch.randn(3, 3, generator=g) / 2
        for sign, k in ((1.0, 0), (-1.0, 1), (1.0, 1)):
            x = torch.randn(3, 3, generator=g).abs() * sign
            torch.testing.assert_close(compiled(x, w, torch.tensor(k)), model(x, w, torch.tensor(k)))
        # hop's own pre-pass is still installed (the switch compiled), this one did not replace it
        assert POST_GRAD_PASS in chain_of(config.post_grad_custom_pre_pass)
    top = next(gm for gm in graphs if called(gm, torch.ops.hop.while_loop))
    (loop,) = called(top, torch.ops.hop.while_loop)
    body = getattr(top, loop.args[1].target)  # type: ignore[union-attr]
    assert body.code.count("aten.mm") == 1 and top.code.count("aten.mm") == 1  # w.t() @ w, once
    (cond,) = called(top, torch.ops.hop.cond)
    assert "aten.sin" in top.code and "aten.sin" not in getattr(top, cond.args[1].target).code  # type: ignore[union-attr]
    # the switch's common cos moved out before hop's rewrite made it nested conds
    assert top.code.count("aten.cos") == 1
    assert not any("aten.cos" in m.code for m in top.modules() if m is not top and isinstance(m, torch.fx.GraphModule))


def chain_of(passes: object) -> list[object]:
    return list(passes) if isinstance(passes, (list, tuple)) else [passes]


def test_enable_and_chain_keep_other_passes() -> None:
    def mine(graph: torch.fx.Graph) -> None:
        pass

    with config.patch(post_grad_custom_pre_pass=None):
        enable()
        assert config.post_grad_custom_pre_pass == [OPTIMIZE_PASS, POST_GRAD_PASS]
    with config.patch(post_grad_custom_pre_pass=mine):
        enable()
        enable()  # twice: still once
        assert config.post_grad_custom_pre_pass == [OPTIMIZE_PASS, POST_GRAD_PASS, mine]
    assert chain([mine, OPTIMIZE_PASS]) == [OPTIMIZE_PASS, POST_GRAD_PASS, mine]
    assert isinstance(OPTIMIZE_PASS.uuid(), bytes) and OPTIMIZE_PASS.uuid() == OPTIMIZE_PASS.uuid()


def test_graphs_without_hop_nodes_are_left_alone() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    before = gm.code
    OPTIMIZE_PASS(gm.graph)
    assert gm.code == before


def test_compiled_training_of_a_loop_gets_the_passes() -> None:
    """A loop's backward is a scan over its trip count, a length known only at run time:
    the pass leaves it alone (it asked whether that length was 0 and failed the compile)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 3, generator=g) / 2).requires_grad_()
    x = torch.randn(3, 3, generator=g)
    k = torch.tensor(0)
    with config.patch(post_grad_custom_pre_pass=chain(None), fx_graph_cache=False):
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        (got,) = torch.autograd.grad(compiled(x, w, k).sum(), [w])
    (want,) = torch.autograd.grad(model(x, w, k).sum(), [w])
    torch.testing.assert_close(got, want)
