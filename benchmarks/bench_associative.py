"""A linear recurrence ``h[t] = a[t] h[t - 1] + b[t]`` by ``associative_scan``, forward and
backward, at (2, 16, L, 8) scanned along L = 1024: hop's backward in log depth (Note [a
parallel backward for an elementwise combine]) against hop's sequential backward (the
derivative of the sequential scan, which it was), torch's ``associative_scan`` and
``jax.lax.associative_scan`` under ``jax.jit`` (a benchmark-only peer: its rows are
skipped where jax is not installed), one thread, values and gradients checked equal,
in one run. Compiled rows use ``torch.compile(fullgraph=True)`` with Inductor.

Run: ``python benchmarks/bench_associative.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch._higher_order_ops.associative_scan import associative_scan as torch_associative_scan

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop
from hop.ops.scanning import _parallel_derivatives

SHAPE, DIM = (2, 16, 1024, 8), 2


def linear(lhs: Any, rhs: Any) -> Any:
    (a1, b1), (a2, b2) = lhs, rhs
    return a1 * a2, a2 * b1 + b2


def hop_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return hop.associative_scan(linear, (a, b), DIM)[1]  # type: ignore[no-any-return]


def torch_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch_associative_scan(linear, (a, b), DIM, combine_mode="generic")[1]  # type: ignore[no-any-return]


def python_recurrence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h, out = b.select(DIM, 0), [b.select(DIM, 0)]
    for t in range(1, a.shape[DIM]):
        h = a.select(DIM, t) * h + b.select(DIM, t)
        out.append(h)
    return torch.stack(out, DIM)


def training_step(fn: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> Any:
    return torch.autograd.grad(fn(a, b), (a, b), g)


def per_call(fn: Callable[[], Any]) -> float:
    return per_call_us(fn, number=5, repeat=5, timer=time.process_time) / 1000


def sequential_backward() -> Any:
    """hop as it was: every combine_fn differentiated as the sequential scan."""
    return mock.patch.object(_parallel_derivatives, "carry_pattern", lambda *args: None)


def jax_rows(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, want: Any) -> list[tuple[str, float]]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return []

    def jlinear(lhs: Any, rhs: Any) -> Any:
        (a1, b1), (a2, b2) = lhs, rhs
        return a1 * a2, a2 * b1 + b2

    def loss(a: Any, b: Any, g: Any) -> Any:
        return (jax.lax.associative_scan(jlinear, (a, b), axis=DIM)[1] * g).sum()

    forward = jax.jit(lambda a, b: jax.lax.associative_scan(jlinear, (a, b), axis=DIM)[1])
    both = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = [jnp.asarray(t.detach().numpy()) for t in (a, b, g)]
    got = both(*args)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(jax.device_get(x).copy()), y, rtol=1e-4, atol=1e-4)
    return [
        ("jax.lax.associative_scan, jit, forward", per_call(lambda: jax.block_until_ready(forward(*args[:2])))),
        ("jax.lax.associative_scan, jit, forward + backward", per_call(lambda: jax.block_until_ready(both(*args)))),
    ]


def main() -> None:
    torch.set_num_threads(1)
    # the same forward graph compiles to another backward with the sequential rows: no caches
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(0)
    a = (torch.rand(SHAPE) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(SHAPE).requires_grad_()
    g = torch.randn(SHAPE)
    ad, bd = a.detach(), b.detach()
    want = training_step(python_recurrence, a, b, g)
    rows: list[tuple[str, float]] = []

    def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        torch._dynamo.reset()
        return torch.compile(fn, backend="inductor", fullgraph=True)

    def train_rows(name: str, fn: Callable[..., torch.Tensor]) -> None:
        torch.testing.assert_close(training_step(fn, a, b, g), want, rtol=1e-4, atol=1e-4)
        rows.append((f"{name}, forward", per_call(lambda: fn(ad, bd))))
        rows.append((f"{name}, forward + backward", per_call(lambda: training_step(fn, a, b, g))))

    train_rows("hop, inductor", compiled(hop_recurrence))
    with sequential_backward():
        train_rows("hop sequential backward, inductor", compiled(hop_recurrence))
    train_rows("torch associative_scan, inductor", compiled(torch_recurrence))
    train_rows("hop, eager", hop_recurrence)
    with sequential_backward():
        # eager runs the parallel prefix's own ops under autograd; traced (make_fx), the node
        traced = torch.fx.experimental.proxy_tensor.make_fx(
            lambda a, b, g: training_step(hop_recurrence, a, b, g), tracing_mode="fake"
        )(a, b, g)
        rows.append(("hop sequential backward, traced, forward + backward", per_call(lambda: traced(a, b, g))))
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda a, b, g: training_step(hop_recurrence, a, b, g), tracing_mode="fake"
    )(a, b, g)
    torch.testing.assert_close(list(traced(a, b, g)), list(want), rtol=1e-4, atol=1e-4)
    rows.append(("hop, traced, forward + backward", per_call(lambda: traced(a, b, g))))
    rows += jax_rows(a, b, g, want)
    report(
        f"ms per call: a linear recurrence over {SHAPE}, scanned along dim {DIM}",
        rows,
        "hop, inductor, forward + backward",
        unit="ms",
    )


if __name__ == "__main__":
    main()
