"""Shared helpers of the property tests: example counts that follow the hypothesis profile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import Phase, settings

from hop.testing import TRANSFORMS, Report, check
from hop.testing.strategies import Case


def examples(fraction: float) -> Any:
    """``settings`` running ``fraction`` of the active profile's examples (25 in "ci", 2000 in "long")."""
    phases = [p for p in settings.default.phases if p is not Phase.explain]  # explain: minutes per failure
    return settings(max_examples=max(1, round(settings.default.max_examples * fraction)), phases=phases)


def run(case: Case, transforms: Sequence[str] = TRANSFORMS) -> Report:
    """``hop.testing.check`` of a drawn program on its drawn inputs."""
    report = check(case.program.compile(), *case.args, transforms=transforms, skip=case.skips())
    assert "eager" in report.ran
    return report
