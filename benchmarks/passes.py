"""hop.passes.optimize: node counts and run time before and after, in one run.

Programs: the demo model (hop/_demo.py), a decoder loop whose weight projection is
the same at every step, a gated block whose two paths share their input
projection, and a configured block (constant flags, a single-step refinement loop).
Each is exported with torch.export, optimized, and timed through ``ep.module()``
(CPU time of one thread, so that other processes on a shared machine disturb it less).
Run: ``python benchmarks/passes.py`` (``--quick``: fewer timing repeats).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us

import hop
import hop._demo
from hop.passes import optimize


class Decoder(torch.nn.Module):
    """Sixteen decoding steps; ``(w * scale).t() @ w`` depends on no carry."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d**0.5)
        self.scale = torch.nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def step(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            proj = (self.w * self.scale).t() @ self.w
            return (h @ proj).tanh()

        return hop.fori_loop(0, 16, step, x)


class Gated(torch.nn.Module):
    """Two paths that both start with the same projection of the input."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def wide(v: torch.Tensor) -> torch.Tensor:
            return self.out(torch.nn.functional.gelu(self.proj(v)))

        def narrow(v: torch.Tensor) -> torch.Tensor:
            return self.out(self.proj(v).relu()) * 0.5

        return hop.cond(x.mean() > 0, wide, narrow, (x,))


class Configured(torch.nn.Module):
    """Config flags traced as constants and a refinement loop configured for one step."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_norm, act = torch.tensor(True), torch.tensor(2)
        h = hop.cond(use_norm, lambda v: torch.nn.functional.layer_norm(v, v.shape[-1:]), lambda v: v.clone(), (x,))
        h = hop.fori_loop(0, 1, lambda i, v: self.lin(v).tanh() + v, h)
        acts = [torch.relu, torch.nn.functional.gelu, torch.nn.functional.silu]
        out: torch.Tensor = hop.switch(act, acts, (h,))
        return out


def nodes(ep: torch.export.ExportedProgram) -> tuple[int, int, int]:
    """(nodes of every graph, nested ones included; computations inside loop bodies and
    branches, what runs per iteration or per branch; hop operators)."""
    top = ep.graph_module
    graphs = [m for m in top.modules() if isinstance(m, torch.fx.GraphModule)]
    every = [n for g in graphs for n in g.graph.nodes]
    nested = sum(n.op == "call_function" for g in graphs if g is not top for n in g.graph.nodes)
    return len(every), nested, sum(isinstance(n.target, hop.HigherOrderOperator) for n in every)


def measure(name: str, model: torch.nn.Module, x: torch.Tensor, number: int) -> tuple[Any, ...]:
    ep = torch.export.export(model, (x,))
    opt = optimize(ep)
    before, after = ep.module(), opt.module()
    with torch.no_grad():
        torch.testing.assert_close(after(x), before(x))
        times = [per_call_us(_call(m, x), number=number, repeat=7, timer=time.process_time) for m in (before, after)]
    return (name, *nodes(ep), *nodes(opt), *times)


def _call(module: Callable[..., Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: module(x)


def main() -> None:
    quick = "--quick" in sys.argv
    torch.set_num_threads(1)  # CPU time of one thread: what other processes on the machine disturb least
    number = 20 if quick else 100
    torch.manual_seed(0)
    rows = [
        measure("demo model (hop/_demo.py)", hop._demo.Model(), torch.randn(3, 4), number),
        measure("decoder loop, invariant projection", Decoder(), torch.randn(8, 64), number),
        measure("gated block, shared prefix", Gated(), torch.randn(32, 256), number),
        measure("configured block (constants, 1-step loop)", Configured(), torch.randn(8, 64), number),
    ]
    counts = f"{'nodes':>6} {'nested':>6} {'hops':>4}"
    head = f"{'program':<44} {counts} -> {counts}   {'before us':>10} {'after us':>10} {'speedup':>8}"
    print("\nhop.passes.optimize on exported programs (ep.module(), CPU time per call, one thread, best of 7)")
    print("nodes: of every graph; nested: computations in loop bodies and branches; hops: hop operators")
    print(head)
    print("-" * len(head))
    for name, n0, b0, h0, n1, b1, h1, t0, t1 in rows:
        before, after = f"{n0:>6} {b0:>6} {h0:>4}", f"{n1:>6} {b1:>6} {h1:>4}"
        print(f"{name:<44} {before} -> {after}   {t0:>10.1f} {t1:>10.1f} {t0 / t1:>7.2f}x")


if __name__ == "__main__":
    main()
