"""DeepSeek-V3 specifics: the router's group-limited, biased choice equals transformers', unsupported options
are refused by name, multi-token-prediction layers are skipped, and the model takes the unfused engine path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.training.hf.hf_models import DEEPSEEK_CASES, padded_batch
from training.hf.families import UnsupportedModelError, config_from_hf
from training.hf.loading import load_hf_model
from training.model.fused_forward import fused_forward_supports


def _reference_choices(reference, ids, mask) -> torch.Tensor:
    """transformers' chosen experts [B, T, MoE layers, top_k] (sorted), read from each router's output."""
    chosen = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
             for module in reference.modules() if type(module).__name__ == "DeepseekV3TopkRouter"]
    try:
        with torch.no_grad():
            reference(input_ids=ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    batch, length = ids.shape
    return torch.stack([layer.view(batch, length, -1) for layer in chosen], 2).sort(dim=-1).values


@pytest.mark.parametrize("case", DEEPSEEK_CASES)
def test_router_chooses_the_same_experts(hf_checkpoints, case):
    directory, reference = hf_checkpoints[case]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    ids, mask = padded_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        ours = model(ids, return_routing=True, compute_router_losses=False).routed_experts
    expected = _reference_choices(reference, ids, mask)
    assert ours.shape[2] == model.config.n_moe_layers == model.config.n_layers - model.config.first_dense_layers
    valid = mask.bool()
    assert torch.equal(ours.sort(dim=-1).values[valid], expected[valid])


def test_group_limit_and_bias_change_the_choice(hf_checkpoints):
    """The group limit and the score bias are load-bearing: without them the router would choose differently."""
    directory, _ = hf_checkpoints["deepseek_v3"]
    model, _, _ = load_hf_model(directory, dtype=torch.float32)
    ids, mask = padded_batch(model.config.vocab_size, seed=2)
    with torch.no_grad():
        routed = model(ids, return_routing=True, compute_router_losses=False).routed_experts
        model.config.n_expert_groups = model.config.top_k_groups = 1
        ungrouped = model(ids, return_routing=True, compute_router_losses=False).routed_experts
        for block in model.layers[model.config.first_dense_layers:]:
            block.feed_forward.score_bias.zero_()
        unbiased = model(ids, return_routing=True, compute_router_losses=False).routed_experts
    assert not torch.equal(routed, ungrouped) and not torch.equal(ungrouped, unbiased)


def test_config_maps_every_deepseek_option(hf_checkpoints):
    config = load_hf_model(hf_checkpoints["deepseek_v3"][0], dtype=torch.float32)[0].config
    assert (config.attention, config.q_lora_rank, config.kv_lora_rank, config.rope_interleave) == ("mla", 32, 16, True)
    assert (config.router_score, config.router_score_bias, config.n_expert_groups, config.top_k_groups) == (
        "sigmoid", True, 4, 2)
    assert (config.routed_scaling_factor, config.n_shared_experts, config.first_dense_layers) == (2.5, 1, 1)
    assert config.rope_scaling["rope_type"] == "yarn" and config.head_dim == 24 and config.rotary_dim == 8
    assert not fused_forward_supports(config)


@pytest.mark.parametrize(("option", "value"), [
    ("attention_bias", True),
    ("scoring_func", "softmax"),
    ("topk_method", "greedy"),
    ("moe_layer_freq", 2),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
    ("hidden_act", "gelu"),
])
def test_unsupported_deepseek_option_is_refused_by_name(hf_checkpoints, option, value):
    config = json.loads((hf_checkpoints["deepseek_v3"][0] / "config.json").read_text())
    config[option] = value
    with pytest.raises(UnsupportedModelError, match=option):
        config_from_hf(config)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_scaling type 'longrope'"),
    ({"n_group": 3}, "n_expert_groups=3 must divide n_experts=8"),
    ({"first_k_dense_replace": 3}, "first_dense_layers=3"),
])
def test_inconsistent_deepseek_config_names_the_field(hf_checkpoints, change, message):
    config = {**json.loads((hf_checkpoints["deepseek_v3"][0] / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf(config)


def test_multi_token_prediction_layers_are_skipped(hf_checkpoints, tmp_path):
    """A real DeepSeek-V3 checkpoint carries layer num_hidden_layers (the MTP module); it is not part of the
    causal model, so the loader skips it (as transformers does) instead of refusing the checkpoint."""
    directory, reference = hf_checkpoints["deepseek_v3"]
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    model, _, _ = load_hf_model(tmp_path, dtype=torch.float32)
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        ours = model(ids, compute_router_losses=False).logits
    torch.testing.assert_close(ours[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=0)


def test_router_losses_and_replay_shape_with_dense_layers(hf_checkpoints):
    """Training forward: finite router losses over the MoE layers only; a replay tensor must have one entry per
    MoE layer (not per layer), and the message says so."""
    model, _, _ = load_hf_model(hf_checkpoints["deepseek_v3"][0], dtype=torch.float32)
    ids, _ = padded_batch(model.config.vocab_size)
    out = model(ids, return_routing=True)
    assert torch.isfinite(out.load_balancing_loss) and out.load_balancing_loss > 0
    assert torch.isfinite(out.router_z_loss) and out.router_z_loss > 0
    per_layer = torch.zeros(*ids.shape, model.config.n_layers, model.config.top_k, dtype=torch.long)
    with pytest.raises(ValueError, match=r"expected \(3, 11, 2, 2\) = \(batch, seq_len, MoE layers, top_k\)"):
        model(ids, routing_override=per_layer)


@pytest.mark.parametrize(("fields", "message"), [
    ({"n_kv_heads": 2}, "n_kv_heads must equal n_heads=4"),
    ({"kv_lora_rank": 0}, "needs kv_lora_rank > 0"),
    ({"qk_rope_head_dim": 7}, "rotary width 7"),
    ({"qk_norm": "head"}, "has no qk_norm"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor must be finite"),
    ({"n_expert_groups": 8, "top_k_groups": 2}, "each group needs >= 2 experts"),
])
def test_model_config_refuses_inconsistent_mla_and_router_fields(fields, message):
    from training.model.config import ModelConfig, ModelConfigError

    base = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_kv_heads": 4, "attention": "mla", "kv_lora_rank": 8,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_experts": 8, "top_k": 2,
            "router_score": "sigmoid", "n_expert_groups": 4, "top_k_groups": 2}
    ModelConfig(**base)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig(**{**base, **fields})
