"""Imported Hugging Face families compute the same logits and routing as transformers (fp32, 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.training.hf.hf_models import ALL_FAMILIES, DEEPSEEK_CASES, MOE_FAMILIES, padded_batch
from training.hf.families import UnsupportedModelError, config_from_hf
from training.hf.loading import load_hf_model
from training.hf.weights import WeightsError


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_logits_match_transformers_on_padded_batch(hf_checkpoints, model_type):
    directory, reference = hf_checkpoints[model_type]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        ours = model(ids, compute_router_losses=False).logits
    valid = mask.bool()
    assert expected.abs().max() > 0.1  # a real signal, not all-zero logits
    torch.testing.assert_close(ours[valid], expected[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", [t for t in MOE_FAMILIES if t not in DEEPSEEK_CASES])
def test_router_chooses_the_same_experts(hf_checkpoints, model_type):
    directory, reference = hf_checkpoints[model_type]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    ids, mask = padded_batch(model.config.vocab_size, seed=2)
    top_k = model.config.top_k
    with torch.no_grad():
        router_logits = reference(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
        ours = model(ids, return_routing=True, compute_router_losses=False).routed_experts
    batch, length = ids.shape
    expected = torch.stack([layer.view(batch, length, -1).topk(top_k, dim=-1).indices for layer in router_logits], 2)
    valid = mask.bool()
    assert torch.equal(ours[valid], expected[valid])


def test_unknown_model_type_names_the_supported_families():
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported families: llama, qwen2, qwen3, qwen3_moe"):
        config_from_hf({"model_type": "gpt2"})


def test_mismatched_tensor_names_it_and_both_shapes(hf_checkpoints, tmp_path):
    directory, _ = hf_checkpoints["qwen3_moe"]
    config = json.loads((directory / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
    with pytest.raises(WeightsError, match=r"experts\.0\.down_proj\.weight.*\(64, 32\).*\(64, 48\)"):
        load_hf_model(tmp_path, dtype=torch.float32)


def test_missing_tensor_is_named(hf_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = hf_checkpoints["qwen2"]
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(WeightsError, match=r"lacks tensor\(s\) model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_hf_model(tmp_path, dtype=torch.float32)


def test_corrupt_shard_is_named(hf_checkpoints, tmp_path):
    directory, _ = hf_checkpoints["llama"]
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError, match="model.safetensors is not a readable safetensors file"):
        load_hf_model(tmp_path, dtype=torch.float32)
