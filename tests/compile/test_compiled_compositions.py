"""Transform compositions around every operator, compiled and exported.

``torch.compile(torch.vmap(torch.func.grad(f)), dynamic=True)`` failed inside Dynamo
("Batching rule not implemented for aten::sym_size.int") on every operator: a
subgraph placeholder's example value was a grad wrapper of a BatchedTensor, which
hop unwrapped only when the BatchedTensor was outermost. Under ``torch.export``
(non-strict) a ``torch.func.jvp`` around a loop with an int carry exported a loop
that ran the wrong number of steps, silently (the 0-dim tensors the ints travel as,
made under the transform, became constants), and a ``torch.func.grad`` around any
operator exported a program that returned FakeTensors: both are refused now, with
what to do. Found by ``hop.testing``'s ``compile_compositions`` and
``export_compositions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop
from hop.errors import HopRuntimeError, HopValueError

Program = Callable[[torch.Tensor], torch.Tensor]

PROGRAMS: dict[str, Program] = {
    "cond": lambda x: hop.cond(x.sum() > 0, lambda a: a.sin() * 2, lambda a: a.cos(), (x,)),
    "switch": lambda x: hop.switch((x.sum() > 0).long(), [lambda a: a.sin(), lambda a: a * a], (x,)),
    "while_loop": lambda x: hop.while_loop(
        lambda k, a: k < 3, lambda k, a: (k + 1, a.sin() * 2), (x.new_zeros((), dtype=torch.long), x)
    )[1],
    "fori_loop": lambda x: hop.fori_loop(0, 3, lambda i, a: a.sin() * 2, x),
    "map": lambda x: hop.map(lambda r: r.sin() * r, x.reshape(3, 1)).reshape(3),
    # xs made from x: strict export of a jvp cannot read a tensor the function closes
    # over (torch's Dynamo fails so on a plain program: "Cannot access data pointer")
    "scan": lambda x: hop.scan(lambda c, r: (c.sin() * r, c), x, x.expand(3, 3) * 0.5)[0],
    "associative_scan": lambda x: hop.associative_scan(lambda a, b: a * b.sin(), x, dim=0),
}


def _no_transform_left() -> None:
    assert torch._C._functorch.peek_interpreter_stack() is None


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_vmap_of_grad_equals_eager(name: str, dynamic: bool) -> None:
    f = PROGRAMS[name]
    per_row = torch.vmap(torch.func.grad(lambda x: f(x).sum()))
    x = torch.tensor([[0.3, -0.2, 0.9], [-1.0, -0.5, 0.1], [0.7, 0.2, -0.4], [-0.3, -0.3, -0.3]])
    want = torch.stack([torch.func.grad(lambda a: f(a).sum())(r) for r in x])
    torch._dynamo.reset()
    got = torch.compile(per_row, backend="aot_eager", fullgraph=True, dynamic=dynamic)(x)
    torch.testing.assert_close(got, want)


def test_compiled_vmap_of_grad_with_inductor_and_dynamic_shapes() -> None:
    f = PROGRAMS["cond"]
    x = torch.tensor([[0.3, -0.2, 0.9], [-1.0, -0.5, 0.1]])
    torch._dynamo.reset()
    got = torch.compile(torch.vmap(torch.func.grad(lambda a: f(a).sum())), fullgraph=True, dynamic=True)(x)
    torch.testing.assert_close(got, torch.stack([torch.func.grad(lambda a: f(a).sum())(r) for r in x]))


class Jvp(torch.nn.Module):
    def __init__(self, f: Program) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = torch.func.jvp(self.f, (x,), (t,))
        return out


TENSOR_CARRIES = [n for n in sorted(PROGRAMS) if n != "fori_loop"]  # fori_loop's int bounds: below


@pytest.mark.parametrize("name", TENSOR_CARRIES)
@pytest.mark.parametrize("strict", [False, True])
def test_exported_jvp_equals_eager(name: str, strict: bool) -> None:
    module = Jvp(PROGRAMS[name])
    x, t = torch.tensor([0.3, -0.2, 0.9]), torch.tensor([1.0, 0.5, -2.0])
    ep = torch.export.export(module, (x, t), strict=strict)
    for v in (x, -x, x * 3):
        got, want = ep.module()(v, t), module(v, t)
        torch.testing.assert_close(got, want)


def test_exported_jvp_of_a_loop_with_int_bounds_is_refused_not_wrong() -> None:
    module = Jvp(PROGRAMS["fori_loop"])
    x, t = torch.tensor([0.3, -0.2, 0.9]), torch.ones(3)
    with pytest.raises(
        HopValueError, match=r"^hop.fori_loop: under torch.func.jvp inside an exported function, loops carry"
    ):
        torch.export.export(module, (x, t))
    _no_transform_left()
    # the fix it names: tensor bounds
    bounded = Jvp(lambda a: hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, v: v.sin() * 2, a))
    ep = torch.export.export(bounded, (x, t))
    torch.testing.assert_close(ep.module()(x, t), module(x, t))


class Grad(torch.nn.Module):
    def __init__(self, f: Program) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda a: self.f(a).sum())(x)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_exported_grad_is_refused_with_what_to_do(name: str) -> None:
    # the exported program returned FakeTensors (cond, map, scan); torch cannot export
    # torch.func.grad of a plain program either
    x = torch.tensor([0.3, -0.2, 0.9])
    message = r"torch.func.grad inside a function torch.export traces cannot be exported .* make_fx\("
    with pytest.raises(HopRuntimeError, match=message):
        torch.export.export(Grad(PROGRAMS[name]), (x,))
    _no_transform_left()
    # grad outside a vmap too (it was refused with a message about factory functions)
    with pytest.raises(HopRuntimeError, match=message):
        torch.export.export(_GradOfVmap(PROGRAMS[name]), (x[None].expand(2, 3).clone(),))
    _no_transform_left()
    # the way it names: export without the transform, differentiate ep.module()
    ep = torch.export.export(_Forward(PROGRAMS[name]), (x,))
    got = torch.func.grad(lambda a: ep.module()(a).sum())(x)
    torch.testing.assert_close(got, Grad(PROGRAMS[name])(x))


class _Forward(torch.nn.Module):
    def __init__(self, f: Program) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x)


def test_a_tensor_made_by_a_factory_under_an_exported_jvp_is_refused_not_wrong() -> None:
    # torch.zeros inside the jvp: export's tracer never sees it; the loop it counted ran
    # the wrong number of steps, silently
    def f(x: torch.Tensor) -> torch.Tensor:
        k = torch.zeros((), dtype=torch.long)
        return hop.while_loop(lambda k, a: k < 3, lambda k, a: (k + 1, a.sin() * 2), (k, x))[1]

    x, t = torch.tensor([0.3, -0.2, 0.9]), torch.ones(3)
    with pytest.raises(HopRuntimeError, match=r"made by a factory function .*x\.new_zeros\(\(\)\)"):
        torch.export.export(Jvp(f), (x, t))
    _no_transform_left()


# --- found by the long profile of compile_compositions -------------------------------------


def test_compiled_grad_of_an_empty_map_with_dynamic_shapes() -> None:
    # the empty loop's output size is a symbol of the traced input (dynamic=True), not
    # data-dependent: it was refused as "a data-dependent shape (s87,)"
    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda r: r * 2, x).sum() + hop.scan(lambda c, r: (c + r, c * r), x.sum(0), x)[1].sum()

    x = torch.zeros(0, 4)
    for program, args in ((torch.func.grad(f), (x,)), (torch.vmap(torch.func.grad(f)), (torch.zeros(3, 0, 4),))):
        torch._dynamo.reset()
        got = torch.compile(program, backend="aot_eager", fullgraph=True, dynamic=True)(*args)
        torch.testing.assert_close(got, program(*args))


INNER: dict[str, Program] = {
    "fori_loop": lambda a: hop.fori_loop(0, 3, lambda i, v: v * 1.1 + 0.1 * i, a),
    "fori_loop of no step": lambda a: hop.fori_loop(1, 1, lambda i, v: v + 0.1 * i, a),
    "while_loop": lambda a: hop.while_loop(lambda k, v: k < 2, lambda k, v: (k + 1, v * 1.1), (0, a))[1],
}


@pytest.mark.parametrize("name", sorted(INNER))
@pytest.mark.parametrize("transform", ["vmap", "vmap_grad"])
def test_an_int_counted_loop_in_a_branch_a_batched_cond_selects(name: str, transform: str) -> None:
    # both branches run on the batch; the loop's counter, read with .item(), made an
    # unbacked symbol that torch.compile's fake run of the cond took for one its output
    # must bind (an internal error, under vmap a crash formatting it)
    def f(y: torch.Tensor) -> torch.Tensor:
        return hop.cond(y.sum() > 0, INNER[name], lambda a: a * 0.5, (y,))

    program = torch.vmap(f) if transform == "vmap" else torch.vmap(torch.func.grad(lambda a: f(a).sum()))
    x = torch.tensor([[0.3, -0.2, 0.1], [-0.3, -0.2, 0.1]])
    torch._dynamo.reset()
    got = torch.compile(program, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, program(x))


def test_a_loop_over_an_empty_batch_laid_out_by_vmap_compiles_with_inductor() -> None:
    # an empty (n, 0, 0) carry of stride (0, 0, 1) counted as contiguous in hop's
    # rewrite of map into a loop; torch's contiguous strides are (1, 1, 1), which the
    # loop's body returned, and torch's while_loop refused the mismatch
    def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        start = hop.map(lambda r: r.reshape(-1).view(r.shape) + r, x) - y
        return hop.while_loop(lambda i, a: i < 0, lambda i, a: (i + 1, y), (0, start))[1]

    x = hop.testing.strategies.with_layout(torch.zeros(0, 0), "channels_last")
    report = hop.testing.check(program, x, torch.zeros(0, 0), transforms=("eager", "compile_inductor_vmap"))
    assert report.ran == ["eager", "compile_inductor_vmap"]


def test_compiled_vmap_of_jvp_of_an_associative_scan_over_one_element_with_dynamic_shapes() -> None:
    # the jvp's scan over the remaining 0 elements shaped its empty output by a run on
    # fake copies in a fresh mode, holding the trace's symbols that mode cannot reason
    # about ("vr must not be None for symbol s87"); it runs in the trace's own mode now
    def f(a: torch.Tensor) -> torch.Tensor:
        return hop.associative_scan(lambda p, q: torch.where(p <= q, p, q), a, dim=0, reverse=True)

    gen = torch.Generator().manual_seed(0)
    xs, t = torch.randn(3, 1, 2, 4, generator=gen), torch.randn(1, 2, 4, generator=gen)
    program = torch.vmap(lambda a: torch.func.jvp(f, (a,), (t,))[1])
    torch._dynamo.reset()
    got = torch.compile(program, backend="aot_eager", fullgraph=True, dynamic=True)(xs)
    torch.testing.assert_close(got, program(xs))


@pytest.mark.xfail(
    reason="torch's Inductor (2.13-2.15) cannot compile vmap of a 0-dim tensor plus a SymFloat, with no hop "
    "operator: hop.testing skips compile_inductor_vmap and compile_compositions where it meets it (a "
    "fori_loop's int counter in a vmapped body, `a + 0.1 * i`)",
    strict=True,
)
def test_torch_compiles_vmap_of_a_scalar_tensor_plus_a_symfloat() -> None:
    def f(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        return torch.vmap(lambda a: a + 0.1 * k)(x)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)(torch.ones(3), torch.tensor(2))
    torch.testing.assert_close(got, f(torch.ones(3), torch.tensor(2)))


class _GradOfVmap(torch.nn.Module):
    def __init__(self, f: Program) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda b: torch.vmap(self.f)(b).sum())(x)


class _JvpOfCountedLoop(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> Any:
        def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return hop.fori_loop(1, torch.tensor(4), lambda i, v: b * b + 0.1 * i, a)

        return torch.func.jvp(f, (x, y), (tx, ty))


def test_an_exported_jvp_of_a_fori_loop_with_a_tensor_bound_runs_its_steps() -> None:
    """Found by the compiled long profile, silently wrong: fori_loop made its counter
    with torch.zeros, which under jvp inside non-strict export is a tensor the trace does
    not follow: exported as a fake constant, the loop ran no step (x and its tangent
    came back as they went in). The counter is made from the bound now."""
    args = (torch.tensor(1.5), torch.tensor(-0.15), torch.ones(()), torch.ones(()))
    ep = torch.export.export(_JvpOfCountedLoop(), args, strict=False)
    torch.testing.assert_close(ep.module()(*args), _JvpOfCountedLoop()(*args))


def test_exported_jvps_of_loops_with_scalar_tangents_deploy() -> None:
    """Found by the compiled long profile: the loop's tangent carry came back float64
    from torch's forward AD (a Python float took part), refused as a dtype mismatch;
    and a 0-dim tangent the exported program holds as a constant became an Inductor
    scalar that torch's while_loop lowering cannot take (AOTInductor failed)."""

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        inner = lambda i, a: hop.fori_loop(1, torch.tensor(4), lambda j, b: (y * y) + 0.1 * j, a * 0.5 + y)  # noqa: E731
        return hop.fori_loop(2, torch.tensor(5), lambda i, a: inner(i, a) + 0.1 * i, x)

    report = hop.testing.check(
        program, torch.tensor(1.5), torch.tensor(-0.15), transforms=["eager", "export_compositions"]
    )
    assert report.ran == ["eager", "export_compositions"]
