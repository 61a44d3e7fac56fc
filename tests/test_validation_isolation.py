"""The validate-once run is invisible: the first call behaves as every later one.

Each test builds its callables inside the test, so the first call really validates
(the verdict cache is keyed on their code and closures); ``hop.config.validate =
"always"`` makes every call validate, the strictest setting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import hop
from hop import _fake_run


@pytest.fixture(autouse=True)
def always_validate() -> Iterator[None]:
    previous = hop.config.validate
    hop.config.validate = "always"
    yield
    hop.config.validate = previous


def _calls(lin: torch.nn.Module) -> dict[str, Callable[[torch.Tensor], Any]]:
    """One first call per operator that reads ``lin`` from its closure."""
    return {
        "cond": lambda x: hop.cond(x.sum() > 0, lambda v: lin(v), lambda v: lin(v) * 2, (x,)),
        "switch": lambda x: hop.switch(torch.tensor(1), [lambda v: lin(v), lambda v: lin(v) * 2], (x,)),
        # a loop's carry keeps its dtype, under autocast too
        "while_loop": lambda x: hop.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, lin(v).to(v.dtype)), (0, x))[1],
        "fori_loop": lambda x: hop.fori_loop(0, 2, lambda i, v: lin(v).to(v.dtype), x),
        "map": lambda x: hop.map(lambda v: lin(v), x.unsqueeze(0))[0],
        "scan": lambda x: hop.scan(lambda c, v: (lin(c).to(c.dtype), c), x, x.unsqueeze(0))[0],
    }


@pytest.mark.parametrize("op", list(_calls(torch.nn.Identity())))
def test_autocast_first_call_returns_real_tensors(op: str) -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4).abs()
    with torch.autocast("cpu", torch.bfloat16):
        out = _calls(lin)[op](x)
        after = lin(x)  # autocast's cast cache must hold no fake weight
        want = _calls(lin)[op](x)
    assert not isinstance(out, FakeTensor)
    assert not isinstance(after, FakeTensor)
    assert out.dtype == (torch.bfloat16 if op in ("cond", "switch", "map") else torch.float32)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("op", list(_calls(torch.nn.Identity())))
def test_checkpoint_around_a_first_call(op: str) -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(_calls(lin)[op], x, use_reentrant=False)
    y.sum().backward()
    assert x.grad is not None
    want = torch.autograd.grad(_calls(lin)[op](x).sum(), x)[0]
    torch.testing.assert_close(x.grad, want)


def test_jit_trace_of_a_first_call() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return hop.cond(x.sum() > 0, lambda v: self.lin(v).sin(), lambda v: self.lin(v).cos(), (x,))

    m = M()
    x = torch.randn(2, 4).abs()
    traced = torch.jit.trace(m, (x,), check_trace=False)
    torch.testing.assert_close(traced(x), m.lin(x).sin())


def test_closed_over_buffer_updated_in_place_by_cond() -> None:
    count = torch.zeros(())

    def taken(x: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        return x + 1

    def untaken(x: torch.Tensor) -> torch.Tensor:
        count.add_(10)
        return x - 1

    hop.cond(torch.tensor(True), taken, untaken, (torch.ones(2),))
    assert count.item() == 1
    hop.switch(torch.tensor(1), [untaken, taken], (torch.ones(2),))
    assert count.item() == 2


def test_closed_over_buffer_updated_in_place_by_loops() -> None:
    count = torch.zeros(())

    def body(i: int, v: torch.Tensor) -> tuple[int, torch.Tensor]:
        count.add_(1)
        return i + 1, v

    hop.while_loop(lambda i, v: i < 2, body, (0, torch.ones(2)))
    assert count.item() == 2

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count.add_(1)
        return c + x, c

    hop.scan(step, torch.zeros(2), torch.ones(3, 2))
    assert count.item() == 5
    hop.map(lambda x: count.add_(1) * 0 + x, torch.ones(4, 2))
    assert count.item() == 9


def test_running_statistic_of_a_module_is_updated_once() -> None:
    bn = torch.nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    hop.cond(torch.tensor(True), lambda v: bn(v), lambda v: bn(v) * 0, (x,))
    assert int(bn.num_batches_tracked) == 1
    plain = torch.nn.BatchNorm1d(4)
    plain(x)
    torch.testing.assert_close(bn.running_mean, plain.running_mean)


def test_recursive_branch_computes_like_python() -> None:
    def factorial(n: torch.Tensor) -> torch.Tensor:
        return hop.cond(n <= 1, lambda m: torch.ones_like(m), lambda m: m * factorial(m - 1), (n,))

    torch.testing.assert_close(factorial(torch.tensor(5.0)), torch.tensor(120.0))
    torch.testing.assert_close(factorial(torch.tensor(1.0)), torch.tensor(1.0))


def test_recursion_does_not_hide_a_real_mismatch() -> None:
    with pytest.raises(hop.errors.HopError, match=r"dtype float32 vs float64"):
        hop.cond(torch.tensor(True), lambda v: v, lambda v: v.double(), (torch.ones(2),))


def test_fake_tensor_logger_is_left_as_the_user_set_it() -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    before = logger.level
    seen: list[int] = []

    def first_call(k: int) -> None:
        x = torch.ones(3)
        # nonzero cannot run on fake tensors: the validation run's failure is logged by torch
        hop.cond(torch.tensor(k % 2 == 0), lambda v: v.nonzero().sum() + v, lambda v: v, (x,))
        seen.append(logger.level)

    threads = [threading.Thread(target=first_call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert logger.level == before
    assert seen == [before] * 8


def test_records_outside_validation_still_reach_the_logger(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    with caplog.at_level(logging.WARNING, logger="torch._subclasses.fake_tensor"):
        logger.warning("user-visible")
    assert "user-visible" in caplog.text


def test_nothing_leaks_after_validation() -> None:
    x = torch.randn(3)
    hop.cond(torch.tensor(True), lambda v: v + 1, lambda v: v - 1, (x,))
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.is_autocast_cache_enabled()
    assert torch._C._get_tracing_state() is None
    assert getattr(_fake_run._LOCAL, "depth", 0) == 0
    assert not torch.nn.modules.module._global_forward_pre_hooks


# --- module hooks: Note [module hooks do not see validation] ----------------------------------


def _hooked_linear(seen: list[str]) -> torch.nn.Linear:
    lin = torch.nn.Linear(4, 4)
    lin.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    lin.register_forward_hook(lambda m, args, out: seen.append("post"))
    return lin


@pytest.mark.parametrize("op", list(_calls(torch.nn.Identity())))
def test_forward_hooks_fire_as_often_as_without_validation(op: str) -> None:
    seen: list[str] = []
    x = torch.randn(2, 4)
    out = _calls(_hooked_linear(seen))[op](x)
    validated = list(seen)
    seen.clear()
    hop.config.validate = "never"
    want = _calls(_hooked_linear(seen))[op](x)
    assert validated == seen and seen  # the real calls' hooks only
    assert out.shape == want.shape and not isinstance(out, FakeTensor)


def test_untaken_branch_module_hooks_do_not_fire() -> None:
    seen: list[str] = []
    a, b = _hooked_linear(seen), _hooked_linear(seen)
    b.register_forward_pre_hook(lambda m, args: seen.append("b"))
    hop.cond(torch.tensor(True), lambda v: a(v), lambda v: b(v), (torch.randn(2, 4),))
    hop.switch(torch.tensor(0), [lambda v: a(v), lambda v: b(v) + 1], (torch.randn(2, 4),))
    assert seen == ["pre", "post"] * 2


def test_hook_state_machine_sees_only_the_real_call() -> None:
    class Counted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.calls = 0
            self.register_forward_pre_hook(Counted.count)

        def count(self, args: Any) -> None:
            self.calls += 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    model = torch.nn.ModuleDict({"a": Counted(), "b": Counted()})
    for step in range(3):
        hop.cond(torch.tensor(step % 2 == 0), lambda v: model["a"](v), lambda v: model["b"](v) * 2, (torch.ones(4),))
    assert (model["a"].calls, model["b"].calls) == (2, 1)


def test_global_module_forward_hooks_see_only_real_calls() -> None:
    seen: list[str] = []
    pre = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: seen.append("pre"))
    post = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append("post"))
    try:
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        hop.cond(torch.tensor(False), lambda v: a(v), lambda v: b(v), (torch.randn(2, 4),))
    finally:
        pre.remove()
        post.remove()
    assert seen == ["pre", "post"]


def test_always_call_hooks_see_only_real_calls() -> None:
    seen: list[str] = []
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.register_forward_hook(lambda m, args, out: seen.append("b"), always_call=True)
    hop.cond(torch.tensor(True), lambda v: a(v), lambda v: b(v), (torch.randn(2, 4),))
    assert seen == []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append("g"), always_call=True)
    try:
        hop.cond(torch.tensor(True), lambda v: a(v), lambda v: v * 2, (torch.randn(2, 4),))
    finally:
        handle.remove()
    assert seen == ["g"]


def test_weight_norm_module_keeps_a_real_weight() -> None:
    a = torch.nn.Linear(4, 4)
    b = torch.nn.utils.weight_norm(torch.nn.Linear(4, 4))  # recomputes .weight in a forward pre-hook
    hop.cond(torch.tensor(True), lambda v: a(v), lambda v: b(v), (torch.randn(2, 4),))
    assert not isinstance(b.weight, FakeTensor)


def test_parametrization_cache_holds_no_fake_weight() -> None:
    class Symmetric(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return (w + w.T) / 2

    lin = torch.nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", Symmetric())
    x = torch.randn(2, 4)
    with torch.nn.utils.parametrize.cached():
        out = hop.cond(torch.tensor(True), lambda v: lin(v), lambda v: lin(v) * 2, (x,))
        again = lin(x)
    assert not isinstance(out, FakeTensor) and not isinstance(again, FakeTensor)
    torch.testing.assert_close(out, lin(x))
    torch.testing.assert_close(again, lin(x))


def test_hooked_branch_is_checked_by_its_real_call() -> None:
    seen: list[str] = []
    lin = _hooked_linear(seen)
    with pytest.raises(hop.errors.OutputMismatchError, match=r"true_fn .*could not be checked ahead of time.*hooks"):
        hop.cond(torch.tensor(True), lambda v: lin(v).double(), lambda v: v, (torch.randn(2, 4),))
    assert seen == ["pre", "post"]
    assert not torch.nn.modules.module._global_forward_pre_hooks  # hop's own is gone, after an error too


def test_dtype_changing_hook_is_no_false_mismatch() -> None:
    lin = torch.nn.Linear(4, 4).double()
    lin.register_forward_pre_hook(lambda m, args: tuple(a.double() for a in args))
    lin.register_forward_hook(lambda m, args, out: out.float())
    x = torch.randn(2, 4)
    hop.config.validate = "once"
    for k in (0, 1, 0):
        out = hop.cond(torch.tensor(k == 0), lambda v: lin(v), lambda v: v * 2, (x,))
        assert out.dtype == torch.float32


def test_hooks_of_another_thread_still_fire_during_validation() -> None:
    seen: list[str] = []
    other = _hooked_linear(seen)
    started, release = threading.Event(), threading.Event()

    def slow(v: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait(5)
        return v + 1

    t = threading.Thread(target=lambda: hop.cond(torch.tensor(True), slow, lambda v: v, (torch.ones(2),)))
    t.start()
    assert started.wait(5)  # the validating thread is inside its fake run now
    other(torch.randn(2, 4))
    release.set()
    t.join()
    assert seen[:2] == ["pre", "post"]


# --- hop.config values of the wrong kind ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("10", hop.errors.HopTypeError, r"^hop\.config: validation_cache_size must be an int, got '10' \(str\)"),
        (2.0, hop.errors.HopTypeError, r"validation_cache_size must be an int, got 2\.0 \(float\)"),
        (True, hop.errors.HopTypeError, r"validation_cache_size must be an int, got True \(bool\)"),
        (0, hop.errors.HopValueError, r"validation_cache_size must be at least 1, got 0"),
    ],
)
def test_validation_cache_size_of_the_wrong_kind_names_the_setting(value: Any, error: type, match: str) -> None:
    previous = hop.config.validation_cache_size
    hop.config.validation_cache_size = value
    try:
        with pytest.raises(error, match=match):
            hop.cond(torch.tensor(True), lambda v: v + 1, lambda v: v - 1, (torch.ones(2),))
        with pytest.raises(error, match=match):
            hop.while_loop(lambda i: i < 2, lambda i: i + 1, (torch.tensor(0),))
    finally:
        hop.config.validation_cache_size = previous


def test_backward_hooks_fire_only_in_the_real_backward() -> None:
    seen: list[str] = []
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    a.register_full_backward_hook(lambda m, gi, go: seen.append("a"))
    b.register_full_backward_hook(lambda m, gi, go: seen.append("b"))
    x = torch.randn(2, 4, requires_grad=True)
    hop.cond(torch.tensor(True), lambda v: a(v), lambda v: b(v), (x,)).sum().backward()
    assert seen == ["a"]
    assert all(p.grad is not None for p in (*a.parameters(), *b.parameters()))


# --- Note [validation under torch.func] -------------------------------------------------------


def _mismatched(op: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call whose untaken branch returns float64 where the taken one returns float32."""
    if op == "cond":
        return lambda v: hop.cond(torch.tensor(True), lambda a: a.sin().sum(), lambda a: a.double().sum(), (v,))
    return lambda v: hop.switch(torch.tensor(0), [lambda a: a.sin().sum(), lambda a: a.double().sum()], (v,))


