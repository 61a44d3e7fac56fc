"""The eager inline cache of cond and switch (Note [the eager inline cache]): the C
module and its Python reference give what the general path gives, and every
change that could make a cached decision wrong is seen."""

from __future__ import annotations

import functools
import gc
import os
import shutil
import sys
import sysconfig
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hop
from hop import _validation as validation
from hop.errors import HopTypeError, HopValueError, OutputMismatchError
from hop.ops.branching import _call_cache, _eager
from hop.ops.branching import cond as cond_module
from hop.ops.branching import switch as switch_module

IMPLS = ["python", *(["c"] if _call_cache.BUILT else [])]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(cond_module, "_fast", _call_cache.py_cond)
        monkeypatch.setattr(switch_module, "_fast", _call_cache.py_switch)
    validation.clear()
    yield request.param
    validation.clear()


def _sin(a: torch.Tensor) -> torch.Tensor:
    return a.sin()


def _cos(a: torch.Tensor) -> torch.Tensor:
    return a.cos()


def _served_by_cache(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Calls that reach the long-hand Python path (which makes entries) are recorded."""
    seen: list[str] = []
    real = _eager.eager_one

    def spy(b: Any, *args: Any) -> Any:
        seen.append(b.name)
        return real(b, *args)

    monkeypatch.setattr(_eager, "eager_one", spy)
    return seen


def test_the_c_module_is_built_where_a_compiler_is() -> None:
    if os.environ.get("HOP_FASTPATH") == "0":
        pytest.skip("HOP_FASTPATH=0: the Python reference runs, by request")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the Python reference runs")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers: the Python reference runs")
    assert _call_cache.BUILT, "hop._fastpath did not build: pip install -e . compiles it"


def test_steady_state_calls_are_served_by_the_cache(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _served_by_cache(monkeypatch)
    x = torch.randn(5)
    for p in [True, False, True, False, True]:
        torch.testing.assert_close(hop.cond(torch.tensor(p), _sin, _cos, (x,)), x.sin() if p else x.cos())
    for i in [0, 1, 2, 1, 0]:
        torch.testing.assert_close(
            hop.switch(torch.tensor(i), [_sin, _cos, torch.tanh], (x,)), [x.sin(), x.cos(), x.tanh()][i]
        )
    # the first call finds no verdict (and validates), the second makes the entry, the rest hit it
    assert seen == ["cond", "cond", "switch", "switch"]
    assert len(validation.INLINE["cond"]) == 1 and len(validation.INLINE["switch"]) == 1


def test_fresh_lambdas_share_an_entry_other_kinds_get_their_own(impl: str) -> None:
    for _ in range(4):
        for x in (torch.randn(3), torch.randn(2, 3), torch.randn(3, dtype=torch.float64)):
            out = hop.cond(torch.tensor(False), lambda a: a + 1, lambda a: a * 2, (x,))
            torch.testing.assert_close(out, x * 2)
    assert len(validation.INLINE["cond"]) == 3


def test_a_selector_of_numbers_is_read_as_python_reads_it(impl: str) -> None:
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(hop.cond(torch.tensor(2), _sin, _cos, (x,)), x.sin())
        torch.testing.assert_close(hop.cond(torch.tensor(0.0), _sin, _cos, (x,)), x.cos())
        torch.testing.assert_close(hop.cond(torch.tensor([True]), _sin, _cos, (x,)), x.sin())
        torch.testing.assert_close(hop.switch(torch.tensor([2], dtype=torch.int32), [_sin, _cos, _sin], (x,)), x.sin())


def test_unreadable_or_wrong_selectors_still_raise(impl: str) -> None:
    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), _sin, _cos, (x,))
        hop.switch(torch.tensor(0), [_sin, _cos], (x,))
    with pytest.raises(HopValueError, match="exactly one element"):
        hop.cond(torch.tensor([True, False]), _sin, _cos, (x,))
    with pytest.raises(HopValueError, match="meta"):
        hop.cond(torch.tensor(True, device="meta"), _sin, _cos, (x,))
    with pytest.raises(HopValueError):
        hop.switch(torch.tensor(2), [_sin, _cos], (x,))
    with pytest.raises(HopValueError):
        hop.switch(torch.tensor(-1), [_sin, _cos], (x,))
    with pytest.raises(HopTypeError, match="integer tensor"):
        hop.switch(torch.tensor(0.0), [_sin, _cos], (x,))


def test_outputs_that_alias_the_operand_are_cloned(impl: str) -> None:
    x = torch.randn(4)
    for _ in range(3):
        for fns in [(lambda a: a, _cos), (lambda a: a[1:], lambda a: a[:3])]:
            out = hop.cond(torch.tensor(True), *fns, (x,))
            assert out.data_ptr() != x.data_ptr() and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
            out.add_(1)  # never writes x
    assert len(validation.INLINE["cond"]) == 2  # still served: the cheap checks see these aliases
    torch.testing.assert_close(x, x.clone())
    y = torch.randn(4)
    before = y.clone()
    for _ in range(3):
        hop.switch(torch.tensor(0), [lambda a: a.view(2, 2).flatten(), _cos], (y,)).add_(1)
    torch.testing.assert_close(y, before)


def test_a_new_output_kind_is_validated_again(impl: str) -> None:
    box = {"dtype": torch.float32}

    def true_fn(a: torch.Tensor) -> torch.Tensor:
        return a.to(box["dtype"])

    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), true_fn, _cos, (x,))
    box["dtype"] = torch.float64  # not in the key: caught by the per-call output check
    with pytest.raises(OutputMismatchError, match="true_fn"):
        hop.cond(torch.tensor(True), true_fn, _cos, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a valid new kind: both branches agree
        out = hop.cond(torch.tensor(False), lambda a: a @ a.T, lambda a: a @ a.T, (torch.randn(2, 2),))
    assert out.dtype is torch.bfloat16


def test_a_reassigned_code_is_a_new_signature(impl: str) -> None:
    def true_fn(a: torch.Tensor) -> torch.Tensor:
        return a.sin()

    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), true_fn, _cos, (x,))
    true_fn.__code__ = (lambda a: a.double()).__code__
    with pytest.raises(OutputMismatchError):  # validated again: the branches now disagree
        hop.cond(torch.tensor(False), true_fn, _cos, (x,))


W: Any = 3.0


def _reads_w(a: torch.Tensor) -> torch.Tensor:
    return a * W


def test_a_rebound_global_gets_its_zero_gradient(impl: str) -> None:
    """Note [untaken branches get zero gradients]: the cache decided a branch reads no
    tensor; once its global is a parameter, the untaken branch's parameter gets zeros."""
    global W
    x = torch.randn(3)
    try:
        for _ in range(3):
            hop.cond(torch.tensor(True), _sin, _reads_w, (x,))
        W = torch.nn.Parameter(torch.tensor(2.0))
        hop.cond(torch.tensor(True), _sin, _reads_w, (x,)).sum().backward()
        assert W.grad is not None and W.grad.item() == 0.0
        hop.cond(torch.tensor(False), _sin, _reads_w, (x,)).sum().backward()
        torch.testing.assert_close(W.grad, x.sum())
    finally:
        W = 3.0


def test_operands_and_closures_that_require_grad_get_gradients(impl: str) -> None:
    w = torch.nn.Parameter(torch.tensor(2.0))
    x = torch.randn(3, requires_grad=True)
    for _ in range(3):
        x.grad = None
        hop.cond(torch.tensor(True), _sin, _cos, (x,)).sum().backward()
        torch.testing.assert_close(x.grad, x.detach().cos())
    for _ in range(3):
        hop.switch(torch.tensor(0), [_sin, lambda a, w=w: a * w], (x.detach(),)).sum().backward()
        assert w.grad is not None and w.grad.item() == 0.0


def test_switch_survives_a_branch_that_changes_the_list(impl: str) -> None:
    branches: list[Callable[[torch.Tensor], torch.Tensor]] = []

    def grow(a: torch.Tensor) -> torch.Tensor:
        branches.append(_cos)
        del branches[2:]
        return a.sin()

    branches += [grow, _cos]
    x = torch.randn(3)
    for _ in range(5):
        torch.testing.assert_close(hop.switch(torch.tensor(0), branches, (x,)), x.sin())
    assert len(branches) == 2


def test_a_raising_branch_raises_and_the_cache_keeps_serving(impl: str) -> None:
    box = {"raise": False}

    def maybe(a: torch.Tensor) -> torch.Tensor:
        if box["raise"]:
            raise KeyError("from the branch")
        return a.sin()

    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), maybe, _cos, (x,))
    box["raise"] = True
    for _ in range(3):
        with pytest.raises(KeyError, match="from the branch"):
            hop.cond(torch.tensor(True), maybe, _cos, (x,))
    box["raise"] = False
    torch.testing.assert_close(hop.cond(torch.tensor(True), maybe, _cos, (x,)), x.sin())


