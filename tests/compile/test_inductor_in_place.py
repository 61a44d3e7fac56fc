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
    assert write_carries_in_place(gm, [torch.tensor(1), torch.zeros(4, 3)]) == [1]
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.index_put_.default in targets and aten.copy_.default in targets
    assert aten.index_put.default not in targets and aten.select_scatter.default not in targets
    got = gm(torch.tensor(1), buf, torch.ones(3))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want[1])  # written in place


@pytest.mark.parametrize("read", ["old", "old_view", "new"])
def test_a_carry_read_after_its_write_is_in_place_only_for_the_new_value(read: str) -> None:
    def body(buf: torch.Tensor, v: torch.Tensor) -> Any:
        view = buf[1:]
        b = aten.index_copy.default(buf, 0, torch.tensor([1]), v[None])
        read_ = {"old": buf, "old_view": view, "new": b}[read]
        return b, read_.sum() + v  # a read after the write

    gm = _body(body, torch.zeros(4, 3), torch.ones(3))
    want = gm(torch.zeros(4, 3), torch.ones(3))
    written = write_carries_in_place(gm, [torch.zeros(4, 3)])
    assert written == ([0] if read == "new" else [])
    assert (aten.index_copy.default in {n.target for n in gm.graph.nodes}) == (read != "new")
    torch.testing.assert_close(gm(torch.zeros(4, 3), torch.ones(3)), want)


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


# Note [a written graph input is the loop's own carry]
def _rows_loop(steps: int, read: str) -> Any:
    w = torch.eye(4) * 0.5

    def fn(buf: torch.Tensor, v: torch.Tensor) -> Any:
        before = buf.sum() if read == "before" else None

        def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            v = torch.tanh(v @ w) + 1
            buf.index_copy_(0, i.reshape(1), v[None])
            return v

        v = hop.fori_loop(torch.tensor(0), torch.tensor(steps), body, v)
        if read == "before":
            return v, before
        if read == "after":
            return v, buf.sum(0)
        if read == "returned":
            return v, buf
        if read == "second_loop":
            return hop.fori_loop(torch.tensor(0), torch.tensor(steps), body, v)
        return v

    return fn


def _compiled_code(fn: Any, *args: torch.Tensor, dynamic: bool | None = None) -> tuple[Any, str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True, dynamic=dynamic), *args)
    return out, "\n".join(code)


def _matches_python(fn: Any, make: Any, *args: torch.Tensor, dynamic: bool | None = None) -> str:
    """Run ``fn`` eagerly on one buffer ``make()`` gives and compiled on another: the
    outputs and the buffers agree. Returns the compiled code."""
    want_buf, buf = make(), make()
    want = fn(want_buf, *args)
    got, code = _compiled_code(fn, buf, *args, dynamic=dynamic)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want_buf)
    return code


def test_a_buffer_only_the_loop_writes_is_written_without_a_copy() -> None:
    fn = _rows_loop(5, "none")
    v = torch.randn(4)
    code = _matches_python(fn, lambda: torch.zeros(8, 4), v)
    want_buf, buf = torch.zeros(8, 4), torch.zeros(8, 4)
    fn(want_buf, v)
    torch.compile(fn, backend="inductor", fullgraph=True)(buf, v)
    # no clone of the buffer before the loop, no copy back after it (only the clone of
    # the zero-trip path, which a loop that runs no step returns)
    call = code[code.index("def call(") :]
    assert "copy_" not in call, call
    assert call.count(".clone()") == call.count("if not should_loop") * 3, call
    # a second call goes on from the buffer the first wrote, as in Python
    want_buf[:2] = 7.0
    buf[:2] = 7.0
    torch.testing.assert_close(torch.compile(fn, backend="inductor", fullgraph=True)(buf, v), fn(want_buf, v))
    torch.testing.assert_close(buf, want_buf)


@pytest.mark.parametrize("read", ["before", "after", "returned", "second_loop"])
@pytest.mark.parametrize("steps", [0, 3])
def test_a_buffer_read_outside_the_loop_keeps_python_values(read: str, steps: int) -> None:
    _matches_python(_rows_loop(steps, read), lambda: torch.ones(8, 4), torch.randn(4))


