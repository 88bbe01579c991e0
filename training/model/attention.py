"""Grouped-query attention with RoPE (and the Hugging Face families' options: qk-norm, biases, clipping).

forward is written over four hooks (rotated_queries, keys_values, attend, project_out) that
mla.MLAttention overrides, so every attention kind shares the KV cache, shared-prefix and
query-position paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.model.config import ModelConfig
from training.model.kv_cache import CacheBatch, KVCache
from training.model.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.clip_qkv = config.clip_qkv
        self.wq = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.d_model, config.n_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=config.output_bias)
        self.qk_norm = config.qk_norm
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":
            q_width = config.head_dim if config.qk_norm == "head" else config.n_heads * config.head_dim
            k_width = config.head_dim if config.qk_norm == "head" else config.n_kv_heads * config.head_dim
            self.q_norm = nn.RMSNorm(q_width, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(k_width, eps=config.norm_eps)

    def reset_parameters(self, *, std: float, output_std: float) -> None:
        for projection in (self.wq, self.wk, self.wv):
            nn.init.normal_(projection.weight, std=std)
        nn.init.normal_(self.wo.weight, std=output_std)
        for projection in (self.wq, self.wk, self.wv, self.wo):
            if projection.bias is not None:
                nn.init.zeros_(projection.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def _project(self, x: torch.Tensor, projection: nn.Linear, norm: nn.RMSNorm | None, heads: int) -> torch.Tensor:
        """x [B, T, d_model] -> [B, heads, T, head_dim] through the projection, qk-norm and clipping."""
        batch, length, _ = x.shape
        out = projection(x)
        if norm is not None and self.qk_norm == "full":
            out = norm(out)
        out = out.view(batch, length, heads, self.head_dim)
        if norm is not None and self.qk_norm == "head":
            out = norm(out)
        if self.clip_qkv is not None:
            out = out.clamp(-self.clip_qkv, self.clip_qkv)
        return out.transpose(1, 2)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Queries [B, n_heads, T, head_dim] before the rotary embedding."""
        return self._project(x, self.wq, self.q_norm, self.n_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        kv_cache: KVCache | None,
        cache_batch: CacheBatch | None,
        query_positions: torch.Tensor | None = None,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_sink: list | None = None,
    ) -> torch.Tensor:
        """query_positions: int [B, N]; when given, only these positions query (causally, over every key of
        their row) and the result is [B, N, d_model]; without it every position does.
        prefix: (keys, values) [1, n_kv_heads, P, head_dim] of a shared prefix every row continues (x starts
        at position P); every query attends all of it. kv_sink: a list this layer appends its (keys, values) to.
        """
        batch, length, _ = x.shape
        k, v = self.keys_values(x, cos, sin)
        if kv_sink is not None:
            kv_sink.append((k, v))
        offset = 0
        if prefix is not None:
            offset = prefix[0].shape[2]
            k = torch.cat([prefix[0].expand(batch, -1, -1, -1), k], dim=2)
            v = torch.cat([prefix[1].expand(batch, -1, -1, -1), v], dim=2)
        if query_positions is not None:
            rows = torch.arange(batch, device=x.device)[:, None]
            q = self.rotated_queries(
                x[rows, query_positions], cos[:, 0][rows, query_positions].unsqueeze(1),
                sin[:, 0][rows, query_positions].unsqueeze(1),
            )
            visible = torch.arange(offset + length, device=x.device) <= offset + query_positions[:, None, :, None]
            return self.project_out(self.attend(q, k, v, attn_mask=visible))
        q = self.rotated_queries(x, cos, sin)
        if prefix is not None:
            visible = torch.arange(offset + length, device=x.device) <= offset + torch.arange(length, device=x.device)[:, None]
            attended = self.attend(q, k, v, attn_mask=visible)
        elif kv_cache is None:
            attended = self.attend(q, k, v, is_causal=True)
        else:
            keys, values = kv_cache.append(self.layer_index, cache_batch, k, v)
            attended = self.attend(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=cache_batch.attention_mask)
        return self.project_out(attended)

    def rotated_queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries [B, n_heads, T, head_dim] of x [B, T, d_model] with the rotary embedding applied."""
        return apply_rotary(self.queries(x), cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask) -> torch.Tensor:
        """Scaled dot-product attention [B, n_heads, T, head_dim]; mask: attn_mask= or is_causal=."""
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.n_kv_heads != self.n_heads, **mask)

    def project_out(self, attended: torch.Tensor) -> torch.Tensor:
        """[B, n_heads, T, head_dim] -> the output projection [B, T, d_model]."""
        batch, _, length, _ = attended.shape
        return self.wo(attended.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim))

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys with the rotary embedding applied, values), each [B, n_kv_heads, T, head_dim]."""
        k = self._project(x, self.wk, self.k_norm, self.n_kv_heads)
        v = self._project(x, self.wv, None, self.n_kv_heads)
        return apply_rotary(k, cos, sin), v
