"""Dispatcher overhead: a trivial HOP whose dense kernel calls its callable once.

Target (issue 2): at most 3 us over calling the callable directly, on plain
eager CPU tensors. Run: ``python benchmarks/bench_dispatch.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch._C import DispatchKey

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop

bench_apply = hop.HigherOrderOperator("bench_apply")


@bench_apply.py_impl(DispatchKey.CompositeExplicitAutograd)
def bench_apply_dense(fn, *tensors):  # type: ignore[no-untyped-def]
    return fn(*tensors)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(8)
    fn = torch.sin

    def direct() -> torch.Tensor:
        return fn(x)

    def direct_below_autograd() -> torch.Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            return fn(x)

    def through_hop() -> torch.Tensor:
        return bench_apply(fn, x)

    def direct_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return fn(x)

    def through_hop_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return bench_apply(fn, x)

    rows = [
        ("fn(x)", per_call_us(direct)),
        ("fn(x) below autograd (what the kernel runs)", per_call_us(direct_below_autograd)),
        ("bench_apply(fn, x)", per_call_us(through_hop)),
        ("fn(x) under no_grad", per_call_us(direct_no_grad)),
        ("bench_apply(fn, x) under no_grad", per_call_us(through_hop_no_grad)),
    ]
    report("hop dispatcher overhead (torch.sin on 8 floats)", rows, baseline="fn(x)")
    overhead = dict(rows)["bench_apply(fn, x)"] - dict(rows)["fn(x)"]
    print(f"\n  overhead of hop's dispatch over calling fn directly: {overhead:.2f} us (target <= 3 us)")


if __name__ == "__main__":
    main()
