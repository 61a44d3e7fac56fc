"""Timing helpers shared by the benchmarks: min over repeats of per-call means, in us."""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable
from typing import Any


def per_call_us(
    fn: Callable[[], Any], *, number: int = 2000, repeat: int = 25, timer: Callable[[], float] = time.perf_counter
) -> float:
    """Best of ``repeat`` runs of the mean time of ``number`` calls, in us.

    The minimum is the least noisy estimate on a shared machine: noise only adds.
    ``timer=time.process_time`` counts this process's CPU time only (single-threaded
    torch), which other processes on a busy machine disturb less than wall time.
    """
    fn()  # warm up (first-call costs are measured separately)
    runs = timeit.Timer(fn, timer=timer).repeat(number=number, repeat=repeat)
    return min(runs) / number * 1e6


def report(title: str, rows: list[tuple[str, float]], baseline: str, unit: str = "us") -> None:
    """Print rows and each one's ratio to the row named ``baseline``."""
    base = dict(rows)[baseline]
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<52} {value:10.2f} {unit}   {value / base:7.2f}x")
