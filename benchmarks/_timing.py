"""Timing helpers shared by the benchmarks: min over repeats of per-call means, in us."""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any


def per_call_us(fn: Callable[[], Any], *, number: int = 2000, repeat: int = 25) -> float:
    """Best of ``repeat`` runs of the mean time of ``number`` calls, in us.

    The minimum is the least noisy estimate on a shared machine: noise only adds.
    """
    fn()  # warm up (first-call costs are measured separately)
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return min(runs) / number * 1e6


def report(title: str, rows: list[tuple[str, float]], baseline: str, unit: str = "us") -> None:
    """Print rows and each one's ratio to the row named ``baseline``."""
    base = dict(rows)[baseline]
    print(f"\n{title}")
    for name, value in rows:
        print(f"  {name:<52} {value:10.2f} {unit}   {value / base:7.2f}x")
