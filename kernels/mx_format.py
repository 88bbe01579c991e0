"""MXFP8 (OCP Microscaling) number format: plain-PyTorch reference quantization and dequantization.

An MXFP8 block is 32 consecutive values that share one E8M0 scale (a biased power of two, code 255 is
NaN); each value is stored as FP8 E4M3 (``torch.float8_e4m3fn``: max 448, no infinities).

The scale is computed with integer arithmetic on the fp32 bits of the block maximum (below), so every
backend agrees on it exactly. Elements are encoded here with PyTorch's own ``float8_e4m3fn`` conversion
(round-half-to-even) after clamping to ±448. The Triton kernels (``kernels.quantize_mxfp8``) instead
round to the E4M3 grid in fp32 themselves, saturating, and only then cast (the cast of an on-grid value
is exact everywhere, whereas Triton 3.9's interpreter casts off-grid fp32 values wrongly). These are
two independent encoders; the tests require them to agree bit for bit.

Conventions shared by the reference and the kernels:

* Scale exponent from the block's absolute maximum ``amax`` (fp32 bits: biased exponent ``eb``,
  mantissa ``m``). ``amax / 448`` rounded *up* to a power of two (RCEIL) is ``2**(eb - 135 + (m >
  0x600000))`` because 448 = 1.75 * 2**8; the spec's FLOOR mode is ``2**(floor(log2 amax) - 8)``.
  Both are clamped to the E8M0 range [2**-127, 2**127]; computing them from bits avoids a rounded
  division, so CPU and GPU agree exactly.
* A block holding any NaN or Inf gets the NaN scale code 0xFF and every element the E4M3 NaN code
  0x7F, so it dequantizes to NaN whatever the backend does with FP8 NaN encodings.
* An all-zero block gets scale code 0 (2**-127) and zero elements.
* Scaled values beyond ±448 saturate to ±448 (FLOOR mode produces up to ±510 before saturation).
* The sign survives rounding to zero: -0.0 and tiny negative values encode as 0x80, like torch's cast.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MX_BLOCK = 32
"""Number of values sharing one E8M0 scale (OCP MX v1.0)."""

E4M3_MAX = 448.0
"""Largest finite FP8 E4M3 (fn) magnitude; quantized values saturate here."""

E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal E4M3 magnitude; below it the grid is uniform with step 2**-9 (subnormals)."""

E4M3_SUBNORMAL_ROUNDER = 16384.0
"""2**14: adding and subtracting it in fp32 rounds a value below 2**-6 to a multiple of 2**-9 (RNE)."""

E4M3_NAN_BITS = 0x7F
E8M0_NAN = 0xFF
E8M0_BIAS = 127


class ScaleMode(str, enum.Enum):  # noqa: UP042 - StrEnum would change str(member) and format()
    """How the shared power-of-two scale is chosen from a block's absolute maximum."""

    RCEIL = "rceil"
    """amax / 448 rounded up to a power of two: no element saturates (what GPUs' cvt.rp does)."""

    FLOOR = "floor"
    """OCP spec: 2**(floor(log2(amax)) - 8); the largest elements may saturate to ±448."""

    @classmethod
    def parse(cls, value: ScaleMode | str) -> ScaleMode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"scale_mode={value!r} is unknown; use 'rceil' (round amax/448 up) or 'floor' (OCP spec)."
            ) from None


