"""Hamiltonian Monte Carlo over many chains, with an adaptive trajectory length.

A transition draws a momentum, runs leapfrog steps (a ``hop.while_loop``) until the
trajectory turns back on itself (a U-turn: the displacement from the start and the
momentum point apart) or a step limit, and accepts the end point or keeps the start
(a ``hop.cond`` on the Metropolis test). A chain is a ``hop.scan`` of
transitions over pre-drawn noise, and the chains are ``torch.vmap`` of one chain, so
each chain's trajectories have their own lengths and accept their own proposals. The
target is a correlated Gaussian whose mean is a parameter: the samples are
differentiated with respect to it (the pathwise gradient through the sampler). The
twin runs every chain, trajectory and test in Python.

The leapfrog step reads the potential's gradient in closed form; ``GradSampler`` takes
it with ``torch.func.grad``, as samplers written against an arbitrary potential do, and
is checked in eager and compiled (torch.export cannot trace ``torch.func.grad`` on
torch 2.13, with or without hop: "Cannot access data pointer of Tensor that doesn't
have storage").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import DEPLOYMENTS, assert_same, check_compile, check_compile_grad, check_deployment, sharing
from torch.export import Dim

import hop

F64 = torch.float64
EPS, MAX_LEAPS, MIN_LEAPS = 0.25, 12, 2


class Sampler(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=F64))
        self.register_buffer("precision", torch.tensor([[2.0, 0.9], [0.9, 1.0]], dtype=F64))

    def potential(self, q: torch.Tensor) -> torch.Tensor:
        d = q - self.mu
        return 0.5 * (d * (self.precision @ d)).sum()

    def gradient(self, q: torch.Tensor) -> torch.Tensor:
        return self.precision @ (q - self.mu)

    def leapfrog(self, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = p - 0.5 * EPS * self.gradient(q)
        q = q + EPS * p
        return q, p - 0.5 * EPS * self.gradient(q)

    def energy(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return self.potential(q) + 0.5 * (p * p).sum()

    def transition(self, q: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, Any]:
        p, log_u = noise[:2], noise[2]

        def going(k: Any, q1: Any, p1: Any) -> Any:
            return (k < MAX_LEAPS) & ((k < MIN_LEAPS) | (((q1 - q) * p1).sum() > 0))

        def leap(k: Any, q1: Any, p1: Any) -> Any:
            return k + 1, *self.leapfrog(q1, p1)

        steps, q1, p1 = hop.while_loop(going, leap, (torch.zeros((), dtype=torch.long), q, p))
        accept = log_u < self.energy(q, p) - self.energy(q1, p1)
        q_next = hop.cond(accept, lambda proposal, start: proposal, lambda proposal, start: start, (q1, q))
        return q_next, (q_next, accept, steps)

    def chain(self, q0: torch.Tensor, noise: torch.Tensor) -> Any:
        _, (samples, accepted, steps) = hop.scan(self.transition, q0, noise)
        return samples, accepted, steps

    def forward(self, q0: torch.Tensor, noise: torch.Tensor) -> Any:
        return torch.vmap(self.chain)(q0, noise)


class PythonSampler(Sampler):
    def forward(self, q0: torch.Tensor, noise: torch.Tensor) -> Any:
        chains = []
        for q, chain_noise in zip(q0, noise, strict=True):
            samples, accepted, lengths = [], [], []
            for step_noise in chain_noise:
                p, log_u = step_noise[:2], step_noise[2]
                k, q1, p1 = 0, q, p
                while k < MAX_LEAPS and (k < MIN_LEAPS or bool(((q1 - q) * p1).sum() > 0)):
                    q1, p1 = self.leapfrog(q1, p1)
                    k += 1
                accept = bool(log_u < self.energy(q, p) - self.energy(q1, p1))
                q = q1 if accept else q
                samples.append(q)
                accepted.append(torch.tensor(accept))
                lengths.append(torch.tensor(k))
            chains.append((torch.stack(samples), torch.stack(accepted), torch.stack(lengths)))
        return tuple(torch.stack(column) for column in zip(*chains, strict=True))


class GradSampler(Sampler):
    def gradient(self, q: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(self.potential)(q)


def draws(chains: int, steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    momenta = torch.randn(chains, steps, 2, generator=g, dtype=F64)
    log_u = torch.rand(chains, steps, 1, generator=g, dtype=F64).log()
    return torch.randn(chains, 2, generator=g, dtype=F64) * 2, torch.cat([momenta, log_u], -1)


def make() -> tuple[Sampler, list[tuple[torch.Tensor, torch.Tensor]]]:
    return Sampler(), [draws(c, s, seed) for c, s, seed in ((8, 6, 1), (5, 6, 2), (12, 6, 3))]


def test_eager_equals_the_python_twin() -> None:
    model, cases = make()
    twin = sharing(PythonSampler(), model)
    for case in cases:
        got = model(*case)
        assert_same(got, twin(*case), "eager")
    _, accepted, steps = model(*cases[2])
    assert 0 < int(accepted.sum()) < accepted.numel()  # some proposals rejected
    assert len(set(steps.flatten().tolist())) > 2  # trajectories of several lengths


def test_pathwise_gradient_equals_the_python_twin() -> None:
    # autograd of the batched sampler, and per chain with torch.func (vmap of grad)
    model, cases = make()
    twin = sharing(PythonSampler(), model)
    for case in cases:
        got = torch.autograd.grad(model(*case)[0].mean(), [model.mu])
        want = torch.autograd.grad(twin(*case)[0].mean(), [twin.mu])
        assert_same(got, want, "d mean / d mu")
    q0, noise = cases[0]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def chain_mean(params: dict[str, torch.Tensor], q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (q[None], n[None]))[0].mean()

    per_chain = torch.vmap(torch.func.grad(chain_mean), (None, 0, 0))(state, q0, noise)
    for k in range(q0.shape[0]):
        want = torch.autograd.grad(twin(q0[k : k + 1], noise[k : k + 1])[0].mean(), [twin.mu])[0]
        torch.testing.assert_close(per_chain["mu"][k], want, msg=lambda m, k=k: f"chain {k}: {m}")


def test_compiled_equals_eager() -> None:
    model, cases = make()
    check_compile(model, cases, "inductor")


def test_compiled_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


CHAINS = Dim("chains", min=2, max=64)
DYNAMIC_SHAPES = ({0: CHAINS}, {0: CHAINS})


def test_torch_func_grad_in_the_leapfrog_step() -> None:
    # eager equals the closed form; compiled (forward, and a training step whose
    # gradient reaches the target's mean through the inner gradient) equals eager
    model, cases = make()
    with_grad = sharing(GradSampler(), model)
    for case in cases:
        assert_same(with_grad(*case), model(*case), "torch.func.grad vs closed form")
    check_compile(with_grad, cases, "inductor")
    check_compile_grad(with_grad, cases, "inductor")


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_deployed_equals_eager(path: str, tmp_path: Path) -> None:
    model, cases = make()
    check_deployment(path, model, cases[0], cases, tmp_path, dynamic_shapes=DYNAMIC_SHAPES)
