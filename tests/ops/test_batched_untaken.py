"""Each batch element differentiates only its own program: a branch a vmapped cond or
switch did not take for an element, and a step a vmapped loop ran for an element that
had already finished, contribute nothing to that element's gradient, not even
``0 * inf`` (Note [finished elements are not differentiated] in
``hop.ops.while_loops._run``). Checked against each element's own program, with the
gradient taken inside the vmap (``vmap(grad(f))``) and outside it (autograd of
``vmap(f)``, ``grad(vmap(f))``), eagerly and traced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop

Fn = Callable[[torch.Tensor], torch.Tensor]
W = torch.tensor(2.0, requires_grad=True)


def root_or_zero(x: torch.Tensor) -> torch.Tensor:  # sqrt's derivative at -1 is nan
    return hop.cond(x > 0, lambda a: a.sqrt() * W, lambda a: torch.zeros_like(a), (x,))


def three_way(x: torch.Tensor) -> torch.Tensor:  # log's derivative at 0 is inf
    index = (x > 0).long() + (x > 5).long()
    branches = [lambda a: torch.zeros_like(a), lambda a: a.sqrt() * W, lambda a: (a - 5).log()]
    return hop.switch(index, branches, (x,))


def shrink(x: torch.Tensor) -> torch.Tensor:
    """Steps until the value is at most 1; a finished element's carry is at most 1, where
    ``sqrt(a - 1)`` has an infinite (or nan) derivative."""
    return hop.while_loop(lambda i, a: a > 1.0, lambda i, a: (i + 1, (a - 1).sqrt() * W / 2), (torch.zeros(()), x))[1]


def adaptive(x: torch.Tensor) -> torch.Tensor:
    """An adaptive step to a target: the RMS norm of the step is differentiated, and a
    finished element's step is zero (the norm's derivative at zero is nan)."""

    def body(t: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = torch.minimum(1.0 - t, torch.full_like(t, 0.4))
        size = (step * y).pow(2).mean().sqrt()
        return t + step, y + step * y.sin() / (1 + size)

    return hop.while_loop(lambda t, y: t < 1.0 - 1e-6, body, (x, torch.full((2,), 0.5) * x))[1].sum()


def counted(n: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(0, n, lambda i, v: (v - 1).clamp_min(0).sqrt() * W, x)


PROGRAMS: dict[str, tuple[Fn, torch.Tensor]] = {
    "cond": (root_or_zero, torch.tensor([4.0, -1.0, 9.0])),
    "switch": (three_way, torch.tensor([-1.0, 4.0, 9.0, 5.0])),
    "while_loop": (shrink, torch.tensor([5.0, 0.5, 17.0, 1.0])),
    "adaptive": (adaptive, torch.tensor([0.1, 0.3, 0.95])),
}


def per_element(fn: Fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's own program, differentiated alone; the gradients of W summed."""
    gx, gw = [], torch.zeros(())
    for e in x.unbind():
        e = e.clone().requires_grad_()
        dx, dw = torch.autograd.grad(fn(e), (e, W), allow_unused=True, materialize_grads=True)
        gx.append(dx)
        gw = gw + dw
    return torch.stack(gx), gw


@pytest.mark.parametrize("name", PROGRAMS)
def test_autograd_outside_vmap(name: str) -> None:
    fn, x = PROGRAMS[name]
    expected = per_element(fn, x)
    xs = x.clone().requires_grad_()
    got = torch.autograd.grad(torch.vmap(fn)(xs).sum(), (xs, W), allow_unused=True, materialize_grads=True)
    assert all(g.isfinite().all() for g in got), got
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", PROGRAMS)
def test_grad_of_vmap_and_vmap_of_grad(name: str) -> None:
    fn, x = PROGRAMS[name]
    expected = per_element(fn, x)[0]
    torch.testing.assert_close(torch.func.grad(lambda v: torch.vmap(fn)(v).sum())(x), expected)
    torch.testing.assert_close(torch.vmap(torch.func.grad(fn))(x), expected)


def test_fori_loop_with_batched_bounds() -> None:
    """Elements run 0, 1 and 3 steps; a step past an element's bound is at sqrt(0)."""
    n, x = torch.tensor([0, 1, 3]), torch.tensor([1.0, 2.0, 5.0])
    expected = torch.stack([torch.func.grad(lambda v, k=k: counted(k, v))(e) for k, e in zip(n, x, strict=True)])
    xs = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(torch.vmap(counted)(n, xs).sum(), xs)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.vmap(torch.func.grad(counted, argnums=1))(n, x), expected)


