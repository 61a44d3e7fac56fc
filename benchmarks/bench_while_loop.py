"""hop.while_loop against a Python ``while`` and torch.while_loop, measured in one run.

Targets (issue 4): a 100-iteration eager loop on a tiny tensor at most 1.5x the
Python ``while``; its backward at most 1.5x the Python loop's backward; with
``checkpoint=True``, peak saved memory for n = 1024 iterations at most
4 * sqrt(n) carries. Issue 25: a traced ``fori_loop(0, 200, ...)`` with int bounds
(``y = tanh(y @ W)``, 4x16 @ 16x16) run eagerly, exported (``ep.module()``) and as a
``make_fx`` graph, at most 1.5x the Python loop; its traced forward + backward at
most 3x hop's eager forward + backward. Run: ``python benchmarks/bench_while_loop.py``
(``--quick`` skips torch.while_loop; ``--counted`` runs only the issue 25 tables).
"""

from __future__ import annotations

import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop


def cond(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return i < 100


def body(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return i + 1, x.sin() + 0.01


def python_loop(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    while cond(i, x):
        i, x = body(i, x)
    return i, x


def forward_and_backward(quick: bool) -> None:
    x = torch.randn(8)
    i = torch.tensor(0)
    rows = [
        ("python while (100 iterations)", per_call_us(lambda: python_loop(i, x), number=20, repeat=15)),
        (
            "hop.while_loop (100 iterations)",
            per_call_us(lambda: hop.while_loop(cond, body, (i, x)), number=20, repeat=15),
        ),
    ]
    if not quick:
        rows.append(
            (
                "torch.while_loop (100 iterations)",
                per_call_us(lambda: torch.while_loop(cond, body, (i, x)), number=3, repeat=3),
            )
        )
    report("eager forward, 8 floats", rows, baseline="python while (100 iterations)")

    xg = torch.randn(8, requires_grad=True)

    def py_backward() -> None:
        python_loop(i, xg)[1].sum().backward()

    def hop_backward() -> None:
        hop.while_loop(cond, body, (i, xg))[1].sum().backward()

    def hop_ckpt_backward() -> None:
        hop.while_loop(cond, body, (i, xg), checkpoint=True)[1].sum().backward()

    rows = [
        ("python while: forward + backward", per_call_us(py_backward, number=10, repeat=10)),
        ("hop.while_loop: forward + backward", per_call_us(hop_backward, number=10, repeat=10)),
        ("hop.while_loop(checkpoint=True): forward + backward", per_call_us(hop_ckpt_backward, number=10, repeat=10)),
    ]
    report("reverse mode, 100 iterations", rows, baseline="python while: forward + backward")


def peak_saved(fn: Any) -> int:
    live, peak = [0], [0]

    def dec() -> None:
        live[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        holder = t.detach()
        weakref.finalize(holder, dec)
        return holder

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return peak[0]


def memory() -> None:
    print("\npeak tensors saved for backward (carry-sized), body x.sin() + 0.01: one saved per iteration")
    print(f"  {'n':>6} {'python loop':>12} {'checkpoint=True':>16} {'4*sqrt(n)':>10}")
    for n in (64, 256, 1024, 4096):
        x = torch.randn(8, requires_grad=True)

        def run(checkpoint: bool, n: int = n, x: torch.Tensor = x) -> None:
            out = hop.while_loop(
                lambda i, v: i < n, lambda i, v: (i + 1, v.sin() + 0.01), (0, x), checkpoint=checkpoint
            )
            out[1].sum().backward()

        print(f"  {n:>6} {peak_saved(lambda: run(False)):>12} {peak_saved(lambda: run(True)):>16} {4 * n**0.5:>10.0f}")


W16 = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) * 0.3
Y16 = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
STEPS = 200


def py_counted(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(STEPS):
        y = torch.tanh(y @ w)
    return y


def hop_counted(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, STEPS, lambda i, v: torch.tanh(v @ w), y)  # type: ignore[no-any-return]


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(W16.clone())

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return hop_counted(y, self.w)


def train_step(fn: Any) -> Any:
    def step(y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, w = y.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(fn(y, w).sum(), (y, w))

    return step


def counted_loops() -> None:
    """Issue 25: a counted loop with static bounds, traced, against the Python loop."""
    y, w = Y16, W16
    exported = torch.export.export(Counted(), (y,)).module()
    traced = make_fx(hop_counted, tracing_mode="fake")(y, w)
    traced_step = make_fx(train_step(hop_counted), tracing_mode="fake")(y, w)
    for got in (exported(y), traced(y, w), hop_counted(y, w)):
        torch.testing.assert_close(got, py_counted(y, w))

    def t(fn: Any) -> float:  # CPU time of this process: other processes disturb it less
        return per_call_us(fn, number=5, repeat=15, timer=time.process_time)

    with torch.no_grad():
        rows = [
            (f"python for loop ({STEPS} steps)", t(lambda: py_counted(y, w))),
            ("hop.fori_loop, eager", t(lambda: hop_counted(y, w))),
            ("hop.fori_loop, torch.export: ep.module()", t(lambda: exported(y))),
            ("hop.fori_loop, make_fx graph", t(lambda: traced(y, w))),
        ]
    report("counted loop, static bounds: tanh(y @ W), 4x16 @ 16x16", rows, baseline=rows[0][0])
    rows = [
        ("python for loop: forward + backward", t(lambda: train_step(py_counted)(y, w))),
        ("hop.fori_loop, eager: forward + backward", t(lambda: train_step(hop_counted)(y, w))),
        ("hop.fori_loop, make_fx graph: forward + backward", t(lambda: traced_step(y, w))),
    ]
    report("counted loop, reverse mode (target: traced <= 3x hop eager)", rows, baseline=rows[1][0])


def main() -> None:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    if "--counted" in sys.argv:
        counted_loops()
        return
    forward_and_backward(quick)
    counted_loops()
    memory()


if __name__ == "__main__":
    main()
