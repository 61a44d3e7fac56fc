"""A transformers decoder generating greedily inside one hop.while_loop, its attention
layers writing transformers' own StaticCache in place (docs/state.md), with the tokens
of ``model.generate(do_sample=False)``: eager, export (run, compiled by Inductor,
AOTInductor in a fresh process). The model is built from a small config with random weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hop
from hop.errors import CompileUnsupported
from hop.testing._deployment_checks import in_fresh_process

transformers = pytest.importorskip("transformers")

MAX_NEW, CACHE = 12, 32


def _model(eos: int) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=eos,
        pad_token_id=0,
        bos_token_id=1,
    )
    return transformers.LlamaForCausalLM(config).eval()


class Generate(torch.nn.Module):
    """Prefill, then one hop.while_loop of single-token steps until EOS or MAX_NEW tokens."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model, eos = self.model, self.model.config.eos_token_id
        cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
        n = prompt.shape[1]
        logits = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(n)).logits
        first = logits[:, -1].argmax(-1)
        tokens = torch.zeros(1, MAX_NEW, dtype=torch.long).index_copy(1, torch.tensor([0]), first[:, None])

        def more(i: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            return (i < MAX_NEW) & (token[0] != eos)

        def step(i: torch.Tensor, token: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
            position = (n + i - 1).reshape(1)
            out = model(input_ids=token[:, None], past_key_values=cache, cache_position=position)
            token = out.logits[:, -1].argmax(-1)
            return i + 1, token, tokens.index_copy(1, i.reshape(1), token[:, None])

        count, _, tokens = hop.while_loop(more, step, (torch.tensor(1), first, tokens))
        return count, tokens


PROMPT = torch.tensor([[1, 5, 9, 12]])


def _generated(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False)[:, PROMPT.shape[1] :]


def _check(got: tuple[torch.Tensor, torch.Tensor], want: torch.Tensor) -> None:
    count, tokens = got
    assert int(count) == want.shape[1]
    torch.testing.assert_close(tokens[:, : int(count)], want)


@pytest.fixture(scope="module", params=[18, 63], ids=["stops_on_eos", "runs_to_the_limit"])
def decoder(request: pytest.FixtureRequest) -> tuple[Any, torch.Tensor]:
    model = _model(request.param)
    want = _generated(model)
    assert (want.shape[1] < MAX_NEW) == (request.param == 18)  # the configs do what their names say
    return model, want


def test_eager(decoder: tuple[Any, torch.Tensor]) -> None:
    model, want = decoder
    with torch.no_grad():
        _check(Generate(model)(PROMPT), want)


@pytest.fixture(scope="module")
def exported(decoder: tuple[Any, torch.Tensor]) -> Any:
    with torch.no_grad():
        return torch.export.export(Generate(decoder[0]), (PROMPT,))


def test_export_runs(decoder: tuple[Any, torch.Tensor], exported: Any) -> None:
    with torch.no_grad():
        _check(exported.module()(PROMPT), decoder[1])


def test_exported_program_compiles_with_inductor(decoder: tuple[Any, torch.Tensor], exported: Any) -> None:
    torch._dynamo.reset()
    with torch.no_grad():
        _check(torch.compile(exported.module(), backend="inductor", fullgraph=True)(PROMPT), decoder[1])


def test_aoti_package_in_a_fresh_process(decoder: tuple[Any, torch.Tensor], exported: Any) -> None:
    """The package runs where neither hop nor transformers can be imported, as a server
    runs it; twice, each call from a fresh cache."""
    first, second = in_fresh_process(exported, [[PROMPT], [PROMPT]], hide=("hop", "transformers"))
    _check(first, decoder[1])
    _check(second, decoder[1])


def test_compiling_the_module_names_the_kernels_wrapper(decoder: tuple[Any, torch.Tensor]) -> None:
    """transformers' hub-kernels wrapper writes a global on every attention call, which
    Dynamo refuses inside an operator's callable: the message names that line; the
    supported way is the exported program (above)."""
    torch._dynamo.reset()
    message = r"layer\.py:\d+ in set .*global_var.*kernels package.*ep\.module\(\)"
    with torch.no_grad(), pytest.raises(CompileUnsupported, match=message):
        torch.compile(Generate(decoder[0]), backend="inductor", fullgraph=True)(PROMPT)
