"""Scenarios run on several gloo ranks on 127.0.0.1, each rank's results saved for the
tests (tests/test_distributed.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Scenario = Callable[[str, int], Any]


def _worker(rank: int, port: int, folder: str, world: int, run: Scenario, names: Sequence[str]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run(name, rank)
        except Exception:  # reported by the test of that scenario
            results[name] = traceback.format_exc()
        dist.barrier()
    torch.save(results, Path(folder) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    run: Scenario, names: Sequence[str], *, world: int, timeout_s: float, folder: Path
) -> list[dict[str, Any]]:
    """``run(name, rank)`` for every scenario on each of ``world`` spawned ranks of one
    process group; per rank, each scenario's result or its traceback. Workers still
    running after ``timeout_s`` are killed and the caller's test fails."""
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    port = _free_port()
    args = (port, str(folder), world, run, list(names))
    procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    files = [folder / f"rank{r}.pt" for r in range(world)]
    if codes != [0] * world or not all(f.exists() for f in files):
        pytest.fail(f"the ranks did not finish within {timeout_s}s or failed: exit codes {codes}")
    return [torch.load(f, weights_only=False) for f in files]
