"""Greedy generation of imported models through GenerationEngine equals transformers' generate."""

from __future__ import annotations

import pytest
import torch

from tests.training.hf.hf_models import ALL_FAMILIES
from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.hf.loading import load_hf_model

NEW_TOKENS = 64


def reference_greedy(reference, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy generate of one prompt: tokens and their log-probabilities."""
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [step.log_softmax(-1)[0, token].item() for step, token in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


# CI runs one dense family (with llama3 rope scaling), one MoE family and DeepSeek-V3 (latent attention, yarn,
# group-limited sigmoid routing, shared experts); the rest with -m slow.
FAST = ("llama", "qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize(
    "model_type", [t if t in FAST else pytest.param(t, marks=pytest.mark.slow) for t in ALL_FAMILIES]
)
def test_engine_greedy_matches_generate(hf_checkpoints, model_type):
    directory, reference = hf_checkpoints[model_type]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    shared = torch.randint(1, vocab, (6,), generator=generator).tolist()
    # mixed lengths, two of them sharing a prefix (the second hits the prefix cache once the first is done)
    prompts = [shared + [5, 9], torch.randint(1, vocab, (13,), generator=generator).tolist(), [7, 3, 11]]
    prompts.append(shared + [17])
    engine = GenerationEngine(
        model, config=EngineConfig(max_batch_size=3, max_seq_len=128, prefix_cache_size=4, min_prefix_tokens=4)
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    results = engine.generate(prompts, params)
    assert engine.prefix_stats["hits"] >= 1
    for prompt, result in zip(prompts, results, strict=True):
        tokens, logprobs = reference_greedy(reference, prompt)
        assert result.token_ids == tokens
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
