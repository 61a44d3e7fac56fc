"""Shared test setup: hypothesis profiles and the state-leak guard."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# gloo (tests/test_distributed.py, docs/distributed.md's example) binds to the
# loopback device: finding one from the machine's hostname can hang a CI worker.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# CI runs a bounded, deterministic profile; HYPOTHESIS_PROFILE=long runs thousands by hand.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def dispatch_state() -> tuple[object, ...]:
    """Everything a leaked guard, mode or transform would change."""
    return (
        torch._C._len_torch_dispatch_stack(),
        torch._ops._len_torch_dispatch_stack_pre_dispatch(),
        str(torch._C._dispatch_tls_local_include_set()),
        str(torch._C._dispatch_tls_local_exclude_set()),
        torch._C._functorch.maybe_current_level(),
        torch._C._is_torch_function_mode_enabled(),
        torch.is_grad_enabled(),
        torch._C._is_fwd_grad_enabled(),
        torch.is_autocast_cache_enabled(),  # torch's legacy ONNX exporter leaves it off when it raises
        torch._C._get_tracing_state() is None,  # torch.jit.trace's tracer
    )


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test draws the same random tensors on every run (compiled float32 results
    are compared with eager ones: a rare draw sits where they round apart)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def no_state_leak() -> Iterator[None]:
    """Every test must leave torch's dispatch state as it found it."""
    before = dispatch_state()
    yield
    assert dispatch_state() == before
