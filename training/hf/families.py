"""Hugging Face model families Flowstate loads into its own MoETransformer.

A family maps a `config.json` (its `model_type`) to a ModelConfig and names the checkpoint's tensors.
The architectures differ only in options of the one model class: qk-norm per head (Qwen3, Qwen3-MoE) or
over the whole projection (OLMoE), attention biases (Qwen2's on Q/K/V, `attention_bias` elsewhere),
renormalised top-k router weights (Mixtral always, Qwen3-MoE/OLMoE by `norm_topk_prob`), the expert
tensors' names, and tied embeddings. The engine, trainer, routing replay and MXFP8 experts are common.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.hf.deepseek import DeepSeekConfigError, deepseek_fields
from training.model.config import ModelConfig, ModelConfigError


class UnsupportedModelError(ValueError):
    """A Hugging Face config Flowstate cannot load; the message names the reason."""


@dataclass(frozen=True)
class Family:
    """How one Hugging Face `model_type` maps onto MoETransformer."""

    model_type: str
    """The config.json `model_type` this family reads."""

    moe: bool
    """Routed experts (True) or one dense SwiGLU MLP per layer."""

    qk_norm: str = "none"
    """ModelConfig.qk_norm of the family."""

    qwen2_bias: bool = False
    """Q/K/V biases always on and no output bias (Qwen2), instead of `attention_bias` on all four."""

    moe_module: str = "mlp"
    """Name of a layer's MoE module in tensor names ("mlp", Mixtral's "block_sparse_moe")."""

    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Tensor names of an expert's gate, up and down projections (Mixtral: w1, w3, w2)."""

    always_normalize: bool = False
    """Top-k router weights always renormalised (Mixtral) rather than by `norm_topk_prob`."""

    experts_key: str = "num_experts"
    """config.json key of the routed expert count."""

    expert_width_key: str = "moe_intermediate_size"
    """config.json key of one expert's hidden width."""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", moe=False),
    "qwen2": Family("qwen2", moe=False, qwen2_bias=True),
    "qwen3": Family("qwen3", moe=False, qk_norm="head"),
    "qwen3_moe": Family("qwen3_moe", moe=True, qk_norm="head"),
    "olmoe": Family("olmoe", moe=True, qk_norm="full", expert_width_key="intermediate_size"),
    "mixtral": Family(
        "mixtral", moe=True, moe_module="block_sparse_moe", expert_names=("w1", "w3", "w2"),
        always_normalize=True, experts_key="num_local_experts", expert_width_key="intermediate_size",
    ),
    # multi-head latent attention, sigmoid group-limited routing, shared experts: training/hf/deepseek.py
    "deepseek_v3": Family("deepseek_v3", moe=True, experts_key="n_routed_experts"),
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def family_of(hf_config: dict[str, Any]) -> Family:
    """The Family of a config.json dict, or UnsupportedModelError naming the supported families."""
    model_type = hf_config.get("model_type")
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise UnsupportedModelError(
            f"config.json has model_type={model_type!r}, which Flowstate cannot load; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}."
        )
    return family


def _rope(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a v4 config (top-level keys) or a v5 one (`rope_parameters`)."""
    parameters = hf_config.get("rope_parameters") or {}
    theta = hf_config.get("rope_theta", parameters.get("rope_theta", 10000.0))
    scaling = hf_config.get("rope_scaling") or {k: v for k, v in parameters.items() if k != "rope_theta"} or None
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _refuse_unsupported(family: Family, hf_config: dict[str, Any]) -> None:
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only SwiGLU with silu).")
    if hf_config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported (Flowstate's MLPs have no biases).")
    if hf_config.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported (full attention only).")
    window, longest = hf_config.get("sliding_window"), hf_config.get("max_position_embeddings", 0)
    if family.model_type == "mixtral" and window is not None and window < longest:
        raise UnsupportedModelError(
            f"sliding_window={window} < max_position_embeddings={longest}: sliding-window attention "
            "is not supported."
        )
    if family.model_type == "qwen3_moe" and (
        hf_config.get("decoder_sparse_step", 1) != 1 or hf_config.get("mlp_only_layers")
    ):
        raise UnsupportedModelError(
            "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
            "every layer must be an MoE layer."
        )


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict (fp32 numerics; precision is a later choice)."""
    family = family_of(hf_config)
    _refuse_unsupported(family, hf_config)
    try:
        d_model, n_heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
        theta, scaling = _rope(hf_config)
        head_dim = hf_config.get("head_dim")
        bias = bool(hf_config.get("attention_bias", False))
        fields: dict[str, Any] = {
            "vocab_size": int(hf_config["vocab_size"]),
            "d_model": d_model,
            "n_layers": int(hf_config["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(hf_config.get("num_key_value_heads") or n_heads),
            "max_seq_len": int(hf_config.get("max_position_embeddings", 2048)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
            "attention_head_dim": int(head_dim) if head_dim and int(head_dim) * n_heads != d_model else None,
            "qk_norm": family.qk_norm,
            "qkv_bias": True if family.qwen2_bias else bias,
            "output_bias": False if family.qwen2_bias else bias,
            "clip_qkv": hf_config.get("clip_qkv"),
            "init_std": float(hf_config.get("initializer_range", 0.02)),
        }
        if family.moe:
            fields.update(
                feed_forward="moe",
                n_experts=int(hf_config.get(family.experts_key) or hf_config.get("num_local_experts")
                              or hf_config["num_experts"]),
                top_k=int(hf_config["num_experts_per_tok"]),
                d_ff_expert=int(hf_config[family.expert_width_key]),
                normalize_top_k_weights=family.always_normalize or bool(hf_config.get("norm_topk_prob", False)),
            )
        else:
            fields.update(feed_forward="dense", d_ff_dense=int(hf_config["intermediate_size"]))
        if family.model_type == "deepseek_v3":
            fields.update(deepseek_fields(hf_config))
    except DeepSeekConfigError as error:
        raise UnsupportedModelError(str(error)) from error
    except KeyError as error:
        raise UnsupportedModelError(
            f"config.json of model_type={family.model_type!r} lacks the key {error.args[0]!r}."
        ) from error
    try:
        return ModelConfig(**fields)
    except ModelConfigError as error:
        raise UnsupportedModelError(f"config.json describes a model Flowstate cannot build: {error}") from error
