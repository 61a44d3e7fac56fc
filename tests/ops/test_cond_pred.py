"""cond's predicate kinds: bool tensors, numbers read as a Python ``if`` reads them, numpy.bool_."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopTypeError, HopValueError


def true_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def false_fn(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


def reference(pred: Any, x: torch.Tensor) -> torch.Tensor:
    return true_fn(x) if pred else false_fn(x)


NUMBER_PREDS = [
    torch.tensor(1),
    torch.tensor(0),
    torch.tensor([3]),
    torch.tensor([[-2]], dtype=torch.int8),
    torch.tensor(0.5),
    torch.tensor([0.0]),
    torch.tensor(0, dtype=torch.uint8),
    torch.tensor(1.0, dtype=torch.float64),
]


@pytest.mark.parametrize("pred", NUMBER_PREDS, ids=lambda p: f"{p.dtype}-{p.item()}")
def test_number_pred_eager_autograd_and_grad(pred: torch.Tensor) -> None:
    x = torch.randn(3, requires_grad=True)
    out = hop.cond(pred, true_fn, false_fn, (x,))
    torch.testing.assert_close(out, reference(pred, x))
    (g,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(reference(pred, x).sum(), x)
    torch.testing.assert_close(g, want)
    g2 = torch.func.grad(lambda v: hop.cond(pred, true_fn, false_fn, (v,)).sum())(x.detach())
    torch.testing.assert_close(g2, want)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
@pytest.mark.parametrize("pred", [torch.tensor(2), torch.tensor(0.0)], ids=["int", "float"])
def test_number_pred_traced(pred: torch.Tensor, mode: str) -> None:
    x = torch.randn(3)
    gm = make_fx(lambda p, v: hop.cond(p, true_fn, false_fn, (v,)), tracing_mode=mode)(pred, x)
    for p in (torch.tensor(0, dtype=pred.dtype), torch.tensor(7, dtype=pred.dtype)):
        torch.testing.assert_close(gm(p, x), reference(p, x))


def test_number_pred_exported_runs_both_ways_and_round_trips(tmp_path: Any) -> None:
    class M(torch.nn.Module):
        def forward(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return hop.cond(p, true_fn, false_fn, (x,))

    x = torch.randn(3)
    ep = torch.export.export(M(), (torch.tensor(3), x))
    assert any(n.target is torch.ops.hop.cond for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2")
    for p in (torch.tensor(0), torch.tensor(-4)):
        torch.testing.assert_close(loaded.module()(p, x), reference(p, x))
        torch.testing.assert_close(ep.run_decompositions().module()(p, x), reference(p, x))


def test_batched_number_pred_under_vmap() -> None:
    preds = torch.tensor([0, 5, -1, 0])
    xs = torch.randn(4, 3)
    out = torch.vmap(lambda p, v: hop.cond(p, true_fn, false_fn, (v,)))(preds, xs)
    torch.testing.assert_close(out, torch.stack([reference(p, v) for p, v in zip(preds, xs, strict=True)]))
    floats = preds.float() * 0.25
    out = torch.vmap(lambda p, v: hop.cond(p, true_fn, false_fn, (v,)))(floats, xs)
    torch.testing.assert_close(out, torch.stack([reference(p, v) for p, v in zip(floats, xs, strict=True)]))


def test_raw_op_takes_a_number_pred() -> None:
    x = torch.randn(3)
    for p in (torch.tensor(0), torch.tensor(2.0)):
        torch.testing.assert_close(torch.ops.hop.cond(p, true_fn, false_fn, (x,)), reference(p, x))


@pytest.mark.parametrize("pred", [np.bool_(True), np.bool_(False)])
def test_numpy_bool_pred(pred: Any) -> None:
    x = torch.randn(3)
    torch.testing.assert_close(hop.cond(pred, true_fn, false_fn, (x,)), reference(pred, x))


@pytest.mark.parametrize(
    ("pred", "error", "message"),
    [
        (None, HopTypeError, "pred must be a bool, a SymBool or a one-element tensor, got NoneType"),
        ("yes", HopTypeError, "pred must be a bool, a SymBool or a one-element tensor, got str"),
        (torch.tensor([1, 0]), HopValueError, r"pred must have exactly one element, got shape \(2,\)"),
        (torch.tensor([0.5, 1.0]), HopValueError, r"pred must have exactly one element, got shape \(2,\)"),
    ],
    ids=["None", "str", "int-vector", "float-vector"],
)
def test_still_refused(pred: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        hop.cond(pred, true_fn, false_fn, (torch.randn(3),))
