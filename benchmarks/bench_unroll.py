"""Loop controls compiled: a scan of a tiny step at L = 256 with ``unroll`` 1, 4, 16 and
the whole loop, against the Python loop compiled by Inductor (Dynamo unrolls it) and
against ``jax.lax.scan(..., unroll=k)`` under ``jax.jit`` (a benchmark-only peer: its
rows are skipped where jax is not installed), one thread, values checked equal, in one
run. Also ``fori_loop(..., unroll=k)`` on the in-place state loop of bench_state.py.

Run: ``python benchmarks/bench_unroll.py``.
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
from bench_state import ROW, STEPS, python_loop_in_place, work

import hop

L, D = 256, 8


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tanh(c * 0.9 + x)
    return c, c.sum()


def hop_scan(unroll: int | bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    return lambda c, xs: hop.scan(step, c, xs, unroll=unroll)


def python_scan(c: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ys = []
    for i in range(L):
        c, y = step(c, xs[i])
        ys.append(y)
    return c, torch.stack(ys)


def per_call(fn: Callable[..., Any], *args: Any) -> float:
    return per_call_us(lambda: fn(*args), number=20, repeat=10, timer=time.process_time)


def jax_rows(c: torch.Tensor, xs: torch.Tensor, want: Any) -> list[tuple[str, float]]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return []

    def jstep(c: Any, x: Any) -> Any:
        c = jnp.tanh(c * 0.9 + x)
        return c, c.sum()

    rows = []
    for unroll in (1, 4, 16, True):
        run = jax.jit(lambda c, xs, u=unroll: jax.lax.scan(jstep, c, xs, unroll=u))
        args = (jnp.asarray(c.numpy()), jnp.asarray(xs.numpy()))
        got = run(*args)
        torch.testing.assert_close(torch.from_numpy(jax.device_get(got[1]).copy()), want[1], rtol=1e-5, atol=1e-5)
        timed = lambda run=run, args=args: jax.block_until_ready(run(*args))  # noqa: E731
        rows.append((f"jax.lax.scan, jit, unroll={unroll}", per_call(timed)))
    return rows


def fori_rows() -> list[tuple[str, float]]:
    w, v = torch.randn(ROW, ROW) / ROW**0.5, torch.randn(ROW)
    rows = []

    def in_place(unroll: int) -> Callable[..., Any]:
        def loop(buffer: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            def body(i: Any, v: torch.Tensor) -> torch.Tensor:
                v = work(v, w)
                buffer.index_copy_(0, torch.as_tensor(i).reshape(1), v[None])
                return v

            return hop.fori_loop(0, STEPS, body, v, unroll=unroll)

        return loop

    for unroll in (1, 4, 8):
        buffer, want = torch.zeros(256, ROW), torch.zeros(256, ROW)
        torch._dynamo.reset()
        compiled = torch.compile(in_place(unroll), backend="inductor", fullgraph=True)
        compiled(buffer, v, w)
        python_loop_in_place(want, v, w)
        torch.testing.assert_close(buffer, want)
        rows.append((f"hop fori_loop in place, unroll={unroll}", per_call(compiled, buffer, v, w) / STEPS))
    torch._dynamo.reset()
    unrolled = torch.compile(python_loop_in_place, backend="inductor", fullgraph=True)
    unrolled(torch.zeros(256, ROW), v, w)
    rows.append(("python for in place (unrolled)", per_call(unrolled, torch.zeros(256, ROW), v, w) / STEPS))
    return rows


def main() -> None:
    torch.set_num_threads(1)
    c, xs = torch.randn(D), torch.randn(L, D)
    want = python_scan(c, xs)
    rows: list[tuple[str, float]] = []
    for unroll in (1, 4, 16, True):
        torch._dynamo.reset()
        compiled = torch.compile(hop_scan(unroll), backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(c, xs), want)
        rows.append((f"hop scan, inductor, unroll={unroll}", per_call(compiled, c, xs)))
    torch._dynamo.reset()
    unrolled = torch.compile(python_scan, backend="inductor", fullgraph=True)
    torch.testing.assert_close(unrolled(c, xs), want)
    rows.append(("python for (unrolled), inductor", per_call(unrolled, c, xs)))
    rows += jax_rows(c, xs, want)
    report(f"us per call: a scan of {L} tiny steps (carry of {D})", rows, "hop scan, inductor, unroll=1")
    title = f"us per step: {STEPS} steps writing one row of {ROW} in place"
    report(title, fori_rows(), "hop fori_loop in place, unroll=1")


if __name__ == "__main__":
    main()
