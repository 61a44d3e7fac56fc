"""The guards of compiled code that calls hop's operators: Dynamo checks every one of
them before each call, and once the compiled code has pushed them out of the CPU's
caches each costs cache misses (Note [public functions, inlined], Note [pytrees read
without tracing]). hop's calls add no more of them than torch's own operators do."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounter

import hop

LIN = torch.nn.Linear(4, 4)
X = torch.randn(3, 4)


def hop_cond(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda v: LIN(v), lambda v: v * 2, (x,))


def torch_cond(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda v: LIN(v), lambda v: v * 2, (x,))


def hop_loop(x: torch.Tensor) -> torch.Tensor:
    return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, LIN(v)), (torch.tensor(0), x))[1]


def torch_loop(x: torch.Tensor) -> torch.Tensor:
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, LIN(v)), (torch.tensor(0), x))[1]


def hop_others(x: torch.Tensor) -> torch.Tensor:
    c, ys = hop.scan(lambda c, r: (LIN(c) + r, c), torch.zeros(4), x)
    m = hop.map(lambda r: LIN(r), ys)
    s = hop.switch(torch.tensor(1), [lambda v: v, lambda v: LIN(v), lambda v: v * 2], (m,))
    f = hop.fori_loop(0, 2, lambda i, v: LIN(v), s)
    return hop.associative_scan(lambda a, b: a + b, f, 0) + c


Pair = collections.namedtuple("Pair", ["a", "b"])


def guards(fn: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """The lines of the guard tree Dynamo built for ``fn``'s one compiled entry."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), fn(X))
    (entry,) = _debug_get_cache_entry_list(fn.__code__)
    return str(entry.guard_manager).splitlines()


def test_no_guard_reads_what_the_public_function_reads() -> None:
    # failed before: Dynamo traced hop.cond's body (the eager fast path's flags, front,
    # hop.ops._common, hop._transforms) and torch's pytree registry, about 40 guards more
    for fn in (hop_cond, hop_loop, hop_others):
        lines = guards(fn)
        assert not [line for line in lines if "__import_hop_dot_ops" in line], fn.__name__
        assert not [line for line in lines if "SUPPORTED_NODES))[" in line], fn.__name__  # a registry entry


def test_no_more_guards_than_torch_twins() -> None:
    # failed before: the gated block of benchmarks/passes.py had 81 guard lines against
    # torch.cond's 40, 2.5% of its compiled call time
    assert len(guards(hop_cond)) <= len(guards(torch_cond))
    assert len(guards(hop_loop)) <= len(guards(torch_loop))


def test_reference_mode_still_reaches_compiled_code() -> None:
    # the flag of hop.testing.reference() is still guarded: compiled code entered inside
    # it is compiled again, through the public function's body, which runs the reference
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(hop_cond, backend=counter)
    torch.testing.assert_close(compiled(X), hop_cond(X))
    assert counter.frame_count == 1
    with hop.testing.reference():
        torch.testing.assert_close(compiled(X), hop_cond(X))
    assert counter.frame_count >= 2


def test_nested_tuples_and_lists_keep_their_structure() -> None:
    # operands and outputs of tuples and lists, with ints among the leaves, are read by
    # hop at trace time (Note [pytrees read without tracing]); a dict anywhere sends the
    # whole tree to torch's pytree code
    def plain(a: tuple[torch.Tensor, list[object]], b: torch.Tensor) -> object:
        return [a[0] * a[1][1], (a[1][0] + b, b - 1)]

    def with_dict(a: tuple[torch.Tensor, list[object]], b: dict[str, torch.Tensor]) -> object:
        return [a[0] * a[1][1], (a[1][0] + b["k"], {"k": b["k"] - 1})]

    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[object, object]:
        first = hop.cond(x.sum() > 0, plain, plain, ((x, [y, 3]), y))
        second = hop.cond(x.sum() > 0, with_dict, with_dict, ((x, [y, 3]), {"k": y}))
        return first, second

    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager", fullgraph=True)(X, X + 1)
    want = fn(X, X + 1)
    for out in got:
        assert type(out) is list and type(out[1]) is tuple
    assert type(got[1][1][1]) is dict
    torch.testing.assert_close(got, want)


def test_named_tuples_dicts_and_other_structures_come_back_whole() -> None:
    # failed in a first version: a named tuple returned by a branch was rebuilt from a
    # TreeSpec Dynamo cannot read (KeyError: namedtuple); a deque is a structure hop
    # leaves to Dynamo's pytree code, by tracing the branch again
    def fn(x: torch.Tensor) -> tuple[object, object, object]:
        pair = hop.cond(x.sum() > 0, lambda v: Pair(v + 1, {"k": v * 2}), lambda v: Pair(v - 1, {"k": v}), (x,))
        carry, ys = hop.scan(lambda c, r: (Pair(c.a + r, c.b), {"y": (c.a, r)}), Pair(x[0], x[1]), x)
        queue = hop.cond(
            x.sum() > 0, lambda v: collections.deque([v + 1, v]), lambda v: collections.deque([v, v]), (x,)
        )
        return pair, (carry, ys), queue

    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager", fullgraph=True)(X)
    want = fn(X)
    assert type(got[0]) is Pair and type(got[0].b) is dict
    assert type(got[1][0]) is Pair and type(got[1][1]) is dict
    assert type(got[2]) is collections.deque
    torch.testing.assert_close(got[:2], want[:2])
    torch.testing.assert_close(list(got[2]), list(want[2]))
