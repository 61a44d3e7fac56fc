"""Randomness inside branches and bodies, in each mode (docs/compile.md, "Randomness").

The global RNG works on every path (Inductor draws its own stream); a
``torch.Generator`` the callable closes over works in eager and non-strict export
(saved, loaded, decomposed), where it became a get_attr the export verifier refused.
Dynamo cannot trace a generator argument: torch.compile and strict export refuse it
with hop's CompileUnsupported, naming the callable.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hop
from hop.errors import CompileUnsupported

GEN = torch.Generator().manual_seed(0)


def _sampling_loop(probs: torch.Tensor) -> torch.Tensor:
    """A decoding loop drawing one token per step with the closed-over generator."""

    def body(i: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        token = torch.multinomial(probs, 1, generator=GEN)
        return tokens.index_copy(0, i.reshape(1), token)

    return hop.fori_loop(torch.tensor(0), torch.tensor(6), body, torch.zeros(6, dtype=torch.int64))


def _noisy_branch(x: torch.Tensor) -> torch.Tensor:
    return hop.cond(x.sum() > 0, lambda a: a + torch.rand(a.shape, generator=GEN), lambda a: a - 1, (x,))


def _noisy_scan(x: torch.Tensor) -> Any:
    return hop.scan(lambda c, r: (c + torch.randn(r.shape, generator=GEN), c * r), torch.zeros(3), x)


PROGRAMS: dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]] = {
    "fori_loop": (_sampling_loop, (torch.softmax(torch.randn(5), 0),)),
    "cond": (_noisy_branch, (torch.ones(3),)),
    "scan": (_noisy_scan, (torch.randn(4, 3),)),
}


class _Program(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.fn(*xs)


def _seeded(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    GEN.manual_seed(7)
    return fn(*xs)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_closed_over_generator_exports_non_strict(name: str) -> None:
    fn, args = PROGRAMS[name]
    ep = torch.export.export(_Program(fn), args)
    want = _seeded(fn, *args)
    torch.testing.assert_close(_seeded(ep.module(), *args), want)  # the same generator, the same draws
    torch.testing.assert_close(_seeded(ep.run_decompositions().module(), *args), want)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()  # a generator of its own: other draws, same shapes
    got = torch.utils._pytree.tree_leaves(loaded(*args))
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in torch.utils._pytree.tree_leaves(want)]


def test_the_generator_is_an_input_of_the_exported_graph() -> None:
    fn, args = PROGRAMS["fori_loop"]
    ep = torch.export.export(_Program(fn), args)
    assert [s.kind.name for s in ep.graph_signature.input_specs].count("CUSTOM_OBJ") == 1
    for gm in ep.graph_module.modules():
        assert not any(isinstance(v, torch.Generator) for v in vars(gm).values())


@pytest.mark.parametrize("how", ["compile", "strict export"])
def test_dynamo_refuses_a_generator_with_hops_error(how: str) -> None:
    fn, args = PROGRAMS["fori_loop"]
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=r"hop.fori_loop: body_fn.*\(body\b|hop.while_loop: body_fn"):
        if how == "compile":
            torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
        else:
            torch.export.export(_Program(fn), args, strict=True)
    torch._dynamo.reset()


def _global_rng(x: torch.Tensor) -> torch.Tensor:
    return hop.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, v: v + torch.rand(v.shape), x)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_global_rng_compiles(backend: str) -> None:
    x = torch.zeros(4)
    torch.manual_seed(0)
    want = _global_rng(x)
    torch._dynamo.reset()
    torch.manual_seed(0)
    got = torch.compile(_global_rng, backend=backend, fullgraph=True)(x)
    if backend == "aot_eager":
        torch.testing.assert_close(got, want)  # the same stream as eager
    else:
        assert got.shape == want.shape and bool(((got >= 0) & (got < 3)).all())  # Inductor's own stream
    torch._dynamo.reset()
