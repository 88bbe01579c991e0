"""Top-k logprobs from the generation engine equal a direct forward pass's log_softmax, for the built-in
model and an imported family (against transformers' own forward), at several temperatures in one batch."""

from __future__ import annotations

import pytest
import torch

from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.hf.loading import load_hf_model
from training.model import ModelConfig, MoETransformer
from training.sampling import MAX_TOP_LOGPROBS

# (temperature, top_logprobs) per request, all in one batch: greedy, sampled, sampled at 0.7, none asked
REQUESTS = ((0.0, 5), (1.0, MAX_TOP_LOGPROBS), (0.7, 3), (1.0, 0))


def _check_against(forward_logits, prompts, results) -> None:
    """forward_logits(sequence [1, L]) -> logits [L, V]; every reported logprob equals its log_softmax."""
    for prompt, result, (temperature, k) in zip(prompts, results, REQUESTS, strict=True):
        sequence = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            logits = forward_logits(sequence[:, :-1]).float()
        expected = (logits / (temperature or 1.0)).log_softmax(-1)[len(prompt) - 1:]
        chosen = expected.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
        if k == 0:
            assert result.top_logprobs is None
            continue
        assert len(result.top_logprobs) == len(result.token_ids)
        for step, alternatives in enumerate(result.top_logprobs):
            ids = [token for token, _ in alternatives]
            values = torch.tensor([value for _, value in alternatives])
            assert len(ids) == k == len(set(ids))
            torch.testing.assert_close(values, expected[step, ids], atol=1e-4, rtol=0)
            # they are the k most likely, most likely first
            torch.testing.assert_close(values, expected[step].topk(k).values, atol=1e-4, rtol=0)
            if temperature == 0:
                assert result.token_ids[step] == ids[0]


def _generate(model, vocab: int) -> tuple[list[list[int]], list]:
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in (9, 4, 13, 6)]
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=4, max_seq_len=128))
    params = [SamplingParams(max_tokens=10, temperature=t, top_logprobs=k, seed=11 + i)
              for i, (t, k) in enumerate(REQUESTS)]
    return prompts, engine.generate(prompts, params)


def test_builtin_model_top_logprobs_equal_its_forward():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.named("tiny", max_seq_len=128, init_std=0.2)).eval()
    prompts, results = _generate(model, model.config.vocab_size)
    _check_against(lambda ids: model(ids).logits[0], prompts, results)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama"])
def test_imported_model_top_logprobs_equal_transformers_forward(hf_checkpoints, model_type):
    directory, reference = hf_checkpoints[model_type]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    prompts, results = _generate(model, model.config.vocab_size)
    _check_against(lambda ids: reference(input_ids=ids).logits[0], prompts, results)


def test_top_logprobs_are_bounded():
    for bad in (-1, MAX_TOP_LOGPROBS + 1):
        with pytest.raises(ValueError, match="top_logprobs must be in"):
            SamplingParams(top_logprobs=bad)
