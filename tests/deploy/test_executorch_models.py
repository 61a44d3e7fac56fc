"""The model zoo of tests/models through hop.deploy.for_executorch: each model exported
on its first case, rewritten, and run on the cases of that shape, in torch and (where
executorch is installed) in ExecuTorch's runtime, equal to eager."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_executorch import HAS_EXECUTORCH, _executorch_run, _flat

import hop.deploy

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))

MODELS = [
    "act_rnn",
    "adaptive_ode",
    "adaptive_rk",
    "early_exit",
    "greedy_decode",
    "implicit_newton",
    "kv_cache_decoder",
    "masked_lstm",
    "mcmc_chains",
    "mixture_of_experts",
    "rollout_reinforce",
    "selective_scan",
]
# torch's cond refuses the LSTM's branch output: its symbolic strides (Max(1, n), 1) are
# not proven dense, inside for_executorch's re-export
REFUSED_BY_TORCH = {"masked_lstm"}
# ExecuTorch 1.5.1's to_edge fails on the rewritten program (loudly): a data-dependent
# guard on an index read (early_exit), a lifted constant it does not find
# (implicit_newton), a scan it takes for aliasing after vmap's lowering (mcmc_chains)
REFUSED_BY_EXECUTORCH = {"early_exit", "implicit_newton", "mcmc_chains"}


def _make(name: str) -> tuple[torch.nn.Module, list[tuple[Any, ...]]]:
    module = importlib.import_module(f"test_{name}")
    model, cases = module.make("hop") if name in ("selective_scan", "implicit_newton") else module.make()
    return model, [c for c in cases if all(a.shape == b.shape for a, b in zip(c, cases[0], strict=True))]


def _marks(name: str) -> list[Any]:
    if name in REFUSED_BY_TORCH or (HAS_EXECUTORCH and name in REFUSED_BY_EXECUTORCH):
        return [pytest.mark.xfail(strict=True, reason="a loud failure of torch or ExecuTorch, see above")]
    return []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in MODELS])
def test_a_model_deploys_with_eager_values(name: str) -> None:
    model, cases = _make(name)
    ep = torch.export.export(model, cases[0])
    out = hop.deploy.for_executorch(ep, max_steps=4000)
    runs = [out.module()]
    if HAS_EXECUTORCH:
        runs.append(_executorch_run(out))
    for run in runs:
        for case in cases:
            want, got = _flat(model(*case)), _flat(run(*case))
            leaves = torch.utils._pytree.tree_leaves
            assert len(leaves(got)) == len(leaves(want))
            for g, w in zip(leaves(got), leaves(want), strict=True):
                torch.testing.assert_close(g, w)
