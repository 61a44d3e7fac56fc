"""Data-dependent sizes through hop's operators against torch's twins (issue 6).

For each program: does ``torch.export`` succeed, how many unbacked symbols and
runtime asserts (``aten._assert_scalar``) the exported graph has, and whether
``ep.module()`` (and a save/load round trip) matches eager on every input. The
twin swaps ``hop.cond`` / ``switch`` / ``while_loop`` / ``map`` for ``torch.cond``
(switch: nested ``torch.cond``), ``torch._higher_order_ops.while_loop`` and
``torch._higher_order_ops.map``.
Run: ``python benchmarks/unbacked_table.py``.
"""

from __future__ import annotations

import io
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._higher_order_ops.map import map as torch_map
from torch._higher_order_ops.while_loop import while_loop as torch_while_loop

import hop

Lib = types.SimpleNamespace
HOP = Lib(name="hop", cond=hop.cond, while_loop=hop.while_loop, map=hop.map, switch=hop.switch)


def _torch_switch(i: torch.Tensor, branches: list[Callable[..., Any]], operands: tuple[Any, ...]) -> Any:
    if len(branches) == 1:
        return branches[0](*operands)
    return torch.cond(
        i == 0,
        branches[0],
        lambda *ops: _torch_switch(i - 1, branches[1:], ops),
        operands,
    )


TORCH = Lib(name="torch", cond=torch.cond, while_loop=torch_while_loop, map=torch_map, switch=_torch_switch)


def mask_union(lib: Lib, x: torch.Tensor) -> Any:
    return lib.cond(x.sum() > 0, lambda x: x[x > 0], lambda x: x[x < 0], (x,)) * 2


def shared_relation(lib: Lib, x: torch.Tensor) -> Any:
    def pos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = x[x > 0]
        return m, m * 2

    def neg(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = x[x < 0]
        return m + 1, m.sin()

    a, b = lib.cond(x.sum() > 0, pos, neg, (x,))
    return a + b


def affine_relation(lib: Lib, x: torch.Tensor) -> Any:
    def pos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = x[x > 0]
        return m, torch.cat([m, m])

    def neg(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = x[x < 0]
        return m, torch.cat([m, -m])

    a, b = lib.cond(x.sum() > 0, pos, neg, (x,))
    return b.reshape(2, a.shape[0]) + a


def int_output(lib: Lib, x: torch.Tensor) -> Any:
    def pos(x: torch.Tensor) -> tuple[int, torch.Tensor]:
        n = (x > 0).sum().item()
        return n, x.new_ones(n)

    def neg(x: torch.Tensor) -> tuple[int, torch.Tensor]:
        n = (x < 0).sum().item()
        return n, x.new_zeros(n)

    n, y = lib.cond(x.sum() > 0, pos, neg, (x,))
    return torch.ones(n) + y


def same_expression(lib: Lib, x: torch.Tensor) -> Any:
    m = x[x > 0]
    return lib.cond(x.sum() > 0, lambda m: m * 2, lambda m: m + 1, (m,)) + m


def switch_three(lib: Lib, x: torch.Tensor, i: torch.Tensor) -> Any:
    branches = [lambda x: x[x > 0], lambda x: x[x < 0], lambda x: x[x.abs() > 0.5]]
    return lib.switch(i, branches, (x,)).sum(0, keepdim=True)


def symbool_predicate(lib: Lib, x: torch.Tensor) -> Any:
    pred = x.nonzero().size(0) > 3
    return lib.cond(pred, lambda x: x.sin(), lambda x: x.cos(), (x,))


def nested(lib: Lib, x: torch.Tensor) -> Any:
    def outer_true(x: torch.Tensor) -> torch.Tensor:
        return lib.cond(x.max() > 1, lambda x: x[x > 1], lambda x: x[x > 0], (x,))

    return lib.cond(x.sum() > 0, outer_true, lambda x: x[x < 0], (x,)) + 1


def user_check(lib: Lib, x: torch.Tensor) -> Any:
    out = lib.cond(x.sum() > 0, lambda x: x[x > 0], lambda x: x[x < 0], (x,))
    torch._check(out.shape[0] <= 2)
    return out.cumsum(0)


def while_grow(lib: Lib, x: torch.Tensor, n: torch.Tensor) -> Any:
    (y,) = lib.while_loop(lambda y: y.shape[0] < n, lambda y: (torch.cat([y, y[:3]]),), (x,))
    return y * 2


def while_count(lib: Lib, x: torch.Tensor) -> Any:
    i, y = lib.while_loop(lambda i, y: y.sum() < 10, lambda i, y: (i + 1, y + 1), (0, x))
    return torch.ones(i) * y.sum()


def while_shrink(lib: Lib, x: torch.Tensor) -> Any:
    (y,) = lib.while_loop(lambda y: y.sum() > 0, lambda y: (y[1:],), (x,))
    return y + 1


def map_shared_size(lib: Lib, xs: torch.Tensor, k: torch.Tensor) -> Any:
    def body(x: torch.Tensor) -> torch.Tensor:
        n = k.item()
        torch._check(n >= 0)
        torch._check(n <= 10)
        return x.sum() * torch.ones(n)

    return lib.map(body, xs) + 1


def map_per_step(lib: Lib, xs: torch.Tensor) -> Any:
    return lib.map(lambda x: x[x > 0].sum(0, keepdim=True) * x[x > 0], xs)


PROGRAMS: list[tuple[Callable[..., Any], list[tuple[Any, ...]]]] = [
    (mask_union, [(torch.tensor([1.0, -2.0, 3.0, 4.0]),), (torch.tensor([-1.0, -2.0, 3.0, -4.0]),)]),
    (shared_relation, [(torch.tensor([1.0, -2.0, 3.0]),), (torch.tensor([-1.0, -2.0, 0.5]),)]),
    (affine_relation, [(torch.tensor([1.0, -2.0, 3.0]),), (torch.tensor([-1.0, -2.0, 0.5]),)]),
    (int_output, [(torch.tensor([1.0, -2.0, 3.0]),), (torch.tensor([-1.0, -2.0, 0.5]),)]),
    (same_expression, [(torch.tensor([1.0, -2.0, 3.0]),), (torch.tensor([-1.0, -2.0, 0.5]),)]),
    (switch_three, [(torch.tensor([1.0, -2.0, 0.3]), torch.tensor(k)) for k in range(3)]),
    (symbool_predicate, [(torch.tensor([1.0, 0.0, 3.0, 2.0, 1.0]),), (torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]),)]),
    (
        nested,
        [(torch.tensor([2.0, -1.0, 0.5]),), (torch.tensor([0.5, -1.0, 0.7]),), (torch.tensor([-2.0, 1.0, -3.0]),)],
    ),
    (user_check, [(torch.tensor([1.0, -2.0, 3.0]),), (torch.tensor([-1.0, -2.0, 0.5]),)]),
    (while_grow, [(torch.randn(3), torch.tensor(10)), (torch.randn(3), torch.tensor(2))]),
    (while_count, [(torch.zeros(3),), (torch.full((3,), 6.0),)]),
    (while_shrink, [(torch.ones(8),), (torch.tensor([-1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),)]),
    (map_shared_size, [(torch.randn(4, 3), torch.tensor(5)), (torch.randn(4, 3), torch.tensor(0))]),
    (map_per_step, [(torch.tensor([[1.0, -1.0, 2.0], [3.0, 4.0, -5.0]]),)]),
]


class _Program(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any], lib: Lib) -> None:
        super().__init__()
        self.fn, self.lib = fn, lib

    def forward(self, *args: Any) -> Any:
        return self.fn(self.lib, *args)


