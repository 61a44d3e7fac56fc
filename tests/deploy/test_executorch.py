"""hop.deploy.for_executorch: every operator written as torch's cond and scan, equal to
eager in the rewritten program and, where executorch is installed (CI's ExecuTorch
stage), in ExecuTorch's runtime after to_edge_transform_and_lower and to_executorch."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

import hop
import hop.deploy
from hop.errors import CompileUnsupported, HopTypeError, HopValueError

HAS_EXECUTORCH = importlib.util.find_spec("executorch") is not None
Cases = Sequence[tuple[Any, ...]]


def _executorch_run(ep: torch.export.ExportedProgram) -> Callable[..., list[Any]]:
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    loaded = Runtime.get().load_program(to_edge_transform_and_lower(ep).to_executorch().buffer)
    method = loaded.load_method("forward")

    def run(*args: Any, _program: Any = loaded) -> list[Any]:  # a method outliving its program crashes
        return list(method.execute(list(args)))

    return run


def _flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def deploy_and_check(
    model: torch.nn.Module,
    cases: Cases,
    *,
    dynamic_shapes: Any = None,
    max_steps: int | None = None,
    failing: Cases = (),
) -> torch.export.ExportedProgram:
    """Export on ``cases[0]``, rewrite, and compare on every case with eager: the
    rewritten program in torch, then in ExecuTorch. ``failing`` cases must raise in both."""
    ep = torch.export.export(model, cases[0], dynamic_shapes=dynamic_shapes)
    out = hop.deploy.for_executorch(ep, max_steps=max_steps)
    names = {
        str(n.target) for m in out.graph_module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
    }
    assert not any(name.startswith("hop.") for name in names), names
    runs = [out.module()]
    if HAS_EXECUTORCH:
        runs.append(_executorch_run(out))
    for run in runs:
        for case in cases:
            want = _flat(model(*case))
            got = _flat(run(*case))
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        for case in failing:
            with pytest.raises((IndexError, RuntimeError)):  # torch's index_select; ExecuTorch's kernel
                run(*case)
    return out


class Cond(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))
        self.register_buffer("b", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> Any:
        y = hop.cond(x.sum() > 0, lambda a: (a @ self.w, a + self.b), lambda a: (a * 2, a), (x,))
        return y[0] + 1, y[1]  # the false branch returns its operand: a copy for torch's cond


def test_cond_takes_both_branches() -> None:
    x = torch.randn(4, 3)
    deploy_and_check(Cond(), [(x.abs(),), (-x.abs(),)])


class Switch(torch.nn.Module):
    def forward(self, x: torch.Tensor, k: torch.Tensor) -> Any:
        return hop.switch(k, [lambda a: a + 1, lambda a: a.sin(), lambda a: a * a], (x,))


def test_switch_takes_each_branch_and_an_index_out_of_range_fails() -> None:
    x = torch.randn(5)
    cases = [(x, torch.tensor(k)) for k in (1, 0, 2)]
    deploy_and_check(Switch(), cases, failing=[(x, torch.tensor(3)), (x, torch.tensor(-1))])


class Counted(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return hop.fori_loop(0, 5, lambda i, a: a * 0.5 + i, x)


def test_fori_loop_with_int_bounds_needs_no_max_steps() -> None:
    out = deploy_and_check(Counted(), [(torch.randn(3),), (torch.ones(3),)])
    assert not any(n.target is torch.ops.higher_order.cond for n in out.graph.nodes)  # runs each step


class Until(torch.nn.Module):
    """A loop whose trip count depends on data: halve until below 1."""

    def forward(self, x: torch.Tensor) -> Any:
        return hop.while_loop(lambda v, n: v.abs().max() > 1, lambda v, n: (v * 0.5, n + 1), (x, torch.tensor(0)))


def test_while_loop_runs_until_its_condition_within_max_steps() -> None:
    x = torch.tensor([3.0, -5.0])
    cases = [(x,), (x / 8,), (x * 30,)]  # 3, 0 and 8 steps
    deploy_and_check(Until(), cases, max_steps=8, failing=[(x * 1000,)])  # 13 steps: too many


def test_a_while_loop_without_max_steps_is_refused() -> None:
    ep = torch.export.export(Until(), (torch.tensor([3.0]),))
    with pytest.raises(CompileUnsupported, match="max_steps"):
        hop.deploy.for_executorch(ep)


class Bounds(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> Any:
        return hop.fori_loop(torch.tensor(0), n, lambda i, a: a + i, x)


def test_fori_loop_with_a_tensor_bound() -> None:
    x = torch.zeros(2)
    cases = [(x, torch.tensor(4)), (x, torch.tensor(0)), (x, torch.tensor(6))]
    deploy_and_check(Bounds(), cases, max_steps=6, failing=[(x, torch.tensor(7))])


class Scan(torch.nn.Module):
    def __init__(self, reverse: bool) -> None:
        super().__init__()
        self.reverse = reverse
        self.decay = torch.nn.Parameter(torch.tensor([0.9, 0.5, 0.1]))

    def forward(self, xs: torch.Tensor) -> Any:
        def step(h: torch.Tensor, x: torch.Tensor) -> Any:
            h = h * self.decay + x
            return h, h.sum()

        return hop.scan(step, torch.zeros(3), xs, reverse=self.reverse)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_over_lengths_up_to_a_bound(reverse: bool) -> None:
    n = Dim("n", min=1, max=16)
    cases = [(torch.randn(5, 3),), (torch.randn(1, 3),), (torch.randn(16, 3),)]
    deploy_and_check(Scan(reverse), cases, dynamic_shapes=({0: n},))


class Map(torch.nn.Module):
    def forward(self, xs: torch.Tensor, w: torch.Tensor) -> Any:
        return hop.map(lambda r: (r @ w).relu(), xs)


def test_map_is_a_scan_without_carries() -> None:
    w = torch.randn(3, 2)
    cases = [(torch.randn(4, 3), w), (torch.randn(2, 3), w)]
    deploy_and_check(Map(), cases, dynamic_shapes=({0: Dim("n", min=1, max=8)}, None))


class Recurrence(torch.nn.Module):
    """h[t] = a[t] * h[t-1] + b[t] as an associative scan of (a, b) pairs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        def combine(left: Any, right: Any) -> Any:
            return left[0] * right[0], right[0] * left[1] + right[1]

        return hop.associative_scan(combine, (a, b), 0)


