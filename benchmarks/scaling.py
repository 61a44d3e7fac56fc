"""How hop's loops scale with the number of steps n, and torch.export with nesting depth (issue 13).

Table 1: for while_loop, fori_loop, scan, map and associative_scan, on a (4, 8) carry
and an (8, 8) weight (``y = tanh(y @ W)`` per step, or its scan / map / recurrence
twin), the time of: eager forward, exported-module forward (``ep.module()``), eager
forward + backward, and the training step traced by ``make_fx(tracing_mode="fake")``
then run (forward + backward), at n = 25, 100, 400, 1600. Forward times are ratios to
the Python loop's forward at the same n, forward + backward times to the Python
loop's forward + backward; "growth" is the time at 4n over the time at n (4 is
linear). Times are this process's CPU time (torch on one thread), best of a few
runs, so that other processes on a shared machine disturb them less. Targets: a
traced while_loop's forward + backward at most 3x the eager one at n = 400 and
1600, growing at most 4.5x per 4x of n; no row growing faster than linearly.

Table 2: torch.export time of cond in while_loop in scan (depth 1: cond; 2: a
while_loop around it; 3: a scan around that; 4: a cond around that), hop against
torch's own operators where torch exports them.

Run: ``python benchmarks/scaling.py`` (a few minutes; ``--quick`` stops at n = 400).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us

import hop

Fn = Callable[..., Any]
W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) * 0.3
Y0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@dataclasses.dataclass
class Program:
    """One loop written with hop and as the Python loop; ``inputs(n)``: its arguments,
    the first two (the initial carry or xs, and W) differentiated."""

    name: str
    python: Fn
    hop: Fn
    inputs: Callable[[int], tuple[Any, ...]]
    static_n: bool = False  # n is a Python int baked into the traced program (one trace per n)


def _xs(n: int) -> torch.Tensor:
    return torch.randn(n, 4, 8, generator=torch.Generator().manual_seed(n)) * 0.1


def py_while(y: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    i = torch.zeros((), dtype=torch.int64)
    while i < n:
        i, y = i + 1, torch.tanh(y @ w)
    return y


def hop_while(y: torch.Tensor, w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    i0 = torch.zeros((), dtype=torch.int64)
    return hop.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, torch.tanh(y @ w)), (i0, y))[1]  # type: ignore[no-any-return]


def py_fori(y: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        y = torch.tanh(y @ w)
    return y


def hop_fori(y: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    return hop.fori_loop(0, n, lambda i, y: torch.tanh(y @ w), y)  # type: ignore[no-any-return]


def py_scan(y: torch.Tensor, w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    ys = []
    for x in xs:
        y = torch.tanh(y @ w + x)
        ys.append(y)
    return torch.stack(ys)


def hop_scan(y: torch.Tensor, w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.tanh(c @ w + x)
        return c, c

    return hop.scan(step, y, xs)[1]  # type: ignore[no-any-return]


def py_map(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.tanh(x @ w) for x in xs])


def hop_map(xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return hop.map(lambda x: torch.tanh(x @ w), xs)  # type: ignore[no-any-return]


def py_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h, hs = torch.zeros_like(b[0]), []
    for t in range(a.shape[0]):
        h = a[t] * h + b[t]
        hs.append(h)
    return torch.stack(hs)


def hop_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def linear(lhs: Any, rhs: Any) -> Any:
        return lhs[0] * rhs[0], rhs[0] * lhs[1] + rhs[1]

    return hop.associative_scan(linear, (a, b), 0)[1]  # type: ignore[no-any-return]


PROGRAMS = [
    Program("while_loop", py_while, hop_while, lambda n: (Y0, W, torch.tensor(n))),
    Program("fori_loop", py_fori, hop_fori, lambda n: (Y0, W, n), static_n=True),
    Program("scan", py_scan, hop_scan, lambda n: (Y0, W, _xs(n))),
    Program("map", py_map, hop_map, lambda n: (_xs(n), W)),
    Program("associative_scan", py_recurrence, hop_recurrence, lambda n: (torch.rand(n, 4, 8), _xs(n))),
]


def training_step(fn: Fn) -> Fn:
    """Gradients of ``fn(*args).sum()`` wrt its first two arguments."""

    def step(*args: Any) -> tuple[torch.Tensor, ...]:
        a, b = args[0].detach().requires_grad_(), args[1].detach().requires_grad_()
        return torch.autograd.grad(fn(a, b, *args[2:]).sum(), (a, b))

    return step


class Forward(torch.nn.Module):
    def __init__(self, fn: Fn, *baked: Any) -> None:
        super().__init__()
        self.fn, self.baked = fn, baked

    def forward(self, *args: Any) -> Any:
        return self.fn(*args, *self.baked)


def _compiled(p: Program, n: int) -> tuple[Fn, Fn]:
    """The exported forward's module and the traced training step, for ``p`` at ``n``."""
    args = p.inputs(n)
    tensors, baked = (args[:2], args[2:]) if p.static_n else (args, ())
    ep = torch.export.export(Forward(p.hop, *baked), tuple(tensors))
    step = training_step(p.hop)
    traced = make_fx(lambda *a: step(*a, *baked), tracing_mode="fake")(*tensors)
    exported = ep.module()
    return (lambda: exported(*tensors)), (lambda: traced(*tensors))


