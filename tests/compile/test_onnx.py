"""hop's operators through torch's ONNX exporter, checked in onnxruntime against eager.

Each program is exported once with ``torch.onnx.export(..., dynamo=True)`` (nothing
registered by hand: ``import hop`` is enough) and run in onnxruntime on the example
and on inputs that take the other branches, other trip counts (0 included) and,
where a ``Dim`` is declared, other sizes. Under the legacy exporter
(``dynamo=False``) an operator whose path a tensor decides raises instead of
writing a file that holds one path (Note [the legacy ONNX exporter]).
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export import Dim

import hop
from hop.errors import CompileUnsupported
from hop.ops.branching.cond import cond_op

onnx = pytest.importorskip("onnx", reason="the ONNX tests need the dev extras (onnx, onnxscript, onnxruntime)")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (a dev extra)")
ort = pytest.importorskip("onnxruntime", reason="the exported files run in onnxruntime (a dev extra)")

Inputs = tuple[Any, ...]


def _export(program: torch.nn.Module | torch.export.ExportedProgram, example: Inputs, dims: Any = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own notes (e.g. torchvision not installed)
        return torch.onnx.export(program, example, dynamic_shapes=dims, dynamo=True, verbose=False)


def _session(onnx_program: Any) -> Any:
    return ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(session: Any, inputs: Inputs) -> list[Any]:
    names = [i.name for i in session.get_inputs()]
    leaves = [x.numpy() for x in pytree.tree_leaves(inputs)]
    assert len(names) == len(leaves)
    return list(session.run(None, dict(zip(names, leaves, strict=True))))


def _check(session: Any, model: torch.nn.Module, inputs: Inputs) -> None:
    got = _run(session, inputs)
    with torch.no_grad():
        want = [torch.as_tensor(w) for w in pytree.tree_leaves(model(*inputs)) if w is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-5, atol=1e-5)


def _op_types(model: Any) -> list[str]:
    """Every node's type, in the graph, its subgraphs and its functions."""

    def walk(nodes: Iterator[Any]) -> Iterator[str]:
        for node in nodes:
            yield node.op_type
            for attr in node.attribute:
                graphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
                for g in graphs:
                    yield from walk(iter(g.node))

    types = list(walk(iter(model.graph.node)))
    for fn in model.functions:
        types.extend(walk(iter(fn.node)))
    return types


# --- the programs ----------------------------------------------------------------------------


class CondTree(torch.nn.Module):
    """Pytree operands and outputs, a closed-over parameter, a float and an int output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        def yes(t: dict[str, torch.Tensor]) -> Any:
            return {"p": self.lin(t["a"]), "q": (t["b"] * 2, t["a"].sum())}

        def no(t: dict[str, torch.Tensor]) -> Any:
            return {"p": t["b"].tanh(), "q": (t["a"] - self.lin.bias, t["b"].mean())}

        return hop.cond(a.sum() > b.sum(), yes, no, ({"a": a, "b": b},))


class CondSizes(torch.nn.Module):
    """Branches returning different lengths: an unbacked output size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda a: a[:2] * 2, lambda a: a.sin(), (x,))


class CondInt(torch.nn.Module):
    """An int output, a size the Dim makes symbolic."""

    def forward(self, x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: (a * 2, a.shape[0]), lambda a: (a, a.shape[0] + 1), (x,))


class Switch(torch.nn.Module):
    def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.switch(i, [lambda a: a + 1, lambda a: a * 2, lambda a: a.exp()], (x,))


class WhileCount(torch.nn.Module):
    """A data-dependent trip count, an int carry returned as an int."""

    def forward(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: a.sum() < 100, lambda i, a: (i + 1, a * 2), (0, x))


class WhileCheckpointed(torch.nn.Module):
    """checkpoint=True, recorded on the node, chooses only a reverse mode: a plain Loop."""

    def forward(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda a: a.sum() < 100, lambda a: (a * 2,), (x,), checkpoint=True)


class WhileGrowing(torch.nn.Module):
    """A carry that changes size between iterations."""

    def forward(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda a: a.sum() < 10, lambda a: torch.cat([a, a]), (x,))