def test_no_references_leak_per_call(impl: str) -> None:
    x = torch.randn(3)
    p = torch.tensor(True)
    for _ in range(5):
        hop.cond(p, _sin, _cos, (x,))
        hop.switch(torch.tensor(1), [_sin, _cos], (x,))
    before = (sys.getrefcount(x), sys.getrefcount(p), sys.getrefcount(_sin), sys.getrefcount(_cos))
    for _ in range(1000):
        hop.cond(p, _sin, _cos, (x,))
        hop.switch(torch.tensor(1), [_sin, _cos], (x,))
    assert (sys.getrefcount(x), sys.getrefcount(p), sys.getrefcount(_sin), sys.getrefcount(_cos)) == before


def test_settings_and_forgotten_verdicts_bypass_the_cache(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return a + 1

    x = torch.ones(2)
    for _ in range(3):
        hop.cond(torch.tensor(True), lambda a: a * 2, counted, (x,))
    assert len(calls) == 1  # the one validation
    monkeypatch.setattr(hop.config, "validate", "always")
    for _ in range(3):
        hop.cond(torch.tensor(True), lambda a: a * 2, counted, (x,))
    assert len(calls) == 4  # validated on every call
    monkeypatch.setattr(hop.config, "validate", "once")
    validation.clear()
    assert not validation.INLINE["cond"]
    hop.cond(torch.tensor(True), lambda a: a * 2, counted, (x,))
    assert len(calls) == 5


def test_the_cache_is_bounded(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_call_cache, "CACHE_SIZE", 4)
    x = torch.randn(2)
    for rank in range(1, 12):
        y = x.reshape([1] * (rank - 1) + [2])
        for _ in range(2):
            hop.cond(torch.tensor(True), _sin, _cos, (y,))
    assert 1 <= len(validation.INLINE["cond"]) <= 4


def test_modes_and_transforms_are_not_served(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), _sin, _cos, (x,))
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda p, v: hop.cond(p, _sin, _cos, (v,)))(torch.tensor(True), x)
    assert any(n.target is torch.ops.hop.cond for n in gm.graph.nodes)
    out = torch.vmap(lambda v: hop.cond(torch.tensor(True), _sin, _cos, (v,)))(torch.randn(2, 3))
    assert out.shape == (2, 3)
    g = torch.func.grad(lambda v: hop.cond(torch.tensor(False), _sin, _cos, (v,)).sum())(x)
    torch.testing.assert_close(g, -x.sin())


