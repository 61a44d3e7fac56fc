"""The demo behind ``python -m hop``: a model with data-dependent control flow,
run eagerly, differentiated, exported, saved, loaded and run again.

It grows as operators land. Today it uses a HOP defined the way a user would
(``docs/writing_a_hop.md``): ``gate(fn, x, w)``, which applies ``fn`` and is
kept as one node with its subgraph in the exported program.
"""

from __future__ import annotations

import io
import time
from typing import Any

import torch
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

import hop
from hop import _subgraph

gate = hop.HigherOrderOperator("demo_gate")


@gate.py_impl(DispatchKey.CompositeExplicitAutograd)
def gate_dense(fn: Any, *tensors: torch.Tensor) -> Any:
    return fn(*tensors)


class _GateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Any, *tensors: torch.Tensor) -> Any:
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        return gate(fn, *tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        vjp_fn = torch.func.vjp(ctx.fn, *ctx.saved_tensors)[1]
        return (None, *vjp_fn(grad))


@gate.py_autograd_impl
def gate_autograd(fn: Any, *tensors: torch.Tensor) -> Any:
    return _GateFunction.apply(fn, *tensors)  # type: ignore[no-untyped-call]


@gate.py_impl(FakeTensorMode)
def gate_fake(mode: FakeTensorMode, fn: Any, *tensors: torch.Tensor) -> Any:
    with mode:
        return fn(*tensors)


@gate.py_impl(ProxyTorchDispatchMode)
def gate_proxy(mode: ProxyTorchDispatchMode, fn: Any, *tensors: torch.Tensor) -> Any:
    graph = _subgraph.trace_subgraph(fn, tensors)
    return _subgraph.emit(mode, gate, (graph, *tensors), gate(graph, *tensors))


def _gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # data-dependent: rows whose norm exceeds 1 are scaled down
    h = x @ w
    norms = h.norm(dim=-1, keepdim=True)
    return torch.where(norms > 1, h / norms, h)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = gate(_gated, x, self.w)
        return out.relu().sum(-1)


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(3, 4)
    report: list[tuple[str, str]] = []

    eager = model(x)
    report.append(("eager", f"output {tuple(eager.shape)}"))

    eager.sum().backward()
    assert model.w.grad is not None
    report.append(("autograd", f"|grad w| = {model.w.grad.norm():.4f}"))

    t0 = time.perf_counter()
    ep = torch.export.export(model, (x,))
    nodes = [repr(n.target) for n in ep.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)]
    report.append(("torch.export", f"{(time.perf_counter() - t0) * 1e3:.0f} ms, hop nodes: {nodes}"))

    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    again = loaded.module()(x)
    torch.testing.assert_close(again, eager.detach())
    report.append(("save/load/run", f"{buffer.getbuffer().nbytes} bytes, matches eager"))

    print("hop demo: a model with a data-dependent gate, through a hop operator")
    for step, result in report:
        print(f"  {step:<14} {result}")
    print("  operators at torch.ops.hop:", ", ".join(sorted(hop.registered_ops())))


if __name__ == "__main__":
    main()
