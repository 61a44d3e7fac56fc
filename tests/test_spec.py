"""Each operator's spec (hop/_spec.py): one per operator, its layout is the node's, and the
framework modules read it instead of naming operators."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop import _operator, _spec

ROOT = Path(hop.__file__).resolve().parent
NAMES = {s.name for s in _spec.specs()}


def test_every_public_operator_has_a_spec_and_every_layout_an_operator() -> None:
    assert {"cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan"} == NAMES
    for spec in _spec.specs():
        assert callable(getattr(hop, spec.name))
        if spec.layout is not None:
            assert _operator.registered_ops()[spec.name].name() == spec.name


def test_fori_loop_is_a_public_function_over_while_loop() -> None:
    fori = _spec.spec_of("fori_loop")
    assert fori is not None and fori.layout is None and fori.over == "while_loop"
    assert "fori_loop" not in _operator.registered_ops()
    assert _spec.spec_of(fori.over) is not None


def _programs() -> list[tuple[str, Callable[[torch.Tensor], Any]]]:
    return [
        ("cond", lambda x: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,))),
        ("switch", lambda x: hop.switch(x.sum().long().clamp(0, 2), [torch.sin, torch.cos, torch.tanh], (x,))),
        (
            "while_loop",
            lambda x: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin()), (torch.tensor(0), x)),
        ),
        ("scan", lambda x: hop.scan(lambda c, r: (c + r, c.sin()), torch.zeros(3), x)),
        ("map", lambda x: hop.map(lambda r: r * x.sum(), x)),
        ("associative_scan", lambda x: hop.associative_scan(lambda a, b: a * b, x, 0)),
    ]


@pytest.mark.parametrize(("name", "fn"), _programs(), ids=[n for n, _ in _programs()])
def test_the_layout_is_where_the_node_holds_what(name: str, fn: Callable[[torch.Tensor], Any]) -> None:
    gm = make_fx(fn)(torch.randn(4, 3))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is getattr(torch.ops.hop, name)]
    spec = _spec.spec_of(name)
    assert spec is not None and spec.layout is not None
    layout, args = spec.layout, node.args

    def is_subgraph(a: Any) -> bool:
        return (
            isinstance(a, torch.fx.Node)
            and a.op == "get_attr"
            and isinstance(getattr(gm, a.target), torch.fx.GraphModule)
        )  # type: ignore[arg-type]

    positions = layout.subgraph_positions(args)
    assert [k for k, a in enumerate(args) if is_subgraph(a)] == list(positions)
    assert all(spec.role(k) is not None for k in range(len(positions)))
    for at in (layout.carries, layout.xs, layout.inputs):
        assert at is None or isinstance(args[at], (tuple, list))
    if layout.selector is not None:
        assert isinstance(args[layout.selector], torch.fx.Node) and not is_subgraph(args[layout.selector])
    for at in (layout.body, layout.condition):
        assert at is None or at in positions
    leading = layout.leading(args)
    assert layout.inputs is not None
    for (
        p
    ) in positions:  # every subgraph reads the carries, slices, then the inputs (associative_scan: twice the slices)
        placeholders = [n for n in getattr(gm, args[p].target).graph.nodes if n.op == "placeholder"]
        extra = len(args[layout.xs]) if name == "associative_scan" and layout.xs is not None else 0
        assert len(placeholders) == leading + extra + len(args[layout.inputs])


# The modules that read the specs: none names an operator in its code (docstrings and
# messages may, as examples). The demo and the quick check run the operators by name.
_USERS = ("__init__.py", "_reference.py", "_demo.py", "_quick_check.py")
_FRAMEWORK = [p for p in ROOT.glob("*.py") if p.name not in _USERS]
_FRAMEWORK += list((ROOT / "passes").glob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


@pytest.mark.parametrize("path", _FRAMEWORK, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_framework_module_names_no_operator(path: Path) -> None:
    tree = ast.parse(path.read_text())
    docstrings = _docstrings(tree)
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docstrings:
            named.append((node.lineno, node.value))
        if isinstance(node, ast.Attribute) and node.attr in NAMES and ast.unparse(node.value) == "torch.ops.hop":
            named.append((node.lineno, node.attr))
    assert named == []
