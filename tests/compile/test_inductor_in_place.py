"""A loop body's writes to its carries are made in place before Inductor lowers the loop
(Note [a written carry is written in place] in hop.compile._inductor_in_place)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.compile._inductor_in_place import write_carries_in_place

aten = torch.ops.aten


def _body(fn: Any, *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn)(*args)


def test_a_chain_of_scatters_into_a_carry_becomes_in_place() -> None:
    def body(i: torch.Tensor, buf: torch.Tensor, v: torch.Tensor) -> Any:
        before = v.sum() + buf.sum()  # a read before the writes
        b = aten.index_put.default(buf, [i.reshape(1)], v[None])
        b = aten.select_scatter.default(b, v * 2, 0, 0)
        return i + 1, b, before

    gm = _body(body, torch.tensor(1), torch.zeros(4, 3), torch.ones(3))
    buf = torch.zeros(4, 3)
    want = gm(torch.tensor(1), buf.clone(), torch.ones(3))
    assert write_carries_in_place(gm, 2) == [1]
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.index_put_.default in targets and aten.copy_.default in targets
    assert aten.index_put.default not in targets and aten.select_scatter.default not in targets
    got = gm(torch.tensor(1), buf, torch.ones(3))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want[1])  # written in place


@pytest.mark.parametrize("read", ["old", "new"])
def test_a_carry_read_after_its_write_is_left_functional(read: str) -> None:
    def body(buf: torch.Tensor, v: torch.Tensor) -> Any:
        b = aten.index_copy.default(buf, 0, torch.tensor([0]), v[None])
        return b, (buf if read == "old" else b).sum() + v  # a read after the write

    gm = _body(body, torch.zeros(4, 3), torch.ones(3))
    assert write_carries_in_place(gm, 1) == []
    assert aten.index_copy.default in {n.target for n in gm.graph.nodes}


@pytest.mark.parametrize("form", ["in_place", "out_of_place"])
def test_a_compiled_loop_writing_rows_matches_python(form: str) -> None:
    w = torch.randn(4, 4) * 0.5

    def in_place(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            v = torch.tanh(v @ w + buf.sum(0))
            buf.index_copy_(0, i.reshape(1), v[None])
            return v

        return hop.fori_loop(torch.tensor(0), torch.tensor(6), body, v)

    def out_of_place(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> Any:
            b, v = c
            v = torch.tanh(v @ w + b.sum(0))
            return b.index_copy(0, i.reshape(1), v[None]), v

        return hop.fori_loop(torch.tensor(0), torch.tensor(6), body, (buf, v))

    fn = in_place if form == "in_place" else out_of_place
    want_buf, buf = torch.zeros(8, 4), torch.zeros(8, 4)
    v = torch.randn(4)
    want = fn(want_buf, v)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="inductor", fullgraph=True)(buf, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want_buf)
