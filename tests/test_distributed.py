"""DDP (and FSDP2) over gloo with two ranks on 127.0.0.1, find_unused_parameters=False.

Ranks that take different branches of a cond or switch train in step because the
untaken branch's parameters get zero gradients (Note [untaken branches get zero
gradients] in hop/ops/branching/_untaken_grads.py); loops reach their body's parameters on
every iteration. One pair of worker processes runs every scenario for three
training steps; each test compares the ranks with each other and with one
process that averages the ranks' gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

import hop

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD, STEPS, LR, TIMEOUT_S = 2, 3, 0.1, 120.0


# --- the models: each forward takes (model, rank, step) inputs from `batch` ------------------


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda v: self.a(v).tanh(), lambda v: self.b(v) * 2, (x,))


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return hop.switch(i, [lambda v, m=m: m(v).sin() for m in self.experts], (x,))


class Loop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, n: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _, h = hop.while_loop(lambda i, h: i < n, lambda i, h: (i + 1, self.lin(h).tanh()), (torch.tensor(0), x))
        return h


class Scan(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        carry, ys = hop.scan(lambda c, x: (self.lin(c + x).tanh(), c * x), torch.zeros(4), xs)
        return ys.sum(0) + carry


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, ...]:
    """Rank- and step-dependent inputs; which branch (or how many iterations) is in the name."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * rank + step)).abs()
    if name == "cond_same_branch":
        return (x if step % 2 == 0 else -x,)
    if name == "fsdp2_per_branch_same_branch":
        return (x if step % 2 == 0 else -x,)  # both ranks on one branch in each step
    if name in ("cond_different_branches", "fsdp2_cond_different_branches"):
        return (x if (rank + step) % 2 == 0 else -x,)
    if name == "switch":
        return (torch.tensor((rank + step) % 3), x)  # one expert is idle on both ranks
    if name == "while_loop":
        return (torch.tensor(1 + (rank + step) % 3), x)  # ranks run different trip counts
    return (x,)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "cond_same_branch": TwoBranches,
    "cond_different_branches": TwoBranches,
    "switch": Experts,
    "while_loop": Loop,
    "scan": Scan,
    "fsdp2_cond_different_branches": TwoBranches,
    # each branch's module sharded on its own: FSDP2's forward hooks on the branches
    "fsdp2_per_branch_same_branch": TwoBranches,
}


# A module sharded on its own holds DTensor parameters outside its forward: the
# untaken branch's get no zero gradient (docs/distributed.md), as with a Python if.
UNTAKEN_GET_NO_GRADIENT = {"fsdp2_per_branch_same_branch"}


def _loss(model: Any, name: str, rank: int, step: int) -> torch.Tensor:
    return model(*batch(name, rank, step)).pow(2).mean()


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A gathered copy of a (possibly DTensor) parameter or gradient."""
    if t is None:
        return None
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _train(name: str, rank: int) -> dict[str, list[Any]]:
    torch.manual_seed(0)
    model = MODELS[name]()
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        if name == "fsdp2_per_branch_same_branch":
            fully_shard(model.a, mesh=mesh)
            fully_shard(model.b, mesh=mesh)
        wrapped: Any = fully_shard(model, mesh=mesh)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(wrapped, name, rank, step).backward()
        grads = [_full(p.grad) for p in wrapped.parameters()]
        opt.step()
    return {"grads": grads, "params": [_full(p) for p in wrapped.parameters()]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario's results on each rank, from one process group."""
    return run_ranks(_train, list(MODELS), world=WORLD, timeout_s=TIMEOUT_S, folder=tmp_path_factory.mktemp("ddp"))


def _single_process(name: str) -> dict[str, list[Any]]:
    """The same training in one process: each step averages the ranks' gradients."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        (sum(_loss(model, name, r, step) for r in range(WORLD)) / WORLD).backward()
        grads = [_full(p.grad) for p in model.parameters()]
        opt.step()
    return {"grads": grads, "params": [_full(p) for p in model.parameters()]}


@pytest.mark.parametrize("name", list(MODELS))
def test_ranks_agree_with_each_other_and_with_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    got = [r[name] for r in ranks]
    for r, res in enumerate(got):
        assert not isinstance(res, str), f"rank {r} failed:\n{res}"
    want = _single_process(name)
    for kind in ("grads", "params"):
        for i, (g0, g1, w) in enumerate(zip(got[0][kind], got[1][kind], want[kind], strict=True)):
            if g0 is None and g1 is None and name in UNTAKEN_GET_NO_GRADIENT:
                assert not w.any(), f"{name}: {kind}[{i}] has no gradient on the ranks"
                continue
            assert g0 is not None and g1 is not None, f"{kind}[{i}] has no gradient"
            torch.testing.assert_close(g0, g1, rtol=0, atol=0, msg=f"{name}: ranks differ at {kind}[{i}]")
            torch.testing.assert_close(g0, w, msg=f"{name}: {kind}[{i}] differs from one process")
