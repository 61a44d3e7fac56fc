"""Property: random programs built on hop.scan agree with their reference under every transform."""

from __future__ import annotations

import pytest
from hypothesis import given
from props import examples, run

from hop.testing import strategies as st

pytestmark = pytest.mark.slow


@examples(0.6)
@given(st.cases(ops=("scan",), depth=2, min_rank=1))
def test_scan_programs_match_reference(case: st.Case) -> None:
    run(case)