def test_tangents_stay_right() -> None:
    """Forward mode was right before (the tangent of where is selected); it stays so."""
    fn, x = PROGRAMS["while_loop"]
    tangent = torch.ones_like(x)
    got = torch.func.jvp(torch.vmap(fn), (x,), (tangent,))[1]
    expected = torch.stack([torch.func.jvp(fn, (e,), (torch.ones(()),))[1] for e in x.unbind()])
    torch.testing.assert_close(got, expected)


def test_values_and_writes_unchanged_with_grad() -> None:
    """The masked step as a cond keeps the values, int carries and the carry count checks."""
    x = torch.tensor([5.0, 0.5, 17.0]).requires_grad_()

    def with_int(v: torch.Tensor) -> Any:
        return hop.while_loop(lambda k, a: a > 1.0, lambda k, a: (k, (a - 1).sqrt()), (3, v))

    k, out = torch.vmap(with_int, out_dims=(None, 0))(x)
    assert k == 3
    torch.testing.assert_close(out, torch.stack([with_int(e)[1] for e in x.detach().unbind()]))


def plain_root(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x > 0, lambda a: a.sqrt(), lambda a: torch.zeros_like(a), (x,))


def plain_shrink(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, a: a > 1.0, lambda i, a: (i + 1, (a - 1).sqrt()), (torch.zeros(()), x))[1]


TRACED: dict[str, tuple[Fn, torch.Tensor]] = {
    "cond": (plain_root, torch.tensor([4.0, -1.0, 9.0])),
    "while_loop": (plain_shrink, torch.tensor([5.0, 0.5, 17.0, 1.0])),
    "adaptive": PROGRAMS["adaptive"],
}


@pytest.mark.parametrize("name", TRACED)
def test_traced_gradients(name: str) -> None:
    """make_fx and torch.compile of grad(vmap(f)) and vmap(grad(f)): the traced loop's
    masked body and its reverse with a batched trip count step by cond as well."""
    fn, x = TRACED[name]
    expected = per_element(fn, x)[0]

    def outside(v: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda u: torch.vmap(fn)(u).sum())(v)

    def inside(v: torch.Tensor) -> torch.Tensor:
        return torch.vmap(torch.func.grad(fn))(v)

    for program in (outside, inside):
        gm = make_fx(program, tracing_mode="symbolic")(x)
        torch.testing.assert_close(gm(x), expected)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(program, backend="aot_eager", fullgraph=True)(x), expected)
    torch._dynamo.reset()


# --- a branch or body that also reads a batched tensor from its closure ----------------------


def _walk(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Steps while the sum stays under 3, each adding ``w`` times the step's noise ``u[t]``
    (``u`` is read from the closure: under vmap, a batched tensor)."""
    running = lambda t, x: (t < 5) & (x.sum() < 3)  # noqa: E731
    step = lambda t, x: (t + 1, x + w * u.index_select(0, t.reshape(1)).squeeze(0))  # noqa: E731
    return hop.while_loop(running, step, (torch.zeros((), dtype=torch.long), s))[1].sum()


def _walk_python(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    t, x = 0, s
    while t < 5 and bool(x.sum() < 3):
        x, t = x + w * u[t], t + 1
    return x.sum()


def _pick(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return hop.cond(s.sum() > 1, lambda a: (a * w * u[0]).sum(), lambda a: (a * 2 * u[1]).sum(), (s,))


def _pick_python(w: torch.Tensor, s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (s * w * u[0]).sum() if bool(s.sum() > 1) else (s * 2 * u[1]).sum()


@pytest.mark.parametrize(("fn", "twin"), [(_walk, _walk_python), (_pick, _pick_python)], ids=["while_loop", "cond"])
def test_a_batched_closure_under_grad_of_vmap(fn: Callable[..., Any], twin: Callable[..., Any]) -> None:
    # the branch autograd node's forward runs under a vmap of its own: a closure batched
    # at the old level failed functorch's internal assert ("batched == nullptr")
    g = torch.Generator().manual_seed(0)
    w, s, u = torch.tensor(0.7), torch.rand(4, 3, generator=g) * 1.5, torch.rand(4, 5, generator=g)
    batched = lambda w, s, u: torch.vmap(fn, (None, 0, 0))(w, s, u).sum()  # noqa: E731
    want = torch.func.grad(lambda w: sum(twin(w, s[i], u[i]) for i in range(4)))(w)
    torch.testing.assert_close(torch.func.grad(batched)(w, s, u), want)
    leaf = w.clone().requires_grad_()
    batched(leaf, s, u).backward()
    torch.testing.assert_close(leaf.grad, want)
    # vmap of grad of a vmap of one element (a per-example gradient of a batched model)
    per_example = torch.vmap(torch.func.grad(lambda w, s, u: batched(w, s[None], u[None])), (None, 0, 0))(w, s, u)
    torch.testing.assert_close(per_example, torch.stack([torch.func.grad(twin)(w, s[i], u[i]) for i in range(4)]))
