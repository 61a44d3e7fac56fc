"""torch.jit.trace around hop: a traced program runs and differentiates as eager.

On real tensors hop's rules run the callables inline, so the tracer records the
aten ops inside; the operators fall through the tracer's dispatch key (Note
[the JIT tracer's key] in ``hop._dispatch``). A trace is valid for inputs of
the traced shape (and, for a data-dependent branch, of the traced branch), as a
trace of the Python code is; the inputs here keep both.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import hop
from hop import _dispatch

Fn = Callable[[torch.Tensor], torch.Tensor]


def _positive() -> torch.Tensor:
    """Values whose data-dependent branches (``sum() > 0``) go the same way every time."""
    return torch.rand(5, 4) + 0.1


RAW: dict[str, Fn] = {
    "cond": lambda a: torch.ops.hop.cond(a.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (a,)),
    "while_loop": lambda a: torch.ops.hop.while_loop(
        lambda i, v: i < 2, lambda i, v: (i + 1, v * 2), (torch.zeros((), dtype=torch.long), a), ()
    )[1],
}


def _trace(fn: Fn, requires_grad: bool) -> torch.jit.ScriptFunction:
    traced = torch.jit.trace(fn, (_positive().requires_grad_(requires_grad),), check_trace=False)
    assert "PythonOp" not in str(traced.graph)  # no Python autograd node, nor a hop op, was recorded
    return traced


def _check_like_eager(traced: torch.jit.ScriptFunction, fn: Fn, requires_grad: bool) -> None:
    """On new values of the traced shape: the outputs, and the gradients when ``requires_grad``."""
    x = _positive()
    leaves = [x.clone().requires_grad_(requires_grad) for _ in range(2)]
    got, want = traced(leaves[0]), fn(leaves[1])
    torch.testing.assert_close(got, want)
    if requires_grad:
        cotangent = torch.randn_like(want)
        (g_traced,) = torch.autograd.grad(got, leaves[0], cotangent)
        (g_eager,) = torch.autograd.grad(want, leaves[1], cotangent)
        torch.testing.assert_close(g_traced, g_eager)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", sorted(RAW))
def test_raw_ops_trace(name: str, requires_grad: bool) -> None:
    # the raw ops go through hop's dispatcher, which meets the tracer's key
    _check_like_eager(_trace(RAW[name], requires_grad), RAW[name], requires_grad)


def test_hop_operators_let_the_tracer_key_fall_through() -> None:
    assert str(_dispatch.TRACER_KEYS) == "DispatchKeySet(Tracer)"
    for op in hop.registered_ops().values():
        assert str(op.non_fallthrough_keys & _dispatch.TRACER_KEYS) == "DispatchKeySet()"
        assert op.non_fallthrough_keys.has(torch._C.DispatchKey.AutogradCPU)