_TRANSFORMS: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], Any]] = {
    "eager": lambda f, x: f(x),
    "grad": lambda f, x: torch.func.grad(f)(x),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (x,)),
    "vjp": lambda f, x: (lambda out, pull: (out, pull(torch.ones_like(out))))(*torch.func.vjp(f, x)),
    "vmap": lambda f, x: torch.vmap(f)(x.expand(2, 3)),
    "grad_of_vmap": lambda f, x: torch.func.grad(lambda v: torch.vmap(f)(v.expand(2, 3)).sum())(x),
}


@pytest.mark.parametrize("op", ["cond", "switch"])
@pytest.mark.parametrize("transform", list(_TRANSFORMS))
def test_mismatch_reported_inside_torch_func_as_outside(op: str, transform: str) -> None:
    with pytest.raises(hop.errors.OutputMismatchError, match=r"dtype float32 vs float64"):
        _TRANSFORMS[transform](_mismatched(op), torch.randn(3))


@pytest.mark.parametrize("transform", list(_TRANSFORMS))
def test_validation_under_torch_func_is_invisible(transform: str) -> None:
    runs: list[str] = []
    w = torch.randn(3)
    batched = torch.randn(2, 3)

    def t(a: torch.Tensor) -> torch.Tensor:
        runs.append(type(a).__name__)
        return (a * w).sin().sum()

    def f(a: torch.Tensor) -> torch.Tensor:
        runs.append(type(a).__name__)
        return (a * w).cos().sum()

    x = torch.randn(3)
    got = _TRANSFORMS[transform](lambda v: hop.cond(torch.tensor(False), t, f, (v,)), x)
    assert runs[:2] == ["FakeTensor", "FakeTensor"] and "FakeTensor" not in runs[2:]
    hop.config.validate = "never"
    want = _TRANSFORMS[transform](lambda v: (v * w).cos().sum(), x)
    torch.testing.assert_close(got, want)
    # a closed-over tensor batched by an outer vmap: its logical rank is checked
    out = torch.vmap(lambda v, y: hop.cond(torch.tensor(True), lambda a: a @ y, lambda a: (a * y).sum(), (v,)))(
        batched, batched
    )
    torch.testing.assert_close(out, (batched * batched).sum(1))