@pytest.mark.parametrize("form", ["closed_over", "carried"])
def test_a_strided_view_is_written_where_python_writes(form: str) -> None:
    # Inductor wrote such a view through a contiguous copy the loop dropped: the
    # caller's tensor kept its initial rows (silently, before the fix)
    w = torch.eye(4) * 0.5

    def carried(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> Any:
            b, v = c
            v = torch.tanh(v @ w) + 1
            return b.index_copy(0, i.reshape(1), v[None]), v

        return hop.fori_loop(torch.tensor(0), torch.tensor(4), body, (buf, v))

    fn = _rows_loop(4, "none") if form == "closed_over" else carried
    want_base, base = torch.zeros(8, 10), torch.zeros(8, 10)
    v = torch.randn(4)
    want = fn(want_base[2:, 3:7], v)
    got, _ = _compiled_code(fn, base[2:, 3:7], v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(base, want_base)
    got, _ = _compiled_code(fn, base.t()[:4, :6].t(), v)  # transposed
    torch.testing.assert_close(got, fn(want_base.t()[:4, :6].t(), v))
    torch.testing.assert_close(base, want_base)


def test_a_body_reading_the_buffer_it_writes_keeps_python_values() -> None:
    def fn(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            v = v + buf.sum(0)  # reads the rows earlier steps wrote, through the closure
            buf.index_copy_(0, i.reshape(1), v[None])
            return v

        return hop.fori_loop(torch.tensor(0), torch.tensor(4), body, v)

    _matches_python(fn, lambda: torch.ones(6, 3), torch.randn(3))


@pytest.mark.parametrize(("rows", "dynamic"), [(8, False), (16, False), (16, True)])
def test_a_scan_writing_a_buffer_it_closes_over_matches_python(rows: int, dynamic: bool) -> None:
    # the scan's loop writes the buffer, then its stacked outputs: before torch 2.15,
    # Inductor paired those writes with the carries in the wrong order (rows = 8, the
    # stacked outputs' size: the buffer silently kept wrong rows; 16: a lowering error)
    def fn(buf: torch.Tensor, xs: torch.Tensor) -> Any:
        def body(i: torch.Tensor, x: torch.Tensor) -> Any:
            buf.index_copy_(0, i.reshape(1), torch.tanh(x)[None])
            return i + 1, x * 2

        return hop.scan(body, torch.tensor(0), xs)

    code = _matches_python(fn, lambda: torch.zeros(rows, 4), torch.randn(8, 4), dynamic=dynamic)
    call = code[code.index("def call(") :]
    assert "copy_" not in call, call  # Note [a written graph input is the loop's own carry]


@pytest.mark.parametrize("form", ["closed_over", "carried"])
def test_a_body_reading_the_row_it_just_wrote_is_written_in_place(form: str) -> None:
    # attention over a cache the step appended to: the read sees this step's row
    def closed_over(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            buf.index_copy_(0, i.reshape(1), v[None])
            return torch.tanh(torch.softmax(buf @ v, 0) @ buf + v)

        return hop.fori_loop(torch.tensor(0), torch.tensor(5), body, v)

    def carried(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> Any:
            b, v = c
            b = b.index_copy(0, i.reshape(1), v[None])
            return b, torch.tanh(torch.softmax(b @ v, 0) @ b + v)

        return hop.fori_loop(torch.tensor(0), torch.tensor(5), body, (buf, v))

    fn = closed_over if form == "closed_over" else carried
    code = _matches_python(fn, lambda: torch.zeros(8, 4), torch.randn(4))
    body = code[code.index("def while_loop_graph_1") :]
    assert "empty_strided_cpu((8, 4)" not in body[: body.index("return")]  # no new buffer per step


def test_a_view_of_the_old_value_read_after_the_write_sees_the_old_rows() -> None:
    def fn(buf: torch.Tensor, v: torch.Tensor) -> Any:
        def body(i: torch.Tensor, c: tuple[torch.Tensor, torch.Tensor]) -> Any:
            b, v = c
            old = b[0]  # a view of the carry before the write
            b = b.index_copy(0, torch.zeros(1, dtype=torch.long), (v * 0 + i)[None])
            return b, v + old * (b[1] + 1)  # read after the write: the old row 0

        return hop.fori_loop(torch.tensor(1), torch.tensor(4), body, (buf, v))

    _matches_python(fn, lambda: torch.zeros(3, 2), torch.ones(2))


def test_a_carry_whose_size_is_read_is_written_in_place() -> None:
    # the size read is a node with no tensor value (the KV cache decoder's body, under
    # AOTInductor, crashed comparing its storage)
    def body(buf: torch.Tensor, v: torch.Tensor) -> Any:
        last = torch.full((1,), buf.shape[0] - 1, dtype=torch.int64)
        b = aten.index_copy.default(buf, 0, last, v[None])
        return b, v * buf.shape[0]

    gm = make_fx(body, tracing_mode="symbolic")(torch.zeros(4, 3), torch.ones(3))
    assert aten.sym_size.int in {n.target for n in gm.graph.nodes}
    want = gm(torch.zeros(4, 3), torch.ones(3))
    buf_node = next(iter(gm.graph.find_nodes(op="placeholder")))  # an initial value of the same sizes
    assert write_carries_in_place(gm, [buf_node]) == [0]
    buf = torch.zeros(4, 3)
    got = gm(buf, torch.ones(3))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf, want[0])
