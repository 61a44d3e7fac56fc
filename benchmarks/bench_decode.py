"""A transformers decoder generating greedily: time per token, in one run.

A small Llama (random weights, built from a config) generates 24 tokens after a
4-token prompt, its attention writing transformers' ``StaticCache`` in place:

- ``model.generate(do_sample=False)`` (eager, transformers' own loop);
- the Python loop over single-token steps (eager), and the same loop calling the step
  compiled by Inductor;
- one ``hop.while_loop`` over the steps (docs/state.md): eager, and exported with
  ``ep.module()`` compiled by Inductor (torch.compile of the module itself stops at
  the kernels package's wrapper: docs/state.md).

Every path's tokens are checked equal to ``generate``'s. Needs ``transformers``
(hop's dev extras). Run: ``python benchmarks/bench_decode.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us, report

import hop

NEW, CACHE = 24, 64


def build() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=255,
        pad_token_id=0,
        bos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config).eval()


def prefill(model: Any, prompt: torch.Tensor) -> tuple[Any, torch.Tensor]:
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    n = prompt.shape[1]
    logits = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(n)).logits
    return cache, logits[:, -1].argmax(-1)


def python_loop(model: Any, prompt: torch.Tensor, step: Any = None) -> torch.Tensor:
    cache, token = prefill(model, prompt)
    n, tokens = prompt.shape[1], [token]

    def one(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=token[:, None], past_key_values=cache, cache_position=position)
        return out.logits[:, -1].argmax(-1)

    run = one if step is None else step(one)
    for i in range(1, NEW):
        token = run(token, torch.tensor([prompt.shape[1] + i - 1]))
        tokens.append(token)
    del n
    return torch.stack(tokens, 1)


class HopGenerate(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        model = self.model
        cache, first = prefill(model, prompt)
        n = prompt.shape[1]
        tokens = torch.zeros(1, NEW, dtype=torch.long).index_copy(1, torch.tensor([0]), first[:, None])

        def step(i: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = model(input_ids=token[:, None], past_key_values=cache, cache_position=(n + i - 1).reshape(1))
            token = out.logits[:, -1].argmax(-1)
            return i + 1, token, tokens.index_copy(1, i.reshape(1), token[:, None])

        return hop.while_loop(lambda i, t, ts: i < NEW, step, (torch.tensor(1), first, tokens))[2]


def main() -> None:
    torch.set_num_threads(1)
    model, prompt = build(), torch.tensor([[1, 5, 9, 12]])
    rows: list[tuple[str, float]] = []
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=NEW, do_sample=False)[:, prompt.shape[1] :]

        def timed(name: str, fn: Any) -> None:
            torch.testing.assert_close(fn(), want)
            rows.append((name, per_call_us(fn, number=3, repeat=5) / NEW))

        timed("model.generate, eager", lambda: model.generate(prompt, max_new_tokens=NEW, do_sample=False)[:, 4:])
        timed("python loop, eager", lambda: python_loop(model, prompt))
        torch._dynamo.reset()
        timed(
            "python loop, step compiled (inductor)",
            lambda: python_loop(model, prompt, lambda f: torch.compile(f, backend="inductor", fullgraph=True)),
        )
        generate = HopGenerate(model)
        timed("hop.while_loop, eager", lambda: generate(prompt))
        exported = torch.export.export(generate, (prompt,)).module()
        torch._dynamo.reset()
        compiled = torch.compile(exported, backend="inductor", fullgraph=True)
        timed("hop.while_loop, exported + inductor", lambda: compiled(prompt))
    report(f"us per token ({NEW} tokens)", rows, "model.generate, eager")


if __name__ == "__main__":
    main()
