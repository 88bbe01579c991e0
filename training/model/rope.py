"""Rotary position embedding: frequencies (with Hugging Face rope scaling), cos/sin tables, rotation.

The scaling kinds follow transformers' modeling_rope_utils: "linear" divides the frequencies, "llama3"
smooths between low and high frequencies, "yarn" (DeepSeek-V3) ramps between interpolated and
extrapolated frequencies and scales cos/sin by an attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from training.model.config import ModelConfig


def _rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(scaling: dict, max_seq_len: int) -> float:
    """The context extension factor of a yarn rope_scaling (from the lengths when `factor` is absent)."""
    factor = scaling.get("factor")
    if factor is None:
        return max_seq_len / float(scaling["original_max_position_embeddings"])
    return float(factor)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos/sin are multiplied by ("yarn" only; 1 otherwise), as transformers computes it."""
    scaling = config.rope_scaling
    if _rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, config.max_seq_len)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict, *, dim: int, base: float,
                              max_seq_len: int) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: a linear ramp between extrapolated and interpolated bands."""
    factor = yarn_factor(scaling, max_seq_len)
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def scaled_inverse_frequencies(
    inv_freq: torch.Tensor, scaling: dict | None, *, dim: int = 0, base: float = 10000.0, max_seq_len: int = 0
) -> torch.Tensor:
    """Apply a Hugging Face rope_scaling ("linear", "llama3", "yarn"; "default" and None leave it) to the
    rotary inverse frequencies, with the same formulas as transformers' modeling_rope_utils."""
    kind = _rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, scaling, dim=dim, base=base, max_seq_len=max_seq_len)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    old_context = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (rotate-half convention) indexed by absolute position, config.rotary_dim
    wide (the whole head, or the rotary part of a latent-attention head)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(config.max_seq_len, config.rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(config.max_seq_len, config.rotary_dim), persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fill the tables in place (also after materialising a model built on the meta device)."""
        dim, device, config = self.config.rotary_dim, self.cos.device, self.config
        if device.type == "meta":
            return
        exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim
        inv_freq = scaled_inverse_frequencies(
            1.0 / (config.rope_theta**exponents), config.rope_scaling, dim=dim, base=config.rope_theta,
            max_seq_len=config.max_seq_len,
        )
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        factor = rope_attention_factor(config)
        self.cos.copy_(angles.cos() * factor)
        self.sin.copy_(angles.sin() * factor)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, rotary_dim] broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the output holds
    the rotated even elements then the odd ones, as transformers' apply_rotary_pos_emb_interleave."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
