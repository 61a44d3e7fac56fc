"""hop._fastpath (C) and its Python twin in hop.ops.branching._call_cache give the same answer.

Hypothesis draws calls of cond and switch (branches of every kind the cache knows or
refuses, operands of several kinds, selectors readable or not, grad on or off); each
call first runs twice through the public function (the second call makes the
entry), then both
implementations serve the same call against the same cache, and must agree on the
form of the answer (NOT_TAKEN, a finished result, or ``(out, k, entry)`` for Python to
finish), on the branch taken, on the entry and on the values. ``key`` is compared
as a relation: two calls' C keys are equal exactly when their Python keys are.
Note [the eager inline cache] lists the deliberate differences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

import hop
from hop import _validation as validation
from hop.ops.branching import _call_cache

pytestmark = pytest.mark.skipif(not _call_cache.BUILT, reason="hop._fastpath is not in use: nothing to compare")

# each example takes milliseconds: many more than the profile's default
MANY = settings(max_examples=settings.default.max_examples * 12)

if _call_cache.BUILT:
    from hop import _fastpath

W = torch.tensor(2.0)
LEARNED = torch.tensor(0.5, requires_grad=True)
SCALE = 3  # an inert global


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def plus_scale(x: torch.Tensor) -> torch.Tensor:
    return x + SCALE  # reads an inert global


def plus_learned(x: torch.Tensor) -> torch.Tensor:
    return x + LEARNED  # reads a global that requires grad


def same(x: torch.Tensor) -> torch.Tensor:
    return x  # the operand itself


def first_column(x: torch.Tensor) -> torch.Tensor:
    return x[..., :1]  # a view


def as_double(x: torch.Tensor) -> torch.Tensor:
    return x.double()  # another dtype for float32 operands


def flattened(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)  # another rank, and a view for some operands


def with_default(x: torch.Tensor, s: int = 2) -> torch.Tensor:
    return x * s


def _closure() -> Callable[[torch.Tensor], torch.Tensor]:
    k = 5

    def closed(x: torch.Tensor) -> torch.Tensor:
        return x - k

    return closed


BRANCHES: list[Callable[..., Any]] = [
    double,
    plus_scale,
    plus_learned,
    same,
    first_column,
    as_double,
    flattened,
    with_default,
    _closure(),
    torch.neg,  # an inert builtin
    torch.abs,
    W.mul,  # a builtin bound to a tensor: never cached
    lambda x: x - 1,
    lambda x: x.neg().neg().neg().neg().neg().neg().neg().neg().neg(),  # x beyond the C walk's 8 nodes
]

DTYPES = [torch.float32, torch.float64, torch.int64]


@hs.composite
def operands(draw: hs.DrawFn) -> torch.Tensor:
    dtype = draw(hs.sampled_from(DTYPES))
    shape = draw(hs.sampled_from([(), (3,), (2, 3)]))
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=dtype).reshape(shape)
    if dtype.is_floating_point and draw(hs.booleans()):
        x.requires_grad_()
        if draw(hs.booleans()):
            x = x * 1  # not a leaf: its grad_fn is what a branch's graph must reach
    return x


@hs.composite
def calls(draw: hs.DrawFn) -> tuple[str, Any, tuple[Callable[..., Any], ...], torch.Tensor, bool]:
    op = draw(hs.sampled_from(["cond", "switch"]))
    n = 2 if op == "cond" else draw(hs.integers(1, 3))
    fns = tuple(draw(hs.sampled_from(BRANCHES)) for _ in range(n))
    x = draw(operands())
    grad = draw(hs.booleans())
    if op == "cond":
        selector = draw(
            hs.sampled_from(
                [torch.tensor(True), torch.tensor(False), torch.tensor([True]), torch.tensor([True, False])]
            )
        )
    else:
        k = draw(hs.integers(-1, n))  # out of range at both ends too
        selector = torch.tensor(k, dtype=draw(hs.sampled_from([torch.int64, torch.int32, torch.uint8])))
        if k < 0 and selector.dtype == torch.uint8:
            selector = torch.tensor(k)
    return op, selector, fns, x, grad


def public(op: str, selector: Any, fns: tuple[Callable[..., Any], ...], x: torch.Tensor) -> None:
    """The public call, which makes entries; a misuse (a view the branch returns, a
    selector out of range) is allowed to raise."""
    try:
        if op == "cond":
            hop.cond(selector, fns[0], fns[1], (x,))
        else:
            hop.switch(selector, list(fns), (x,))
    except Exception:
        pass


def served(impl: str, op: str, selector: Any, fns: tuple[Callable[..., Any], ...], x: torch.Tensor) -> Any:
    if op == "cond":
        call = _fastpath.cond if impl == "c" else _call_cache.py_cond
        return call(selector, fns[0], fns[1], (x,))
    call = _fastpath.switch if impl == "c" else _call_cache.py_switch
    return call(selector, list(fns), (x,))


def outcome(answer: Any) -> tuple[str, Any, Any, Any]:
    """(form, branch, entry, value) of an answer."""
    if answer is _call_cache.NOT_TAKEN:
        return "not taken", None, None, None
    if type(answer) is tuple:
        out, k, entry = answer
        return "finish", k, entry, out
    return "done", None, None, answer


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.detach(), b.detach()))
    return a is b


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    validation.clear()
    yield
    validation.clear()


@MANY
@given(hs.lists(calls(), min_size=1, max_size=6))
def test_c_and_python_serve_every_call_alike(sequence: list[Any]) -> None:
    for op, selector, fns, x, grad in sequence:
        with torch.set_grad_enabled(grad):
            public(op, selector, fns, x)  # validates
            public(op, selector, fns, x)  # finds the verdict, makes the entry
            answers = {}
            for impl in ("c", "python"):
                try:
                    answers[impl] = outcome(served(impl, op, selector, fns, x))
                except Exception as e:  # what the branch or the selector raised
                    answers[impl] = ("raised", type(e), None, None)
        c, py = answers["c"], answers["python"]
        where = f"{op} with {[getattr(f, '__name__', f) for f in fns]} on {x.dtype}{tuple(x.shape)}, grad={grad}"
        assert c[:2] == py[:2], f"{where}: C answers {c[:2]}, Python {py[:2]}"
        assert c[2] is py[2], f"{where}: different entries"
        assert same_value(c[3], py[3]), f"{where}: different values"


@MANY
@given(calls(), calls())
def test_keys_are_equal_exactly_when_pythons_are(a: Any, b: Any) -> None:
    (_, _, fns_a, x_a, _), (_, _, fns_b, x_b, _) = a, b
    c_a, c_b = _fastpath.key(list(fns_a), x_a), _fastpath.key(list(fns_b), x_b)
    p_a, p_b = _call_cache.py_key(fns_a, x_a), _call_cache.py_key(fns_b, x_b)
    assert (c_a is None) == (p_a is None) and (c_b is None) == (p_b is None), (fns_a, fns_b)
    if p_a is not None and p_b is not None:
        assert (c_a == c_b) == (p_a == p_b), (fns_a, x_a.dtype, fns_b, x_b.dtype)


def test_the_c_module_refuses_another_entry_layout() -> None:
    with pytest.raises(RuntimeError, match=r"reads entries as \(items, dtype, .*rebuild the extension"):
        _fastpath.configure(
            entry_fields=("items", "dtype"),
            tensor=torch.Tensor,
            not_taken=_call_cache.NOT_TAKEN,
            config={},
            reference={},
            sinks=[],
            index_dtypes=set(),
            inert_types=frozenset(),
            cond_cache={},
            switch_cache={},
            mode_stack_len=len,
            functorch_level=len,
            tf_mode=len,
            grad_enabled=len,
            accumulate_grad=type,
            library_namespaces=set(),
        )
