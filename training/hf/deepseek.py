"""DeepSeek-V3 (`model_type` "deepseek_v3") onto MoETransformer's options, and its checkpoint's tensor names.

Multi-head latent attention (attention="mla": q_lora_rank or a full query projection, kv_lora_rank,
qk_nope/qk_rope/v head widths, rope_interleave, yarn rope scaling), sigmoid routing with the
e_score_correction_bias and group-limited top-k (n_group, topk_group), norm_topk_prob,
routed_scaling_factor, shared experts and the first_k_dense_replace dense layers. Options whose
semantics Flowstate does not implement are refused by name rather than loaded approximately.
"""

from __future__ import annotations

from typing import Any

from training.model.config import ModelConfig

MODEL_TYPE = "deepseek_v3"


class DeepSeekConfigError(ValueError):
    """A DeepSeek-V3 config.json option Flowstate does not implement; the message names it."""


# option -> (values accepted, why): anything else is refused naming the option.
_ACCEPTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "attention_bias": ((False, None), "MLA projections with biases are not implemented"),
    "scoring_func": (("sigmoid", None), "only DeepSeek-V3's sigmoid router scores are implemented"),
    "topk_method": (("noaux_tc", None), "only DeepSeek-V3's noaux_tc (biased, group-limited) top-k is implemented"),
    "moe_layer_freq": ((1, None), "every layer after first_k_dense_replace must be an MoE layer"),
    "ep_size": ((1, None), "expert parallelism is a launch choice, not a checkpoint option"),
    "quantization_config": ((None,), "quantized (e.g. FP8 block-scaled) checkpoints must be dequantized to "
                                     "bf16/fp32 first"),
    "pretraining_tp": ((1, None), "tensor-parallel pretraining slices are not implemented"),
}


def refuse_unsupported(hf_config: dict[str, Any]) -> None:
    """DeepSeekConfigError naming the first option of `hf_config` Flowstate cannot honour."""
    for option, (accepted, why) in _ACCEPTED.items():
        value = hf_config.get(option)
        if value not in accepted:
            raise DeepSeekConfigError(f"DeepSeek-V3 option {option}={value!r} is not supported: {why}.")
    if hf_config.get("n_routed_experts") is None:
        raise DeepSeekConfigError("DeepSeek-V3 option n_routed_experts is missing (a dense DeepSeek is not supported).")


def deepseek_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields beyond the common ones (config_from_hf fills those) of a DeepSeek-V3 config."""
    refuse_unsupported(hf_config)
    q_lora = hf_config.get("q_lora_rank")
    groups = hf_config.get("n_group") or 1
    return {
        "attention": "mla",
        "n_kv_heads": int(hf_config["num_attention_heads"]),
        "attention_head_dim": None,
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(hf_config["kv_lora_rank"]),
        "qk_nope_head_dim": int(hf_config["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(hf_config["qk_rope_head_dim"]),
        "v_head_dim": int(hf_config["v_head_dim"]),
        "rope_interleave": bool(hf_config.get("rope_interleave", True)),
        "feed_forward": "moe",
        "n_experts": int(hf_config["n_routed_experts"]),
        "top_k": int(hf_config["num_experts_per_tok"]),
        "d_ff_expert": int(hf_config["moe_intermediate_size"]),
        "d_ff_dense": int(hf_config["intermediate_size"]),
        "normalize_top_k_weights": bool(hf_config.get("norm_topk_prob", True)),
        "router_score": "sigmoid",
        "router_score_bias": True,
        "n_expert_groups": int(groups),
        "top_k_groups": int(hf_config.get("topk_group") or groups),
        "routed_scaling_factor": float(hf_config.get("routed_scaling_factor", 1.0)),
        "n_shared_experts": int(hf_config.get("n_shared_experts") or 0),
        "first_dense_layers": int(hf_config.get("first_k_dense_replace") or 0),
    }


def attention_tensors(config: ModelConfig, hf: str, ours: str) -> dict[str, str]:
    """HF name -> our parameter name of one layer's latent attention (hf/ours: the layer's prefixes)."""
    names = {
        "kv_a_proj_with_mqa.weight": "wkv_a.weight",
        "kv_a_layernorm.weight": "kv_a_norm.weight",
        "kv_b_proj.weight": "wkv_b.weight",
        "o_proj.weight": "wo.weight",
    }
    if config.q_lora_rank is None:
        names["q_proj.weight"] = "wq.weight"
    else:
        names.update({"q_a_proj.weight": "wq_a.weight", "q_a_layernorm.weight": "q_a_norm.weight",
                      "q_b_proj.weight": "wq_b.weight"})
    return {f"{hf}.self_attn.{key}": f"{ours}.attention.{value}" for key, value in names.items()}


def is_extra_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of a layer past num_hidden_layers: DeepSeek-V3's multi-token-prediction module
    (num_nextn_predict_layers), which transformers also ignores when loading."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= config.n_layers
