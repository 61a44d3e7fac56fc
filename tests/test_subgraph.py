"""hop.subgraph on its own: pytrees, output checks, tracing, effects."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop import subgraph
from hop.errors import HopTypeError, OutputMismatchError


def test_flatten_roundtrip_and_paths() -> None:
    tree = (torch.zeros(1), {"h": torch.ones(2), "c": [torch.ones(3), 4]})
    leaves, spec = subgraph.flatten(tree)
    assert len(leaves) == 4
    rebuilt = subgraph.unflatten(leaves, spec)
    assert rebuilt[1]["c"][1] == 4
    assert subgraph.leaf_paths(tree) == ["output[0]", 'output[1]["h"]', 'output[1]["c"][0]', 'output[1]["c"][1]']
    assert subgraph.leaf_paths([1, 2], root="carry") == ["carry[0]", "carry[1]"]


def test_describe() -> None:
    assert subgraph.describe(torch.zeros(2, 3)) == "Tensor(2x3, float32, cpu)"
    assert subgraph.describe(3) == "int(3)"


def outputs(*trees: object) -> list[object]:
    return list(trees)


def test_same_outputs_pass_with_different_sizes() -> None:
    subgraph.check_same_outputs("cond", ("true_fn", "false_fn"), outputs(torch.zeros(2), torch.zeros(5)))


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (
            (torch.zeros(1), {"h": torch.zeros(1)}),
            (torch.zeros(1), {"h": torch.zeros(1, dtype=torch.float64)}),
            'hop.cond: true_fn and false_fn disagree at output[1]["h"]: dtype float32 vs float64. '
            'Make both return the same kind of value at output[1]["h"].',
        ),
        (
            [torch.zeros(1), torch.zeros(2)],
            [torch.zeros(1), torch.zeros(2, 2)],
            "hop.cond: true_fn and false_fn disagree at output[1]: rank 1 vs 2 (shapes (2,) vs (2, 2))",
        ),
        (
            (torch.zeros(1),),
            (torch.zeros(1), torch.zeros(1)),
            "hop.cond: true_fn and false_fn return different structures: (*,) vs (*, *): 1 value vs 2. "
            "Make true_fn and false_fn return the same pytree structure.",
        ),
        (
            (torch.zeros(1), 3),
            (torch.zeros(1), torch.zeros(1)),
            "hop.cond: true_fn and false_fn disagree at output[1]: int vs Tensor",
        ),
        (
            torch.zeros(1),
            torch.zeros(1, device="meta"),
            "hop.cond: true_fn and false_fn disagree at output: device cpu vs meta",
        ),
    ],
)
def test_mismatch_messages_name_the_path_and_the_difference(a: object, b: object, message: str) -> None:
    with pytest.raises(OutputMismatchError) as info:
        subgraph.check_same_outputs("cond", ("true_fn", "false_fn"), outputs(a, b))
    assert str(info.value).startswith(message)
    assert isinstance(info.value, HopTypeError) and isinstance(info.value, TypeError)
    assert info.value.op == "cond" and info.value.role == "false_fn"


def test_rank_check_can_be_relaxed() -> None:
    subgraph.check_same_outputs("x", ("a", "b"), outputs(torch.zeros(1), torch.zeros(1, 1)), check_rank=False)


def test_trace_subgraph_outside_make_fx_uses_fake_tensors() -> None:
    gm = subgraph.trace_subgraph(lambda a: a.sin() + 1, (torch.randn(3),))
    assert isinstance(gm, torch.fx.GraphModule)
    torch.testing.assert_close(gm(torch.zeros(3)), torch.ones(3))


def test_trace_subgraph_under_an_existing_fake_mode() -> None:
    with FakeTensorMode() as mode:
        x = torch.randn(3)
    gm = subgraph.trace_subgraph(lambda a: a * 2, (x,))
    assert mode is not None
    torch.testing.assert_close(gm(torch.ones(3)), torch.full((3,), 2.0))


def test_trace_subgraph_reenters_the_active_tracer() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def outer(a: torch.Tensor) -> torch.Tensor:
        graphs.append(subgraph.trace_subgraph(lambda b: b.new_ones(b.shape[0] + 1), (a,)))
        return a + 1

    make_fx(outer, tracing_mode="symbolic")(torch.randn(4))
    (gm,) = graphs
    assert gm(torch.randn(6)).shape == (7,)  # symbolic size, traced in the parent's ShapeEnv


def effects(fn: object, *args: torch.Tensor) -> subgraph.Effects:
    return subgraph.find_mutations_and_aliases(make_fx(fn, tracing_mode="fake")(*args))  # type: ignore[arg-type]


def test_effects_detect_in_place_writes() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b.add_(1)
        return a + b

    assert effects(f, torch.randn(2), torch.randn(2)).mutated == (1,)


def test_effects_detect_out_arguments() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        torch.sin(a, out=b)
        return a * 2

    assert effects(f, torch.randn(2), torch.randn(2)).mutated == (1,)


def test_effects_detect_aliasing_outputs() -> None:
    e = effects(lambda a, b: (b.t(), a + 1, a), torch.randn(2, 2), torch.randn(2, 2))
    assert e.mutated == ()
    assert set(e.aliased) == {(0, 1), (2, 0)}


def test_effects_of_a_pure_function() -> None:
    assert effects(lambda a: a.sin(), torch.randn(2)) == subgraph.Effects((), ())


def test_clone_aliases() -> None:
    x = torch.randn(3)
    out = subgraph.clone_aliases([x, x[:2], x.sin()], [x])
    assert out[0] is not x and out[1]._base is None
    torch.testing.assert_close(out[0], x)
    y = torch.randn(2)
    same = subgraph.clone_aliases([y, y], [])
    assert same[0] is y and same[1] is not y  # an output aliasing an earlier output is cloned too


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_a_constant_a_branch_builds_becomes_a_pure_lifted_input(mode: str) -> None:
    graphs: list[torch.fx.GraphModule] = []
    lifted: list[object] = []

    def outer(a: torch.Tensor) -> torch.Tensor:
        (gm,), values = subgraph.trace_branches([lambda b: b + torch.tensor([1.0, 2.0])], (a,))
        graphs.append(gm)
        lifted.extend(values)
        return a + 1

    make_fx(outer, tracing_mode=mode)(torch.randn(2))
    (gm,) = graphs
    assert len(lifted) == 1  # the constant, an input of the graph ...
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert not [name for name, _ in gm.named_buffers()] and not hasattr(gm, "_tensor_constant0")  # ... not an attribute
    # torch.tensor records lift_fresh_copy then detach_ on the copy: not a write to the input
    assert subgraph.find_mutations_and_aliases(gm) == subgraph.Effects((), ())
    torch.testing.assert_close(gm(torch.ones(2), torch.tensor([1.0, 2.0])), torch.tensor([2.0, 3.0]))


def test_trace_example_copies_real_values_and_not_fake_ones() -> None:
    x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    copy = subgraph.trace_example(x)
    assert copy is not x and copy.is_contiguous() and torch.equal(copy, x)
    assert copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        empty = subgraph.trace_example(fake)
    assert empty is not fake and empty.shape == fake.shape and empty.is_contiguous()
    assert subgraph.trace_example(3) == 3


def test_the_public_module_names_every_helper_where_it_lives() -> None:
    from hop import _closures, _effects, _lifting, _output_checks, _pytree, _tracing

    homes = (_closures, _effects, _lifting, _output_checks, _pytree, _tracing)
    for name in subgraph.__all__:
        assert any(getattr(m, name, None) is getattr(subgraph, name) for m in homes), name
    # outside __all__, but reachable as when the helpers were one module
    for name in ("with_closure_as_inputs", "convert_closures", "is_inert", "may_alias", "flatten_dropping_none"):
        assert callable(getattr(subgraph, name))
    assert hop.subgraph is subgraph
