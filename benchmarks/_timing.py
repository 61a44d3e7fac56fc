"""Timing helpers shared by the benchmarks: best-of-N medians, in microseconds."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Any


def per_call_us(fn: Callable[[], Any], *, number: int = 2000, repeat: int = 15) -> float:
    """Median over ``repeat`` runs of the mean time of ``number`` calls, in us."""
    fn()  # warm up (first-call costs are measured separately)
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def report(title: str, rows: list[tuple[str, float]], baseline: str) -> None:
    """Print rows as us and as a ratio to the row named ``baseline``."""
    base = dict(rows)[baseline]
    print(f"\n{title}")
    for name, us in rows:
        print(f"  {name:<44} {us:9.2f} us   {us / base:6.2f}x")