@dataclass(frozen=True)
class MXTensor:
    """A tensor quantized to MXFP8 along one axis, with its E8M0 scales."""

    data: torch.Tensor
    """float8_e4m3fn, same shape as the source tensor."""

    scales: torch.Tensor
    """uint8 E8M0 codes. Row-wise: ``[..., K // 32]``. Column-wise: ``[n_blocks, N]`` (2-D source) or
    ``[E, K // 32, N]`` (3-D source); in the grouped 2-D layout row ``block_base[e] + j`` holds block
    ``j`` of group ``e`` (see ``group_block_table``) and rows past ``block_base[E]`` are padding."""

    axis: str
    """"rows": blocks are 1x32 along the last dimension; "cols": blocks are 32x1 along dimension -2."""

    offsets: torch.Tensor | None = None
    """int32 [E+1] group offsets when column blocks restart at each group boundary, else None."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp8_reference(self, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Elementwise building blocks (mirrored line by line in the Triton kernels)
# ----------------------------------------------------------------------------------------------------


def e8m0_codes_from_amax(amax: torch.Tensor, nonfinite: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """int32 E8M0 codes for fp32 block maxima; ``nonfinite`` marks blocks holding NaN/Inf."""
    bits = amax.to(torch.float32).contiguous().view(torch.int32)
    biased_exponent = (bits >> 23) & 0xFF
    code = biased_exponent - 8
    if mode is ScaleMode.RCEIL:
        code = code + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    code = code.clamp(0, 254)
    return torch.where(nonfinite, torch.full_like(code, E8M0_NAN), code)


def reciprocal_scale_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """fp32 2**(127 - code), exact and normal for every code a finite block can get (<= 247)."""
    safe = codes.clamp(max=247)
    return ((254 - safe) << 23).to(torch.int32).view(torch.float32)


def scale_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """fp32 2**(code - 127); code 0 is the subnormal 2**-127, code 255 is NaN."""
    codes = codes.to(torch.int32)
    bits = torch.where(codes == 0, torch.full_like(codes, 0x00400000), codes << 23)
    scale = bits.view(torch.float32)
    return torch.where(codes == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


def encode_e4m3_saturating(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bits of finite fp32 values: round half to even, saturate at ±448 (never NaN)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _quantize_last_axis_blocks(blocks: torch.Tensor, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks: fp32 [..., 32] -> (E4M3 bits uint8 [..., 32], E8M0 codes uint8 [...])."""
    nonfinite_values = ~torch.isfinite(blocks)
    any_nonfinite = bool(nonfinite_values.any())
    if any_nonfinite:
        nonfinite = nonfinite_values.any(dim=-1)
        blocks = torch.where(nonfinite_values, torch.zeros_like(blocks), blocks)
    else:  # the common case skips the masking passes
        nonfinite = torch.zeros(blocks.shape[:-1], dtype=torch.bool, device=blocks.device)
    codes = e8m0_codes_from_amax(blocks.abs().amax(dim=-1), nonfinite, mode)
    element_bits = encode_e4m3_saturating(blocks * reciprocal_scale_from_codes(codes).unsqueeze(-1))
    if any_nonfinite:
        element_bits = torch.where(
            nonfinite.unsqueeze(-1), torch.full_like(element_bits, E4M3_NAN_BITS), element_bits
        )
    return element_bits, codes.to(torch.uint8)


# ----------------------------------------------------------------------------------------------------
# Group layout for column-wise blocks that must not straddle expert boundaries
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupBlockTable:
    """Where each 32-row block of a grouped tensor starts and ends, computed on the device (no sync)."""

    block_base: torch.Tensor
    """int32 [E+1]: first block index of each group; block_base[E] is the number of blocks in use."""

    row_start: torch.Tensor
    """int32 [max_blocks]: first row of each block (== total rows for padding blocks)."""

    row_end: torch.Tensor
    """int32 [max_blocks]: one past the last row of each block (== row_start for padding blocks)."""

    group: torch.Tensor
    """int32 [max_blocks]: the group each block belongs to (clamped to E-1 for padding blocks)."""


def max_group_blocks(total_rows: int, n_groups: int, block_rows: int = MX_BLOCK) -> int:
    """Upper bound on sum_e ceil(n_e / block_rows) that needs no device sync: T // block_rows + E."""
    return total_rows // block_rows + n_groups


