"""hop's programs in ExecuTorch's runtime, against eager hop and AOTInductor, in one run.

Two small models: a 64-step scan of a small step (a 16-wide tanh RNN cell) and a cond
choosing between two matmuls. Each is exported once; ``hop.deploy.for_executorch``
rewrites it for ExecuTorch (``to_edge_transform_and_lower(...).to_executorch()``, the
portable kernels, no delegate), run through ExecuTorch's Python runtime; AOTInductor
compiles the exported program as it is. Values are checked equal before timing.
Single-threaded; process CPU time.

Needs ``pip install executorch==1.5.1`` beside torch 2.13. Run:
``python benchmarks/bench_executorch.py``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop
import hop.deploy

WIDTH, STEPS = 16, 64


class Rnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, xs: torch.Tensor) -> Any:
        def step(h: torch.Tensor, x: torch.Tensor) -> Any:
            h = torch.tanh(h @ self.w + x)
            return h, h

        return hop.scan(step, torch.zeros(WIDTH), xs)[1]


class Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.b = torch.nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda v: v @ self.a, lambda v: (v @ self.b).relu(), (x,))


def executorch_runner(ep: torch.export.ExportedProgram) -> Callable[[torch.Tensor], Any]:
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    pte = to_edge_transform_and_lower(hop.deploy.for_executorch(ep)).to_executorch()
    program = Runtime.get().load_program(pte.buffer)
    method = program.load_method("forward")

    def run(x: torch.Tensor, _program: Any = program) -> Any:  # the method needs its program alive
        return method.execute([x])[0]

    return run


def aoti_runner(ep: torch.export.ExportedProgram, folder: str) -> Callable[[torch.Tensor], Any]:
    path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{folder}/model.pt2")
    return torch._inductor.aoti_load_package(path)  # type: ignore[no-any-return]


def main() -> None:
    torch.set_num_threads(1)
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        for name, model, x in (
            (f"scan, {STEPS} steps", Rnn(), torch.randn(STEPS, WIDTH)),
            ("cond", Branch(), torch.randn(8, WIDTH)),
        ):
            ep = torch.export.export(model, (x,))
            runners = {"eager hop": model, "AOTInductor": aoti_runner(ep, folder), "ExecuTorch": executorch_runner(ep)}
            want = model(x)
            rows = []
            for label, run in runners.items():
                torch.testing.assert_close(run(x), want)
                us = per_call_us(lambda run=run, x=x: run(x), number=200, repeat=10, timer=time.process_time)
                rows.append((label, us))
            report(f"{name}: us per call", rows, "eager hop")


if __name__ == "__main__":
    main()
