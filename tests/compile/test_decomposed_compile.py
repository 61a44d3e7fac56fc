"""A user's operator defined only by its decomposition, compiled: strict export and
torch.compile (aot_eager and Inductor, forward and training) inline the decomposition;
an exported node compiles, deploys with AOTInductor and exports to ONNX. The
operators and models are tests/test_decomposed_ops.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_decomposed_ops import MODELS, OPS, grads, inputs, nodes_of


@pytest.fixture(params=sorted(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, MODELS[request.param]()


def test_strict_export_and_compile_inline_the_decomposition(case: tuple[str, Any]) -> None:
    name, model = case
    first, second = inputs(name)
    ep = torch.export.export(model, (first,), strict=True)
    assert nodes_of(ep.graph_module, OPS[name]) == 0  # Dynamo traced the decomposition
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        for b in (first, second):
            torch.testing.assert_close(ep.module()(b), model.python(b))
            torch.testing.assert_close(compiled(b), model.python(b))
            torch.testing.assert_close(grads(compiled, b, model.w), grads(model.python, b, model.w))


def test_an_exported_node_compiles_and_deploys(case: tuple[str, Any], tmp_path: Path) -> None:
    name, model = case
    first, second = inputs(name)
    ep = torch.export.export(model, (first,))
    compiled = torch.compile(ep.module(), backend="inductor", fullgraph=True)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "op.pt2"))
    loaded = torch._inductor.aoti_load_package(package)
    for b in (first, second):
        torch.testing.assert_close(compiled(b), model.python(b))
        torch.testing.assert_close(loaded(b), model.python(b))


def test_onnx_runs_the_decomposition(case: tuple[str, Any]) -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    name, model = case
    first, second = inputs(name)
    program = torch.onnx.export(model, (first,), dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    feed = session.get_inputs()[0].name
    for b in (first, second):
        (got,) = session.run(None, {feed: b.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), model.python(b).detach())