def test_associative_scan_is_the_sequential_scan() -> None:
    cases = [(torch.rand(6, 2), torch.randn(6, 2)), (torch.rand(1, 2), torch.randn(1, 2))]
    n = Dim("n", min=1, max=8)
    deploy_and_check(Recurrence(), cases, dynamic_shapes=({0: n}, {0: n}))


class Nested(torch.nn.Module):
    """A loop of branches over a scan: each step a switch on its counter's parity, each
    branch a scan."""

    def forward(self, x: torch.Tensor) -> Any:
        def body(i: torch.Tensor, v: torch.Tensor) -> Any:
            def up(a: torch.Tensor) -> Any:
                return hop.scan(lambda c, r: (c + r, c), a[0], a)[1] + 1

            return hop.switch(i % 2, [up, lambda a: a.flip(0)], (v,))

        return hop.fori_loop(torch.tensor(0), torch.tensor(3), body, x)


def test_nested_operators() -> None:
    deploy_and_check(Nested(), [(torch.randn(4, 2),), (torch.ones(4, 2),)], max_steps=3)


def test_a_saved_and_loaded_program(tmp_path: Path) -> None:
    x = torch.randn(4, 3)
    ep = torch.export.export(Cond(), (x,))
    torch.export.save(ep, tmp_path / "cond.pt2")
    out = hop.deploy.for_executorch(torch.export.load(tmp_path / "cond.pt2"))
    torch.testing.assert_close(out.module()(x), ep.module()(x))


