"""Property: programs nesting every hop operator agree with their reference under every transform."""

from __future__ import annotations

import pytest
from hypothesis import given
from props import examples, run

from hop.testing import strategies as st

pytestmark = pytest.mark.slow


@examples(1.0)
@given(st.cases(depth=3, budget=14))
def test_nested_programs_match_reference(case: st.Case) -> None:
    run(case)
