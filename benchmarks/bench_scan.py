"""hop.map / hop.scan / hop.associative_scan against the Python loop and torch's HOPs, in one run.

Targets (issue 5): eager map and scan over 100 slices of a tiny tensor at most 1.5x
the Python loop + ``torch.stack``; the backward of a 100-step scan at most 1.5x the
backward of the Python loop. torch's ``torch._higher_order_ops`` scan / map are
timed where they run (their eager path compiles with Dynamo: the first call is
reported separately).
Run: ``python benchmarks/bench_scan.py`` (``--quick`` skips torch's HOPs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop

N = 100


def f(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = c * 0.5 + x
    return c, c.cos()


def python_map(xs: torch.Tensor) -> torch.Tensor:
    return torch.stack([f(x) for x in xs])


def python_scan(init: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    carry, ys = init, []
    for x in xs:
        carry, y = step(carry, x)
        ys.append(y)
    return carry, torch.stack(ys)


def _first_call_ms(fn: Callable[[], Any]) -> float:
    torch._dynamo.reset()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def torch_hops(xs: torch.Tensor, init: torch.Tensor) -> list[tuple[str, Callable[[], Any]]]:
    """torch's own map / scan where they run on this build (they compile in eager)."""
    rows: list[tuple[str, Callable[[], Any]]] = []
    try:
        from torch._higher_order_ops.map import map as torch_map

        torch_map(f, xs)
        rows.append(("torch._higher_order_ops.map(f, xs)", lambda: torch_map(f, xs)))
    except Exception as e:  # a torch build where it does not run: report and go on
        print(f"  (torch map does not run here: {type(e).__name__})")
    try:
        from torch._higher_order_ops.scan import scan as torch_scan

        def torch_step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = c * 0.5 + x
            return c, c.cos()

        torch_scan(torch_step, init, xs)
        rows.append(("torch._higher_order_ops.scan(step, init, xs)", lambda: torch_scan(torch_step, init, xs)))
    except Exception as e:
        print(f"  (torch scan does not run here: {type(e).__name__})")
    return rows


def steady_state(quick: bool) -> None:
    xs, init = torch.randn(N, 8), torch.randn(8)
    number, repeat = 200, 15
    rows = [
        ("python: torch.stack([f(x) for x in xs])", per_call_us(lambda: python_map(xs), number=number, repeat=repeat)),
        ("hop.map(f, xs)", per_call_us(lambda: hop.map(f, xs), number=number, repeat=repeat)),
    ]
    hops = [] if quick else torch_hops(xs, init)
    rows += [(name, per_call_us(fn, number=5, repeat=3)) for name, fn in hops if ".map" in name]
    report(f"eager map over {N} slices of 8 floats", rows, baseline=rows[0][0])
    rows = [
        ("python: loop + torch.stack", per_call_us(lambda: python_scan(init, xs), number=number, repeat=repeat)),
        ("hop.scan(step, init, xs)", per_call_us(lambda: hop.scan(step, init, xs), number=number, repeat=repeat)),
        (
            "hop.scan(..., reverse=True)",
            per_call_us(lambda: hop.scan(step, init, xs, reverse=True), number=number, repeat=repeat),
        ),
    ]
    rows += [(name, per_call_us(fn, number=5, repeat=3)) for name, fn in hops if ".scan" in name]
    report(f"eager scan over {N} slices of 8 floats", rows, baseline=rows[0][0])


def backward() -> None:
    xs, init = torch.randn(N, 8, requires_grad=True), torch.randn(8, requires_grad=True)

    def run(fn: Callable[..., Any]) -> Callable[[], Any]:
        def go() -> Any:
            carry, ys = fn(step, init, xs)
            return torch.autograd.grad(carry.sum() + ys.sum(), (init, xs))

        return go

    def python(fn: Any, i: torch.Tensor, x: torch.Tensor) -> Any:
        return python_scan(i, x)

    rows = [
        ("python: loop forward + backward", per_call_us(run(python), number=50, repeat=10)),
        ("hop.scan forward + backward", per_call_us(run(hop.scan), number=50, repeat=10)),
    ]
    report(f"forward + backward of a {N}-step scan", rows, baseline=rows[0][0])


def associative() -> None:
    xs = torch.randn(1024, 16)
    a, b = torch.rand(1024, 16), torch.randn(1024, 16)

    def linear(lhs: Any, rhs: Any) -> Any:
        return lhs[0] * rhs[0], rhs[0] * lhs[1] + rhs[1]

    def python_recurrence() -> torch.Tensor:
        h, hs = torch.zeros(16), []
        for t in range(a.shape[0]):
            h = a[t] * h + b[t]
            hs.append(h)
        return torch.stack(hs)

    rows = [
        ("torch.cumsum(xs, 0)", per_call_us(lambda: xs.cumsum(0), number=200, repeat=10)),
        (
            "hop.associative_scan(add, xs, 0)  (pointwise)",
            per_call_us(lambda: hop.associative_scan(torch.add, xs, 0), number=50, repeat=10),
        ),
        (
            "hop.associative_scan(add, xs, 0, combine_mode='generic')",
            per_call_us(lambda: hop.associative_scan(torch.add, xs, 0, combine_mode="generic"), number=20, repeat=5),
        ),
    ]
    report("associative scan over 1024 slices of 16 floats", rows, baseline=rows[0][0])
    rows = [
        ("python loop: h = a[t] * h + b[t]", per_call_us(python_recurrence, number=10, repeat=5)),
        (
            "hop.associative_scan(linear, (a, b), 0)",
            per_call_us(lambda: hop.associative_scan(linear, (a, b), 0), number=50, repeat=10),
        ),
    ]
    report("linear recurrence over 1024 steps", rows, baseline=rows[0][0])


def first_call(quick: bool) -> None:
    xs, init = torch.randn(N, 8), torch.randn(8)

    def new_step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return c + x, c * x

    rows = [("hop.scan first call", _first_call_ms(lambda: hop.scan(new_step, init, xs)))]
    if not quick:
        from torch._higher_order_ops.scan import scan as torch_scan

        def torch_step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return c + x, c * x

        rows.append(
            ("torch._higher_order_ops.scan first call", _first_call_ms(lambda: torch_scan(torch_step, init, xs)))
        )
    report("first call", rows, baseline=rows[0][0], unit="ms")


def main() -> None:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    steady_state(quick)
    backward()
    associative()
    first_call(quick)


if __name__ == "__main__":
    main()
