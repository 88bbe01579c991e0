"""Hopper FP8 recipe: E4M3 with fp32 block scales (1x128 activations, 128x128 weights), DeepSeek-V3 style.

Hopper (sm_90) has FP8 tensor cores but no hardware MX block scaling, so block-scaled FP8 there is done
by scaling each partial product in software. With 128-wide scale blocks that costs a quarter of the
scale multiplies of MXFP8's 32-wide blocks, and fp32 (not power-of-two) scales use the E4M3 range fully.
A 128x128 weight block has the same extent along both axes, so one quantized copy of a weight serves
the forward GEMM and (read transposed) the dgrad GEMM.

Quantization is element-wise PyTorch (it runs on any device); the GEMMs are the grouped Triton kernel of
``kernels.grouped_gemm_mxfp8`` with ``SCALE_BLOCK_K=128`` and fp32 scales, and the weight-gradient
kernel of ``kernels.grouped_wgrad_mxfp8`` with 128x1 token blocks that restart at every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.grouped_gemm_mxfp8 import grouped_gemm_launch
from kernels.grouped_wgrad_mxfp8 import grouped_wgrad_launch
from kernels.mx_format import E4M3_MAX, check_offsets, encode_e4m3_saturating, group_block_table

HOPPER_BLOCK = 128
"""Extent of a scale block along each blocked axis."""


@dataclass(frozen=True)
class BlockwiseFP8Tensor:
    """E4M3 data with fp32 scales over 1x128 (activations) or 128x128 (weights) blocks."""

    data: torch.Tensor
    """float8_e4m3fn, same shape as the source."""

    scales: torch.Tensor
    """fp32: ``[T, K // 128]`` for activations, ``[E, K // 128, N // 128]`` for weights,
    ``[T // 128 + E, N]`` for 128x1 token blocks (row ``block_base[e] + j`` = block j of expert e);
    NaN marks a block holding NaN/Inf."""

    offsets: torch.Tensor | None = None
    """int32 [E+1] expert offsets for 128x1 token blocks, else None."""


def _block_scales(amax: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    scale = amax / E4M3_MAX
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)


def _encode(values: torch.Tensor, scale: torch.Tensor, nonfinite_values: torch.Tensor) -> torch.Tensor:
    finite = torch.where(nonfinite_values, torch.zeros_like(values), values)
    scaled = finite / scale
    scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros_like(scaled))
    bits = encode_e4m3_saturating(scaled)
    nan_bits = torch.full_like(bits, 0x7F)
    return torch.where(torch.isnan(scale).expand_as(bits), nan_bits, bits)


def quantize_fp8_blockwise_activations(x: torch.Tensor) -> BlockwiseFP8Tensor:
    """[T, K] -> 1x128 blocks along K (K must be a multiple of 128)."""
    if x.dim() != 2 or x.shape[1] % HOPPER_BLOCK:
        raise ValueError(f"activations must be [T, K] with K % {HOPPER_BLOCK} == 0, got shape {tuple(x.shape)}.")
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, HOPPER_BLOCK)
    nonfinite_values = ~torch.isfinite(blocks)
    amax = torch.where(nonfinite_values, torch.zeros_like(blocks), blocks.abs()).amax(dim=-1)
    scale = _block_scales(amax, nonfinite_values.any(dim=-1))
    bits = _encode(blocks, scale.unsqueeze(-1), nonfinite_values)
    return BlockwiseFP8Tensor(data=bits.reshape(x.shape).view(torch.float8_e4m3fn), scales=scale)


def quantize_fp8_blockwise_weights(w: torch.Tensor) -> BlockwiseFP8Tensor:
    """[E, K, N] -> 128x128 blocks (K and N must be multiples of 128)."""
    if w.dim() != 3 or w.shape[1] % HOPPER_BLOCK or w.shape[2] % HOPPER_BLOCK:
        raise ValueError(
            f"weights must be [E, K, N] with K and N multiples of {HOPPER_BLOCK}, got shape {tuple(w.shape)}."
        )
    n_experts, k, n = w.shape
    blocks = w.to(torch.float32).reshape(n_experts, k // HOPPER_BLOCK, HOPPER_BLOCK, n // HOPPER_BLOCK, HOPPER_BLOCK)
    nonfinite_values = ~torch.isfinite(blocks)
    amax = torch.where(nonfinite_values, torch.zeros_like(blocks), blocks.abs()).amax(dim=(2, 4))
    scale = _block_scales(amax, nonfinite_values.any(dim=(2, 4)))
    bits = _encode(blocks, scale[:, :, None, :, None], nonfinite_values)
    return BlockwiseFP8Tensor(data=bits.reshape(w.shape).view(torch.float8_e4m3fn), scales=scale)


def quantize_fp8_blockwise_tokens(x: torch.Tensor, offsets: torch.Tensor) -> BlockwiseFP8Tensor:
    """[T, N] sorted by expert -> 128x1 blocks along tokens, restarting at each expert (for wgrad)."""
    if x.dim() != 2:
        raise ValueError(f"token-blocked quantization takes [T, N], got shape {tuple(x.shape)}.")
    total_rows, n = x.shape
    check_offsets(offsets, total_rows)
    table = group_block_table(offsets, total_rows, block_rows=HOPPER_BLOCK)
    n_blocks = table.row_start.numel()
    offsets = offsets.to(torch.int32)
    if total_rows == 0:
        empty = torch.zeros(0, n, dtype=torch.uint8, device=x.device).view(torch.float8_e4m3fn)
        return BlockwiseFP8Tensor(empty, torch.ones(n_blocks, n, device=x.device), offsets)
    rows = table.row_start.to(torch.int64).unsqueeze(1) + torch.arange(HOPPER_BLOCK, device=x.device)
    valid = rows < table.row_end.to(torch.int64).unsqueeze(1)
    gathered = x.to(torch.float32)[rows.clamp(max=total_rows - 1)]
    gathered = torch.where(valid.unsqueeze(-1), gathered, torch.zeros_like(gathered))
    nonfinite_values = ~torch.isfinite(gathered)
    amax = torch.where(nonfinite_values, torch.zeros_like(gathered), gathered.abs()).amax(dim=1)
    scale = _block_scales(amax, nonfinite_values.any(dim=1))
    bits = _encode(gathered, scale.unsqueeze(1), nonfinite_values)
    data = torch.zeros(total_rows, n, dtype=torch.uint8, device=x.device)
    data[rows[valid]] = bits[valid]
    return BlockwiseFP8Tensor(data=data.view(torch.float8_e4m3fn), scales=scale, offsets=offsets)


def dequantize_fp8_blockwise(t: BlockwiseFP8Tensor) -> torch.Tensor:
    values = t.data.to(torch.float32)
    if t.offsets is not None:
        offsets = t.offsets.to(torch.int64)
        table = group_block_table(offsets, values.shape[0], block_rows=HOPPER_BLOCK)
        row_ids = torch.arange(values.shape[0], device=values.device)
        group = torch.searchsorted(offsets[1:], row_ids, right=True).clamp(max=offsets.numel() - 2)
        scale_rows = table.block_base.to(torch.int64)[group] + (row_ids - offsets[group]) // HOPPER_BLOCK
        return values * t.scales[scale_rows]
    if values.dim() == 2:
        return values * t.scales.repeat_interleave(HOPPER_BLOCK, dim=1)
    return values * t.scales.repeat_interleave(HOPPER_BLOCK, dim=1).repeat_interleave(HOPPER_BLOCK, dim=2)


def _check(a: BlockwiseFP8Tensor, w: BlockwiseFP8Tensor) -> None:
    if a.data.dim() != 2 or w.data.dim() != 3:
        raise ValueError("expected activations [T, K] and weights [E, K, N] from the quantize_fp8_blockwise_* helpers.")
    if a.scales.dtype != torch.float32 or w.scales.dtype != torch.float32:
        raise ValueError("blockwise FP8 scales must be fp32.")


def fp8_blockwise_grouped_mm(
    a: BlockwiseFP8Tensor, w: BlockwiseFP8Tensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Forward: out[rows of e] = a[rows of e] @ w[e]; a [T, K] 1x128, w [E, K, N] 128x128 -> [T, N]."""
    _check(a, w)
    return grouped_gemm_launch(
        a_data=a.data, a_scales=a.scales, b_data=w.data, b_scales=w.scales, b_transposed=False,
        offsets=offsets.to(torch.int32), scale_block_k=HOPPER_BLOCK, scale_block_n=HOPPER_BLOCK, out_dtype=out_dtype,
    )


def fp8_blockwise_grouped_mm_dgrad(
    grad_out: BlockwiseFP8Tensor, w: BlockwiseFP8Tensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """dgrad: grad_out [T, N] 1x128, the same 128x128 weight read transposed -> [T, K] = grad_out @ w[e].T."""
    _check(grad_out, w)
    return grouped_gemm_launch(
        a_data=grad_out.data, a_scales=grad_out.scales, b_data=w.data, b_scales=w.scales, b_transposed=True,
        offsets=offsets.to(torch.int32), scale_block_k=HOPPER_BLOCK, scale_block_n=HOPPER_BLOCK, out_dtype=out_dtype,
    )


def fp8_blockwise_grouped_wgrad(
    a: BlockwiseFP8Tensor, grad_out: BlockwiseFP8Tensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """wgrad: dW[e] = a[rows of e].T @ grad_out[rows of e], both in 128x1 token blocks -> [E, K, N]."""
    for name, operand in (("a", a), ("grad_out", grad_out)):
        if operand.offsets is None or operand.data.dim() != 2:
            raise ValueError(f"{name} must come from quantize_fp8_blockwise_tokens({name}, offsets).")
    return grouped_wgrad_launch(
        a_data=a.data, a_scales=a.scales, g_data=grad_out.data, g_scales=grad_out.scales,
        offsets=offsets.to(torch.int32), token_block=HOPPER_BLOCK, out_dtype=out_dtype,
    )
