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


@pytest.mark.parametrize(
    "family", ["qwen3_moe", pytest.param("olmoe", marks=pytest.mark.slow), pytest.param("mixtral", marks=pytest.mark.slow)]
)
def test_engine_greedy_matches_generate_on_the_benchmarked_models(family):
    """benchmarks/bench_hf_engine.py's models (8 experts, top-2, a 4096 x 256 output weight): their decode
    steps take the fused path's own expert dispatch (training.model.fused_moe) and the transposed output
    product, which the tiny families above never reach. Batch 8 with mixed lengths, as the benchmark."""
    from benchmarks.bench_hf_engine import imported_pair, workload

    reference, model = imported_pair(family)
    pairs = [(prompt, 24) for prompt, _ in workload(model.config.vocab_size, requests=10)]
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=8, max_seq_len=256))
    results = engine.generate([p for p, _ in pairs], SamplingParams(max_tokens=24, temperature=0.0))
    for (prompt, _), result in zip(pairs, results, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        assert result.token_ids == expected[0, len(prompt):].tolist()