def measure(p: Program, n: int) -> dict[str, float]:
    """Seconds per call of each column (best of a few runs: noise only adds)."""
    args = p.inputs(n)
    exported, traced = _compiled(p, n)
    reps = max(2, min(20, 4000 // n))

    def t(fn: Fn) -> float:
        return per_call_us(fn, number=1, repeat=reps, timer=time.process_time) / 1e6

    return {
        "python fwd": t(lambda: p.python(*args)),
        "eager fwd": t(lambda: p.hop(*args)),
        "exported fwd": t(exported),
        "python fwd+bwd": t(lambda: training_step(p.python)(*args)),
        "eager fwd+bwd": t(lambda: training_step(p.hop)(*args)),
        "traced fwd+bwd": t(traced),
    }


ROWS = [  # (label, column, baseline column)
    ("python loop fwd (ms)", "python fwd", None),
    ("eager fwd / python", "eager fwd", "python fwd"),
    ("exported fwd / python", "exported fwd", "python fwd"),
    ("python loop fwd+bwd (ms)", "python fwd+bwd", None),
    ("eager fwd+bwd / python", "eager fwd+bwd", "python fwd+bwd"),
    ("traced fwd+bwd / python", "traced fwd+bwd", "python fwd+bwd"),
    ("traced fwd+bwd / eager fwd+bwd", "traced fwd+bwd", "eager fwd+bwd"),
]


def scaling_table(ns: list[int]) -> None:
    growth_head = "  ".join(f"{a}->{b}" for a, b in itertools.pairwise(ns))
    print(f"\n{'':34}" + "".join(f"{'n=' + str(n):>9}" for n in ns) + f"   growth of the time per 4x n ({growth_head})")
    for p in PROGRAMS:
        times = {n: measure(p, n) for n in ns}
        print(p.name)
        for label, col, base in ROWS:
            if base is None:
                cells = [times[n][col] * 1e3 for n in ns]
            else:
                cells = [times[n][col] / times[n][base] for n in ns]
            growth = [times[b][col] / times[a][col] for a, b in itertools.pairwise(ns)]
            line = f"  {label:<32}" + "".join(f"{c:9.2f}" for c in cells)
            print(line + "   " + "  ".join(f"{g:7.2f}" for g in growth))


# --- torch.export against nesting depth ---------------------------------------------------------------


def nested(lib: Any, depth: int) -> Fn:
    """cond (depth 1), in a while_loop (2), in a scan (3), in a cond (4); ``x`` of shape (4, 8)."""

    def level1(x: torch.Tensor) -> torch.Tensor:
        return lib.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))  # type: ignore[no-any-return]

    def level2(x: torch.Tensor) -> torch.Tensor:
        i0 = torch.zeros((), dtype=torch.int64)
        return lib.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, level1(v) * 0.9), (i0, x))[1]  # type: ignore[no-any-return]

    def level3(x: torch.Tensor) -> torch.Tensor:
        return lib.scan(lambda c, r: (level2(c + r), c.sum(0)), x[0], x)[1]  # type: ignore[no-any-return]

    def level4(x: torch.Tensor) -> torch.Tensor:
        return lib.cond(x.mean() > 0, lambda v: level3(v), lambda v: level3(-v), (x,))  # type: ignore[no-any-return]

    return [level1, level2, level3, level4][depth - 1]


def _torch_scan(fn: Fn, init: Any, xs: Any) -> Any:
    from torch._higher_order_ops.scan import scan

    return scan(fn, init, xs)


def _torch_while_loop(cond_fn: Fn, body_fn: Fn, carried: Any) -> Any:
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop(cond_fn, body_fn, carried)


HOP = type(
    "Lib",
    (),
    {"cond": staticmethod(hop.cond), "while_loop": staticmethod(hop.while_loop), "scan": staticmethod(hop.scan)},
)
TORCH = type(
    "Lib",
    (),
    {
        "cond": staticmethod(torch.cond),
        "while_loop": staticmethod(_torch_while_loop),
        "scan": staticmethod(_torch_scan),
    },
)


def export_seconds(lib: Any, depth: int) -> str:
    x = torch.randn(4, 8)
    module = Forward(nested(lib, depth))
    best = float("inf")
    for _ in range(2):
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            ep = torch.export.export(module, (x,))
        except Exception as e:  # torch's twin where it does not export: say why and go on
            return f"fails ({type(e).__name__})"
        best = min(best, time.perf_counter() - start)
    torch.testing.assert_close(ep.module()(x), module(x))
    return f"{best:.2f} s"


def export_table() -> None:
    print("\ntorch.export time against nesting depth (cond in while_loop in scan in cond)")
    print(f"  {'depth':<6}{'hop':>14}{'torch':>24}")
    for depth in range(1, 5):
        print(f"  {depth:<6}{export_seconds(HOP, depth):>14}{export_seconds(TORCH, depth):>24}")


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ns = [25, 100, 400] if "--quick" in sys.argv else [25, 100, 400, 1600]
    start = time.perf_counter()
    scaling_table(ns)
    export_table()
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
