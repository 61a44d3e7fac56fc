"""A batched environment rollout trained with a policy gradient (REINFORCE).

Each episode balances a pole on a cart (Euler steps of the classic cart-pole physics)
with a small policy network: at every step it pushes right with the probability the
network gives (decided by a pre-drawn uniform, so runs are reproducible), and the
episode ends when the cart leaves the track, the pole falls past 12 degrees, or the
step limit is reached. One episode is a ``hop.while_loop`` whose step counter starts
as ``torch.zeros(())`` (written per episode, as users write it); the batch is
``torch.vmap`` of the episode, so episodes end at different steps and vmap broadcasts
the unbatched initial counter (a stride-0 carry). The return and the log-probability
of the actions taken feed the REINFORCE loss, differentiated from outside the vmap.
The twin plays each episode in a Python loop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import DEPLOYMENTS, assert_same, check_compile, check_compile_grad, check_deployment, sharing
from torch.export import Dim

import hop

GRAVITY, CART, POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
X_LIMIT, ANGLE_LIMIT, MAX_STEPS = 2.4, 12 * math.pi / 180, 40
F64 = torch.float64


def physics(state: torch.Tensor, push: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Euler step of the cart and pole; and whether the episode is over."""
    x, v, theta, omega = state.unbind(-1)
    force = torch.where(push, FORCE, -FORCE)
    cos, sin = theta.cos(), theta.sin()
    total = CART + POLE
    lever = (force + POLE * HALF_LENGTH * omega**2 * sin) / total
    alpha = (GRAVITY * sin - cos * lever) / (HALF_LENGTH * (4 / 3 - POLE * cos**2 / total))
    accel = lever - POLE * HALF_LENGTH * alpha * cos / total
    new = torch.stack([x + TAU * v, v + TAU * accel, theta + TAU * omega, omega + TAU * alpha], -1)
    return new, (new[..., 0].abs() > X_LIMIT) | (new[..., 2].abs() > ANGLE_LIMIT)


def at(noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``noise[t]`` for a tensor step ``t``, as a masked sum: torch's vmap of index_select
    or gather with a batched index specializes the batch size under torch.export."""
    return (noise * (torch.arange(noise.shape[0]) == t)).sum()


class Rollout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8, dtype=F64), torch.nn.Tanh(), torch.nn.Linear(8, 1, dtype=F64)
        )

    def decide(self, state: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The action (push right) and its log-probability."""
        p = torch.sigmoid(self.net(state)).squeeze(-1)
        push = u < p
        return push, torch.where(push, p.log(), (1 - p).log())

    def episode(self, state: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def running(t: Any, state: Any, done: Any, ret: Any, logp: Any) -> Any:
            return (t < MAX_STEPS) & ~done

        def act(t: Any, state: Any, done: Any, ret: Any, logp: Any) -> Any:
            push, lp = self.decide(state, at(noise, t))
            state, done = physics(state, push)
            return t + 1, state, done, ret + 1, logp + lp

        zero = torch.zeros((), dtype=F64)
        start = (torch.zeros((), dtype=torch.long), state, torch.zeros((), dtype=torch.bool), zero, zero)
        _, _, _, ret, logp = hop.while_loop(running, act, start)
        return ret, logp

    def forward(self, states: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.vmap(self.episode)(states, noise)


class PythonRollout(Rollout):
    def forward(self, states: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rets, logps = [], []
        for state, u in zip(states, noise, strict=True):
            t, done = 0, False
            ret, logp = torch.zeros((), dtype=F64), torch.zeros((), dtype=F64)
            while t < MAX_STEPS and not done:
                push, lp = self.decide(state, u[t])
                state, finished = physics(state, push)
                done, ret, logp, t = bool(finished), ret + 1, logp + lp, t + 1
            rets.append(ret)
            logps.append(logp)
        return torch.stack(rets), torch.stack(logps)


def reinforce_loss(ret: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return -((ret - ret.mean()) * logp).mean()


def episodes(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 4, generator=g, dtype=F64) - 0.5) * 0.1, torch.rand(
        batch, MAX_STEPS, generator=g, dtype=F64
    )


def make() -> tuple[Rollout, list[tuple[torch.Tensor, torch.Tensor]]]:
    return Rollout(), [episodes(b, s) for b, s in ((8, 1), (5, 2), (16, 3))]


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonRollout(), model)
    lengths: set[float] = set()
    for case in cases:
        assert_same(model(*case), twin(*case), "eager")
        lengths |= set(model(*case)[0].tolist())
    assert len(lengths) > 3 and min(lengths) < MAX_STEPS  # episodes end early, at different steps


def test_policy_gradient_equals_the_python_twin_and_has_no_nan() -> None:
    # from outside the vmap (autograd of the batched program), and per episode inside it
    model, cases = make()
    twin = sharing(PythonRollout(), model)
    params = list(model.parameters())
    for case in cases:
        got = torch.autograd.grad(reinforce_loss(*model(*case)), params)
        want = torch.autograd.grad(reinforce_loss(*twin(*case)), list(twin.parameters()))
        assert all(bool(g.isfinite().all()) for g in got)
        assert_same(got, want, "REINFORCE gradient")
    states, noise = cases[0]
    named = dict(model.named_parameters())

    def episode_logp(p: dict[str, torch.Tensor], s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (s, u), strict=True, tie_weights=False)[1]

    per_episode = torch.vmap(torch.func.grad(lambda p, s, u: episode_logp(p, s[None], u[None]).sum()), (None, 0, 0))
    got_each = per_episode(named, states, noise)
    for k in range(states.shape[0]):
        want_each = torch.autograd.grad(twin(states[k : k + 1], noise[k : k + 1])[1].sum(), list(twin.parameters()))
        assert_same([got_each[n][k] for n in named], want_each, f"vmap(grad) episode {k}")


def test_compiled_equals_eager() -> None:
    model, cases = make()
    check_compile(model, cases, "inductor")


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


def test_compiled_training_follows_the_python_learning_curve() -> None:
    # REINFORCE updates, each step compiled (Inductor, forward and backward), against
    # the twin trained by the same updates in plain Python
    model, _ = make()
    twin = sharing(PythonRollout(), model)
    compiled = torch.compile(lambda s, u: reinforce_loss(*model(s, u)), backend="inductor", fullgraph=True)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    curve, twin_curve = [], []
    for update in range(4):
        states, noise = episodes(12, 100 + update)
        for m, o, loss_fn, out in ((model, opt, compiled, curve), (twin, twin_opt, None, twin_curve)):
            o.zero_grad()
            loss = loss_fn(states, noise) if loss_fn is not None else reinforce_loss(*m(states, noise))
            loss.backward()
            o.step()
            out.append(m(states, noise)[0].mean().item())
    torch.testing.assert_close(curve, twin_curve)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


BATCH = Dim("batch", min=2, max=64)
DYNAMIC_SHAPES = ({0: BATCH}, {0: BATCH})


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_deployed_equals_eager(path: str, tmp_path: Path) -> None:
    model, cases = make()
    check_deployment(path, model, cases[0], cases, tmp_path, dynamic_shapes=DYNAMIC_SHAPES)
