"""hop.bounded_while, hop's operator declared by its decomposition: each mode against
the plain Python loop with a step budget."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import hop
from hop.errors import HopTypeError, HopValueError


def python(cond_fn: Any, body_fn: Any, carries: tuple[torch.Tensor, ...], max_steps: int) -> tuple[torch.Tensor, ...]:
    steps = 0
    while steps < max_steps and bool(cond_fn(*carries)):
        carries = tuple(body_fn(*carries))
        steps += 1
    return carries


def cond_fn(c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return c.abs().max() > 0.3


def body_fn(c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return c * 0.5 + 0.01, s + c.sin().sum()


@pytest.mark.parametrize("max_steps", [0, 1, 3, 50, torch.tensor(3)])
def test_equals_the_python_loop(max_steps: Any) -> None:
    x = torch.tensor([3.0, -2.0, 0.5])
    got = hop.bounded_while(cond_fn, body_fn, (x, torch.zeros(())), max_steps)
    want = python(cond_fn, body_fn, (x, torch.zeros(())), int(max_steps))
    assert isinstance(got, tuple) and len(got) == 2
    torch.testing.assert_close(got, want)


def test_is_a_registered_operator() -> None:
    assert torch.ops.hop.bounded_while is hop.registered_ops()["bounded_while"]


def _loss(x: torch.Tensor, n: int = 4) -> torch.Tensor:
    c, s = hop.bounded_while(cond_fn, body_fn, (x, x.new_zeros(())), n)
    return c.sum() * 2 + s


def _python_loss(x: torch.Tensor, n: int = 4) -> torch.Tensor:
    c, s = python(cond_fn, body_fn, (x, x.new_zeros(())), n)
    return c.sum() * 2 + s


def test_gradients_and_transforms_equal_python() -> None:
    x = torch.tensor([3.0, -2.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(torch.func.grad(_loss)(x), torch.func.grad(_python_loss)(x))
    t = torch.ones_like(x)
    torch.testing.assert_close(torch.func.jvp(_loss, (x,), (t,)), torch.func.jvp(_python_loss, (x,), (t,)))
    torch.autograd.gradcheck(_loss, (x.clone().requires_grad_(),))
    # vmap: each row stops at its own step, as its own Python loop does
    xs = torch.tensor([[3.0, -2.0, 0.5], [0.1, 0.2, 0.1], [9.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(torch.vmap(_loss)(xs), torch.stack([_python_loss(r) for r in xs]))
    torch.testing.assert_close(
        torch.vmap(torch.func.grad(_loss))(xs), torch.stack([torch.func.grad(_python_loss)(r) for r in xs])
    )


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.9, 0.5, 0.7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (c,) = hop.bounded_while(lambda c: c.abs().max() > 0.1, lambda c: (c * self.w,), (x,), 6)
        return c


def test_exports_as_one_node_and_runs_after_save_and_load() -> None:
    m, x = Model(), torch.tensor([3.0, -2.0, 0.5])
    ep = torch.export.export(m, (x,))
    assert sum(n.target is torch.ops.hop.bounded_while for n in ep.graph.nodes) == 1
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for y in (x, x * 0.01, x * 10):
        torch.testing.assert_close(loaded.module()(y), m(y))
    decomposed = ep.run_decompositions()
    torch.testing.assert_close(decomposed.module()(x), m(x))


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        ((3, body_fn, (torch.ones(2), torch.zeros(())), 2), HopTypeError, "cond_fn must be callable"),
        ((cond_fn, body_fn, (), 2), HopTypeError, "carries must be a non-empty tuple"),
        ((cond_fn, body_fn, (torch.ones(2), 0.0), 2), HopTypeError, "carries[1] must be a tensor"),
        ((cond_fn, body_fn, (torch.ones(2), torch.zeros(())), -1), HopValueError, "at least 0"),
        ((cond_fn, body_fn, (torch.ones(2), torch.zeros(())), 2.0), HopTypeError, "max_steps must be an int"),
        ((cond_fn, body_fn, (torch.ones(2), torch.zeros(())), torch.tensor(2.0)), HopTypeError, "integer tensor"),
    ],
)
def test_misuse_names_the_operator_and_the_argument(args: Any, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        hop.bounded_while(*args)
    assert "hop.bounded_while" in str(info.value) and words in str(info.value)


def test_a_body_changing_a_carry_names_the_users_body() -> None:
    def grows(c: torch.Tensor) -> tuple[torch.Tensor]:
        return (c.double(),)

    with pytest.raises(hop.HopError, match="grows"):
        hop.bounded_while(lambda c: c.sum() > 0, grows, (torch.ones(2),), 3)
