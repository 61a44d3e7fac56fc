"""Data-dependent sizes across branches and loops (hop/_unbacked.py, docs/dynamic_shapes.md)."""

from __future__ import annotations

import importlib.util
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import hop
from hop.errors import HopValueError, OutputMismatchError

_spec = importlib.util.spec_from_file_location(
    "unbacked_table", Path(__file__).parents[1] / "benchmarks" / "unbacked_table.py"
)
assert _spec is not None and _spec.loader is not None
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)


def export(fn: Callable[..., Any], *args: Any) -> torch.export.ExportedProgram:
    return torch.export.export(table._Program(fn, table.HOP), args)


def roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def hop_node(ep: torch.export.ExportedProgram, name: str) -> torch.fx.Node:
    return next(n for n in ep.graph.nodes if n.target is getattr(torch.ops.hop, name))


def asserts(gm: torch.fx.GraphModule) -> list[str]:
    """The conditions and messages of the runtime asserts of ``gm``'s top graph."""
    return [
        str(n.args[1]) for n in gm.graph.nodes if n.target is torch.ops.aten._assert_scalar.default and len(n.args) > 1
    ]


def out_sizes(node: torch.fx.Node) -> list[Any]:
    """The ``meta['val']`` sizes of the getitems of a multi-output node (or the node)."""
    users = sorted((u for u in node.users if u.target.__name__ == "getitem"), key=lambda u: u.args[1])
    vals = [u.meta["val"] for u in users] or [node.meta["val"]]
    return [list(v.shape) if isinstance(v, torch.Tensor) else v for v in vals]


# --- the table: every program exports, runs and round-trips for every branch ------------------


@pytest.mark.parametrize("fn, inputs", table.PROGRAMS, ids=[fn.__name__ for fn, _ in table.PROGRAMS])
def test_table_program_exports_and_matches_eager_for_every_branch(fn: Callable[..., Any], inputs: Any) -> None:
    result = table.measure(fn, inputs, table.HOP)
    if fn is table.map_per_step:
        assert result["export"].startswith("HopValueError")
        return
    assert result["export"] == "ok" and result["matches eager"], result


# --- branches -------------------------------------------------------------------------------


def test_a_size_that_is_one_expression_in_every_branch_stays_that_expression() -> None:
    ep = export(table.same_expression, torch.tensor([1.0, -2.0, 3.0]))
    node = hop_node(ep, "cond")
    assert not node.meta.get("unbacked_bindings")  # no fresh symbol: the size is the outer mask's
    (size,) = out_sizes(node)[0]
    assert str(size) in {str(s) for n in ep.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})}


def test_differing_sizes_get_one_fresh_symbol_with_the_union_range() -> None:
    ep = export(table.mask_union, torch.tensor([1.0, -2.0, 3.0, 4.0]))
    node = hop_node(ep, "cond")
    (sym,) = node.meta["unbacked_bindings"]
    assert ep.range_constraints[sym].lower == 0 and ep.range_constraints[sym].upper == 4
    assert asserts(ep.graph_module) == [
        "hop.cond: output.size(0) must be >= 0 (the union of the branches' ranges)",
        "hop.cond: output.size(0) must be <= 4 (the union of the branches' ranges)",
    ]


def test_equal_sizes_in_every_branch_share_one_symbol_and_need_no_eq_assert() -> None:
    ep = export(table.shared_relation, torch.tensor([1.0, -2.0, 3.0]))
    (a,), (b,) = out_sizes(hop_node(ep, "cond"))
    assert str(a) == str(b)
    assert not any("Eq(" in m for m in asserts(ep.graph_module))
    twin = torch.export.export(table._Program(table.shared_relation, table.TORCH), (torch.tensor([1.0, -2.0, 3.0]),))
    assert any("Eq(" in m for m in asserts(twin.graph_module))  # what torch needs instead


def test_an_affine_image_of_a_unified_size_is_expressed_in_its_symbol() -> None:
    ep = export(table.affine_relation, torch.tensor([1.0, -2.0, 3.0]))
    (a,), (b,) = out_sizes(hop_node(ep, "cond"))
    assert str(b) == f"2*{a}"
    for x in (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -2.0, 0.5])):
        torch.testing.assert_close(roundtrip(ep).module()(x), table.affine_relation(table.HOP, x))


