"""A small transformer decoder's greedy generation: one while_loop over positions, with a
static KV cache carried functionally (each step writes its keys and values at the
position with ``index_copy``, out of place), an int step counter as while_loop.md
shows, RMSNorm, a causal attention over the cache masked to the positions written,
and the prompt fed through the same loop (teacher-forced) before generation.

The reference is independent of the cache: a Python loop that recomputes the whole
prefix with full causal attention at every step. Checked in eager, under autograd
(the last logits w.r.t. the parameters), vmap over prompts, jvp, torch.compile
(aot_eager; Inductor with dynamic and static shapes; a training step), export
(strict and non-strict, saved and loaded, other batch sizes), AOTInductor in a fresh
process and ONNX in onnxruntime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from matrix import DEPLOYMENTS, assert_same, check_compile, check_compile_grad, check_deployment, sharing
from torch.export import Dim

import hop

VOCAB, WIDTH, HEADS, LAYERS, LENGTH, PROMPT = 13, 8, 2, 2, 7, 3
HEAD = WIDTH // HEADS


class RMSNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(WIDTH) + 0.1 * torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` (b, n, width) as (b, heads, n, head)."""
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        return tuple(t.reshape(*t.shape[:2], HEADS, HEAD).transpose(1, 2) for t in (q, k, v))  # type: ignore[return-value]

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.out(attended.transpose(1, 2).reshape(*x.shape))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(0.1 * torch.randn(LENGTH, WIDTH))
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy continuation of ``prompt`` (b, PROMPT) to LENGTH tokens; the tokens and the
        logits of the last step."""
        b = prompt.shape[0]
        tokens = torch.cat([prompt, prompt.new_zeros(b, LENGTH - PROMPT)], 1)
        keys = torch.zeros(LAYERS, b, HEADS, LENGTH, HEAD)
        values = torch.zeros(LAYERS, b, HEADS, LENGTH, HEAD)
        logits = torch.zeros(b, VOCAB)

        def step(t: int, tokens: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, logits: torch.Tensor) -> Any:
            at = torch.full((1,), t, dtype=torch.int64)
            x = self.embed(tokens.index_select(1, at)) + self.position.index_select(0, at)  # (b, 1, width)
            seen = (torch.arange(LENGTH) <= t).reshape(1, 1, 1, LENGTH)
            new_keys, new_values = [], []
            for layer, block in enumerate(self.blocks):
                q, k, v = block.heads(x)
                k_cache = keys[layer].index_copy(2, at, k)
                v_cache = values[layer].index_copy(2, at, v)
                scores = (q @ k_cache.transpose(-1, -2)) / HEAD**0.5
                weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
                x = block.finish(x, weights @ v_cache)
                new_keys.append(k_cache)
                new_values.append(v_cache)
            logits = self.head(self.norm(x))[:, 0]
            forced = tokens.index_select(1, (at + 1).clamp(max=LENGTH - 1))[:, 0]
            chosen = torch.where(at + 1 < PROMPT, forced, logits.argmax(-1))
            tokens = tokens.index_copy(1, (at + 1).clamp(max=LENGTH - 1), chosen[:, None])
            return t + 1, tokens, torch.stack(new_keys), torch.stack(new_values), logits

        _, tokens, _, _, logits = hop.while_loop(lambda t, *_: t < LENGTH - 1, step, (0, tokens, keys, values, logits))
        return tokens, logits


class Recompute(Decoder):
    """The reference: no cache, the whole prefix recomputed with causal attention each step."""

    def forward(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = prompt
        logits = torch.zeros(prompt.shape[0], VOCAB)
        for t in range(LENGTH - 1):
            n = t + 1
            x = self.embed(tokens[:, :n]) + self.position[:n]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            for block in self.blocks:
                q, k, v = block.heads(x)
                weights = ((q @ k.transpose(-1, -2)) / HEAD**0.5).masked_fill(~causal, float("-inf")).softmax(-1)
                x = block.finish(x, weights @ v)
            logits = self.head(self.norm(x))[:, -1]
            if n < PROMPT:
                continue
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
        return tokens, logits


def make() -> tuple[Decoder, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    model = Decoder()
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randint(1, VOCAB, (b, PROMPT), generator=g),) for b in (3, 2, 5)]


def test_eager_equals_full_recompute() -> None:
    model, cases = make()
    reference = sharing(Recompute(), model)
    for case in cases:
        got = model(*case)
        assert_same(got, reference(*case), "eager")
    assert len(set(model(*cases[2])[0][:, PROMPT:].flatten().tolist())) > 1  # not one token repeated


def test_gradient_of_the_last_logits_equals_full_recompute() -> None:
    model, cases = make()
    reference = sharing(Recompute(), model)
    for case in cases:
        got = torch.autograd.grad(model(*case)[1].logsumexp(-1).sum(), list(model.parameters()))
        want = torch.autograd.grad(reference(*case)[1].logsumexp(-1).sum(), list(reference.parameters()))
        assert_same(got, want, "d logsumexp / d parameters")


def test_vmap_over_prompts_and_jvp() -> None:
    model, cases = make()
    (prompt,) = cases[2]
    batched = torch.vmap(lambda p: tuple(o[0] for o in model(p[None])))(prompt)
    assert_same(batched, model(prompt), "vmap over prompts")
    params = dict(model.named_parameters())
    direction = {k: torch.randn_like(v) for k, v in params.items()}

    def logits(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (prompt,))[1]

    _, tangent = torch.func.jvp(logits, (params,), (direction,))
    eps = 1e-3
    ahead = {k: v + eps * direction[k] for k, v in params.items()}
    behind = {k: v - eps * direction[k] for k, v in params.items()}
    with torch.no_grad():  # the tokens stay the same for so small a step (a central difference)
        tokens = [torch.func.functional_call(model, p, (prompt,))[0] for p in (ahead, behind)]
        assert torch.equal(*tokens)
        numeric = (logits(ahead) - logits(behind)) / (2 * eps)
    torch.testing.assert_close(tangent, numeric, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_compiled_equals_eager(backend: str, dynamic: bool) -> None:
    model, cases = make()
    check_compile(model, cases, backend, dynamic=dynamic)


def test_compiled_training_gradients_equal_eager() -> None:
    model, cases = make()
    check_compile_grad(model, cases, "aot_eager")


BATCH = Dim("batch", min=2, max=64)


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_deployed_equals_eager(path: str, tmp_path: Path) -> None:
    model, cases = make()
    # nothing here is refused: the strict export path runs like the rest
    check_deployment(path, model, cases[0], cases, tmp_path, dynamic_shapes=({0: BATCH},), strict_refused=False)