def test_trace_and_reference_still_see_cached_calls(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3)
    for _ in range(3):
        hop.cond(torch.tensor(True), _sin, _cos, (x,))
        hop.switch(torch.tensor(1), [_sin, _cos], (x,))
    with hop.debug.trace() as records:
        hop.cond(torch.tensor(True), _sin, _cos, (x,))
        hop.switch(torch.tensor(1), [_sin, _cos], (x,))
    assert [r.op for r in records if r.kind == "call"] == ["cond", "switch"]
    ran: list[str] = []
    for name in ("reference_cond", "reference_switch"):
        real = getattr(hop._reference, name)
        monkeypatch.setattr(hop._reference, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    with hop.testing.reference():
        torch.testing.assert_close(hop.cond(torch.tensor(True), _sin, _cos, (x,)), x.sin())
        torch.testing.assert_close(hop.switch(torch.tensor(1), [_sin, _cos], (x,)), x.cos())
    assert ran == ["reference_cond", "reference_switch"]


# --- what a QA probe found: threads, memory, settings, indirect parameters -----------------

P = torch.nn.Parameter(torch.tensor(2.0))
NS = types.SimpleNamespace(w=P)
LST = [P]
DCT = {"w": P}
PART = functools.partial(torch.mul, P)


@pytest.mark.parametrize(
    "untaken",
    [
        lambda a: a * NS.w,
        lambda a: a * LST[0],
        lambda a: a * DCT["w"],
        lambda a: PART(a),
        P.mul,
    ],
    ids=["namespace", "list", "dict", "partial", "bound builtin"],
)
def test_parameters_reached_through_globals_get_zero_gradients(impl: str, untaken: Any) -> None:
    for _ in range(4):
        P.grad = None
        hop.cond(torch.tensor(True), _sin, untaken, (torch.randn(3),)).sum().backward()
        assert P.grad is not None and P.grad.item() == 0.0


def test_entries_keep_nothing_alive(impl: str) -> None:
    global BUF
    p = torch.tensor(True)
    BUF = [torch.randn(1000)]
    big = weakref.ref(BUF[0])
    for _ in range(4):
        hop.cond(p, _reads_buf, _cos, (torch.randn(3),))
    BUF = [1]  # the entry decided on the old value: it must not keep it
    gc.collect()
    assert big() is None
    owners = []
    for _ in range(5):
        w = torch.randn(3)
        owners.append(weakref.ref(w))
        for _ in range(4):
            hop.cond(p, w.mul, w.add, (torch.randn(3),))  # bound builtins: never cached
        del w
    gc.collect()
    assert all(r() is None for r in owners)


BUF: Any = []


def _reads_buf(a: torch.Tensor) -> torch.Tensor:
    return a + len(BUF)


def test_an_equal_validate_string_is_once(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hop.config, "validate", "".join(["on", "ce"]))  # equal, not the same object
    seen = _served_by_cache(monkeypatch)
    for _ in range(5):
        hop.cond(torch.tensor(True), _sin, _cos, (torch.randn(3),))
    assert seen == ["cond", "cond"]


def test_methods_bound_to_fresh_tensors_never_share_a_verdict(impl: str) -> None:
    y = torch.randn(3)
    for _ in range(50):
        t = torch.randn(3)
        hop.cond(torch.tensor(True), t.add, t.sub, (y,))
        with pytest.raises(OutputMismatchError):
            hop.cond(torch.tensor(True), t.add, t.dot, (y,))  # a new method at a reused address


def test_threads_clearing_the_cache_while_a_selector_is_read(impl: str) -> None:
    """Reading a tensor selector releases the GIL; a thread that empties the cache then
    must not free the entry another thread found (a use-after-free in C)."""
    x = torch.randn(3)
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        try:
            for _ in range(800):
                torch.testing.assert_close(hop.cond(torch.tensor(True), _sin, _cos, (x,)), x.sin())
                torch.testing.assert_close(hop.switch(torch.tensor(1), [_sin, _cos], (x,)), x.cos())
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            stop.set()

    def churn() -> None:
        while not stop.is_set():
            validation.clear()  # what a full verdict cache or a new output kind does
            hop.cond(torch.tensor(False), _sin, _cos, (x,))

    threads = [threading.Thread(target=serve), threading.Thread(target=churn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize(
    ("alias", "served"),
    [(lambda a: a.detach(), False), (lambda a: a.data, False), (lambda a: a.detach().view(-1), True)],
    ids=["detach", "data", "view of detach"],
)
def test_aliases_that_are_not_views_are_cloned(impl: str, alias: Any, served: bool) -> None:
    """x.detach() shares x's memory without being a view: validation sees the shared
    storage, such calls are never cached inline, and the general path clones them."""
    for requires_grad in (False, True):
        x = torch.randn(3, requires_grad=requires_grad)
        before = x.detach().clone()
        for _ in range(4):
            hop.cond(torch.tensor(True), alias, lambda a: a * 2, (x,)).mul_(0)
            hop.switch(torch.tensor(0), [alias, lambda a: a * 2], (x,)).mul_(0)
        torch.testing.assert_close(x.detach(), before)
    # a view is seen by the cache's own checks; the others are never served from it
    assert bool(validation.INLINE["cond"]) is served and bool(validation.INLINE["switch"]) is served


def _finished_in_python(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = _eager.finish_ran

    def spy(*args: Any) -> Any:
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(_eager, "finish_ran", spy)
    return seen


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_an_operand_requiring_grad_that_the_branch_reaches_is_served(
    impl: str, leaf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Note [untaken branches get zero gradients]: the graph gives x its gradient, so
    # no zero-gradient node is needed and the cache finishes the call itself
    finished = _finished_in_python(monkeypatch)
    w = torch.randn(3, requires_grad=True)
    for p in [True, False, True, False]:
        x = w if leaf else w * 2
        w.grad = None
        out = hop.cond(torch.tensor(p), _sin, _cos, (x,))
        assert out.grad_fn is not None
        out.sum().backward()
        scale = 1 if leaf else 2
        torch.testing.assert_close(w.grad, scale * (x.detach().cos() if p else -x.detach().sin()))
    assert len(finished) <= 2  # the calls that made the entry; then the cache serves


def test_an_operand_the_branch_does_not_reach_still_gets_zeros(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    finished = _finished_in_python(monkeypatch)
    x = torch.randn(3, requires_grad=True)
    deep = lambda a: a.neg().neg().neg().neg().neg().neg().neg().neg().neg()  # noqa: E731 x beyond 8 nodes
    for _ in range(4):
        x.grad = None
        (y,) = torch.autograd.grad(hop.cond(torch.tensor(True), lambda a: torch.ones(3), _cos, (x,)).sum(), x)
        torch.testing.assert_close(y, torch.zeros(3))
        x.grad = None
        hop.cond(torch.tensor(True), deep, _cos, (x,)).sum().backward()
        torch.testing.assert_close(x.grad, -torch.ones(3))
    assert len(finished) >= 4  # Python finished each: a node for the first, a longer walk for the second


def test_no_references_leak_per_call_with_grad(impl: str) -> None:
    x = torch.randn(3, requires_grad=True)
    p = torch.tensor(True)
    for _ in range(5):
        hop.cond(p, _sin, _cos, (x,))
    before = (sys.getrefcount(x), sys.getrefcount(p), sys.getrefcount(_sin))
    for _ in range(1000):
        hop.cond(p, _sin, _cos, (x,))
        hop.switch(torch.tensor(1), [_sin, _cos], (x,))
    assert (sys.getrefcount(x), sys.getrefcount(p), sys.getrefcount(_sin)) == before
