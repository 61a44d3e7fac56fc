"""hop under user TorchDispatchModes (Note [user modes] in hop/_transforms.py).

A mode that no hop operator has a rule for (an op logger, selective
checkpointing's caching modes) sees the aten ops of what runs, exactly as under
the plain-Python program; validation is invisible to it, so the first call looks
like every later one; below a tracing mode it is stepped over.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import hop
from hop.ops.branching.cond import cond_op


class OpLog(TorchDispatchMode):
    """Records every aten op it sees, then runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


W = torch.randn(4, 4)


def _mm(v: torch.Tensor) -> torch.Tensor:
    return v @ W


def _twice(v: torch.Tensor) -> torch.Tensor:
    return v * 2


# (hop program, its plain-Python reference), both of x
PROGRAMS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], Any]]] = {
    "cond": (lambda x: hop.cond(PRED, _mm, _twice, (x,)), _mm),
    "switch": (lambda x: hop.switch(INDEX, [_twice, _mm], (x,)), _mm),
    "while_loop": (
        lambda x: hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, _mm(v)), (0, x))[1],
        lambda x: _mm(_mm(_mm(x))),
    ),
    "fori_loop": (lambda x: hop.fori_loop(0, 3, lambda i, v: _mm(v), x), lambda x: _mm(_mm(_mm(x)))),
    "map": (lambda x: hop.map(_mm, x), lambda x: torch.stack([_mm(r) for r in x])),
    "scan": (
        lambda x: hop.scan(lambda c, r: (c + _mm(r), c), torch.zeros_like(x[0]), x)[0],
        lambda x: functools.reduce(lambda c, r: c + _mm(r), x, torch.zeros_like(x[0])),
    ),
    "associative_scan": (lambda x: hop.associative_scan(torch.add, x, 0), lambda x: x.cumsum(0)),
}
PRED, INDEX = torch.tensor(True), torch.tensor(1)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_results_and_ops_under_a_user_mode(name: str) -> None:
    program, reference = PROGRAMS[name]
    x = torch.randn(3, 4)
    seen = []
    for _ in range(3):  # the first call validates: the mode must not see it
        with OpLog() as log:
            out = program(x)
        torch.testing.assert_close(out, reference(x))
        seen.append(log.ops)
    assert seen[0] == seen[1] == seen[2]
    with OpLog() as log:
        reference(x)
    if "mm" in log.ops:  # the mode sees what runs: the taken branch, every iteration
        assert seen[0].count("mm") == log.ops.count("mm")
    assert "mul" not in seen[0] or name != "cond"  # not the untaken branch


def test_untaken_branch_runs_nothing_under_a_user_mode() -> None:
    x = torch.randn(3, 4)
    with OpLog() as log:
        hop.cond(torch.tensor(False), _mm, _twice, (x,))
        hop.cond(torch.tensor(False), _mm, _twice, (x,))
    assert "mm" not in log.ops and log.ops.count("mul") == 2


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradients_under_a_user_mode(name: str) -> None:
    program, reference = PROGRAMS[name]
    x = torch.randn(3, 4, dtype=torch.float64)
    w = W.double().requires_grad_()
    globals()["W"] = w
    try:
        want = torch.autograd.grad(reference(x.requires_grad_()).sum(), [x, w], allow_unused=True)
        with OpLog():
            got = torch.autograd.grad(program(x).sum(), [x, w], allow_unused=True)
    finally:
        globals()["W"] = w.detach().float()
    for g, r in zip(got, want, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r)


def test_raw_op_under_a_user_mode_runs_its_kernel_with_the_mode_active() -> None:
    x = torch.randn(3, 4)
    with OpLog() as log:
        out = cond_op(torch.tensor(True), _mm, _twice, (x,))
    torch.testing.assert_close(out, _mm(x))
    with OpLog() as plain:
        _mm(x)
    assert log.ops[-len(plain.ops) :] == plain.ops  # what a Python call shows: mm, not matmul


def test_flop_counter_counts_the_taken_branch_and_every_iteration() -> None:
    x = torch.randn(3, 4)
    with FlopCounterMode(display=False) as plain:
        _mm(x)
    flops = plain.get_total_flops()  # of one (3, 4) @ (4, 4)
    for program, expected in (
        (lambda: hop.cond(torch.tensor(True), _mm, _twice, (x,)), flops),  # the taken branch only
        (lambda: hop.fori_loop(0, 5, lambda i, v: _mm(v), x), 5 * flops),  # every iteration
        (lambda: hop.map(_mm, x.unsqueeze(1)), flops),  # 3 rows of (1, 4) @ (4, 4)
    ):
        with FlopCounterMode(display=False) as counter:
            program()
        assert counter.get_total_flops() == expected


def test_a_user_mode_inside_make_fx_is_stepped_over() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with OpLog():
            return hop.cond(x.sum() > 0, lambda v: v @ w, lambda v: v * 2, (x,))

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    for mode in ("real", "fake", "symbolic"):
        gm = make_fx(f, tracing_mode=mode)(x, w)
        assert any(n.target is torch.ops.hop.cond for n in gm.graph.nodes)
        for v in (x, -x):
            torch.testing.assert_close(gm(v, w), f(v, w))


def test_selective_activation_checkpointing_around_control_flow() -> None:
    lin = torch.nn.Linear(4, 4)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def f(x: torch.Tensor) -> torch.Tensor:
        h = hop.cond(x.sum() > 0, lambda v: torch.tanh(lin(v)), lambda v: lin(v) * 2, (x,))
        _, ys = hop.scan(lambda c, r: (c + r.sin(), c * r), torch.zeros(4), h)
        step = (lambda i, v: (i + 1, torch.tanh(v @ lin.weight)),)[0]
        return hop.while_loop(lambda i, v: i < 3, step, (torch.tensor(0), ys))[1].sum()

    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(f(x), [x, *lin.parameters()])
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    for _ in range(2):
        got = torch.autograd.grad(checkpoint(f, x, use_reentrant=False, context_fn=context), [x, *lin.parameters()])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_a_rule_registered_for_a_mode_takes_over() -> None:
    class Counting(OpLog):
        pass

    op = hop.HigherOrderOperator("test_user_modes_twice")

    @op.py_impl(torch._C.DispatchKey.CompositeExplicitAutograd)
    def twice_dense(fn: Any, x: torch.Tensor) -> torch.Tensor:
        return fn(fn(x))

    x = torch.ones(2)
    with Counting() as log:
        out = op(torch.sin, x)
    torch.testing.assert_close(out, x.sin().sin())
    assert log.ops.count("sin") == 2  # a user mode: the kernel ran with it active

    @op.py_impl(Counting)
    def twice_counting(mode: Counting, fn: Any, x: torch.Tensor) -> torch.Tensor:
        mode.ops.append("twice")
        return fn(fn(x))

    with Counting() as log:
        op(torch.sin, x)
    assert log.ops == ["twice"]  # now the mode's rule runs, with the mode popped


def test_errors_under_a_user_mode_leave_no_mode_behind() -> None:
    x = torch.randn(3, 4)
    with OpLog(), pytest.raises(hop.errors.HopError):
        hop.cond(torch.tensor(True), _mm, lambda v: v.double(), (x,))
    assert torch._C._len_torch_dispatch_stack() == 0
