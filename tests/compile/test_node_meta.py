"""Node metadata inside hop's subgraphs (Note [re-traced subgraphs keep their node meta]):
after strict export and after re-tracing a captured program under
``preserve_node_meta``, a node inside a branch or body still names the user's line in
its ``stack_trace`` and its op in ``source_fn_stack``, as for torch's own operators.
Debuggers, profilers and tlparse read them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

import hop


def in_branch(x: torch.Tensor) -> torch.Tensor:
    return x.cos()  # line: cond branch


def in_body(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return i + 1, x.sin()  # line: while body


def in_scan(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return c + x.exp(), c  # line: scan body


def in_map(r: torch.Tensor) -> torch.Tensor:
    return r.tan()  # line: map body


def in_combine(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p * q.abs()  # line: combine


def in_switch(v: torch.Tensor) -> torch.Tensor:
    return v.sigmoid()  # line: switch branch


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = hop.cond(x.sum() > 0, in_branch, lambda a: a * 2, (x,))
        _, z = hop.while_loop(lambda i, v: i < 3, in_body, (torch.tensor(0), y))
        c, ys = hop.scan(in_scan, torch.zeros(3), z.unsqueeze(0).expand(2, 3))
        ms = hop.map(in_map, ys)
        a = hop.associative_scan(in_combine, ms, 0)
        s = hop.switch(torch.tensor(1), [lambda v: v.neg(), in_switch], (c,))
        return c, a, s


# the aten op, the operator whose subgraph holds it, the comment on the user's line
EXPECTED = {
    torch.ops.aten.cos.default: ("cond", "cond branch"),
    torch.ops.aten.sin.default: ("while_loop", "while body"),
    torch.ops.aten.exp.default: ("scan", "scan body"),
    torch.ops.aten.tan.default: ("map", "map body"),
    torch.ops.aten.abs.default: ("associative_scan", "combine"),
    torch.ops.aten.sigmoid.default: ("switch", "switch branch"),
}


def subgraph_nodes(gm: torch.fx.GraphModule) -> dict[Any, torch.fx.Node]:
    found = {}
    for name, module in gm.named_modules():
        if name and isinstance(module, torch.fx.GraphModule):
            found.update({n.target: n for n in module.graph.nodes if n.target in EXPECTED})
    return found


def check_meta(gm: torch.fx.GraphModule) -> None:
    found = subgraph_nodes(gm)
    assert set(found) == set(EXPECTED), f"missing inside subgraphs: {set(EXPECTED) - set(found)}"
    for target, (op, line) in EXPECTED.items():
        node = found[target]
        stack = [entry[0] for entry in node.meta.get("source_fn_stack", [])]
        assert stack[:1] == [op] and len(stack) == 2, f"{target}: source_fn_stack {stack}"
        trace = node.meta.get("stack_trace") or ""
        assert f"# line: {line}" in trace and __file__ in trace, f"{target}: stack_trace\n{trace}"
        assert "hop/ops" not in trace.splitlines()[-2], f"{target}: points at hop's own code\n{trace}"


X = torch.tensor([0.5, -0.25, 1.0])


@pytest.fixture(scope="module")
def exported() -> torch.export.ExportedProgram:
    return torch.export.export(Model(), (X,), strict=True)


def test_strict_export_names_the_users_line(exported: torch.export.ExportedProgram) -> None:
    check_meta(exported.graph_module)


def test_retracing_under_preserve_node_meta_keeps_it(exported: torch.export.ExportedProgram) -> None:
    with fx_traceback.preserve_node_meta():
        gm = make_fx(torch.fx.Interpreter(exported.module()).run, tracing_mode="fake")(X)
    check_meta(gm)
    torch.testing.assert_close(gm(X), Model()(X))


def test_run_decompositions_keeps_it(exported: torch.export.ExportedProgram) -> None:
    check_meta(exported.run_decompositions().graph_module)


def test_the_graph_aot_autograd_hands_the_backend_keeps_it() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g: torch.fx.GraphModule, _: Any) -> Any:
            graphs.append(g)
            return g

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    torch._dynamo.reset()
    out = torch.compile(Model(), backend=backend, fullgraph=True)(X)
    torch.testing.assert_close(out, Model()(X))
    check_meta(graphs[0])
