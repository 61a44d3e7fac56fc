"""State inside control flow: in-place writes to carries, operands and closed-over
buffers, with the plain Python program's values in every mode (Note [state inside
control flow] in hop._state)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop


class ForiBuffer(torch.nn.Module):
    """A fori_loop body writing one row per step into a module buffer (a KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def body(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(0, i.reshape(1), y[None])
            return y * 2

        return hop.fori_loop(torch.tensor(0), torch.tensor(4), body, x)


class SetItemBuffer(torch.nn.Module):
    """``self.cache[i] = y`` with a tensor index, only on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def cond_fn(i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return i < 5

        def body(i: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hop.cond(i % 2 == 0, self._write, lambda i, y: None, (i, y))
            return i + 1, y + 1

        return hop.while_loop(cond_fn, body, (torch.tensor(0), x))[1]

    def _write(self, i: torch.Tensor, y: torch.Tensor) -> None:
        self.cache[i.reshape(1)] = y[None]


class CarryWritten(torch.nn.Module):
    """A while_loop carry written in place and returned (a ring buffer carried)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.zeros(4, 3)

        def body(i: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            b.index_copy_(0, (i % 4).reshape(1), y[None])
            return i + 1, b, y + 1

        _, b, y = hop.while_loop(lambda i, b, y: i < 6, body, (torch.tensor(0), buf, x))
        return b, y + buf.sum()  # buf itself was written, as in Python


class CondOperand(torch.nn.Module):
    """cond writing an operand in one branch only, and a buffer in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros_like(x)

        def bump(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            a.add_(v)
            return v * 2

        def count(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.count.add_(1)
            return v - 1

        out = hop.cond(x.sum() > 0, bump, count, (acc, x))
        return out, acc


class ScanState(torch.nn.Module):
    """A scan step adding into a running buffer and writing its carry."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.total.add_(x)
            c.mul_(0.5).add_(x)
            return c, c.sum()

        c, ys = hop.scan(step, torch.ones(3), xs)
        return c, ys


class SwitchState(torch.nn.Module):
    """switch: one branch writes an operand and an element of a buffer, one only the
    buffer, one nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("hist", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros_like(x)

        def first(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.hist[0] += 1
            return v + 1

        def second(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            a.copy_(v * 3)
            self.hist[1] += 1
            return v * 2

        out = hop.switch(x.sum().long() % 3, [first, second, lambda a, v: v - 1], (acc, x))
        return out, acc


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], torch.Tensor]]] = {
    "fori_buffer": (ForiBuffer, lambda: torch.arange(3.0)),
    "setitem_buffer": (SetItemBuffer, lambda: torch.arange(3.0)),
    "carry_written": (CarryWritten, lambda: torch.arange(3.0)),
    "cond_pos": (CondOperand, lambda: torch.arange(3.0)),
    "cond_neg": (CondOperand, lambda: -torch.arange(3.0)),
    "scan_state": (ScanState, lambda: torch.arange(12.0).reshape(4, 3)),
    "switch_0": (SwitchState, lambda: torch.ones(3)),
    "switch_1": (SwitchState, lambda: torch.tensor([1.0, 0.0, 0.0])),
    "switch_2": (SwitchState, lambda: torch.tensor([2.0, 0.0, 0.0])),
}


def _eager(name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    make, inp = MODELS[name]
    m = make()
    out = m(inp())
    return out, dict(m.named_buffers())


def _check(name: str, run: Callable[[torch.nn.Module, torch.Tensor], tuple[Any, dict[str, torch.Tensor]]]) -> None:
    want, want_buffers = _eager(name)
    make, inp = MODELS[name]
    got, got_buffers = run(make(), inp())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_buffers, want_buffers)


def _second_call(name: str, run: Callable[..., Any]) -> None:
    """A second call reads the state the first left (the program is not traced twice)."""
    make, inp = MODELS[name]
    ref = make()
    ref(inp())
    want = ref(inp())
    got = run(make(), inp())
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], dict(ref.named_buffers()))


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
@pytest.mark.parametrize("name", MODELS)
def test_make_fx(name: str, tracing_mode: str) -> None:
    """The module's buffers as inputs of the traced function: the graph writes them."""

    def run(m: torch.nn.Module, x: torch.Tensor) -> Any:
        names = [n for n, _ in m.named_buffers()]

        def f(x: torch.Tensor, *buffers: torch.Tensor) -> Any:
            return torch.func.functional_call(m, dict(zip(names, buffers, strict=True)), (x,))

        buffers = [b.clone() for _, b in m.named_buffers()]
        gm = make_fx(f, tracing_mode=tracing_mode)(x, *[b.clone() for b in buffers])
        out = gm(x, *buffers)
        return out, dict(zip(names, buffers, strict=True))

    _check(name, run)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    ("decompose", "strict"), [(False, False), (True, False), (True, True)], ids=["training_ir", "decomposed", "strict"]
)
def test_export(name: str, decompose: bool, strict: bool) -> None:
    def run(m: torch.nn.Module, x: torch.Tensor) -> Any:
        ep = torch.export.export(m, (x,), strict=strict)
        if decompose:
            ep = ep.run_decompositions()
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        mod = torch.export.load(buf).module()
        return mod(x), dict(mod.named_buffers())

    _check(name, run)


@pytest.mark.parametrize("name", ["fori_buffer", "cond_neg", "scan_state"])
def test_export_names_mutated_buffers(name: str) -> None:
    make, inp = MODELS[name]
    ep = torch.export.export(make(), (inp(),)).run_decompositions()
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(n for n, _ in make().named_buffers())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", MODELS)
def test_compile(name: str, backend: str) -> None:
    torch._dynamo.reset()

    def run(m: torch.nn.Module, x: torch.Tensor) -> Any:
        out = torch.compile(m, backend=backend, fullgraph=True)(x)
        return out, dict(m.named_buffers())

    _check(name, run)


class Decoder(torch.nn.Module):
    """A step reading the cache the previous steps (and calls) wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def step(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(0, i.reshape(1), h[None])
            return torch.tanh(h + self.cache.sum(0))

        return hop.fori_loop(torch.tensor(0), torch.tensor(5), step, x)


def test_aoti_package_keeps_the_state_across_calls(tmp_path: Any) -> None:
    x = torch.linspace(-1, 1, 4)
    eager = Decoder()
    want = [eager(x), eager(x)]
    assert not torch.equal(want[0], want[1])  # the second call reads what the first wrote
    ep = torch.export.export(Decoder(), (x,))
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "decoder.pt2"))
    loaded = torch._inductor.aoti_load_package(package)
    torch.testing.assert_close([loaded(x), loaded(x)], want)