def measure(fn: Callable[..., Any], inputs: list[tuple[Any, ...]], lib: Lib) -> dict[str, Any]:
    """Export ``fn`` with ``lib``'s operators; count symbols and asserts; check every input."""
    m = _Program(fn, lib)
    try:
        wants = [m(*args) for args in inputs]
    except Exception as e:
        return {"export": f"eager {type(e).__name__}: {str(e).splitlines()[0][:60]}"}
    try:
        ep = torch.export.export(m, inputs[0])
    except Exception as e:
        return {"export": f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"}
    symbols = {str(s) for n in ep.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})}
    asserts = sum(n.target is torch.ops.aten._assert_scalar.default for n in ep.graph.nodes)
    programs = [("ep.module()", ep)]
    try:
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        buffer.seek(0)
        programs.append(("loaded", torch.export.load(buffer)))
    except Exception as e:
        return {"export": f"save fails: {type(e).__name__}", "symbols": len(symbols), "asserts": asserts}
    ok = True
    for args, want in zip(inputs, wants, strict=True):
        for _, program in programs:
            try:
                got = program.module()(*args)
                same = torch.utils._pytree.tree_map(lambda a, b: torch.allclose(a, b), got, want)
                ok = ok and all(torch.utils._pytree.tree_leaves(same))
            except Exception:
                ok = False
    return {"export": "ok", "symbols": len(symbols), "asserts": asserts, "matches eager": ok}


def main() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    header = "| program | hop: symbols / asserts / matches | torch twin: symbols / asserts / matches |"
    print(header)
    print("|---|---|---|")
    for fn, inputs in PROGRAMS:
        cells = []
        for lib in (HOP, TORCH):
            r = measure(fn, inputs, lib)
            if "symbols" in r and r["export"] != "ok":
                cells.append(f"{r['symbols']} / {r['asserts']} / {r['export']}")
            elif r["export"] != "ok":
                cells.append(f"fails: {r['export']}")
            else:
                cells.append(f"{r['symbols']} / {r['asserts']} / {'yes' if r['matches eager'] else 'NO'}")
        print(f"| {fn.__name__} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
