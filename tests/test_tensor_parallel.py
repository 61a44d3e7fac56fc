"""Tensor parallelism (DTensor) inside hop's operators: a ColwiseParallel/RowwiseParallel
MLP in a cond branch, a while_loop body and a scan body, run by two gloo ranks on
127.0.0.1, forward and backward, equal to the same model unsharded (Note [tensor
subclasses run as Python] in hop.ops._common: a DTensor operand runs the operator as
the plain Python program); and the cond and while_loop models' forward under
torch.compile (Note [subclass operands desugared] in hop._subclasses), whose training
is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

import hop

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD, TIMEOUT_S, WIDTH = 2, 120.0, 8


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).tanh())


class WithMlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()


class InCond(WithMlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda v: self.mlp(v), lambda v: self.mlp(v * 2).sin(), (x,))


class InWhile(WithMlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def body(i: torch.Tensor, h: torch.Tensor) -> Any:
            return i + 1, self.mlp(h).tanh()

        return hop.while_loop(lambda i, h: i < 3, body, (torch.tensor(0), x))[1]


class InScan(WithMlp):
    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        def step(h: torch.Tensor, x: torch.Tensor) -> Any:
            h = self.mlp(h + x).tanh()
            return h, h

        return hop.scan(step, torch.zeros(xs.shape[1:]), xs)[1]


class DTensorOperands(WithMlp):
    """The operands, predicate and carries are DTensors themselves (the MLP's output
    stays one): a cond choosing by a DTensor, a scan over DTensor rows."""

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        mesh = next((p.device_mesh for p in self.parameters() if isinstance(p, DTensor)), None)
        if mesh is not None:
            xs = distribute_tensor(xs, mesh, [Replicate()])

        def step(h: torch.Tensor, x: torch.Tensor) -> Any:
            h = hop.cond(x.sum() > 0, lambda a, b: self.mlp(a + b).tanh(), lambda a, b: a * 0.5, (h, x))
            return h, h.sum()

        _, ys = hop.scan(step, xs[0] * 0, xs)
        return ys.full_tensor() if isinstance(ys, DTensor) else ys


MODELS = {"cond": InCond, "while_loop": InWhile, "scan": InScan, "dtensor_operands": DTensorOperands}
# the sharded model under torch.compile(fullgraph=True), aot_eager: its nodes over DTensor
# parameters run on their local shards (Note [subclass operands desugared] in hop._subclasses)
COMPILED = ("cond", "while_loop")


def _inputs(name: str, sign: float) -> torch.Tensor:
    x = torch.randn(4, 3, WIDTH, generator=torch.Generator().manual_seed(7)).abs() * sign
    if name == "dtensor_operands":
        return x[:, 0] * torch.tensor([1.0, -1.0, 1.0, 1.0])[:, None]  # some rows take the other branch
    return x if name == "scan" else x[0]


def _sharded(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    local = not isinstance(model, DTensorOperands)  # DTensorOperands keeps DTensors between ops
    plan = {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(use_local_output=local)}
    return parallelize_module(model, mesh, plan)


def _run(case: str, rank: int) -> dict[str, Any]:
    """The sharded and the unsharded model on inputs taking each branch: outputs and
    parameter gradients (the sharded ones gathered)."""
    from torch.distributed.device_mesh import init_device_mesh

    name, compiled = case.removesuffix(" compiled"), case.endswith(" compiled")
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    plain = MODELS[name]()
    twin = MODELS[name]()
    twin.load_state_dict(plain.state_dict())
    sharded = _sharded(twin, mesh)
    if compiled:
        sharded = torch.compile(sharded, backend="aot_eager", fullgraph=True)
    out: dict[str, Any] = {}
    for sign in (1.0, -1.0):
        for label, model in (("plain", plain), ("sharded", sharded)):
            if compiled:  # the forward: DTensor's autograd.Functions have no torch.func rule
                with torch.no_grad():
                    out[f"{label}{sign}"] = (model(_inputs(name, sign)), [])
                continue
            model.zero_grad(set_to_none=True)
            y = model(_inputs(name, sign))
            y.pow(2).sum().backward()
            grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            out[f"{label}{sign}"] = (y.detach(), [g if g is None else g.detach().clone() for g in grads])
    if compiled:
        try:
            sharded(_inputs(name, 1.0)).sum().backward()
            out["training"] = "no error"
        except Exception as e:
            out["training"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_run, CASES, world=WORLD, timeout_s=TIMEOUT_S, folder=tmp_path_factory.mktemp("tp"))


CASES = [*MODELS, *(f"{name} compiled" for name in COMPILED)]


@pytest.mark.parametrize("name", CASES)
def test_a_tensor_parallel_mlp_equals_the_unsharded_one(ranks: list[dict[str, Any]], name: str) -> None:
    for rank in ranks:
        result = rank[name]
        assert not isinstance(result, str), result
        if name.endswith(" compiled"):  # training it is refused by name, never run wrongly
            assert "hop.cond" in result["training"] or "hop.while_loop" in result["training"], result["training"]
            assert "torch.func cannot differentiate" in result["training"], result["training"]
        for sign in (1.0, -1.0):
            y, grads = result[f"sharded{sign}"]
            want_y, want_grads = result[f"plain{sign}"]
            torch.testing.assert_close(y, want_y)
            assert len(grads) == len(want_grads)
            for g, w in zip(grads, want_grads, strict=True):
                assert (g is None) == (w is None)
                if g is not None:
                    torch.testing.assert_close(g, w)
