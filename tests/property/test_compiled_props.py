"""Property: random programs over every operator, compiled, equal eager.

The differential check of the compiler bridge: ``hop.testing.check`` with the
``COMPILED`` transforms (``torch.compile(fullgraph=True)`` with aot_eager and
Inductor, dynamic and static, forward and gradients; the vmapped program compiled
and exported; strict export; an AOTInductor package in a fresh process; ONNX in
onnxruntime) on
programs drawn by ``hop.testing.strategies``, each checked on its inputs and on
perturbed copies that take other branches and trip counts. Compiling is slow, so
the programs of one example are bundled into one (``hop.testing.bundle``): one
compilation, one AOTInductor build, checks them all. Failures are not shrunk (each
step would compile again): the report prints every program of the bundle.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as hs

from hop.testing import bundle, check
from hop.testing import strategies as st

pytestmark = pytest.mark.slow

# Data-dependent sizes under torch.compile need Dynamo's capture flags and are
# checked by tests/compile; here, programs of static sizes.
KINDS = tuple(k for k in st.KINDS if k != "data_dependent")


def compiled_examples(fraction: float) -> settings:
    """``fraction`` of the profile's examples (at least one), never shrunk."""
    n = max(1, round(settings.default.max_examples * fraction))
    return settings(max_examples=n, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def bundles(size: int) -> hs.SearchStrategy[list[st.Case]]:
    one = st.cases(ops=st.OPERATORS, depth=2, kinds=KINDS, sides=False, budget=8)
    return hs.lists(one, min_size=size, max_size=size)


def run(cases: Sequence[st.Case], transforms: Sequence[str]) -> None:
    fn, args = bundle([(case.program.compile(), case.args) for case in cases])
    report = check(fn, *args, transforms=("eager", *transforms))
    print(report)


@compiled_examples(0.04)
@given(bundles(6))
def test_compiled_programs_equal_eager(cases: list[st.Case]) -> None:
    run(
        cases,
        (
            "compile_aot_eager",
            "compile_inductor",
            "compile_inductor_vmap",
            "export_strict",
            "export_vmap",
            "export_compositions",
        ),
    )


@compiled_examples(0.04)
@given(bundles(6))
def test_static_shapes_and_compiled_compositions_equal_eager(cases: list[st.Case]) -> None:
    run(cases, ("compile_inductor_static", "compile_compositions"))


@compiled_examples(0.04)
@given(bundles(6))
def test_deployed_programs_equal_eager(cases: list[st.Case]) -> None:
    run(cases, ("aoti", "onnx", "deploy_vmap"))
