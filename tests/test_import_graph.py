"""hop's import graph has no cycle and no upward import, lazy imports included (tools/check_layers.py)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import check_layers


def test_hop_has_no_import_cycle() -> None:
    edges = check_layers.graph()
    assert "hop.ops.branching.cond" in edges and "hop._dispatch" in edges
    assert check_layers.cycles(edges) == []


def test_function_level_imports_count() -> None:
    edges = check_layers.graph()
    # hop.compile.dynamo imports its handlers inside a function, when Dynamo loads
    assert "hop.compile._dynamo_branching" in edges["hop.compile.dynamo"]


def test_a_cycle_is_found_with_its_members() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert check_layers.cycles(edges) == [["a", "b", "c"]]
    assert check_layers.cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_core_module_imports_a_layer_above() -> None:
    edges = check_layers.graph()
    assert check_layers.is_core("hop._dispatch") and check_layers.is_core("hop._observe")
    assert not check_layers.is_core("hop.debug") and not check_layers.is_core("hop.ops.scanning._rules")
    assert check_layers.upward(edges) == []


def test_an_upward_import_is_found() -> None:
    edges = {
        "hop._dispatch": {"hop.debug": 3, "hop._records": 4},
        "hop._observe": {"hop.ops.scanning._rules": 7},
        "hop.debug": {"hop._records": 1},  # hop.debug is above the core: it may import it
        "hop.ops.branching.cond": {"hop.compile.inductor": 9},  # not a core module: cycles are checked apart
    }
    assert check_layers.upward(edges) == [
        ("hop._dispatch", 3, "hop.debug"),
        ("hop._observe", 7, "hop.ops.scanning._rules"),
    ]


OPERATORS = ["cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan"]


@pytest.mark.parametrize("op", OPERATORS)
def test_each_operator_names_its_compile_rules(op: str) -> None:
    # the (operator, Dynamo / Inductor / ONNX) rules live in hop.compile; each
    # operator's module names them, and every name it gives exists
    import hop

    module = importlib.import_module(getattr(hop, op).__module__)  # hop.ops.<family>.<op>
    doc = module.__doc__ or ""
    assert "\nCompiled: " in doc
    names = re.findall(r"``(hop\.compile\.[\w.]+)``", doc)
    assert {"Dynamo", "Inductor", "ONNX"} <= set(re.findall(r"\b(Dynamo|Inductor|ONNX)\b", doc))
    assert len(names) >= 3
    root = Path(hop.__file__ or "").resolve().parents[1]
    for name in names:  # read, not imported: importing the bridge would load Dynamo, Inductor, ONNX
        path, attr = name.rsplit(".", 1)
        tree = ast.parse((root / (path.replace(".", "/") + ".py")).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert attr in defined, name
