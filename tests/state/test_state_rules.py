"""State inside control flow: gradients through written values, what is refused and how
it reads, and eager state that a validation run must never touch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import CompileUnsupported, MutationError


class Trained(torch.nn.Module):
    """A scan writing a running total and its carry, then a cond updating a statistic:
    both buffers end up depending on the parameter, as in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("total", torch.zeros(3))
        self.register_buffer("stat", torch.zeros(3))

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.total.add_(x * self.w)
            c.mul_(0.5).add_(x * self.w)
            return c, c.sum()

        c, ys = hop.scan(step, torch.ones(3), xs)

        def update(v: torch.Tensor) -> torch.Tensor:
            self.stat.mul_(0.9).add_(v * self.w)
            return v * self.w

        out = hop.cond(c.sum() > 0, update, lambda v: v * 2, (c,))
        return ys.sum() + out.sum() + self.total.sum() * 0.5 + self.stat.sum()


def _ring(x: torch.Tensor) -> torch.Tensor:
    """A while_loop writing a carried ring buffer row by row, differentiated."""
    buf = torch.zeros(4, 3)

    def body(i: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b.index_copy_(0, (i % 4).reshape(1), (y * y)[None])
        return i + 1, b, y * 1.5

    _, b, y = hop.while_loop(lambda i, b, y: i < 6, body, (torch.tensor(0), buf, x))
    return (b * torch.arange(12.0).reshape(4, 3)).sum() + y.sum() + buf.sum()


_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_TORCH_214_SAVED_INPUT = pytest.mark.xfail(
    _VERSION == (2, 14),
    strict=True,
    raises=RuntimeError,
    reason="torch 2.14's Inductor removes the copy of a written buffer that the operator's backward saves "
    "(its no-op passes), so the saved tensor is the buffer, which the write-back then changes: autograd's "
    "'modified by an inplace operation'. A loud error, never a wrong value; 2.13 and 2.15 keep the copy",
)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=_TORCH_214_SAVED_INPUT)])
def test_gradients_flow_through_written_buffers(backend: str) -> None:
    xs = torch.arange(12.0).reshape(4, 3)
    ref = Trained()
    want = torch.autograd.grad(ref(xs), ref.w)[0]
    torch._dynamo.reset()
    m = Trained()
    run = m if backend == "eager" else torch.compile(m, backend=backend, fullgraph=True)
    got = torch.autograd.grad(run(xs), m.w)[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(m.total, ref.total)
    torch.testing.assert_close(m.stat, ref.stat)


@pytest.mark.parametrize("how", ["aot_eager", "inductor", "make_fx", "func_grad"])
def test_gradients_flow_through_a_written_carry(how: str) -> None:
    x = torch.arange(3.0, requires_grad=True)
    want = torch.autograd.grad(_ring(x), x)[0]
    torch._dynamo.reset()
    if how == "func_grad":
        got = torch.func.grad(_ring)(torch.arange(3.0))
    elif how == "make_fx":
        gm = make_fx(lambda v: torch.func.grad(_ring)(v), tracing_mode="fake")(torch.arange(3.0))
        got = gm(torch.arange(3.0))
    else:
        x = torch.arange(3.0, requires_grad=True)
        got = torch.autograd.grad(torch.compile(_ring, backend=how, fullgraph=True)(x), x)[0]
    torch.testing.assert_close(got, want)


# --- refusals: before anything runs, naming the operator, the callable and the tensor ----------


def _map_shared(xs: torch.Tensor, buf: torch.Tensor) -> Any:
    def f(x: torch.Tensor) -> torch.Tensor:
        buf.add_(x)
        return x * 2

    return hop.map(f, xs)


def _scan_slice(xs: torch.Tensor, buf: torch.Tensor) -> Any:
    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.mul_(2)
        return c + x, c

    return hop.scan(step, torch.zeros(3), xs)


def _carry_replaced(xs: torch.Tensor, buf: torch.Tensor) -> Any:
    def body(i: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b.add_(1)
        return i + 1, b * 2

    return hop.while_loop(lambda i, b: i < 3, body, (torch.tensor(0), xs[0]))


def _cond_fn_writes(xs: torch.Tensor, buf: torch.Tensor) -> Any:
    def check(i: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf.add_(1)
        return i < 3

    return hop.while_loop(check, lambda i, b: (i + 1, b + 1), (torch.tensor(0), xs[0]))


def _combine_writes(xs: torch.Tensor, buf: torch.Tensor) -> Any:
    def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf.add_(1)
        return a + b

    return hop.associative_scan(combine, xs, 0)


REFUSED: dict[str, tuple[Callable[..., Any], str]] = {
    "map_shared": (_map_shared, r"hop\.map: f \(.*f .*\) writes buf in place.*no fixed order"),
    "scan_slice": (_scan_slice, r"hop\.scan: combine_fn \(.*step .*\) writes slice 0 of xs in place"),
    "carry_replaced": (_carry_replaced, r"hop\.while_loop: body_fn \(.*body .*\) writes carry 1 in place.*another"),
    "cond_fn_writes": (_cond_fn_writes, r"hop\.while_loop: cond_fn \(.*check .*\) writes buf in place.*condition"),
    "combine_writes": (
        _combine_writes,
        r"hop\.associative_scan: combine_fn \(.*combine .*\) writes buf in place.*no fixed order",
    ),
}


@pytest.mark.parametrize("mode", ["make_fx", "export", "compile"])
@pytest.mark.parametrize("name", REFUSED)
def test_writes_python_semantics_cannot_keep_are_refused(name: str, mode: str) -> None:
    fn, message = REFUSED[name]
    xs, buf = torch.ones(4, 3), torch.zeros(3)
    before = buf.clone()
    torch._dynamo.reset()
    with pytest.raises((MutationError, torch._dynamo.exc.BackendCompilerFailed), match=message) as info:
        if mode == "make_fx":
            make_fx(fn, tracing_mode="fake")(xs, buf)
        elif mode == "export":

            class Wrapped(torch.nn.Module):
                def forward(self, xs: torch.Tensor, buf: torch.Tensor) -> Any:
                    return fn(xs, buf)

            torch.export.export(Wrapped(), (xs, buf))
        else:
            torch.compile(fn, backend="aot_eager", fullgraph=True)(xs, buf)
    if mode == "compile":
        assert isinstance(info.value.__cause__ or info.value.inner_exception, MutationError)  # type: ignore[attr-defined]
    torch.testing.assert_close(buf, before)  # nothing ran


def test_eager_runs_what_traced_refuses() -> None:
    """Eager runs the Python: map's calls happen in order, so a shared write is Python's."""
    buf = torch.zeros(3)
    out = _map_shared(torch.arange(6.0).reshape(2, 3), buf)
    torch.testing.assert_close(out, torch.arange(6.0).reshape(2, 3) * 2)
    torch.testing.assert_close(buf, torch.tensor([3.0, 5.0, 7.0]))


# --- augmented assignment of a buffer --------------------------------------------------------


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def taken(v: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return v * 2

        return hop.cond(x.sum() > 0, taken, lambda v: v - 1, (x,))


def test_validation_never_leaves_a_fake_tensor_in_a_module() -> None:
    """The validate-once fake run runs both branches: ``self.count += 1`` in the untaken
    one assigned its fake result to the module (a FakeTensor buffer afterwards)."""
    m = Counter()
    m(-torch.ones(3))  # the taken branch does not write; the fake run ran both
    assert type(m.count) is torch.Tensor
    m(torch.ones(3))
    assert type(m.count) is torch.Tensor and m.count.item() == 1.0


def test_augmented_assignment_exports_and_is_named_under_compile() -> None:
    m = Counter()
    ep = torch.export.export(m, (torch.ones(3),))
    mod = ep.module()
    mod(torch.ones(3))
    mod(torch.ones(3))
    assert mod.count.item() == 2.0
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=r"at .*test_state_rules.py:\d+ in taken .*self\.count\.add_\(1\)"):
        torch.compile(Counter(), backend="aot_eager", fullgraph=True)(torch.ones(3))


def _returns_written(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a.add_(1), lambda a: a - 1, (x,)) * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_branch_returning_the_operand_it_wrote(backend: str, sign: float) -> None:
    want_x = torch.full((3,), sign)
    want = _returns_written(want_x)
    x = torch.full((3,), sign)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_returns_written, backend=backend, fullgraph=True)(x), want)
    torch.testing.assert_close(x, want_x)


def _operand_also_closed_over(x: torch.Tensor) -> Any:
    acc = torch.zeros(3)

    def taken(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a.add_(v)  # writes the operand...
        return acc * 2  # ...and reads the same tensor through the closure

    return hop.cond(x.sum() > 0, taken, lambda a, v: v * 0, (acc, x)), acc


def _view_of_a_read_buffer(x: torch.Tensor, buf: torch.Tensor) -> Any:
    view = buf[0]

    def body(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        view.add_(1)  # writes a view of buf, which the body reads whole
        return y + buf.sum()

    return hop.fori_loop(torch.tensor(0), torch.tensor(3), body, x)


@pytest.mark.parametrize("mode", ["make_fx", "compile"])
def test_a_write_through_one_of_two_aliases_is_never_made_two_values(mode: str) -> None:
    """Made pure, two ways to one memory would become two tensors, each missing the
    other's writes (a silent difference from Python, found by review): refused, unless
    the path gives the one value Python does (Dynamo passes one tensor once)."""
    want_cond = _operand_also_closed_over(torch.ones(3))
    torch._dynamo.reset()
    if mode == "make_fx":
        with pytest.raises(MutationError, match=r"hop.cond: true_fn \(.*taken.*\) writes acc in place.*shares memory"):
            make_fx(_operand_also_closed_over, tracing_mode="fake")(torch.ones(3))
        with pytest.raises(MutationError, match=r"hop.fori_loop: body_fn \(.*body.*\) writes view in place.*shares"):
            make_fx(_view_of_a_read_buffer, tracing_mode="fake")(torch.zeros(()), torch.zeros(2, 3))
        return
    got = torch.compile(_operand_also_closed_over, backend="aot_eager", fullgraph=True)(torch.ones(3))
    torch.testing.assert_close(got, want_cond)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"hop.fori_loop: body_fn .* shares memory"):
        torch.compile(_view_of_a_read_buffer, backend="aot_eager", fullgraph=True)(torch.zeros(()), torch.zeros(2, 3))