def test_hessian_through_a_validated_cond() -> None:
    x = torch.randn(3)
    h = torch.func.hessian(lambda v: hop.cond(torch.tensor(True), lambda a: a.pow(3).sum(), lambda a: a.sum(), (v,)))
    torch.testing.assert_close(h(x), torch.diag(6 * x))


@pytest.mark.parametrize("op", ["scan", "map"])
def test_empty_loop_over_a_hooked_module_raises_instead_of_firing_hooks(op: str) -> None:
    seen: list[str] = []
    lin = _hooked_linear(seen)
    call = {
        "scan": lambda: hop.scan(lambda c, x: (lin(c), c), torch.zeros(4), torch.ones(0, 4)),
        "map": lambda: hop.map(lambda x: lin(x), torch.ones(0, 4)),
    }[op]
    with pytest.raises(hop.errors.HopRuntimeError, match=r"xs has length 0.*Linear has forward hooks.*avoid calling"):
        call()
    assert seen == []


def test_hooked_modules_as_branches() -> None:
    seen: list[str] = []
    a, b = _hooked_linear(seen), _hooked_linear(seen)
    out = hop.cond(torch.tensor(False), a, b, (torch.ones(2, 4),))
    assert seen == ["pre", "post"]
    torch.testing.assert_close(out, b(torch.ones(2, 4)))


class _GradOfEnergy(torch.nn.Module):
    """A layer whose forward takes a gradient itself (an HMC leapfrog step's force)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda u: (self.lin(u) ** 2).sum())(v)


@pytest.mark.parametrize("op", list(_calls(torch.nn.Identity())))
def test_torch_func_grad_inside_a_first_call(op: str) -> None:
    # torch.func.grad refuses to run while saved-tensor hooks are pushed: the
    # validation run sets the caller's aside instead of pushing its own
    force = _GradOfEnergy()
    x = torch.randn(2, 4)
    out = _calls(force)[op](x)
    hop.config.validate = "never"
    torch.testing.assert_close(out, _calls(force)[op](x))


@pytest.mark.parametrize("op", list(_calls(torch.nn.Identity())))
def test_saved_tensor_hooks_see_only_the_real_run(op: str) -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _calls(lin)[op](x).sum().backward()
        validated = len(packed)
        packed.clear()
        hop.config.validate = "never"
        _calls(lin)[op](x).sum().backward()
    assert validated == len(packed)
    assert not any(isinstance(t, FakeTensor) for t in packed)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
