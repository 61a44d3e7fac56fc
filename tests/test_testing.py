"""hop.testing itself: reference semantics, the oracle's verdicts and reports, program printing."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
import torch
from hypothesis import find
from torch._C._functorch import is_batchedtensor

import hop
from hop.errors import HopTypeError, HopValueError
from hop.testing import CheckFailure, check, reference
from hop.testing import programs as P
from hop.testing import strategies as S

# ---- reference() ----------------------------------------------------------------------------


def test_reference_runs_cond_and_switch_as_python() -> None:
    seen: list[str] = []

    def branch(name: str) -> Any:
        return lambda v: seen.append(f"{name}:{type(v).__name__}") or v + 1

    x = torch.zeros(2)
    with reference():
        hop.cond(torch.tensor(True), branch("t"), branch("f"), (x,))
        hop.switch(torch.tensor(2), [branch("0"), branch("1"), branch("2")], (x,))
        with pytest.raises(IndexError, match="switch index 3 out of range for 2 branches"):
            hop.switch(3, [branch("0"), branch("1")], (x,))
    assert seen == ["t:Tensor", "2:Tensor"]  # one branch, real tensors: nothing checked on fake ones


def test_reference_loops() -> None:
    x = torch.arange(3.0)
    with reference():
        n, v = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2), [0, x])
        assert n == 3 and v.tolist() == [0.0, 8.0, 16.0]
        assert type(hop.while_loop(lambda v: v.sum() < 0, lambda v: v, [x])) is list
        steps: list[Any] = []
        hop.fori_loop(1, 3, lambda i, v: steps.append(i) or v, x)
        hop.fori_loop(torch.tensor([1]), 3, lambda i, v: steps.append(i) or v, x)
        assert steps[:2] == [1, 2]
        assert [s.tolist() for s in steps[2:]] == [[1], [2]]  # i is a tensor like the tensor bound
        carry, ys = hop.scan(lambda c, r: (c + r, c * r), torch.zeros(()), x, reverse=True)
        assert carry.item() == 3.0 and ys.tolist() == [0.0, 2.0, 0.0]
        torch.testing.assert_close(
            hop.associative_scan(lambda a, b: a + b, x, 0, reverse=True), torch.tensor([3.0, 3, 2])
        )
        torch.testing.assert_close(hop.map(lambda r, k: r * k, x.reshape(3, 1), 2), x.reshape(3, 1) * 2)
        assert hop.map(lambda r: r.sum(0, keepdim=True), torch.zeros(0, 4)).shape == (0, 1)  # shaped on zeros
        assert hop.scan(lambda c, r: (c, r[:1]), torch.ones(()), torch.zeros(2, 0, 5), dim=1)[1].shape == (1, 0, 5)
    assert hop.scan(lambda c, r: (c, r[:1]), torch.ones(()), torch.zeros(2, 0, 5), dim=1)[1].shape == (1, 0, 5)


def test_reference_nests_restores_on_error_and_is_per_thread() -> None:
    calls: list[str] = []
    pred = torch.tensor(True)

    def t(v: torch.Tensor) -> torch.Tensor:
        calls.append(type(v).__name__)
        return v

    with pytest.raises(RuntimeError, match="boom"), reference():
        with reference():
            pass
        hop.cond(pred, t, t, (torch.zeros(1),))
        raise RuntimeError("boom")
    assert calls == ["Tensor"]
    calls.clear()
    hop.cond(pred, t, t, (torch.zeros(3, 3, 3),))  # outside again: checked on fake tensors first
    assert "FakeTensor" in calls

    other: list[str] = []
    with reference():
        thread = threading.Thread(target=lambda: other.extend(calls_in_thread(pred)))
        thread.start()
        thread.join()
    assert "FakeTensor" in other


def calls_in_thread(pred: torch.Tensor) -> list[str]:
    seen: list[str] = []

    def f(v: torch.Tensor) -> torch.Tensor:
        seen.append(type(v).__name__)
        return v

    hop.cond(pred, f, f, (torch.zeros(2, 2, 2, 2),))
    return seen


# ---- check() ----------------------------------------------------------------------------------


def test_check_passes_and_reports_what_ran() -> None:
    def program(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: (a.sin(), {"h": a * 2}), lambda a: (a.cos(), {"h": a}), (x,))

    report = check(program, torch.randn(3, dtype=torch.float64))
    assert report.ran == list(hop.testing.TRANSFORMS) and report.skipped == {}
    assert str(report).startswith("ran: eager, autograd, gradcheck")


def test_check_records_why_transforms_are_skipped() -> None:
    def masked(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a[a > 0], lambda a: a[:1], (x,))

    report = check(masked, torch.tensor([1.0, -2.0, 3.0]), skip={"export": "not needed here"})
    assert report.skipped["gradcheck"] == "the floating-point inputs are not all float64"
    assert report.skipped["vmap"].startswith("torch.vmap: a data-dependent op")
    assert report.skipped["export"] == "not needed here"
    assert "make_fx_symbolic" in report.ran

    ints = check(lambda n: hop.fori_loop(0, 3, lambda i, v: v + i, n), torch.arange(3), transforms=["autograd", "jvp"])
    assert ints.skipped == {"autograd": "no floating-point tensor inputs", "jvp": "no floating-point tensor inputs"}


class _WrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.saved_tensors[0].cos() * 2  # wrong: twice the derivative


def test_check_names_the_transform_and_path_of_a_wrong_gradient() -> None:
    def program(x: torch.Tensor) -> Any:
        return _WrongGrad.apply(x)

    with pytest.raises(CheckFailure) as info:
        check(program, torch.randn(3), reference=torch.sin)
    assert info.value.transform == "autograd" and info.value.path == "grad of args[0]"
    assert str(info.value).startswith("hop.testing.check: autograd at grad of args[0]: Tensor-likes are not close!")


def test_check_names_the_transform_and_path_of_a_wrong_vmap() -> None:
    def my_op(x: torch.Tensor) -> torch.Tensor:  # a HOP-like function whose batching rule is wrong
        return x * 2 if is_batchedtensor(x) else x

    def program(x: torch.Tensor) -> Any:
        return x + 1, {"h": my_op(x)}

    with pytest.raises(CheckFailure) as info:
        check(program, torch.ones(2), transforms=["eager", "vmap"])
    assert (info.value.transform, info.value.path) == ("vmap", 'output[1]["h"]')
    assert "\ngot:      tensor([[2.0000, 2.0000]," in str(info.value)  # the first copy is the input itself


def _under_vmap() -> bool:
    stack = torch._C._functorch.get_interpreter_stack() or []
    return any(i.key() == torch._C._functorch.TransformType.Vmap for i in stack)


class _WrongUnderVmap(_WrongGrad):
    """sin, whose derivatives are wrong (doubled) when run batched: right per example,
    and wrong only where a vmap is involved."""

    generate_vmap_rule = True

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * x.cos() * (2 if _under_vmap() else 1)

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t * ctx.saved_tensors[0].cos() * (2 if _under_vmap() else 1)


@pytest.mark.parametrize("transform", ["vmap_grad", "grad_vmap", "vmap_jvp"])
def test_compositions_catch_a_derivative_wrong_only_under_vmap(transform: str) -> None:
    x = torch.randn(3, dtype=torch.float64)
    report = check(_WrongUnderVmap.apply, x, transforms=["eager", "autograd", "jvp", "vmap"])
    assert report.ran == ["eager", "autograd", "jvp", "vmap"]  # right one example at a time
    with pytest.raises(CheckFailure, match=rf"^hop.testing.check: {transform} at (grad|tangent) of"):
        check(_WrongUnderVmap.apply, x, transforms=["eager", transform], reference=torch.sin)


@pytest.mark.parametrize("layout", S.LAYOUTS)
def test_layouts_keep_shape_and_values(layout: str) -> None:
    t = torch.arange(24.0).reshape(2, 3, 4)
    u = S.with_layout(t, layout)
    assert u.shape == t.shape
    want = t[:1].expand(t.shape) if layout == "expanded" else t
    assert torch.equal(u, want)
    assert u.is_contiguous() == (layout in ("contiguous", "offset"))
    assert (u.storage_offset() == 1) == (layout == "offset")
    case = S.Case(P.Program(("x",), (P.Var("x"),)), (t,), (layout,))
    if layout != "contiguous":
        assert "with_layout(torch.tensor(" in repr(case) and repr(case).count("import") == 1


def test_check_fails_on_a_wrong_eager_result_and_a_raising_transform() -> None:
    with pytest.raises(CheckFailure, match=r"^hop.testing.check: eager at output\[0\]: 1 vs the reference's 2$"):
        check(lambda x: (1, x), torch.ones(1), reference=lambda x: (2, x))
    with pytest.raises(CheckFailure, match="eager: the output structure differs"):
        check(lambda x: (x,), torch.ones(1), reference=lambda x: [x])

    def not_traceable(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x  # a Python decision on data, outside any hop operator

    with pytest.raises(CheckFailure, match="make_fx_fake: fn raised"):
        check(not_traceable, torch.ones(2), transforms=["eager", "make_fx_fake"])


def test_check_user_mistakes() -> None:
    with pytest.raises(HopTypeError, match=r"^hop\.testing\.check: fn must be callable, got int$"):
        check(1, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(HopValueError, match=r"^hop\.testing\.check: unknown transform 'grad'\. Choose from eager,"):
        check(torch.sin, torch.ones(1), transforms=["grad"])


# ---- programs and strategies ------------------------------------------------------------------


def test_programs_print_as_the_source_that_runs() -> None:
    body = P.Lambda(("a",), P.Apply(P.UNARY["pointwise"][0], P.Var("a")))
    program = P.Program(
        ("x",),
        (P.Cond("o", P.PREDICATES[0], body, P.Lambda(("b",), P.Var("x")), P.Var("x")),),
        names=("out",),
    )
    assert program.to_source() == (
        "def program(x):\n"
        "    return {'out': (lambda o: hop.cond(o.sum() > 0, lambda a: a.sin(), lambda b: x, (o,)))(x)}\n"
    )
    assert repr(program) == program.to_source()
    assert program.closures and not program.data_dependent
    x = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(program.compile()(x), {"out": x.sin()})
    case = S.Case(program, (x,))
    assert repr(case).endswith("x = torch.tensor([1.0, 2.0], dtype=torch.float32).reshape((2,))\n")


def test_strategies_draw_float64_zero_size_and_scalar_tensors() -> None:
    assert find(S.tensors(), lambda t: t.dtype == torch.float64).dtype == torch.float64
    assert find(S.tensors(), lambda t: t.numel() == 0 and t.dim() > 0).numel() == 0
    assert find(S.tensors(), lambda t: t.dim() == 0).shape == ()
    assert find(S.tensors(dtypes=[torch.bool]), lambda t: t.numel() > 0).dtype == torch.bool


def test_strategies_nest_the_chosen_operators() -> None:
    def nests(case: S.Case) -> bool:
        source = case.program.to_source()
        return "hop.while_loop" in source and "hop.scan" in source and case.program.data_dependent

    case = find(S.cases(ops=("while_loop", "scan"), min_rank=1, depth=2), nests)
    assert "hop.cond" not in case.program.to_source()


def test_check_without_eager_still_compares_with_the_reference() -> None:
    def program(x: torch.Tensor) -> Any:
        return hop.scan(lambda c, r: (c + r, c * r), torch.zeros(()), x)

    report = check(program, torch.randn(4), transforms=["fake", "jvp"])
    assert report.ran == ["jvp", "fake"]


# --- the compiler bridge: the COMPILED transforms ------------------------------------------------


def _counted(x: torch.Tensor) -> Any:
    """An int carry, a cond and a scan: what the compiled paths must agree on."""
    n, y = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 1.5), (0, x))
    z = hop.cond(y.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (y,))
    return n, z, hop.scan(lambda c, r: (c + r, c * r), z[0], z)


def _counted_by_bounds(x: torch.Tensor) -> Any:
    """The same without int outputs or int carries: what ONNX and an exported vmap take."""
    y = hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, v: v * 1.5 + i, x)
    z = hop.cond(y.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (y,))
    return z, hop.scan(lambda c, r: (c + r, c * r), z[0], z)


@pytest.mark.parametrize("transform", hop.testing.COMPILED)
def test_compiled_transforms_pass_and_report(transform: str) -> None:
    # an exported vmap or jvp carries tensors only; ONNX returns tensors only
    program = (
        _counted_by_bounds if transform in ("export_vmap", "export_compositions", "onnx", "deploy_vmap") else _counted
    )
    report = check(program, torch.randn(4, 3, dtype=torch.float64), transforms=("eager", transform))
    assert report.ran == ["eager", transform], report


# every compiled transform but the two Inductor ones that compile_inductor_static stands for (time)
@pytest.mark.parametrize(
    "transform", [t for t in hop.testing.COMPILED if t not in ("compile_inductor", "compile_inductor_vmap")]
)
def test_compiled_transforms_catch_a_compiled_value_that_differs(transform: str) -> None:
    def differs(x: torch.Tensor) -> torch.Tensor:
        scale = 2.0 if torch.compiler.is_compiling() else 1.0  # what eager computes differs
        return hop.cond(x.sum() > 0, lambda a: a * scale, lambda a: a - scale, (x,))

    with pytest.raises(CheckFailure, match=rf"{transform} at (output|grad of input|tangent of output)"):
        check(differs, torch.ones(3), transforms=("eager", transform))  # the branch that scales


def test_compiled_transforms_skip_what_the_compiled_path_refuses_by_design() -> None:
    def growing(x: torch.Tensor) -> torch.Tensor:  # Inductor keeps carries at a fixed size
        return hop.while_loop(lambda v: v.shape[0] < 4, lambda v: torch.cat([v, v[:1]]), (x,))

    report = check(growing, torch.randn(1), transforms=("eager", "compile_inductor"))
    assert "CompileUnsupported" in report.skipped["compile_inductor"]


_SHIFT = torch.tensor(-0.25)


def test_export_vmap_skips_what_a_plain_program_fails_too() -> None:
    # found by the compiled fuzzer's long profile: strict export of torch.vmap(fn), where fn
    # reads a module-level tensor outside any operator, fails in torch (Dynamo copies the
    # tensor with requires_grad_ under the transform), with or without hop
    def shifted(x: torch.Tensor) -> torch.Tensor:
        return hop.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, (torch.tanh(x + _SHIFT),))

    report = check(shifted, torch.randn(3), transforms=("eager", "export_vmap"))
    assert "a plain program neither" in report.skipped["export_vmap"]


def test_bundle_runs_many_programs_as_one() -> None:
    x, y = torch.randn(3), torch.randn(2, 2)
    fn, args = hop.testing.bundle([(lambda a: a.sin(), (x,)), (lambda a, b: a + b, (y, y))])
    out = fn(*args)
    assert len(args) == 3 and len(out) == 2
    torch.testing.assert_close(out[0], x.sin())
    torch.testing.assert_close(out[1], y + y)


@pytest.mark.parametrize("layout", ["expanded", "transposed", "offset", "channels_last"])
def test_perturbed_arguments_keep_their_layout(layout: str) -> None:
    """Found by the deployed long profile: an AOTInductor package built on an expanded
    argument reads every later input with stride 0 (torch checks no strides, in a plain
    program too), and the perturbed copy was contiguous: a wrong value blamed on hop."""
    from hop.testing._case import CheckCase, perturbed
    from hop.testing.strategies import with_layout

    x = with_layout(torch.randn(2, 3, 4, dtype=torch.float64), layout)
    flag = with_layout(torch.rand(2, 3, 4) > 0.5, layout)
    case = CheckCase(fn=torch.add, ref=torch.add, args=(x, flag), rtol=None, atol=None, batch_size=2, seed=0)
    moved, flipped = perturbed(case, 1, laid_out=True)
    for new, old in ((moved, x), (flipped, flag)):
        assert (new.stride(), new.storage_offset(), new.shape) == (old.stride(), old.storage_offset(), old.shape)
    assert not torch.equal(moved, x) and torch.equal(flipped, ~flag)


def test_export_compositions_skips_what_a_plain_program_fails_too() -> None:
    # found by the compiled fuzzer's long profile: torch's non-strict export of
    # torch.func.jvp(f), where f makes a tensor with a factory, lifts it as a fake constant
    # wrapped by the jvp's level, which torch.export.save cannot store
    def made(x: torch.Tensor) -> torch.Tensor:
        o = x.reshape(-1, 1) @ torch.full((1, 1), 0.5)
        return hop.cond(o.sum() < 0.5, lambda a: a * 2, lambda a: a * 3, (o.reshape(x.shape),))

    report = check(made, torch.randn(3), transforms=("eager", "export_compositions"))
    assert "a plain program neither" in report.skipped["export_compositions"]

    class Plain(torch.nn.Module):  # the same without hop: when torch fixes it, drop the limitation
        def forward(self, x: torch.Tensor, t: torch.Tensor) -> Any:
            return torch.func.jvp(lambda v: (v.reshape(-1, 1) @ torch.full((1, 1), 0.5)) * 2, (x,), (t,))

    ep = torch.export.export(Plain(), (torch.randn(3), torch.randn(3)), strict=False)
    with pytest.raises(NotImplementedError, match="Cannot access storage of TensorWrapper"):
        torch.export.save(ep, io.BytesIO())


def test_onnx_values_are_compared_as_reordered_float32() -> None:
    """Found by the deployed long profile: onnxruntime summed a scan of a scan's float32
    running sums in its own order, 2.7e-6 relative from eager: not a wrong value."""
    from hop.testing._case import CheckCase, compare_leaf

    want = torch.tensor([37.6639, 18.6942])
    got = want * (1 + 2.7e-6)
    case = CheckCase(fn=torch.sin, ref=torch.sin, args=(want,), rtol=None, atol=None, batch_size=2, seed=0)
    compare_leaf(case, "onnx", "output", got, want)
    with pytest.raises(CheckFailure):
        compare_leaf(case, "eager", "output", got, want)  # eager keeps assert_close's defaults
    with pytest.raises(CheckFailure):
        compare_leaf(case, "onnx", "output", want * (1 + 1e-4), want)  # a real difference still fails