def check_offsets(offsets: torch.Tensor, total_rows: int, *, name: str = "offsets") -> None:
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int tensor [E+1] with E >= 1, got shape {tuple(offsets.shape)}.")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 (or int64), got {offsets.dtype}.")
    if offsets.device.type == "cpu":
        if int(offsets[0]) != 0 or int(offsets[-1]) != total_rows:
            raise ValueError(
                f"{name} must start at 0 and end at the number of rows ({total_rows}); got "
                f"{int(offsets[0])}..{int(offsets[-1])}."
            )
        if bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"{name} must be non-decreasing (rows sorted by group); got {offsets.tolist()}.")


def group_block_table(offsets: torch.Tensor, total_rows: int, block_rows: int = MX_BLOCK) -> GroupBlockTable:
    """Split each group's rows into blocks of ``block_rows`` (the last one partial); see GroupBlockTable."""
    offsets = offsets.to(torch.int64)
    n_groups = offsets.numel() - 1
    sizes = offsets[1:] - offsets[:-1]
    blocks_per_group = (sizes + block_rows - 1) // block_rows
    block_base = torch.zeros(n_groups + 1, dtype=torch.int64, device=offsets.device)
    block_base[1:] = blocks_per_group.cumsum(0)
    block_ids = torch.arange(max_group_blocks(total_rows, n_groups, block_rows), device=offsets.device)
    group = torch.searchsorted(block_base[1:], block_ids, right=True)
    in_use = group < n_groups
    group = group.clamp(max=n_groups - 1)
    row_start = offsets[group] + block_rows * (block_ids - block_base[group])
    row_end = torch.minimum(row_start + block_rows, offsets[group + 1])
    padding = torch.full_like(row_start, total_rows)
    return GroupBlockTable(
        block_base=block_base.to(torch.int32),
        row_start=torch.where(in_use, row_start, padding).to(torch.int32),
        row_end=torch.where(in_use, row_end, padding).to(torch.int32),
        group=group.to(torch.int32),
    )


# ----------------------------------------------------------------------------------------------------
# Reference quantize / dequantize
# ----------------------------------------------------------------------------------------------------


def _check_source(x: torch.Tensor, *, name: str) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be fp32, bf16 or fp16 to quantize to MXFP8, got {x.dtype}.")


def quantize_mxfp8_rows_reference(x: torch.Tensor, *, scale_mode: ScaleMode | str = ScaleMode.RCEIL) -> MXTensor:
    """Blocks of 1x32 along the last dimension (which must be a multiple of 32)."""
    mode = ScaleMode.parse(scale_mode)
    _check_source(x, name="x")
    if x.dim() < 1 or x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"row-wise MXFP8 needs the last dimension to be a multiple of {MX_BLOCK}; got shape "
            f"{tuple(x.shape)}. Pad it or choose model sizes that are multiples of {MX_BLOCK}."
        )
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    bits, codes = _quantize_last_axis_blocks(blocks, mode)
    return MXTensor(data=bits.reshape(x.shape).view(torch.float8_e4m3fn), scales=codes, axis="rows")


