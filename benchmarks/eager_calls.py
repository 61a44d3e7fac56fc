"""One small eager call per operator, in us per call (best of 15 runs), as one JSON line.

For comparing two trees of hop in one run (a refactoring must leave these alone):
``PYTHONPATH=<tree> python benchmarks/eager_calls.py``, the trees taking turns in
fresh processes; benchmarks/results.md has such a comparison.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

import hop


def per_call_us(fn: Callable[[], Any], number: int, repeat: int = 15) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def solve_with_a_helper(y: torch.Tensor, k: float) -> torch.Tensor:
    """An adaptive step whose branches read a helper defined here: new objects per call."""

    def rhs(v: torch.Tensor) -> torch.Tensor:
        return -k * v

    def step(t: torch.Tensor, h: torch.Tensor, v: torch.Tensor) -> Any:
        trial = v + h * rhs(v)
        err = (trial - (v + 0.5 * h * (rhs(v) + rhs(trial)))).abs().max()
        return hop.cond(err < 1e-3, lambda: (t + h, h * 1.2, trial), lambda: (t, h * 0.5, v), ())

    return hop.while_loop(lambda t, h, v: t < 1.0, step, (torch.tensor(0.0), torch.tensor(0.1), y))[2]


def python_solve(y: torch.Tensor, k: float) -> torch.Tensor:
    with hop.testing.reference():
        return solve_with_a_helper(y, k)


def main() -> None:
    torch.set_num_threads(1)
    x, xs, k = torch.randn(4), torch.randn(10, 4), torch.tensor(1)
    w = torch.randn(4, requires_grad=True)
    branches = [torch.sin, torch.cos, torch.tanh]
    calls: dict[str, tuple[Callable[[], Any], int]] = {
        "cond": (lambda: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,)), 2000),
        "python if": (lambda: torch.sin(x) if x.sum() > 0 else torch.cos(x), 2000),
        "switch": (lambda: hop.switch(k, branches, (x,)), 2000),
        "cond grad fwd": (lambda: hop.cond(x.sum() > 0, lambda a: a * w, lambda a: a - w, (x,)), 1000),
        "while_loop 10": (lambda: hop.while_loop(lambda i, v: i < 10, lambda i, v: (i + 1, v * 0.5), (0, x)), 300),
        "fori_loop 10": (lambda: hop.fori_loop(0, 10, lambda i, v: v * 0.5, x), 300),
        "scan 10": (lambda: hop.scan(lambda c, a: (c + a, c * a), x, xs), 300),
        "map 10": (lambda: hop.map(lambda a: a.sin(), xs), 300),
        "associative_scan 10": (lambda: hop.associative_scan(lambda a, b: a + b, xs, 0), 300),
        "solver with a helper": (lambda: solve_with_a_helper(x, 2.0), 10),
        "python solver": (lambda: python_solve(x, 2.0), 10),
    }
    print(json.dumps({name: per_call_us(fn, number) for name, (fn, number) in calls.items()}))


if __name__ == "__main__":
    main()