def test_int_outputs_share_the_symbol_of_the_sizes_they_equal_and_size_later_tensors() -> None:
    ep = export(table.int_output, torch.tensor([1.0, -2.0, 3.0]))
    n, (size,) = out_sizes(hop_node(ep, "cond"))
    assert isinstance(n, torch.SymInt) and str(n) == str(size)
    assert asserts(ep.graph_module) == ["hop.cond: output[0] must be >= 0 (the union of the branches' ranges)"]
    for x in (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -2.0, 0.5])):
        torch.testing.assert_close(ep.module()(x), table.int_output(table.HOP, x))


def test_switch_unifies_every_branch() -> None:
    x = torch.tensor([1.0, -2.0, 0.3])
    ep = export(table.switch_three, x, torch.tensor(0))
    (sym,) = hop_node(ep, "switch").meta["unbacked_bindings"]
    assert (ep.range_constraints[sym].lower, ep.range_constraints[sym].upper) == (0, 3)


def test_a_data_dependent_symbool_predicate_keeps_the_operator() -> None:
    x = torch.tensor([1.0, 0.0, 3.0, 2.0, 1.0])
    ep = export(table.symbool_predicate, x)
    pred = hop_node(ep, "cond").args[0]
    assert isinstance(pred.meta["val"], torch.SymBool)
    for x in (torch.tensor([1.0, 0.0, 3.0, 2.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])):
        torch.testing.assert_close(roundtrip(ep).module()(x), table.symbool_predicate(table.HOP, x))


def test_strides_follow_the_branches_when_they_agree() -> None:
    def transposed(x: torch.Tensor) -> torch.Tensor:  # (3, k) with strides (1, 3) in both branches
        return hop.cond(x.sum() > 0, lambda x: x[x[:, 0] > 0].t(), lambda x: x[x[:, 0] < 0].t(), (x,))

    def mixed(x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda x: x[x[:, 0] > 0].t(), lambda x: x[x[:, 0] < 0].t().contiguous(), (x,))

    def output_meta(fn: Callable[..., Any]) -> torch.Tensor:
        gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(5, 3))
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return (out[0] if isinstance(out, (list, tuple)) else out).meta["val"]  # type: ignore[no-any-return]

    assert output_meta(transposed).stride() == (1, 3)
    assert output_meta(mixed).is_contiguous()


def test_the_range_asserts_fire_with_the_operator_and_output_named() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        def pos(x: torch.Tensor) -> torch.Tensor:
            m = x[x > 0]
            torch._check(m.shape[0] <= 2)
            return m

        return hop.cond(x.sum() > 0, pos, lambda x: x[:1] * 0, (x,)) + 1

    x = torch.tensor([1.0, -2.0, 3.0])
    gm = make_fx(fn, tracing_mode="symbolic")(x)
    torch.testing.assert_close(gm(x), fn(x))
    # a branch that breaks the range it promised (its own check removed) trips hop's assert
    gm.cond_graph_0 = make_fx(lambda x: x[x > 0], tracing_mode="symbolic")(x)
    with pytest.raises(RuntimeError, match=re.escape("hop.cond: output.size(0) must be <= 2")):
        gm(torch.tensor([1.0, 2.0, 3.0]))


