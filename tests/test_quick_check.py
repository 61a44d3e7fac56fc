"""``python -m hop --check`` (hop/_quick_check.py): one line per operator, exit 1 on a failure."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hop
from hop import _quick_check


def test_every_public_operator_is_checked() -> None:
    public = {"cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan"}
    assert set(_quick_check._programs()) == public


def test_a_passing_operator_reports_ok(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(3, dtype=torch.float64)
    programs = {"cond": (lambda x: hop.cond(x.sum() > 0, torch.sin, torch.cos, (x,)), (x,))}
    monkeypatch.setattr(_quick_check, "_programs", lambda: programs)
    assert _quick_check.main([]) == 0
    assert "cond              ok" in capsys.readouterr().out


def test_a_failing_operator_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def wrong(x: Any) -> Any:  # differs from its own Python program under a transform
        return hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,)) + torch.randn(())

    programs = {"cond": (wrong, (torch.randn(3, dtype=torch.float64),))}
    monkeypatch.setattr(_quick_check, "_programs", lambda: programs)
    monkeypatch.setattr(_quick_check, "TRANSFORMS_CHECKED", ("eager",))
    assert _quick_check.main([]) == 1
    out = capsys.readouterr().out
    assert "cond              FAILED" in out and "1 operator(s) failed" in out
