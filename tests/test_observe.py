"""hop.debug.trace(): every public call is recorded (eager, traced, exported, compiled)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop import _observe, _observe_calls
from hop.debug import DispatchRecord
from hop.errors import HopRuntimeError, HopTypeError


def calls(records: list[DispatchRecord], op: str | None = None) -> list[DispatchRecord]:
    return [r for r in records if r.kind == "call" and (op is None or r.op == op)]


def fresh(src: str) -> Callable[..., Any]:
    """A function with a code object of its own: a signature no verdict knows yet."""
    fn: Callable[..., Any] = eval(src)
    return fn


# --- eager ---------------------------------------------------------------------------------------


def test_the_issue_snippet_records_the_eager_call_and_its_branch() -> None:
    x = torch.randn(3, requires_grad=True)
    with hop.debug.trace() as t:
        hop.cond(torch.tensor(True), lambda x: x.sin(), lambda x: x.cos(), (x,))
    assert list(t), "the trace of an eager call is empty"
    (r,) = calls(t)
    assert r.op == "cond" and r.key == "eager" and r.branch == 0 and r.role == "true_fn"
    assert "branch 0 (true_fn)" in str(r) and str(r).startswith("cond: eager -> ")
    t_fn, f_fn = torch.sin, torch.cos
    hop.cond(torch.tensor(True), t_fn, f_fn, (x,))  # validated
    with hop.debug.trace() as t:
        hop.cond(torch.tensor(False), t_fn, f_fn, (x,))
    (r,) = calls(t)
    assert r.branch == 1 and r.role == "false_fn" and r.route == "fast-path" and r.validation == "cached"
    assert not hop.debug.SINKS and not _observe._frames()


def test_validation_ran_then_hit_its_cache() -> None:
    t_fn, f_fn = fresh("lambda a: a * 2"), fresh("lambda a: a - 1")
    x = torch.randn(4)
    with hop.debug.trace() as t:
        hop.cond(torch.tensor(True), t_fn, f_fn, (x,))
        hop.cond(torch.tensor(False), t_fn, f_fn, (x,))
    first, second = calls(t)
    assert first.validation == "ran" and first.validation_us is not None and first.validation_us > 0
    assert first.route == "inline" and "validation ran in" in str(first)
    assert second.validation == "cached" and second.validation_us is None and second.route == "fast-path"
    assert first.elapsed_us is not None and second.elapsed_us is not None


def test_validation_off_and_pytree_operands_take_the_general_path() -> None:
    x = {"a": torch.randn(2)}
    fn = fresh("lambda d: d['a'].sin()")
    with hop.debug.trace() as t:
        hop.cond(torch.tensor(True), fn, fn, (x,))
        hop.cond(torch.tensor(True), fn, fn, (x,))
    ran, cached = calls(t)
    assert (ran.route, ran.validation) == ("inline", "ran")
    assert (cached.route, cached.validation) == ("inline", "cached")
    old = hop.config.validate
    hop.config.validate = "never"
    try:
        with hop.debug.trace() as t:
            hop.switch(torch.tensor(0), [fresh("lambda a: a + 1")], (torch.ones(2),))
    finally:
        hop.config.validate = old
    (r,) = calls(t)
    assert r.validation == "off" and r.branch == 0 and r.role == "branches[0]"


def _eager_cases() -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    x = torch.randn(4, 3)
    return [
        ("cond", lambda: hop.cond(torch.tensor(False), torch.sin, torch.cos, (x,)), {"branch": 1}),
        ("cond", lambda: hop.cond(True, torch.sin, torch.cos, (x,)), {"branch": 0, "validation": None}),
        ("switch", lambda: hop.switch(torch.tensor(2), [torch.sin, torch.cos, torch.tanh], (x,)), {"branch": 2}),
        (
            "while_loop",
            lambda: hop.while_loop(lambda i, v: i < 5, lambda i, v: (i + 1, v * 2), (torch.tensor(0), x)),
            {"trips": 5},
        ),
        ("while_loop", lambda: hop.while_loop(lambda i: i < 0, lambda i: i + 1, (torch.tensor(0),)), {"trips": 0}),
        ("fori_loop", lambda: hop.fori_loop(0, 7, lambda i, v: v + i, x), {"trips": 7}),
        ("scan", lambda: hop.scan(lambda c, r: (c + r, c * 2), torch.zeros(3), x), {"trips": 4, "length": 4}),
        ("map", lambda: hop.map(torch.sin, x), {"trips": 4, "length": 4}),
        ("associative_scan", lambda: hop.associative_scan(lambda a, b: a + b, x, 1), {"length": 3}),
    ]


@pytest.mark.parametrize(("op", "run", "expect"), _eager_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_eager_call_of_every_operator(op: str, run: Callable[[], Any], expect: dict[str, Any]) -> None:
    with hop.debug.trace() as t:
        run()
    (r,) = calls(t, op)
    assert r.key == "eager" and r.route in ("fast-path", "inline") and r.depth == 0
    for field, value in expect.items():
        assert getattr(r, field) == value, (field, str(r))
    if "trips" in expect:
        assert f"{expect['trips']} trip" in str(r)


def test_a_failing_validation_is_recorded() -> None:
    bad = fresh("lambda a: a @ torch.ones(5, 5)")  # the untaken branch fails on these operands
    with hop.debug.trace() as t, pytest.raises(HopRuntimeError, match="false_fn"):
        hop.cond(torch.tensor(True), fresh("lambda a: a + 1"), bad, (torch.ones(3),))
    (r,) = calls(t)
    assert r.validation == "failed" and r.detail == "raised HopRuntimeError" and r.branch is None


def test_transforms_route_and_what_ran_inline_under_them() -> None:
    x = torch.randn(3)
    with hop.debug.trace() as t:
        torch.func.grad(lambda a: hop.cond(torch.tensor(False), torch.sin, torch.cos, (a,)).sum())(x)
        torch.vmap(lambda a: hop.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 2), (0, a))[1])(x[None])
    grad, vmap = calls(t)
    assert (grad.key, grad.route, grad.kernel, grad.branch) == (
        "FuncTorchDynamicLayerFrontMode",
        "transform",
        "cond_grad",
        1,
    )
    assert grad.detail is not None and grad.detail.startswith("Grad level")
    assert (vmap.route, vmap.kernel, vmap.trips) == ("transform", "while_loop_vmap", 2)


def test_a_numpy_bool_pred_is_run_as_a_python_bool() -> None:
    np = pytest.importorskip("numpy")
    with hop.debug.trace() as t:
        hop.cond(np.bool_(False), torch.sin, torch.cos, (torch.ones(2),))
    inner, outer = calls(t)
    assert (inner.depth, inner.branch, inner.validation) == (1, 1, None)
    assert (
        outer.depth == 0
        and outer.validation is None
        and outer.detail is not None
        and outer.detail.startswith("a numpy bool")
    )


def test_fori_loop_with_tensor_bounds_is_a_while_loop_inside() -> None:
    with hop.debug.trace() as t:
        hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, v: v + 1, torch.zeros(2))
    inner, outer = calls(t)
    assert (inner.op, inner.trips, inner.depth) == ("while_loop", 3, 1)
    assert outer.op == "fori_loop" and outer.depth == 0 and "while_loop" in str(outer)


def test_nested_calls_come_first_and_are_deeper() -> None:
    def body(i: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, hop.cond(v.sum() > 0, torch.sin, torch.cos, (v,))

    with hop.debug.trace() as t:
        hop.while_loop(lambda i, v: i < 2, body, (torch.tensor(0), torch.ones(3)))
    records = calls(t)
    assert (records[-1].op, records[-1].depth, records[-1].trips) == ("while_loop", 0, 2)
    eager_conds = [r for r in records if r.op == "cond" and r.key == "eager"]
    assert len(eager_conds) == 2 and all(r.depth == 1 and r.branch == 0 for r in eager_conds)


def test_a_failing_call_is_recorded_and_leaves_nothing_behind() -> None:
    with hop.debug.trace() as t, pytest.raises(HopTypeError):
        hop.cond(torch.tensor(True), "not callable", torch.cos, (torch.ones(1),))  # type: ignore[arg-type]
    (r,) = calls(t)
    assert r.detail is not None and "raised HopTypeError" in r.detail
    assert not _observe._frames() and not hop.debug.SINKS
    with hop.debug.trace() as t:  # claim() is not left consumed: the next call is recorded
        hop.map(torch.sin, torch.ones(2, 2))
    assert [r.op for r in calls(t)] == ["map"]


def test_without_a_sink_no_call_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a call was watched with no sink installed")

    monkeypatch.setattr(_observe_calls, "watch", never)
    x = torch.ones(2, 2)
    hop.cond(torch.tensor(True), torch.sin, torch.cos, (x,))
    hop.switch(torch.tensor(0), [torch.sin], (x,))
    hop.while_loop(lambda i: i < 2, lambda i: i + 1, (torch.tensor(0),))
    hop.fori_loop(0, 2, lambda i, v: v + 1, x)
    hop.scan(lambda c, r: (c + r, r), torch.zeros(2), x)
    hop.map(torch.sin, x)
    hop.associative_scan(lambda a, b: a + b, x, 0)
    with pytest.raises(AssertionError, match="watched"), hop.debug.trace():
        hop.map(torch.sin, x)


def test_records_keep_their_old_shape() -> None:
    r = DispatchRecord("cond", "CPU", "kernel", "cond_dense")
    assert str(r) == "cond: CPU -> kernel cond_dense" and r.kind == "dispatch"


# --- traced: make_fx, torch.export ---------------------------------------------------------------


def _traced_cases() -> list[tuple[str, Callable[[torch.Tensor], Any], tuple[str, ...]]]:
    return [
        ("cond", lambda x: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,)), ("true_fn", "false_fn")),
        ("switch", lambda x: hop.switch(x.sum().long().clamp(0, 1), [torch.sin, torch.cos], (x,)), ("branches[0]",)),
        (
            "while_loop",
            lambda x: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.sin()), (torch.tensor(0), x))[1],
            ("cond_fn", "body_fn"),
        ),
        ("fori_loop", lambda x: hop.fori_loop(torch.tensor(0), torch.tensor(2), lambda i, v: v * 2, x), ("body_fn",)),
        ("scan", lambda x: hop.scan(lambda c, r: (c + r, c.sin()), torch.zeros(3), x)[1], ("combine_fn",)),
        ("map", lambda x: hop.map(torch.cos, x), ("f",)),
        ("associative_scan", lambda x: hop.associative_scan(lambda a, b: a * b, x, 0), ("combine_fn",)),
    ]


@pytest.mark.parametrize(("op", "fn", "roles"), _traced_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_make_fx_of_every_operator(op: str, fn: Callable[[torch.Tensor], Any], roles: tuple[str, ...]) -> None:
    with hop.debug.trace() as t:
        make_fx(fn)(torch.randn(4, 3))
    (r,) = calls(t, op)
    if op == "fori_loop":  # its node is a while_loop
        (r,) = calls(t, "while_loop")
    assert r.detail is not None and "traced" in r.detail and "ProxyTorchDispatchMode" in r.detail
    assert r.branch is None and r.trips is None
    subgraph_roles = {s.role for s in t if s.kind == "subgraph"}
    assert set(roles) <= subgraph_roles, subgraph_roles


@pytest.mark.parametrize(("op", "fn", "roles"), _traced_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_export_of_every_operator(op: str, fn: Callable[[torch.Tensor], Any], roles: tuple[str, ...]) -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return fn(x)

    with hop.debug.trace() as t:
        torch.export.export(M(), (torch.randn(4, 3),))
    node_op = "while_loop" if op == "fori_loop" else op
    traced = [r for r in calls(t, node_op) if r.detail is not None and "traced" in r.detail]
    assert traced and traced[-1].branch is None, [str(r) for r in calls(t)]
    assert set(roles) <= {s.role for s in t if s.kind == "subgraph" and s.op == node_op}


def test_export_records_the_call_and_its_subgraphs() -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,))
            out: torch.Tensor = hop.scan(lambda c, r: (c + r, c * r), torch.zeros(3), y)[1]
            return out

    with hop.debug.trace() as t:
        torch.export.export(M(), (torch.randn(4, 3),))
    assert {r.op for r in calls(t)} >= {"cond", "scan"}
    cond = calls(t, "cond")[-1]
    assert cond.detail is not None and "traced" in cond.detail
    assert {(r.op, r.role) for r in t if r.kind == "subgraph"} >= {
        ("cond", "true_fn"),
        ("cond", "false_fn"),
        ("scan", "combine_fn"),
    }


def test_closure_tensors_lifted_into_a_traced_branch() -> None:
    w = torch.randn(3, requires_grad=True)
    with hop.debug.trace() as t:
        make_fx(lambda x: hop.cond(x.sum() > 0, lambda a: a * w, lambda a: a + 1, (x,)))(torch.randn(3))
    (r,) = calls(t, "cond")
    assert r.closures == ("float32[3] requires_grad",) and "lifted 1 from closures" in str(r)


def test_unification_and_its_runtime_asserts() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = hop.cond(x.sum() > 0, lambda a: a[a > 0], lambda a: a, (x,))
        return out

    with hop.debug.trace() as t:
        make_fx(f, tracing_mode="symbolic")(torch.randn(4))
    (unify,) = {r.detail: r for r in t if r.kind == "unify"}.values()
    assert unify.op == "cond" and unify.detail is not None
    assert "true_fn=u" in unify.detail and "false_fn=s" in unify.detail and " -> u" in unify.detail
    asserts = [r.detail for r in t if r.kind == "assert"]
    assert asserts and all(a is not None and a.startswith("hop.cond: output.size(0) must be") for a in asserts)


def test_a_growing_carry_is_unified_too() -> None:
    def f(x: torch.Tensor) -> Any:
        return hop.while_loop(lambda v: v.shape[0] < 10, lambda v: torch.cat([v, v[:1]]), (x,))

    with hop.debug.trace() as t:
        make_fx(f, tracing_mode="symbolic")(torch.randn(3))
    (unify,) = [r for r in t if r.kind == "unify"]
    assert unify.op == "while_loop" and unify.detail is not None
    assert unify.detail.startswith("carry[0].size(0) on entry=s") and "-> u" in unify.detail
    assert any(r.kind == "assert" and r.op == "while_loop" for r in t)


# --- torch.compile ---------------------------------------------------------------------------------


def test_graph_break_is_recorded_with_its_reason_then_the_eager_call() -> None:
    def g(x: torch.Tensor) -> torch.Tensor:
        body = fresh("lambda i, v: (i + 1, v.sin())")
        out = hop.while_loop(lambda i, v: i < 3, body, (torch.tensor(0), x), checkpoint=True)
        return out[1] * 2

    torch._dynamo.reset()
    with hop.debug.trace() as t:
        torch.compile(g, backend="eager")(torch.randn(3))
    breaks = [r for r in t if r.kind == "graph-break"]
    assert breaks and breaks[0].op == "while_loop" and breaks[0].key == "Dynamo"
    reason = breaks[0].detail
    assert reason is not None and reason.startswith("CompileUnsupported: hop.while_loop: checkpoint")
    eager = [r for r in calls(t, "while_loop") if r.key == "eager"]
    assert eager and eager[-1].detail == "checkpointed"


def test_compiled_call_is_captured_with_its_subgraphs() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))
        return out + 1

    torch._dynamo.reset()
    with hop.debug.trace() as t:
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(3))
    captured = [r for r in calls(t, "cond") if r.key == "Dynamo"]
    assert captured and captured[0].route == "captured"
    assert {r.role for r in t if r.kind == "subgraph" and r.key == "Dynamo"} == {"true_fn", "false_fn"}


def test_a_first_call_says_what_its_one_time_import_cost() -> None:
    """A fresh process's first validated call imports torch._dynamo (torch's first ShapeEnv
    does): its record says how much of ``took`` that was; a later call has no such share."""
    import subprocess
    import sys

    program = """
import sys, torch, hop
assert "torch._dynamo" not in sys.modules
x = torch.randn(3)
with hop.debug.trace() as records:
    hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))
    hop.cond(x.sum() > 0, lambda a: a.tan(), lambda a: a.cos(), (x,))
first, second = records
assert first.import_us is not None and 0 < first.import_us <= first.elapsed_us, first
assert "one-time import of torch._dynamo" in str(first)
assert second.validation == "ran" and second.import_us is None, second
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
