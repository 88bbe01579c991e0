"""Typed configuration of the policy model (decoder-only MoE transformer).

One dataclass describes every size; named presets go from a CI-sized model that trains on a
2-core CPU to multi-GPU sizes, so scaling is a config change and never a code change.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Precision = Literal["fp32", "bf16", "mxfp8"]
FeedForwardKind = Literal["moe", "dense"]
QKNorm = Literal["none", "head", "full"]
AttentionKind = Literal["gqa", "mla"]
RouterScore = Literal["softmax", "sigmoid"]

QK_NORMS: tuple[str, ...] = ("none", "head", "full")
ROPE_SCALING_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
ATTENTION_KINDS: tuple[str, ...] = ("gqa", "mla")
ROUTER_SCORES: tuple[str, ...] = ("softmax", "sigmoid")

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "mxfp8")
FEED_FORWARD_KINDS: tuple[str, ...] = ("moe", "dense")
# MX formats share one exponent per block of 32 consecutive values along the reduction dim.
MX_BLOCK_SIZE = 32


class ModelConfigError(ValueError):
    """A ModelConfig whose fields contradict each other; the message says how to fix it."""


@dataclass
class ModelConfig:
    """Shape and numerics of a MoETransformer."""

    vocab_size: int = 2048
    """Rows of the token embedding; must be >= the tokenizer's vocabulary size."""

    d_model: int = 128
    """Width of the residual stream."""

    n_layers: int = 2
    """Number of transformer blocks."""

    n_heads: int = 4
    """Query heads per attention layer; d_model must be divisible by it."""

    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""

    max_seq_len: int = 2048
    """Longest sequence (prompt + completion) the rotary tables and KV cache are sized for."""

    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    feed_forward: FeedForwardKind = "moe"
    """"moe" for routed SwiGLU experts, "dense" for one SwiGLU MLP per layer (baseline)."""

    n_experts: int = 4
    """Routed experts per MoE layer (ignored by dense models)."""

    top_k: int = 2
    """Experts each token is routed to; must be <= n_experts."""

    d_ff_expert: int = 256
    """Hidden width of one SwiGLU expert."""

    d_ff_dense: int = 512
    """Hidden width of the dense SwiGLU MLP (dense models only)."""

    normalize_top_k_weights: bool = True
    """Renormalise the top-k router probabilities of a token to sum to one."""

    precision: Precision = "fp32"
    """Numerics of the expert matmuls: "fp32", "bf16" or "mxfp8" (block-scaled FP8, 32-wide blocks)."""

    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection."""

    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    attention_head_dim: int | None = None
    """Width of one attention head when it is not d_model / n_heads (Qwen3 sets it explicitly)."""

    qk_norm: QKNorm = "none"
    """RMSNorm of queries and keys before the rotary embedding: "head" normalises each head (Qwen3,
    Qwen3-MoE), "full" the whole projection (OLMoE), "none" neither (Llama, Qwen2, Mixtral, ours)."""

    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; Llama/Qwen3 with attention_bias)."""

    output_bias: bool = False
    """Bias on the attention output projection (Llama/Qwen3/OLMoE with attention_bias)."""

    rope_scaling: dict[str, Any] | None = None
    """Rotary frequency scaling as in a Hugging Face config: {"rope_type": "linear", "factor": f} or the
    "llama3" kind (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""

    clip_qkv: float | None = None
    """Clamp query, key and value projections to [-clip_qkv, clip_qkv] (OLMoE's option)."""

    attention: AttentionKind = "gqa"
    """"gqa": grouped-query attention; "mla": DeepSeek's multi-head latent attention (the mla_* fields)."""

    q_lora_rank: int | None = None
    """MLA: rank of the low-rank query projection (None: one full query projection)."""

    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent."""

    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without the rotary embedding."""

    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with the rotary embedding (the key part is shared by all heads)."""

    v_head_dim: int = 0
    """MLA: per-head value width."""

    rope_interleave: bool = False
    """MLA: the rotary part holds interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's rope_interleave)."""

    router_score: RouterScore = "softmax"
    """Router scores: "softmax" over the experts, or an independent "sigmoid" per expert (DeepSeek-V3)."""

    router_score_bias: bool = False
    """A per-expert bias added to the scores for choosing experts only (DeepSeek's e_score_correction_bias);
    the gate weights use the unbiased scores. A buffer, set by auxiliary-loss-free balancing, not by SGD."""

    n_expert_groups: int = 1
    """Groups the experts are split into for group-limited routing (DeepSeek's n_group)."""

    top_k_groups: int = 1
    """Groups a token may route into: the best by the sum of each group's two best scores (topk_group)."""

    routed_scaling_factor: float = 1.0
    """Multiplier of the routed experts' gate weights (after any renormalisation)."""

    n_shared_experts: int = 0
    """Experts every token uses, as one SwiGLU of width n_shared_experts * d_ff_expert beside the routed ones."""

    first_dense_layers: int = 0
    """In an MoE model, the first layers use a dense SwiGLU of width d_ff_dense (first_k_dense_replace)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        """Width of one attention head (of the cached keys and values: MLA pads the narrower to the wider)."""
        if self.attention == "mla":
            return max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Width the rotary embedding turns: the whole head, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def n_moe_layers(self) -> int:
        """Layers with a router (the routing tensors' layer dimension)."""
        return self.n_layers - self.first_dense_layers if self.is_moe else 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` has routed experts."""
        return self.is_moe and index >= self.first_dense_layers

    def validate(self) -> None:
        """Raise ModelConfigError when fields are out of range or contradict each other."""
        self._validate_fields()
        self._validate_rope_scaling()
        self._validate_heads()
        self._validate_mla()
        self._validate_router()
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ModelConfigError("rope_theta, norm_eps and init_std must all be positive.")
        hidden_widths = self._validate_feed_forward()
        if self.precision == "mxfp8":
            self._validate_mx_blocks(hidden_widths)

    def _validate_fields(self) -> None:
        """Each field on its own: sizes positive, kinds among the known ones."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.feed_forward not in FEED_FORWARD_KINDS:
            raise ModelConfigError(
                f"feed_forward={self.feed_forward!r} is unknown; use one of {FEED_FORWARD_KINDS}."
            )
        if self.precision not in PRECISIONS:
            raise ModelConfigError(f"precision={self.precision!r} is unknown; use one of {PRECISIONS}.")
        if self.attention_head_dim is not None and self.attention_head_dim <= 0:
            raise ModelConfigError(f"attention_head_dim must be positive, got {self.attention_head_dim}.")
        if self.qk_norm not in QK_NORMS:
            raise ModelConfigError(f"qk_norm={self.qk_norm!r} is unknown; use one of {QK_NORMS}.")

    def _validate_heads(self) -> None:
        """Head width and grouped-query layout."""
        if self.attention_head_dim is None and self.d_model % self.n_heads:
            raise ModelConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"pick n_heads among the divisors of d_model (e.g. {_divisors_hint(self.d_model)})."
            )
        if self.rotary_dim % 2:
            raise ModelConfigError(
                f"rotary width {self.rotary_dim} (head_dim, or qk_rope_head_dim with MLA) is odd; rotary embeddings rotate pairs, "
                "so choose n_heads such that d_model/n_heads is even."
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} for grouped-query "
                "attention; set n_kv_heads to a divisor of n_heads (n_kv_heads=n_heads disables GQA)."
            )

    def _validate_mla(self) -> None:
        """Multi-head latent attention's widths; the GQA-only options are off."""
        if self.attention not in ATTENTION_KINDS:
            raise ModelConfigError(f"attention={self.attention!r} is unknown; use one of {ATTENTION_KINDS}.")
        if self.attention != "mla":
            return
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"attention='mla' needs {name} > 0, got {getattr(self, name)}.")
        if self.qk_nope_head_dim < 0 or (self.q_lora_rank is not None and self.q_lora_rank <= 0):
            raise ModelConfigError("qk_nope_head_dim must be >= 0 and q_lora_rank None or positive.")
        if self.n_kv_heads != self.n_heads:
            raise ModelConfigError(
                f"attention='mla' expands the latent to every head: n_kv_heads must equal n_heads={self.n_heads}."
            )
        if self.qk_norm != "none" or self.qkv_bias or self.output_bias or self.clip_qkv is not None:
            raise ModelConfigError("attention='mla' has no qk_norm, qkv_bias, output_bias or clip_qkv.")

    def _validate_router(self) -> None:
        """Router kind, group-limited routing, shared experts and leading dense layers."""
        if self.router_score not in ROUTER_SCORES:
            raise ModelConfigError(f"router_score={self.router_score!r} is unknown; use one of {ROUTER_SCORES}.")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ModelConfigError(f"routed_scaling_factor must be finite and positive, got {self.routed_scaling_factor}.")
        if self.n_shared_experts < 0 or not 0 <= self.first_dense_layers < max(self.n_layers, 1):
            raise ModelConfigError(
                f"n_shared_experts={self.n_shared_experts} must be >= 0 and first_dense_layers="
                f"{self.first_dense_layers} in [0, n_layers={self.n_layers}) (at least one MoE layer)."
            )
        groups, chosen = self.n_expert_groups, self.top_k_groups
        if groups < 1 or not 1 <= chosen <= groups or self.n_experts % groups:
            raise ModelConfigError(
                f"n_expert_groups={groups} must divide n_experts={self.n_experts} and top_k_groups={chosen} "
                f"be between 1 and n_expert_groups."
            )
        per_group = self.n_experts // groups
        if groups > 1 and (per_group < 2 or self.top_k > chosen * per_group):
            raise ModelConfigError(
                f"Group-limited routing scores a group by its two best experts and picks top_k={self.top_k} "
                f"among top_k_groups={chosen} groups of {per_group} experts: each group needs >= 2 experts "
                "and top_k <= top_k_groups * experts per group."
            )

    def _validate_feed_forward(self) -> dict[str, int]:
        """The feed-forward kind's sizes; returns its hidden widths by field name."""
        if self.feed_forward == "moe":
            if self.n_experts < 1 or self.d_ff_expert < 1:
                raise ModelConfigError("MoE models need n_experts >= 1 and d_ff_expert >= 1.")
            if not 1 <= self.top_k <= self.n_experts:
                raise ModelConfigError(
                    f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}; "
                    "lower top_k or add experts."
                )
            hidden_widths = {"d_ff_expert": self.d_ff_expert}
            if self.first_dense_layers and self.d_ff_dense < 1:
                raise ModelConfigError("first_dense_layers > 0 needs d_ff_dense >= 1.")
        else:
            if self.d_ff_dense < 1:
                raise ModelConfigError("Dense models need d_ff_dense >= 1.")
            hidden_widths = {"d_ff_dense": self.d_ff_dense}
        return hidden_widths

    def _validate_mx_blocks(self, hidden_widths: dict[str, int]) -> None:
        """mxfp8 scales blocks of MX_BLOCK_SIZE values: every width it quantizes must be a multiple."""
        for name, value in {"d_model": self.d_model, **hidden_widths}.items():
            if value % MX_BLOCK_SIZE:
                raise ModelConfigError(
                    f"precision='mxfp8' scales blocks of {MX_BLOCK_SIZE} values, but {name}={value} "
                    f"is not a multiple of {MX_BLOCK_SIZE}; round it up to "
                    f"{-(-value // MX_BLOCK_SIZE) * MX_BLOCK_SIZE} or use precision='bf16'."
                )

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if kind not in ROPE_SCALING_TYPES:
            raise ModelConfigError(
                f"rope_scaling type {kind!r} is not supported; supported types are {ROPE_SCALING_TYPES}."
            )
        needed = {"linear": ("factor",), "llama3": (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",)}.get(kind, ())
        missing = [key for key in needed if key not in self.rope_scaling]
        if missing:
            raise ModelConfigError(f"rope_scaling of type {kind!r} lacks {missing}.")

    @property
    def is_moe(self) -> bool:
        """True when the feed-forward layers are routed experts."""
        return self.feed_forward == "moe"

    def dense_equivalent(self) -> ModelConfig:
        """A dense model with the same active parameters per token (hidden = top_k * d_ff_expert)."""
        if not self.is_moe:
            return dataclasses.replace(self)
        return dataclasses.replace(self, feed_forward="dense", d_ff_dense=self.top_k * self.d_ff_expert)

    def _attention_parameters(self) -> int:
        """Parameters of one attention layer."""
        if self.attention == "mla":
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank is None:
                query = self.d_model * self.n_heads * qk_head
            else:
                query = self.q_lora_rank * (self.d_model + 1 + self.n_heads * qk_head)
            latent = self.d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            expand = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return query + latent + expand + self.n_heads * self.v_head_dim * self.d_model
        attention = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attention += self.head_dim * (self.n_heads + 2 * self.n_kv_heads) * self.qkv_bias
        attention += self.d_model * self.output_bias
        return attention + {"none": 0, "head": 2 * self.head_dim,
                            "full": self.head_dim * (self.n_heads + self.n_kv_heads)}[self.qk_norm]

    def parameter_counts(self) -> dict[str, int]:
        """Total and per-token active parameter counts (embeddings included once when tied; buffers such
        as the router score bias are not parameters)."""
        per_layer = self._attention_parameters() + 2 * self.d_model
        dense = 3 * self.d_model * self.d_ff_dense
        if self.is_moe:
            expert = 3 * self.d_model * self.d_ff_expert
            fixed = self.d_model * self.n_experts + self.n_shared_experts * expert
            moe_total, moe_active = self.n_experts * expert + fixed, self.top_k * expert + fixed
            n_dense, n_moe = self.first_dense_layers, self.n_moe_layers
        else:
            moe_total = moe_active = 0
            n_dense, n_moe = self.n_layers, 0
        embeddings = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        shared = embeddings + self.d_model + self.n_layers * per_layer + n_dense * dense
        return {"total": shared + n_moe * moe_total, "active": shared + n_moe * moe_active}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelConfigError(f"Unknown ModelConfig fields {unknown}; known fields are {sorted(known)}.")
        return cls(**data)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def named(cls, name: str, **overrides: Any) -> ModelConfig:
        """A preset by name ("tiny", "small", "base", "large"), optionally with fields overridden.

        A "-dense" suffix (e.g. "small-dense") gives the dense model with equal active parameters.
        """
        dense = name.endswith("-dense")
        preset = NAMED_CONFIGS.get(name.removesuffix("-dense"))
        if preset is None:
            choices = sorted(NAMED_CONFIGS) + [f"{n}-dense" for n in sorted(NAMED_CONFIGS)]
            raise ModelConfigError(f"Unknown model size {name!r}; choose one of {choices}.")
        config = cls(**{**preset, **overrides})
        return config.dense_equivalent() if dense else config


def _divisors_hint(value: int) -> list[int]:
    return [d for d in range(1, min(value, 64) + 1) if value % d == 0][-4:]


NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    # < 2M parameters: trains in seconds on a 2-core CPU, used by CI and by other teams' tests.
    "tiny": {
        "vocab_size": 2048,
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "max_seq_len": 2048,
        "n_experts": 4,
        "top_k": 2,
        "d_ff_expert": 256,
    },
    # ~22M parameters (~8M active): the CPU demo model.
    "small": {
        "vocab_size": 8192,
        "d_model": 256,
        "n_layers": 6,
        "n_heads": 8,
        "n_kv_heads": 4,
        "max_seq_len": 4096,
        "n_experts": 8,
        "top_k": 2,
        "d_ff_expert": 512,
    },
    # ~1.2B parameters (~0.21B active): a single-GPU model.
    "base": {
        "vocab_size": 32768,
        "d_model": 1024,
        "n_layers": 16,
        "n_heads": 16,
        "n_kv_heads": 4,
        "max_seq_len": 8192,
        "rope_theta": 500000.0,
        "n_experts": 32,
        "top_k": 4,
        "d_ff_expert": 704,
        "precision": "bf16",
    },
    # ~7.6B parameters (~1.1B active): multi-GPU, MXFP8 expert matmuls.
    "large": {
        "vocab_size": 65536,
        "d_model": 2048,
        "n_layers": 24,
        "n_heads": 32,
        "n_kv_heads": 8,
        "max_seq_len": 16384,
        "rope_theta": 1000000.0,
        "n_experts": 64,
        "top_k": 6,
        "d_ff_expert": 768,
        "precision": "mxfp8",
    },
}