def quantize_mxfp8_cols_reference(
    x: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
) -> MXTensor:
    """Blocks of 32x1 along dimension -2, computed from ``x`` itself (not from a row-wise copy).

    3-D ``[E, K, N]`` (expert weights): K must be a multiple of 32, scales ``[E, K // 32, N]``.
    2-D ``[T, N]`` with ``offsets`` (tokens sorted by expert): blocks restart at each group boundary,
    the last block of a group may be partial, scales ``[T // 32 + E, N]`` (see ``group_block_table``).
    2-D without offsets: one group, scales ``[ceil(T / 32), N]``.
    """
    mode = ScaleMode.parse(scale_mode)
    _check_source(x, name="x")
    if x.dim() == 3:
        if offsets is not None:
            raise ValueError("offsets apply to 2-D [tokens, N] tensors only; 3-D tensors are per-expert already.")
        if x.shape[1] % MX_BLOCK:
            raise ValueError(
                f"column-wise MXFP8 of a [E, K, N] tensor needs K % {MX_BLOCK} == 0; got shape {tuple(x.shape)}."
            )
        n_experts, k, n = x.shape
        blocks = x.to(torch.float32).reshape(n_experts, k // MX_BLOCK, MX_BLOCK, n).transpose(-1, -2)
        bits, codes = _quantize_last_axis_blocks(blocks, mode)
        data = bits.transpose(-1, -2).reshape(x.shape).view(torch.float8_e4m3fn)
        return MXTensor(data=data, scales=codes, axis="cols")
    if x.dim() != 2:
        raise ValueError(f"column-wise MXFP8 takes a 2-D [T, N] or 3-D [E, K, N] tensor, got shape {tuple(x.shape)}.")
    total_rows, n = x.shape
    grouped = offsets is not None
    if offsets is None:
        offsets = torch.tensor([0, total_rows], dtype=torch.int32, device=x.device)
    check_offsets(offsets, total_rows)
    table = group_block_table(offsets, total_rows)
    n_scale_rows = table.row_start.numel() if grouped else -(-total_rows // MX_BLOCK)
    if total_rows == 0:
        return MXTensor(
            data=torch.zeros_like(x, dtype=torch.uint8).view(torch.float8_e4m3fn),
            scales=torch.zeros(n_scale_rows, n, dtype=torch.uint8, device=x.device),
            axis="cols",
            offsets=offsets.to(torch.int32) if grouped else None,
        )
    row_start = table.row_start[:n_scale_rows].to(torch.int64)
    row_end = table.row_end[:n_scale_rows].to(torch.int64)
    rows = row_start.unsqueeze(1) + torch.arange(MX_BLOCK, device=x.device)
    valid = rows < row_end.unsqueeze(1)
    gathered = x.to(torch.float32)[rows.clamp(max=total_rows - 1)]
    gathered = torch.where(valid.unsqueeze(-1), gathered, torch.zeros_like(gathered))
    bits, codes = _quantize_last_axis_blocks(gathered.transpose(1, 2), mode)
    data = torch.zeros(total_rows, n, dtype=torch.uint8, device=x.device)
    data[rows[valid]] = bits.transpose(1, 2)[valid]
    return MXTensor(
        data=data.view(torch.float8_e4m3fn),
        scales=codes,
        axis="cols",
        offsets=offsets.to(torch.int32) if grouped else None,
    )


def dequantize_mxfp8_reference(mx: MXTensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = mx.data.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    scales = scale_from_codes(mx.scales)
    if mx.axis == "rows":
        blocks = values.reshape(*values.shape[:-1], values.shape[-1] // MX_BLOCK, MX_BLOCK) * scales.unsqueeze(-1)
        return blocks.reshape(values.shape).to(dtype)
    if mx.axis != "cols":
        raise ValueError(f"MXTensor.axis must be 'rows' or 'cols', got {mx.axis!r}.")
    if values.dim() == 3:
        return (values * scales.repeat_interleave(MX_BLOCK, dim=1)).to(dtype)
    total_rows = values.shape[0]
    if mx.offsets is None:
        row_scale_index = torch.arange(total_rows, device=values.device) // MX_BLOCK
    else:
        offsets = mx.offsets.to(torch.int64)
        table = group_block_table(offsets, total_rows)
        row_ids = torch.arange(total_rows, device=values.device)
        group = torch.searchsorted(offsets[1:], row_ids, right=True)
        row_scale_index = table.block_base.to(torch.int64)[group] + (row_ids - offsets[group]) // MX_BLOCK
    return (values * scales[row_scale_index]).to(dtype)


def fake_quantize_mxfp8(
    x: torch.Tensor,
    *,
    axis: str,
    offsets: torch.Tensor | None = None,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
) -> torch.Tensor:
    """fp32 values of ``x`` after an MXFP8 round trip along ``axis`` ("rows" or "cols")."""
    if axis == "rows":
        return dequantize_mxfp8_reference(quantize_mxfp8_rows_reference(x, scale_mode=scale_mode))
    if axis == "cols":
        return dequantize_mxfp8_reference(quantize_mxfp8_cols_reference(x, offsets=offsets, scale_mode=scale_mode))
    raise ValueError(f"axis must be 'rows' or 'cols', got {axis!r}.")