def test_a_user_check_on_a_unified_size_is_asserted_at_run_time() -> None:
    ep = export(table.user_check, torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(ep.module()(torch.tensor([1.0, -2.0, 3.0])), torch.tensor([1.0, 4.0]))
    for program in (ep, roundtrip(ep)):
        with pytest.raises(RuntimeError, match=r"u\d+ <= 2"):
            program.module()(torch.tensor([1.0, 2.0, 3.0]))


def test_nested_conds_unify_inside_out() -> None:
    ep = export(table.nested, torch.tensor([2.0, -1.0, 0.5]))
    (sym,) = hop_node(ep, "cond").meta["unbacked_bindings"]
    assert (ep.range_constraints[sym].lower, ep.range_constraints[sym].upper) == (0, 3)


def test_fake_mode_unifies_nested_output_pytrees() -> None:
    def fn(x: torch.Tensor) -> dict[str, Any]:
        m = x[x > 0]
        return {"m": (m, m * 2), "n": x.sum()}

    def other(x: torch.Tensor) -> dict[str, Any]:
        m = x[x < 0]
        return {"m": (m + 1, m), "n": x.sum()}

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        out = hop.cond(mode.from_tensor(torch.tensor(True)), fn, other, (torch.randn(4),))
    a, b = out["m"]
    assert isinstance(a.shape[0], torch.SymInt) and str(a.shape[0]) == str(b.shape[0])
    assert out["n"].shape == ()


def test_without_a_shape_env_differing_sizes_are_an_error_naming_the_path() -> None:
    with FakeTensorMode() as mode, pytest.raises(OutputMismatchError, match=r"output\[1\]"):
        hop.cond(
            mode.from_tensor(torch.tensor(True)),
            lambda x: (x, x[:2]),
            lambda x: (x, x[:3]),
            (torch.randn(4),),
        )


# --- loops ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args, expected",
    [
        (table.while_grow, (torch.randn(3), torch.tensor(10)), (3, None)),
        (table.while_count, (torch.zeros(3),), (0, None)),
        (table.while_shrink, (torch.ones(8),), (0, 8)),
    ],
    ids=["grow", "count", "shrink"],
)
def test_while_loop_carries_get_derived_ranges(fn: Any, args: Any, expected: tuple[int, int | None]) -> None:
    ep = export(fn, *args)
    bound = [str(s) for n in ep.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})]
    (sym,) = [s for s in ep.range_constraints if str(s) in bound]
    vr = ep.range_constraints[sym]
    assert vr.lower == expected[0]
    assert (vr.upper if expected[1] is not None else None) == expected[1] or vr.upper > 10**9
    messages = asserts(ep.graph_module)
    assert messages and all(m.startswith("hop.while_loop: carry[") for m in messages)


def test_loop_ranges_widen_a_counter_but_keep_a_saturating_one() -> None:
    def fn(x: torch.Tensor) -> Any:
        i, y = hop.while_loop(lambda i, y: y.sum() < 10, lambda i, y: (torch.sym_min(i + 1, 5), y + 1), (0, x))
        return torch.ones(i), y

    gm = make_fx(fn, tracing_mode="symbolic")(torch.zeros(3))
    messages = asserts(gm)
    assert "hop.while_loop: carry[0] must be <= 5 (the range derived from the initial value and body_fn)" in messages


def test_map_refuses_sizes_that_may_differ_between_steps() -> None:
    with pytest.raises(HopValueError, match=r"hop\.map: f: ys\[0\].*data dependent.*slice of xs"):
        export(table.map_per_step, torch.tensor([[1.0, -1.0, 2.0], [3.0, 4.0, -5.0]]))


def test_scan_refuses_ys_sizes_computed_from_the_carry() -> None:
    def fn(c: torch.Tensor, xs: torch.Tensor) -> Any:
        return hop.scan(lambda c, x: (c + x, c[c > 0]), c, xs)

    with pytest.raises(HopValueError, match=r"hop\.scan: combine_fn: ys\[0\].*carry or the slice"):
        make_fx(fn, tracing_mode="symbolic")(torch.randn(3), torch.randn(4, 3))


def test_map_keeps_a_size_computed_from_unscanned_inputs() -> None:
    ep = export(table.map_shared_size, torch.randn(4, 3), torch.tensor(5))
    for program in (ep, roundtrip(ep)):
        assert program.module()(torch.randn(4, 3), torch.tensor(7)).shape == (4, 7)


@pytest.mark.parametrize(
    "branches",
    [
        (lambda x: (x > 0).sum().item(), lambda x: (x < 0).sum().item()),  # a count from .item()
        (lambda x: 3, lambda x: 5),  # Python ints
    ],
    ids=["item", "ints"],
)
def test_a_lone_int_output_exports_and_round_trips(branches: Any) -> None:
    def fn(lib: Any, x: torch.Tensor) -> torch.Tensor:
        n = hop.cond(x.sum() > 0, branches[0], branches[1], (x,))
        return torch.zeros(n) + x.sum()

    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -2.0, 3.0])]
    ep = export(fn, xs[0])
    for program in (ep, roundtrip(ep)):
        for x in xs:
            torch.testing.assert_close(program.module()(x), fn(None, x))
