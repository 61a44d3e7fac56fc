"""The spec registry (hop/_spec.py) ties every table that names operators to the specs.

An operator is declared by its spec; the compile tables (Dynamo handlers, Inductor
lowerings and rewrites, ONNX translations), the public functions Dynamo inlines, the
plain-Python reference, the random-program generator and the docs each hold one entry
per operator. Adding an operator without one of them, or leaving a stale entry behind
after removing one, fails here, naming the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # the Dynamo handlers are installed on its import

import hop
from hop import _operator, _reference, _spec
from hop.testing import strategies

DOCS = Path(__file__).resolve().parents[1] / "docs"
SPECS = _spec.specs()
OPERATORS = [s.name for s in SPECS if s.layout is not None]  # those with a node of their own
PUBLIC = [s.name for s in SPECS]  # every public function, fori_loop (a while_loop) included


def _names(table: Any) -> set[str]:
    return {op.name() for op in table}


def _dynamo_handlers() -> set[str]:
    from hop.compile import _dynamo_branching, _dynamo_scans, _dynamo_while

    return _names({**_dynamo_branching.HANDLERS, **_dynamo_while.HANDLERS, **_dynamo_scans.HANDLERS})


def _inductor_lowered() -> set[str]:
    from torch._inductor import lowering  # hop.compile.inductor registers on its import

    return {name for name, op in _operator.registered_ops().items() if op in lowering.lowerings and name in PUBLIC}


def _onnx_translated() -> set[str]:
    from hop.compile._onnx_ops import TRANSLATIONS

    return _names(TRANSLATIONS)


def _dynamo_public() -> dict[str, str]:
    from hop.compile._dynamo_public import public_functions

    return {fn.__name__: op.name() for fn, op in public_functions()}


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ("a Dynamo handler (hop/compile/_dynamo_*.py HANDLERS)", _dynamo_handlers),
        ("an Inductor lowering or rewrite (hop/compile/inductor.py)", _inductor_lowered),
        ("an ONNX translation (hop/compile/_onnx_ops.py TRANSLATIONS)", _onnx_translated),
    ],
    ids=["dynamo", "inductor", "onnx"],
)
def test_every_operator_has_its_compiler_entries_and_no_table_a_stale_one(table: str, names: Any) -> None:
    have = names()
    missing, stale = set(OPERATORS) - have, have - set(OPERATORS)
    assert not missing, f"operators without {table}: {sorted(missing)}"
    assert not stale, f"{table} for what has no spec: {sorted(stale)}"


def test_every_public_function_is_inlined_by_dynamo_over_its_operator() -> None:
    public = _dynamo_public()
    assert set(public) == set(PUBLIC)
    for spec in SPECS:
        assert public[spec.name] == (spec.over or spec.name), spec.name


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_function_has_a_reference_a_generator_entry_and_a_page(name: str) -> None:
    assert callable(getattr(_reference, f"reference_{name}", None)), f"hop/_reference.py has no reference_{name}"
    assert name in strategies.OPERATORS, f"hop.testing.strategies.OPERATORS lacks {name}"
    assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    assert getattr(hop, name) is not None and name in hop.__all__


def test_the_reference_runs_each_operator_as_python() -> None:
    # every public function routes to its reference under hop.testing.reference()
    x = torch.tensor([1.0, -2.0, 3.0])
    calls = {
        "cond": lambda: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,)),
        "switch": lambda: hop.switch(torch.tensor(1), [torch.sin, torch.cos], (x,)),
        "while_loop": lambda: hop.while_loop(lambda v: v.sum() < 10, lambda v: (v + 1,), (x,)),
        "fori_loop": lambda: hop.fori_loop(0, 2, lambda i, v: v + i, x),
        "map": lambda: hop.map(torch.sin, x),
        "scan": lambda: hop.scan(lambda c, r: (c + r, c), x[0], x),
        "associative_scan": lambda: hop.associative_scan(lambda a, b: a + b, x, 0),
    }
    assert set(calls) == set(PUBLIC)
    for name, call in calls.items():
        with hop.testing.reference():
            want = call()
        torch.testing.assert_close(call(), want, msg=name)


@pytest.mark.parametrize("name", OPERATORS)
def test_the_raw_op_is_declared_by_its_spec(name: str) -> None:
    """The spec is the one declaration of a node's parameters: the raw op's tuple
    arguments (their names in messages) and every node's arguments are placed by it."""
    spec = _spec.spec_of(name)
    assert spec is not None and spec.layout is not None
    op = _operator.registered_ops()[name]
    assert dict(op._tuple_args) == spec.tuple_args()
    assert spec.role_names(len(spec.roles)) == spec.roles or spec.role_pattern is not None
    layout = spec.layout
    graphs = ("g0", "g1", "g2")[: len(spec.roles) or 3]
    args = spec.node_args(selector="sel", subgraphs=graphs, carries="init", xs="xs", inputs="ins", rest=("const",))
    assert [args[p] for p in layout.subgraph_positions(args)] == list(graphs)
    for position, part in (
        (layout.selector, "sel"),
        (layout.carries, "init"),
        (layout.xs, "xs"),
        (layout.inputs, "ins"),
    ):
        assert position is None or args[position] == part
    fixed = len(spec.params) - (1 if layout.variadic else 0)
    assert len(args) == fixed + (len(graphs) - len(layout.subgraphs) + 1 if layout.variadic else 0)
