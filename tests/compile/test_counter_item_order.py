"""A loop's int counter, read with ``.item()`` in the body, is defined before every
kernel that uses it (Note [a subgraph reads its inputs first] in hop.compile._inductor_subgraphs).

A kernel that writes at a position made from the counter (``index_copy`` at
``torch.full((1,), t)``) does not tell Inductor's scheduler that it uses the counter's
symbol, so nothing kept the read before it: a greedy decoder failed at run time
(``UnboundLocalError: cannot access local variable 'u10'``) and its AOTInductor build
did not compile (``'u9' was not declared``). Inductor's memory-planning reorder moves
such a read late only for some buffer sizes; these tests make that move every time,
with a post-fusion pass that puts each read as late as the dependencies the scheduler
knows allow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hop

V, D, T, B = 32, 16, 8, 2


def late_reads(nodes: list[Any]) -> list[Any]:
    """Each ``.item()`` (``ir.DynamicScalar``) just before the first node that declares it needs it."""
    from torch._inductor import ir

    reads = [n for n in nodes if isinstance(n.node, ir.DynamicScalar)]
    out, pending = [], list(reads)
    for node in nodes:
        if node in reads:
            continue
        needed = {dep.name for dep in node.unmet_dependencies}
        for read in list(pending):
            if read.get_buffer_names() & needed:
                out.append(read)
                pending.remove(read)
        out.append(node)
    return out + pending


@pytest.fixture(autouse=True)
def reads_moved_late() -> Iterator[None]:
    config = torch._inductor.config
    if not hasattr(config, "_post_fusion_custom_pass"):
        pytest.skip("this torch has no post-fusion pass to move the reads with")
    torch._dynamo.reset()
    with config.patch(_post_fusion_custom_pass=late_reads, fx_graph_cache=False):
        yield
    torch._dynamo.reset()


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def decode(
    tokens: torch.Tensor, cache: torch.Tensor, emb: torch.Tensor, w: torch.Tensor, g: torch.Tensor, head: torch.Tensor
) -> Any:
    """Greedy decoding over a static cache, the step ``t`` an int carry. The first fused
    kernel (embedding, norm, the cache's write at ``t``) uses ``t`` only where it writes;
    the first kernel that says it uses ``t`` (the mask) comes after a matmul."""
    n = tokens.shape[1] - 1

    def body(t: Any, tokens: torch.Tensor, cache: torch.Tensor) -> Any:
        pos = torch.full((1,), t, dtype=torch.long)
        h = rms_norm(emb[tokens[:, 0]], g)
        cache = cache.index_copy(1, pos, h[:, None])
        y = h @ w
        mask = torch.arange(cache.shape[1]) <= t
        scores = (cache * y[:, None]).sum(-1).masked_fill(~mask, float("-inf"))
        attended = (scores.softmax(-1)[..., None] * cache).sum(1)
        following = (attended @ head).argmax(-1)
        return t + 1, tokens.index_copy(1, pos + 1, following[:, None]), cache

    return hop.while_loop(lambda t, tokens, cache: t < n, body, (0, tokens, cache))[1:]


def decode_inputs() -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(B, T, dtype=torch.long)
    tokens[:, 0] = torch.arange(B) + 3
    return tokens, torch.zeros(B, T, D), torch.randn(V, D), torch.randn(D, D), torch.rand(D) + 0.5, torch.randn(D, V)


def stack_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fori_loop (Python-int bounds: an int counter) that writes row ``i`` of a buffer."""

    def body(i: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.index_copy(0, torch.full((1,), i), torch.relu(out[-1:] @ w + x[:1]))
        return out + (torch.arange(out.shape[0])[:, None] == i) * (out[:1] @ w)

    return hop.fori_loop(0, x.shape[0], body, torch.zeros(x.shape[0], w.shape[1]))


def compiled(fn: Callable[..., Any], dynamic: bool) -> Callable[..., Any]:
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_decoder_counter_read_before_its_kernels(dynamic: bool) -> None:
    args = decode_inputs()
    torch.testing.assert_close(compiled(decode, dynamic)(*args), decode(*args))


class _Decoder(torch.nn.Module):
    def forward(self, *args: torch.Tensor) -> Any:
        return decode(*args)


def test_decoder_counter_read_before_its_kernels_aoti(tmp_path: Path) -> None:
    args = decode_inputs()
    ep = torch.export.export(_Decoder(), args)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "decoder.pt2"))
    loaded = torch._inductor.aoti_load_package(package)
    torch.testing.assert_close(tuple(loaded(*args)), tuple(decode(*args)))


@pytest.mark.parametrize("dynamic", [False, True])
def test_fori_loop_counter_read_before_its_kernels(dynamic: bool) -> None:
    x, w = torch.randn(5, 4), torch.randn(4, 4) * 0.5
    torch.testing.assert_close(compiled(stack_rows, dynamic)(x, w), stack_rows(x, w))