class Fori(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, n: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.fori_loop(0, n.item(), lambda i, a: a * 0.5 + self.w * i, x)


class ScanTree(torch.nn.Module):
    """Pytree carry and xs, no y for one leaf, reverse, a closed-over parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, xs: torch.Tensor) -> Any:
        def step(c: dict[str, torch.Tensor], x: dict[str, torch.Tensor]) -> Any:
            new = {"h": (c["h"] * x["u"] + self.w).tanh(), "n": c["n"] + 1}
            return new, (c["h"] * x["v"], None)

        init = {"h": torch.zeros(3), "n": torch.zeros((), dtype=torch.int64)}
        return hop.scan(step, init, {"u": xs, "v": xs.cos()}, reverse=True)


class Map(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda r: self.lin(r).relu(), xs)


class Cumsum(torch.nn.Module):
    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return hop.associative_scan(torch.add, xs, 0)


class Recurrence(torch.nn.Module):
    """pointwise mode, dim 1: h[t] = a[t] * h[t - 1] + b[t] (a selective scan's recurrence)
    as pairs, with a closed-over tensor the combine reads."""

    def __init__(self) -> None:
        super().__init__()
        self.floor = torch.full((2,), -1e9)  # never binding: the combine stays associative

    def forward(self, xs: torch.Tensor) -> Any:
        def combine(p: tuple[torch.Tensor, torch.Tensor], q: tuple[torch.Tensor, torch.Tensor]) -> Any:
            a = p[0] * q[0]
            return a, torch.maximum(q[0] * p[1] + q[1], self.floor)

        return hop.associative_scan(combine, (xs.sigmoid(), xs.cos()), 1)


class CumprodTree(torch.nn.Module):
    """generic mode, dim 1, reverse, a pytree of two leaves."""

    def forward(self, xs: torch.Tensor) -> Any:
        def combine(p: tuple[torch.Tensor, torch.Tensor], q: tuple[torch.Tensor, torch.Tensor]) -> Any:
            return p[0] * q[0], torch.maximum(p[1], q[1])

        return hop.associative_scan(combine, (xs, xs.sin()), 1, reverse=True, combine_mode="generic")


class Nested(torch.nn.Module):
    """A cond inside a while_loop's body inside a scan's body."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, xs: torch.Tensor) -> Any:
        def step(c: torch.Tensor, x: torch.Tensor) -> Any:
            def body(i: int, v: torch.Tensor) -> Any:
                return i + 1, hop.cond(v.sum() > 0, lambda a: self.lin(a), lambda a: a + 1.0, (v,))

            i, v = hop.while_loop(lambda i, v: (v.abs().sum() < 50) & (i < 5), body, (0, c + x))
            return v.tanh(), v * i

        return hop.scan(step, torch.zeros(3), xs)


def _rows(*lengths: int, width: int = 3) -> list[Inputs]:
    return [(torch.randn(n, width),) for n in lengths]


N = Dim("n")
ROWS = {0: N}  # a dynamic dim 0
# name: (program, example, other inputs, dynamic shapes, the ONNX control flow expected)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], Inputs, list[Inputs], Any, set[str]]] = {
    "cond": (CondTree, (torch.ones(3), torch.zeros(3)), [(torch.zeros(3), torch.ones(3))], None, {"If"}),
    "cond_sizes": (CondSizes, (torch.ones(4),), [(-torch.ones(4),)], None, {"If"}),
    "cond_int": (
        CondInt,
        (torch.ones(4),),
        [(-torch.ones(4),), (torch.ones(7),), (-torch.ones(2),)],
        (ROWS,),
        {"If"},
    ),
    "switch": (
        Switch,
        (torch.tensor(1), torch.randn(3)),
        [(torch.tensor(0), torch.randn(3)), (torch.tensor(2), torch.randn(3))],
        None,
        {"If"},
    ),
    "while_loop": (
        WhileCount,
        (torch.rand(3) + 0.5,),
        [(torch.full((3,), 50.0),), (torch.full((3,), 0.01),)],  # 0 and 12 trips
        None,
        {"Loop"},
    ),
    "while_loop_checkpointed": (
        WhileCheckpointed,
        (torch.ones(3),),
        [(torch.full((3,), 20.0),), (torch.full((3,), 0.01),)],
        None,
        {"Loop"},
    ),
    "while_loop_growing": (WhileGrowing, (torch.ones(2),), [(torch.full((2,), 0.1),)], None, {"Loop"}),
    "fori_loop": (
        Fori,
        (torch.tensor(3), torch.randn(3)),
        [(torch.tensor(0), torch.randn(3)), (torch.tensor(7), torch.randn(3))],
        None,
        {"Loop"},
    ),
    "scan": (ScanTree, (torch.randn(4, 3),), _rows(7, 1, 0), (ROWS,), {"Loop"}),
    "map": (Map, (torch.randn(4, 3),), _rows(9, 1, 0), (ROWS,), {"Loop"}),
    "associative_scan": (Cumsum, (torch.randn(5, 2),), _rows(8, 2, 1, 0, 33, width=2), (ROWS,), {"Loop"}),
    "associative_scan_pointwise": (
        Recurrence,
        (torch.randn(2, 5),),
        [(torch.randn(2, 17),), (torch.randn(2, 1),), (torch.randn(2, 0),), (torch.randn(2, 64),)],
        ({1: N},),
        {"Loop"},
    ),
    "associative_scan_generic": (
        CumprodTree,
        (torch.randn(2, 5),),
        [(torch.randn(2, 8),), (torch.randn(2, 1),), (torch.randn(2, 0),)],
        ({1: N},),
        {"Loop", "If"},
    ),
    "nested": (
        Nested,
        (torch.randn(4, 3),),
        [(torch.randn(6, 3),), (torch.randn(2, 3) * 5,)],
        (ROWS,),
        {"Loop", "If"},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_exports_and_runs_in_onnxruntime_like_eager(name: str) -> None:
    make, example, others, dims, control = CASES[name]
    model = make().eval()
    onnx_program = _export(model, example, dims)
    onnx.checker.check_model(onnx_program.model_proto, full_check=True)  # a valid model, shapes inferred
    types = set(_op_types(onnx_program.model_proto))
    assert control <= types, types
    assert not any(t.startswith("torch.ops.hop") for t in types)
    session = _session(onnx_program)
    for inputs in [example, *others]:
        _check(session, model, inputs)


@pytest.mark.parametrize("name", ["cond", "scan", "nested"])
def test_exports_from_an_exported_program(name: str) -> None:
    make, example, others, dims, _ = CASES[name]
    model = make().eval()
    program = torch.export.export(model, example, dynamic_shapes=dims)
    assert any(n.target in hop.registered_ops().values() for n in program.graph.nodes)
    session = _session(_export(program, example))
    for inputs in [example, *others]:
        _check(session, model, inputs)


def test_a_pointwise_associative_scan_is_a_parallel_prefix() -> None:
    # Note [a pointwise associative_scan in ONNX]: one Loop of ceil(log2 n) steps, no
    # sequential scan (which sits under an If for short lengths)
    model, xs = Recurrence().eval(), torch.randn(2, 5)
    types = _op_types(_export(model, (xs,), ({1: N},)).model_proto)
    assert types.count("Loop") == 1 and "If" not in types, types


def test_a_saved_file_runs_in_a_fresh_onnxruntime(tmp_path: Any) -> None:
    model = Map().eval()
    path = tmp_path / "map.onnx"
    _export(model, (torch.randn(4, 3),), (ROWS,)).save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    _check(session, model, (torch.randn(6, 3),))


@pytest.mark.parametrize("opset", [17, 20])
def test_other_opsets(opset: int) -> None:
    # the exporter translates at its own opset, then converts the model
    model = ScanTree().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            model, (torch.randn(4, 3),), dynamic_shapes=(ROWS,), dynamo=True, verbose=False, opset_version=opset
        )
    assert {o.version for o in onnx_program.model_proto.opset_import if o.domain == ""} == {opset}
    _check(_session(onnx_program), model, (torch.randn(6, 3),))


@pytest.mark.parametrize("index", [-1, 3, 7])
def test_a_switch_index_out_of_range_fails_in_onnxruntime(index: int) -> None:
    # Note [switch's range check]: never some branch instead
    session = _session(_export(Switch().eval(), (torch.tensor(1), torch.randn(3))))
    with pytest.raises(Exception, match="out of data bounds"):
        _run(session, (torch.tensor(index), torch.randn(3)))


class WideScan(torch.nn.Module):
    """Each y's size is dynamic (dim 1 of xs): a length of 0 cannot be given its shape."""

    def forward(self, xs: torch.Tensor) -> Any:
        return hop.scan(lambda c, x: (c + x.sum(), x * c), torch.zeros(()), xs)


def test_a_scan_of_dynamic_step_shape_fails_at_length_zero() -> None:
    # Note [scans as ONNX loops]: onnxruntime would give the empty ys a wrong shape
    model = WideScan().eval()
    session = _session(_export(model, (torch.randn(4, 3),), ({0: N, 1: Dim("w")},)))
    _check(session, model, (torch.randn(2, 5),))
    with pytest.raises(Exception, match="out of data bounds"):
        _run(session, (torch.randn(0, 5),))


class SharedLength(torch.nn.Module):
    """Two xs whose length is one Dim, for scan, map and a generic associative_scan.
    torch's ONNX exporter traces sizes without their hints, so the trace cannot tell
    the two lengths equal: hop's check is left to the file (issue: it refused)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        c, ys = hop.scan(lambda c, x: (c + x[0] * x[1], c), torch.zeros(3), (a, b))
        m = hop.map(lambda x: x[0] - x[1], (a, b))
        p = hop.associative_scan(lambda x, y: (x[0] + y[0], x[1] * y[1]), (a, b), dim=0, combine_mode="generic")
        return c, ys, m, p[0], p[1]


def test_xs_sharing_a_dim_export_and_mismatched_lengths_fail_in_onnxruntime() -> None:
    model, length = SharedLength().eval(), Dim("length")
    session = _session(_export(model, (torch.randn(5, 3), torch.randn(5, 3)), {"a": {0: length}, "b": {0: length}}))
    for n in (5, 2, 8):
        _check(session, model, (torch.randn(n, 3), torch.randn(n, 3)))
    with pytest.raises(Exception, match="out of data bounds"):
        _run(session, (torch.randn(4, 3), torch.randn(6, 3)))  # a shorter first: no Gather out of range but hop's


class ConstantInts(torch.nn.Module):
    """Branches returning Python ints: constants that differ (an unbacked int output), the
    same constant in both, and a constant against a size."""

    def forward(self, x: torch.Tensor) -> Any:
        p = x.sum() > 0
        y, k = hop.cond(p, lambda a: (a * 2, 3), lambda a: (a, 4), (x,))
        z, same = hop.cond(p, lambda a: (a + 1, 5), lambda a: (a - 1, 5), (x,))
        n = hop.cond(p, lambda a: a.shape[0], lambda a: 2, (x,))
        return y * k + z * same, torch.full((2,), n)


class SwitchConstants(torch.nn.Module):
    def forward(self, i: torch.Tensor, x: torch.Tensor) -> Any:
        y, k = hop.switch(i, [lambda a: (a, 1), lambda a: (a * 2, 7), lambda a: (a.sin(), 1)], (x,))
        return y * k


class NestedConstants(torch.nn.Module):
    """A cond returning constant ints inside a loop body: a subgraph of a subgraph."""

    def forward(self, x: torch.Tensor) -> Any:
        def body(i: int, v: torch.Tensor) -> torch.Tensor:
            return v * hop.cond(v.sum() > 0, lambda a: 2, lambda a: -3, (v,)) + 1

        return hop.fori_loop(0, 3, body, x)


@pytest.mark.parametrize("name", ["cond", "switch", "nested"])
def test_branches_returning_constant_ints_export(name: str) -> None:
    # torch's exporter cannot translate a subgraph that returns a Python int: hop's
    # preparation makes each such output a 0-dim int64 constant, as the exporter
    # represents ints
    if name == "cond":
        model: torch.nn.Module = ConstantInts().eval()
        example: Inputs = (torch.ones(3),)
        others: list[Inputs] = [(-torch.ones(3),), (torch.ones(6),), (-torch.ones(1),)]
        dims: Any = (ROWS,)
    elif name == "switch":
        model, example, dims = SwitchConstants().eval(), (torch.tensor(1), torch.randn(3)), None
        others = [(torch.tensor(0), torch.randn(3)), (torch.tensor(2), torch.randn(3))]
    else:
        model, example, dims = NestedConstants().eval(), (torch.ones(3),), None
        others = [(-torch.ones(3) * 5,), (torch.full((3,), -0.2),)]
    onnx_program = _export(model, example, dims)
    onnx.checker.check_model(onnx_program.model_proto, full_check=True)
    session = _session(onnx_program)
    for inputs in [example, *others]:
        _check(session, model, inputs)


def test_exporting_a_program_with_constant_outputs_leaves_it_alone() -> None:
    model, x = ConstantInts().eval(), torch.ones(3)
    program = torch.export.export(model, (x,))
    before = [str(m.graph) for m in program.graph_module.modules()]
    session = _session(_export(program, (x,)))
    assert [str(m.graph) for m in program.graph_module.modules()] == before
    for inputs in [(x,), (-x,)]:
        _check(session, model, inputs)
        torch.testing.assert_close(program.module()(*inputs), model(*inputs))


def test_translations_cover_every_operator() -> None:
    from hop.compile.onnx import translations

    names = {op.name() for op in translations()}
    assert names == {"cond", "switch", "while_loop", "scan", "map", "associative_scan"}  # fori_loop: a while_loop
    assert set(hop.registered_ops()) >= names


def test_a_custom_translation_table_takes_precedence() -> None:
    calls = []

    def mine(*args: Any) -> Any:
        calls.append(args)
        raise RuntimeError("mine ran")

    with pytest.raises(Exception) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = {cond_op: mine}
        torch.onnx.export(CondSizes(), (torch.ones(4),), dynamo=True, verbose=False, custom_translation_table=table)
    assert calls and "mine ran" in repr(info.value.__cause__) + str(info.value)


def test_hop_imported_after_the_exporter_registers_at_once() -> None:
    code = (
        "import torch\n"
        "import torch.onnx._internal.exporter._torchlib.ops  # torch's translations, before hop\n"
        "import hop\n"
        "f = lambda x: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,))\n"
        "m = type('M', (torch.nn.Module,), {'forward': lambda self, x: f(x)})()\n"
        "p = torch.onnx.export(m, (torch.ones(3),), dynamo=True, verbose=False)\n"
        "assert 'If' in [n.op_type for n in p.model.graph]\n"
    )
    _python(code)


def test_import_hop_loads_neither_the_exporter_nor_onnxscript() -> None:
    code = (
        "import sys, hop\n"
        "loaded = [m for m in sys.modules if m.startswith(('onnx', 'torch.onnx._internal.exporter'))]\n"
        "assert not loaded, loaded\n"
    )
    _python(code)


def _python(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


# --- the legacy exporter (TorchScript tracing) ----------------------------------------------------


def _legacy(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> bytes:
    class Model(torch.nn.Module):
        def forward(self, a: torch.Tensor) -> Any:
            return fn(a)

    buffer = io.BytesIO()
    # The legacy exporter turns the autocast cache off while it traces and does not turn
    # it back on when the trace raises: restore it for the tests that run after.
    cache = torch.is_autocast_cache_enabled()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation warning, TracerWarnings
            torch.onnx.export(Model(), (x,), buffer, dynamo=False)
    finally:
        torch.set_autocast_cache_enabled(cache)
    return buffer.getvalue()


DATA_DEPENDENT: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "cond": (lambda a: hop.cond(a.sum() > 0, torch.sin, torch.cos, (a,)), "pred"),
    "switch": (lambda a: hop.switch((a.sum() > 0).long(), [torch.sin, torch.cos], (a,)), "index"),
    "while_loop": (lambda a: hop.while_loop(lambda v: v.sum() < 100, lambda v: v * 2, (a.abs() + 0.1,))[0], "cond_fn"),
    "scan": (lambda a: hop.scan(lambda c, r: (c + r, c * r), torch.zeros(3), a)[1], "length of xs"),
    "map": (lambda a: hop.map(torch.sin, a), "length of xs"),
    "associative_scan": (lambda a: hop.associative_scan(torch.add, a, 0), "length of xs"),
    "raw cond": (lambda a: torch.ops.hop.cond(a.sum() > 0, torch.sin, torch.cos, (a,)), "pred"),
    "raw while_loop": (
        lambda a: torch.ops.hop.while_loop(lambda v: v.sum() < 9, lambda v: v * 2, (a.abs(),), ()),
        "cond_fn",
    ),
    "raw scan": (lambda a: torch.ops.hop.scan(lambda c, r: (c + r, c), (torch.zeros(3),), (a,), (), False), "length"),
}


@pytest.mark.parametrize("name", sorted(DATA_DEPENDENT))
def test_the_legacy_exporter_refuses_a_path_a_tensor_decides(name: str) -> None:
    fn, what = DATA_DEPENDENT[name]
    x = torch.randn(4, 3)
    fn(x)  # eager first: its inline caches must not skip the check
    op = name.removeprefix("raw ")
    with pytest.raises(CompileUnsupported, match=rf"^hop\.{op}: torch\.onnx\.export\(dynamo=False\).*{what}") as info:
        _legacy(fn, x)
    assert "dynamo=True" in str(info.value)
    assert info.value.op == op


STATIC: dict[str, Callable[[torch.Tensor], Any]] = {
    "cond": lambda a: hop.cond(True, torch.sin, torch.cos, (a,)),
    "switch": lambda a: hop.switch(1, [torch.sin, lambda v: v * 3], (a,)),
    "while_loop": lambda a: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin() * 2), (0, a))[1],
    "fori_loop": lambda a: hop.fori_loop(0, 3, lambda i, v: v.tanh() + i, a),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_the_legacy_exporter_unrolls_a_path_python_fixes(name: str) -> None:
    # the same path for every input: the unrolled file is right
    fn, x = STATIC[name], torch.randn(4, 3)
    session = ort.InferenceSession(_legacy(fn, x), providers=["CPUExecutionProvider"])
    y = torch.randn(4, 3)
    (got,) = session.run(None, {session.get_inputs()[0].name: y.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), fn(y))


def test_plain_jit_trace_still_unrolls_a_data_dependent_cond() -> None:
    # outside an ONNX export the trace is the documented unrolled one (tests/test_jit_trace.py)
    fn = DATA_DEPENDENT["cond"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarning (the predicate is data), jit.trace's deprecation
        traced = torch.jit.trace(fn, (torch.ones(3),), check_trace=False)
    torch.testing.assert_close(traced(torch.ones(3) * 2), fn(torch.ones(3) * 2))


class _Episodes(torch.nn.Module):
    """A batched rollout with a done flag: each row runs until its own sum passes 4."""

    def forward(self, x: torch.Tensor) -> Any:
        def episode(s0: torch.Tensor) -> Any:
            def body(s: torch.Tensor, done: torch.Tensor) -> Any:
                s = s * 1.5 + 0.1
                return s, s.sum() > 4

            return hop.while_loop(lambda s, done: ~done, body, (s0, torch.tensor(False)))

        return torch.vmap(episode)(x)


class _BoolBranches(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        def row(v: torch.Tensor) -> Any:
            return hop.cond(v.sum() > 0, lambda a: (a > 1, a * 2), lambda a: (a < 0, a), (v,))

        return torch.vmap(row)(x)


@pytest.mark.parametrize("model", [_Episodes(), _BoolBranches()], ids=["while_done_flag", "cond_bool_outputs"])
def test_vmapped_bool_carries_and_outputs_load_in_onnxruntime(model: torch.nn.Module) -> None:
    # onnxruntime's CPU provider has no bool Where: hop selects bool values with logical ops
    xs = torch.tensor([[0.5, 1.0], [2.0, 3.0], [-0.1, 0.3], [-2.0, 2.5]])  # every row stops
    session = _session(_export(model, (xs,)))
    _check(session, model, (xs,))


@pytest.mark.xfail(
    reason="onnxscript's optimizer (which torch.onnx.export runs) crashes on a matmul of a 0-dim value reshaped to "
    "a matrix, with no hop operator: hop.testing's onnx check skips where it meets it",
    raises=Exception,
    strict=True,
)
def test_onnxscript_optimizes_a_matmul_of_a_scalar_reshaped() -> None:
    class Scalar(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return (t.reshape(1, -1) @ t.reshape(-1, 1)).reshape(())

    _export(Scalar(), (torch.tensor(1.5),))


def test_hop_testing_skips_onnxscripts_optimizer_bug() -> None:
    from hop.testing import check

    def program(x: torch.Tensor) -> Any:
        def scaled(t: torch.Tensor) -> torch.Tensor:
            return t + (t.reshape(1, -1) @ t.reshape(-1, 1)).reshape(()) * 0.1

        return hop.cond(x.sum() > 0, scaled, torch.sin, (x,))

    report = check(program, torch.tensor(1.5), transforms=["eager", "onnx"])
    assert report.ran == ["eager"] and "onnxscript's optimizer" in report.skipped["onnx"]
    assert check(program, torch.ones(3), transforms=["eager", "onnx"]).ran == ["eager", "onnx"]


def test_hop_testing_skips_what_the_exporter_cannot_translate_in_a_plain_program() -> None:
    """onnxscript has no translation of ``amax`` over every dim (a plain program fails
    alike): the node the exporter names is torch's op, not hop's."""
    from hop.testing import check

    def program(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda t: t * t.reshape(-1).amax(), torch.sin, (x,))

    report = check(program, torch.ones(3), transforms=["eager", "onnx"])
    assert report.ran == ["eager"] and "cannot translate aten.amax.default" in report.skipped["onnx"]