def test_a_users_operator_is_its_decomposition() -> None:
    class Budget(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return hop.bounded_while(lambda v: v.sum() < 10, lambda v: v * 2, (x,), 6)[0]

    deploy_and_check(Budget(), [(torch.ones(2),), (torch.full((2,), 0.01),), (torch.full((2,), 20.0),)], max_steps=6)


class Sized(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a[a > 0], lambda a: a[a < 0], (x,))


def test_outputs_of_data_dependent_size_are_refused() -> None:
    ep = torch.export.export(Sized(), (torch.randn(5),))
    with pytest.raises(CompileUnsupported, match=r"hop\.cond: .*depend on data"):
        hop.deploy.for_executorch(ep)


def test_a_scan_that_may_have_length_0_is_refused() -> None:
    ep = torch.export.export(Scan(False), (torch.randn(0, 3),))
    with pytest.raises(CompileUnsupported, match=r"hop\.scan: .*length 0"):
        hop.deploy.for_executorch(ep)


def test_misuse() -> None:
    with pytest.raises(HopTypeError, match="ExportedProgram"):
        hop.deploy.for_executorch(Cond())  # type: ignore[arg-type]
    ep = torch.export.export(Cond(), (torch.randn(4, 3),))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(HopValueError, match="max_steps"):
            hop.deploy.for_executorch(ep, max_steps=bad)  # type: ignore[arg-type]


def test_a_loop_carry_of_varying_size_is_refused() -> None:
    # ExecuTorch 1.5.1's scan fails on it (torch's own scan too): refused before
    ep = torch.export.export(Counted(), (torch.randn(5),), dynamic_shapes=({0: Dim("n", min=1, max=8)},))
    with pytest.raises(CompileUnsupported, match=r"hop\.while_loop: a carry of shape \(s\d+,\) varies") as e:
        hop.deploy.for_executorch(ep)
    assert "(the call at test_executorch.py:" in str(e.value)  # the user's line
    assert "carry 1" not in str(e.value)  # hop's own number (carry 0 is fori_loop's counter)


class IntOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        n = hop.cond(x.sum() > 0, lambda a: a.shape[0] * 2, lambda a: a.shape[0], (x,))
        return x * n


def test_an_int_output_is_refused() -> None:
    ep = torch.export.export(IntOut(), (torch.randn(3),))
    with pytest.raises(CompileUnsupported, match=r"hop\.cond: output 0 is a Python number"):
        hop.deploy.for_executorch(ep)


class ShapePredicate(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return hop.cond(x.shape[0] > 4, lambda a: a.cos(), lambda a: a.sin(), (x,))


def test_a_predicate_on_a_size() -> None:
    cases = [(torch.randn(6),), (torch.randn(3),)]
    deploy_and_check(ShapePredicate(), cases, dynamic_shapes=({0: Dim("n", min=1, max=8)},))


class TwoConds(torch.nn.Module):
    """Two conds whose outputs are read after both ran: ExecuTorch 1.5.1 planned them into
    one buffer (the second's value came back for both, silently) until each cond's
    outputs were copied at once (Note [a cond's outputs copied at once])."""

    def __init__(self, loop: bool) -> None:
        super().__init__()
        self.loop = loop

    def forward(self, t: torch.Tensor, h: torch.Tensor, x: torch.Tensor) -> Any:
        def step(t: torch.Tensor, h: torch.Tensor) -> Any:
            accept = (t * x).sum() < 2
            t = hop.cond(accept, lambda t, h: t + h, lambda t, h: t, (t, h))
            h = hop.cond(accept, lambda h: h * 1.5, lambda h: h * 0.5, (h,))
            return t, h

        if self.loop:
            return hop.while_loop(lambda t, h: t < 1.0, step, (t, h))
        return step(t, h)


@pytest.mark.parametrize("loop", [False, True])
def test_two_conds_read_after_both_ran(loop: bool) -> None:
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    cases = [(torch.tensor(0.0, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64), x)]
    cases.append((cases[0][0], cases[0][1], -x))
    deploy_and_check(TwoConds(loop), cases, max_steps=50)


class ViewedYs(torch.nn.Module):
    """A scan's ys read through a view (flattened), and each of JAX's loop controls,
    which chunk a loop and flatten the chunks' ys."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x: torch.Tensor) -> Any:
        _, ys = hop.scan(lambda c, r: (c + r, (c * r)[None].expand(2, 3)), x[0] * 0, x)
        step = lambda c, r: (torch.tanh(c * self.w + r), c * r)  # noqa: E731
        _, unrolled = hop.scan(step, x[0] * 0, x, unroll=3)
        _, back = hop.scan(step, x[0] * 0, x, unroll=3, reverse=True)
        counted = hop.fori_loop(0, 5, lambda i, v: v * 0.9 + self.w * i, x[0], unroll=2)
        branch = lambda r: hop.cond(r.sum() > 0, lambda a: a * self.w, lambda a: a.sin(), (r,))  # noqa: E731
        batched = hop.map(branch, x, batch_size=2)
        _, ticks = hop.scan(lambda c, _: (c * self.w + 1, c.sum()), x[0], None, length=4, unroll=3)
        return ys.flatten(0, 1), unrolled, back, counted, batched, ticks


def test_views_of_a_scans_ys_and_the_loop_controls() -> None:
    # ExecuTorch 1.5.1 refused a view of a scan's ys ("Guard shape_dynamism_eq_base
    # failed"), which every chunked loop control makes (Note [a scan's stacked outputs copied])
    with torch.no_grad():
        deploy_and_check(ViewedYs(), [(torch.randn(5, 3),), (torch.randn(5, 3) - 1,)])
