"""A GRPO step on an imported MoE with routing replay lowers the loss; the trained policy exports to HF."""

from __future__ import annotations

import pytest
import torch

from tests.training.hf.hf_models import MOE_FAMILIES, padded_batch
from training.engine import EngineConfig, GenerationEngine, SamplingParams
from training.hf.loading import load_hf_model, save_hf_model
from training.train.grpo import GRPOConfig, policy_loss, token_logprobs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_grpo_step_with_routing_replay_lowers_loss_and_exports(hf_checkpoints, model_type, tmp_path):
    directory, _ = hf_checkpoints[model_type]
    model, hf_config, _ = load_hf_model(directory, dtype=torch.float32)
    prompt = [11, 42, 7, 99, 5]
    engine = GenerationEngine(model, config=EngineConfig(max_batch_size=4, max_seq_len=64, prefix_cache_size=0))
    results = engine.generate([prompt] * 4, [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(4)])
    sequences = torch.tensor([r.prompt_token_ids + r.token_ids for r in results])
    routing = torch.stack([r.routed_experts.long() for r in results])  # [B, T-1, layers, top_k]
    behaviour = torch.tensor([r.logprobs for r in results])
    rewards = torch.tensor([float(sum(t % 2 == 0 for t in r.token_ids)) for r in results])
    advantages = rewards - rewards.mean()
    assert advantages.abs().sum() > 0
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1)
    mask[:, len(prompt) - 1:] = 1

    def loss_and_logprobs():
        logits = model(sequences[:, :-1], routing_override=routing, compute_router_losses=False).logits
        logprobs = token_logprobs(logits, sequences[:, 1:])
        padded_behaviour = torch.zeros_like(logprobs)
        padded_behaviour[:, len(prompt) - 1:] = behaviour
        out = policy_loss(logprobs=logprobs, behaviour_logprobs=padded_behaviour, advantages=advantages,
                          loss_mask=mask, config=GRPOConfig())
        return out.loss, logprobs

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss, logprobs = loss_and_logprobs()
    # routing replay: the learner's forward reproduces the sampler's logprobs
    torch.testing.assert_close(logprobs[:, len(prompt) - 1:].detach(), behaviour, atol=1e-4, rtol=0)
    loss.backward()
    first_moe = model.config.first_dense_layers
    router = model.layers[first_moe].feed_forward.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after, _ = loss_and_logprobs()
    assert after < loss - 1e-4

    model.eval()
    save_hf_model(model, hf_config, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, attention = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        expected = reloaded(input_ids=ids, attention_mask=attention).logits
        ours = model(ids, compute_router_losses=False).logits
    torch.testing.assert_close(ours[attention.bool()], expected[attention.bool()], atol=1e-4, rtol=0)
    again, _, _ = load_hf_model(tmp_path, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True))


# d_model 64 and expert width 32: multiples of the MX block (DeepSeek: its dense layer and shared expert stay bf16)
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_imported_moe_runs_mxfp8_experts_with_routing_replay(hf_checkpoints, model_type):
    directory, _ = hf_checkpoints[model_type]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    ids, attention = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids, compute_router_losses=False, return_routing=True)
    model.config.precision = "mxfp8"
    out = model(ids, compute_router_losses=False, routing_override=reference.routed_experts)
    valid = attention.bool()
    error = (out.logits[valid] - reference.logits[valid]).abs().max()
    assert 0 < error < 0.1 * reference.logits[valid].abs().max()  # quantised, yet close
    out.logits[valid].logsumexp(-1).sum().backward()
    assert model.layers[model.config.first_dense_layers].feed_forward.w_gate.grad.abs().sum() > 0
