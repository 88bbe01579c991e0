"""Multi-head latent attention (DeepSeek-V2/V3), computed as ordinary multi-head attention.

Queries come from a full projection or a low-rank one (q_lora_rank, with an RMSNorm between). Keys and
values come from one compressed latent per token (kv_lora_rank, normalised) expanded per head by wkv_b,
plus a rotary key part (qk_rope_head_dim) shared by all heads. Only the rotary part of queries and keys
is rotated (interleaved pairs with rope_interleave, as transformers does it).

The expanded keys and values are what this module caches and hands to the common KV cache, prefix cache
and shared-prefix paths: keys [B, n_heads, T, qk_nope + qk_rope] and values [B, n_heads, T, v_head_dim],
each zero-padded to config.head_dim (the wider of the two), so the engine needs no MLA-specific cache.
Zero padding changes no dot product, and the padded value columns are dropped before the output
projection. (Caching the latent instead would be 2 * n_heads * head_dim / (kv_lora_rank + qk_rope) times
smaller; that is a serving optimisation for large models, not done here.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.model.attention import Attention
from training.model.config import ModelConfig
from training.model.rope import apply_rotary, apply_rotary_interleaved, yarn_factor, yarn_mscale

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q/kv latent RMSNorms (transformers' DeepseekV3RMSNorm default; not config.rms_norm_eps)."""


def mla_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head width), times yarn's mscale(factor, mscale_all_dim)^2 when the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
        factor = yarn_factor(scaling, config.max_seq_len)
        mscale = yarn_mscale(factor, float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


class MLAttention(Attention):
    """Attention's forward over MLA's projections (it overrides every hook; Attention.__init__ is not run)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        nn.Module.__init__(self)
        self.layer_index = layer_index
        self.n_heads = self.n_kv_heads = config.n_heads
        self.head_dim = config.head_dim
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleave = config.rope_interleave
        self.scale = mla_softmax_scale(config)
        d_model, heads, qk_width = config.d_model, config.n_heads, self.nope + self.rope
        self.wq = self.wq_a = self.q_a_norm = self.wq_b = None
        if config.q_lora_rank is None:
            self.wq = nn.Linear(d_model, heads * qk_width, bias=False)
        else:
            self.wq_a = nn.Linear(d_model, config.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.q_lora_rank, heads * qk_width, bias=False)
        self.wkv_a = nn.Linear(d_model, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, d_model, bias=False)

    def reset_parameters(self, *, std: float, output_std: float) -> None:
        for projection in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if projection is not None:
                nn.init.normal_(projection.weight, std=std)
        nn.init.normal_(self.wo.weight, std=output_std)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.reset_parameters()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, self.head_dim - x.shape[-1])) if x.shape[-1] < self.head_dim else x

    def rotated_queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries [B, n_heads, T, head_dim] (nope part, rotated rope part, zero padding)."""
        batch, length, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q = q.view(batch, length, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        return self._pad(torch.cat([q_nope, self._rotate(q_rope, cos, sin)], dim=-1))

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys with the rotary part rotated, values), each [B, n_heads, T, head_dim] zero-padded."""
        batch, length, _ = x.shape
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        expanded = self.wkv_b(self.kv_a_norm(latent)).view(batch, length, self.n_heads, self.nope + self.v_dim)
        k_nope, v = expanded.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k_rope = self._rotate(k_rope.view(batch, 1, length, self.rope), cos, sin)
        keys = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        return self._pad(keys), self._pad(v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **mask)

    def project_out(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        values = attended[..., : self.v_dim]
        return self.wo(values.transpose(1, 2).reshape(batch, length, self.n_heads * self.v_dim))
