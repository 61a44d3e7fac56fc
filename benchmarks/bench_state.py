"""State inside a compiled loop: the cost of writing one row per step into a large buffer.

A ``fori_loop`` whose body writes one row of 64 floats into a buffer of N rows and does
a small fixed amount of other work, compiled with Inductor, in two forms: the buffer
carried and written out of place (``index_copy``), and a buffer the body closes over,
written in place (``index_copy_``, docs/state.md). Measured per step at N = 256, 4096
and 65536, and against the same Python ``for`` loop compiled by Inductor (Dynamo
unrolls it), in one run.

Targets (the issue on state inside control flow): per-step time at N = 65536 within
1.3x of N = 256 (a write costs the slice written, not the buffer), and hop at most
1.0x the unrolled Python loop at 200 steps. Run: ``python benchmarks/bench_state.py``.
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

ROW, STEPS = 64, 200


def work(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The step's other work: a small fixed amount (a 64x64 matvec and a tanh)."""
    return torch.tanh(v @ w)


def hop_loop(buffer: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def body(i: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        buf, v = carry
        v = work(v, w)
        return buf.index_copy(0, i.reshape(1), v[None]), v

    return hop.fori_loop(torch.tensor(0), torch.tensor(STEPS), body, (buffer, v))


def hop_loop_in_place(buffer: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        v = work(v, w)
        buffer.index_copy_(0, i.reshape(1), v[None])
        return v

    return hop.fori_loop(torch.tensor(0), torch.tensor(STEPS), body, v)


def python_loop_in_place(buffer: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for i in range(STEPS):
        v = work(v, w)
        buffer[i] = v
    return v


def python_loop(buffer: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for i in range(STEPS):
        v = work(v, w)
        buffer = buffer.index_copy(0, torch.tensor([i]), v[None])
    return buffer, v


def per_step_us(fn: Callable[..., Any], *args: torch.Tensor) -> float:
    # CPU time of this (single-threaded) process: other load on the machine disturbs it less
    return per_call_us(lambda: fn(*args), number=5, repeat=10, timer=time.process_time) / STEPS


def main() -> None:
    torch.set_num_threads(1)
    w, v = torch.randn(ROW, ROW) / ROW**0.5, torch.randn(ROW)
    rows: list[tuple[str, float]] = []
    for n in (256, 4096, 65536):
        buffer = torch.zeros(n, ROW)
        torch._dynamo.reset()
        compiled = torch.compile(hop_loop, backend="inductor", fullgraph=True)
        got = compiled(buffer, v, w)
        torch.testing.assert_close(got[0], python_loop(buffer, v, w)[0])
        rows.append((f"hop fori_loop, inductor, N = {n}", per_step_us(compiled, buffer, v, w)))
    for n in (256, 4096, 65536):
        buffer, want = torch.zeros(n, ROW), torch.zeros(n, ROW)
        torch._dynamo.reset()
        compiled = torch.compile(hop_loop_in_place, backend="inductor", fullgraph=True)
        compiled(buffer, v, w)
        python_loop_in_place(want, v, w)
        torch.testing.assert_close(buffer, want)
        rows.append((f"hop fori_loop in place, inductor, N = {n}", per_step_us(compiled, buffer, v, w)))
    for name, loop in (("", python_loop), (" in place", python_loop_in_place)):
        buffer = torch.zeros(256, ROW)
        torch._dynamo.reset()
        unrolled = torch.compile(loop, backend="inductor", fullgraph=True)
        unrolled(buffer, v, w)
        rows.append((f"python for{name} (unrolled), inductor, N = 256", per_step_us(unrolled, buffer, v, w)))
    report(f"us per step ({STEPS} steps, one row of {ROW} written per step)", rows, "hop fori_loop, inductor, N = 256")


if __name__ == "__main__":
    main()
