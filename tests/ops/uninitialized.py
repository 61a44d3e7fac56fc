"""Checks that tracing never runs user code on uninitialized memory.

With torch's deterministic mode on, ``torch.empty`` fills float memory with NaN,
so a value a traced body receives that is read from a placeholder shows as NaN
instead of as whatever the allocator left there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx


def traced_with_nan_fill(fn: Callable[..., Any], mode: str, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    """make_fx of ``fn`` with uninitialized memory filled with NaN, in a thread joined with a
    generous bound: a loop run on placeholder values could spin instead of failing."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["gm"] = make_fx(fn, tracing_mode=mode)(*args)
        except Exception as e:  # re-raised below, in the test's thread
            result["error"] = e

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=300)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert not thread.is_alive(), "tracing did not finish"
    if "error" in result:
        raise result["error"]
    gm: torch.fx.GraphModule = result["gm"]
    return gm


def observer(seen: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """A function recording the real tensors it is given (eager, make_fx real), outside any trace."""

    def observe(w: torch.Tensor) -> None:
        if type(w) is torch.Tensor:
            with disable_proxy_modes_tracing():
                seen.append(w.detach().clone())

    return observe


def all_finite(seen: list[torch.Tensor]) -> bool:
    return all(bool(w.isfinite().all()) for w in seen)
