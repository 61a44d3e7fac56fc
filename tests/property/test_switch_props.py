"""Property: random programs built on hop.switch agree with their reference under every transform."""

from __future__ import annotations

import pytest
from hypothesis import given
from props import examples, run

from hop.testing import strategies as st

pytestmark = pytest.mark.slow


@examples(0.6)
@given(st.cases(ops=("switch",), depth=2, min_rank=0))
def test_switch_programs_match_reference(case: st.Case) -> None:
    run(case)
