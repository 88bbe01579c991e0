"""Triton MXFP8 quantization (1x32 row blocks, 32x1 column blocks) and dequantization.

The scale selection mirrors ``kernels.mx_format`` (the PyTorch reference) operation for operation; the
elements are rounded to the E4M3 grid in fp32 here (round half to even, saturating at ±448) before the
cast to FP8, while the reference uses torch's conversion. Results are bit-identical on a GPU, under
``TRITON_INTERPRET=1`` and in the reference. Column-wise
quantization is computed from the high-precision input itself: the backward GEMMs need blocks along
the token axis, which cannot be derived from row-wise quantized data without a second rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.mx_format import (
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_NAN_BITS,
    E4M3_SUBNORMAL_ROUNDER,
    E8M0_NAN,
    MX_BLOCK,
    MXTensor,
    ScaleMode,
    check_offsets,
    group_block_table,
)

# Triton kernels may only read module globals that are constexpr.
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
E4M3_MAX_C = tl.constexpr(E4M3_MAX)
E4M3_MIN_NORMAL_C = tl.constexpr(E4M3_MIN_NORMAL)
E4M3_SUBNORMAL_ROUNDER_C = tl.constexpr(E4M3_SUBNORMAL_ROUNDER)
E4M3_NAN_BITS_C = tl.constexpr(E4M3_NAN_BITS)
E8M0_NAN_C = tl.constexpr(E8M0_NAN)


def triton_usable(tensor: torch.Tensor) -> bool:
    """True where the Triton kernels can run on ``tensor``: CUDA, or CPU under the interpreter."""
    return tensor.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def require_triton_device(tensor: torch.Tensor, *, name: str) -> None:
    if tensor.device.type == "cuda" and torch.cuda.get_device_capability(tensor.device) < (8, 9):
        raise ValueError(
            f"{name} is on a GPU of compute capability {torch.cuda.get_device_capability(tensor.device)}; the "
            "FP8 kernels need 8.9+ (Ada, Hopper or newer). Use the reference path (backend='reference')."
        )
    if not triton_usable(tensor):
        raise ValueError(
            f"{name} is on {tensor.device}, where Triton cannot run: move it to CUDA, set TRITON_INTERPRET=1 "
            "(before importing triton) to interpret the kernels on the CPU, or use the reference in "
            "kernels.mx_format."
        )


# ----------------------------------------------------------------------------------------------------
# Shared device functions
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _e8m0_codes(
    amax,  # fp32 block absolute maxima over the finite values
    nonfinite,  # bool: block holds a NaN or Inf
    RCEIL: tl.constexpr,  # True: amax/448 rounded up to a power of two; False: OCP floor(log2(amax)) - 8
):
    bits = amax.to(tl.int32, bitcast=True)
    code = ((bits >> 23) & 0xFF) - 8
    if RCEIL:
        code += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    code = tl.minimum(tl.maximum(code, 0), 254)
    return tl.where(nonfinite, E8M0_NAN_C, code)


@triton.jit
def _reciprocal_scale(
    code,  # int32 E8M0 codes
):
    safe = tl.minimum(code, 247)
    return ((254 - safe) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_from_code(
    code,  # int32 E8M0 codes (255 = NaN)
):
    bits = tl.where(code == 0, 0x00400000, code << 23)
    scale = bits.to(tl.float32, bitcast=True)
    return tl.where(code == E8M0_NAN_C, float("nan"), scale)


@triton.jit
def _round_to_e4m3_grid(
    scaled,  # fp32 finite values already divided by the block scale
):
    magnitude = tl.minimum(tl.abs(scaled), E4M3_MAX_C)
    bits = magnitude.to(tl.int32, bitcast=True)
    kept_lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + kept_lsb) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (magnitude + E4M3_SUBNORMAL_ROUNDER_C) - E4M3_SUBNORMAL_ROUNDER_C
    rounded = tl.where(magnitude < E4M3_MIN_NORMAL_C, subnormal, normal)
    # Copy the sign bit with integer ops: on the GPU `-rounded` compiles to `0 - rounded`, which turns a
    # negative value that rounds to zero into +0.0, while torch's cast (the reference) keeps -0.0.
    sign_bit = (scaled.to(tl.int32, bitcast=True) >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(
    values,  # fp32 tile; the MX block runs along AXIS
    AXIS: tl.constexpr,  # axis of the tile that holds one 32-value block
    RCEIL: tl.constexpr,  # scale rounding mode, see _e8m0_codes
):
    magnitude = tl.abs(values)
    # NaN compares false with everything, so this one test catches NaN and Inf.
    nonfinite_values = ~(magnitude <= FLOAT32_MAX)
    amax = tl.max(tl.where(nonfinite_values, 0.0, magnitude), axis=AXIS)
    nonfinite = tl.max(nonfinite_values.to(tl.int32), axis=AXIS) > 0
    code = _e8m0_codes(amax, nonfinite, RCEIL)
    finite = tl.where(nonfinite_values, 0.0, values)
    scaled = finite * tl.expand_dims(_reciprocal_scale(code), AXIS)
    element_bits = _round_to_e4m3_grid(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    element_bits = tl.where(tl.expand_dims(nonfinite, AXIS), E4M3_NAN_BITS_C, element_bits)
    return element_bits, code.to(tl.uint8)


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # fp32/bf16/fp16 [M, K] source, last dimension contiguous
    data_ptr,  # uint8 [M, K] output E4M3 bits (contiguous)
    scales_ptr,  # uint8 [M, K // 32] output E8M0 codes (contiguous)
    n_rows,  # M
    n_cols,  # K, a multiple of 32
    stride_x_row,  # elements between consecutive rows of x
    BLOCK_ROWS: tl.constexpr,  # rows per program
    RCEIL: tl.constexpr,  # scale rounding mode
):
    row_tile = tl.program_id(0)
    block_col = tl.program_id(1)
    rows = row_tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = block_col * 32 + tl.arange(0, 32)
    mask = (rows < n_rows)[:, None]
    values = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    element_bits, code = _quantize_tile(values.to(tl.float32), 1, RCEIL)
    tl.store(data_ptr + rows[:, None] * n_cols + cols[None, :], element_bits, mask=mask)
    tl.store(scales_ptr + rows * (n_cols // 32) + block_col, code, mask=rows < n_rows)


@triton.jit
def _quantize_cols_kernel(
    x_ptr,  # fp32/bf16/fp16 [R, N] source, last dimension contiguous
    data_ptr,  # uint8 [R, N] output E4M3 bits (contiguous)
    scales_ptr,  # uint8 [n_blocks, N] output E8M0 codes (contiguous)
    block_row_start_ptr,  # int32 [n_blocks] first row of each block (read when GROUPED)
    block_row_end_ptr,  # int32 [n_blocks] one past the last row of each block (read when GROUPED)
    n_rows,  # R
    n_cols,  # N
    stride_x_row,  # elements between consecutive rows of x
    GROUPED: tl.constexpr,  # True: block extents come from the group table; False: rows 32*b .. 32*b+31
    BLOCK_COLS: tl.constexpr,  # columns per program
    RCEIL: tl.constexpr,  # scale rounding mode
):
    block = tl.program_id(0)
    col_tile = tl.program_id(1)
    if GROUPED:
        row_start = tl.load(block_row_start_ptr + block)
        row_end = tl.load(block_row_end_ptr + block)
    else:
        row_start = block * 32
        row_end = tl.minimum(row_start + 32, n_rows)
    rows = row_start + tl.arange(0, 32)
    cols = col_tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    values = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    element_bits, code = _quantize_tile(values.to(tl.float32), 0, RCEIL)
    tl.store(data_ptr + rows[:, None] * n_cols + cols[None, :], element_bits, mask=mask)
    tl.store(scales_ptr + block * n_cols + cols, code, mask=col_mask)


@triton.jit
def _dequantize_kernel(
    data_ptr,  # uint8 [R, C] E4M3 bits (contiguous)
    scales_ptr,  # uint8 E8M0 codes, element (scale_row, c // COLS_PER_SCALE) at scale_row * stride_scales_row
    scale_row_of_row_ptr,  # int32 [R] scale row used by each data row
    out_ptr,  # fp32/bf16 [R, C] output (contiguous)
    n_rows,  # R
    n_cols,  # C
    stride_scales_row,  # elements between consecutive scale rows
    COLS_PER_SCALE: tl.constexpr,  # 32 for row-wise blocks, 1 for column-wise blocks
    BLOCK_ROWS: tl.constexpr,  # rows per program
    BLOCK_COLS: tl.constexpr,  # columns per program
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    element_bits = tl.load(data_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0)
    scale_rows = tl.load(scale_row_of_row_ptr + rows, mask=rows < n_rows, other=0)
    code = tl.load(
        scales_ptr + scale_rows[:, None] * stride_scales_row + (cols // COLS_PER_SCALE)[None, :], mask=mask, other=0
    )
    values = element_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _scale_from_code(code.to(tl.int32))
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_source(x: torch.Tensor) -> None:
    if x.dtype not in _SOURCE_DTYPES:
        raise ValueError(f"MXFP8 quantization takes fp32, bf16 or fp16 input, got {x.dtype}.")
    require_triton_device(x, name="x")
    if x.dim() >= 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"x must have a contiguous last dimension (stride 1), got strides {x.stride()}; call .contiguous()."
        )


def _as_rows_2d(x: torch.Tensor, what: str) -> torch.Tensor:
    """View leading dimensions as rows without copying; refuse layouts that would need a copy."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{what}: the leading dimensions of shape {tuple(x.shape)} / strides {x.stride()} cannot be "
            "flattened without a copy; call .contiguous() first."
        ) from None


def quantize_mxfp8_rows(x: torch.Tensor, *, scale_mode: ScaleMode | str = ScaleMode.RCEIL) -> MXTensor:
    """Triton 1x32 quantization along the last dimension; bit-identical to the reference."""
    mode = ScaleMode.parse(scale_mode)
    _check_source(x)
    if x.dim() < 1 or x.shape[-1] % MX_BLOCK:
        raise ValueError(
            f"row-wise MXFP8 needs the last dimension to be a multiple of {MX_BLOCK}; got shape {tuple(x.shape)}."
        )
    rows_2d = _as_rows_2d(x, "quantize_mxfp8_rows")
    n_rows, n_cols = rows_2d.shape
    data = torch.empty(n_rows, n_cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_rows, n_cols // MX_BLOCK, dtype=torch.uint8, device=x.device)
    if n_rows and n_cols:
        block_rows = 32
        grid = (triton.cdiv(n_rows, block_rows), n_cols // MX_BLOCK)
        _quantize_rows_kernel[grid](
            rows_2d, data, scales, n_rows, n_cols, rows_2d.stride(0),
            BLOCK_ROWS=block_rows, RCEIL=mode is ScaleMode.RCEIL,
        )
    return MXTensor(
        data=data.view(x.shape).view(torch.float8_e4m3fn),
        scales=scales.view(*x.shape[:-1], n_cols // MX_BLOCK),
        axis="rows",
    )


def quantize_mxfp8_cols(
    x: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
) -> MXTensor:
    """Triton 32x1 quantization along dimension -2 (same layouts as ``quantize_mxfp8_cols_reference``)."""
    mode = ScaleMode.parse(scale_mode)
    _check_source(x)
    if x.dim() == 3:
        if offsets is not None:
            raise ValueError("offsets apply to 2-D [tokens, N] tensors only; 3-D tensors are per-expert already.")
        if x.shape[1] % MX_BLOCK:
            raise ValueError(
                f"column-wise MXFP8 of a [E, K, N] tensor needs K % {MX_BLOCK} == 0; got shape {tuple(x.shape)}."
            )
        flat = _as_rows_2d(x, "quantize_mxfp8_cols")
        result = _quantize_cols_2d(flat, table=None, n_blocks=flat.shape[0] // MX_BLOCK, mode=mode)
        n_experts, k, n = x.shape
        return MXTensor(
            data=result.data.view(x.shape),
            scales=result.scales.view(n_experts, k // MX_BLOCK, n),
            axis="cols",
        )
    if x.dim() != 2:
        raise ValueError(f"column-wise MXFP8 takes a 2-D [T, N] or 3-D [E, K, N] tensor, got shape {tuple(x.shape)}.")
    if offsets is None:
        return _quantize_cols_2d(x, table=None, n_blocks=triton.cdiv(x.shape[0], MX_BLOCK), mode=mode)
    check_offsets(offsets, x.shape[0])
    table = group_block_table(offsets, x.shape[0])
    result = _quantize_cols_2d(x, table=table, n_blocks=table.row_start.numel(), mode=mode)
    return MXTensor(data=result.data, scales=result.scales, axis="cols", offsets=offsets.to(torch.int32))


def _quantize_cols_2d(x: torch.Tensor, *, table, n_blocks: int, mode: ScaleMode) -> MXTensor:
    n_rows, n_cols = x.shape
    data = torch.zeros(n_rows, n_cols, dtype=torch.uint8, device=x.device)
    scales = torch.zeros(n_blocks, n_cols, dtype=torch.uint8, device=x.device)
    if n_rows and n_cols and n_blocks:
        block_cols = 64
        grid = (n_blocks, triton.cdiv(n_cols, block_cols))
        row_start = table.row_start if table is not None else data  # unread when not GROUPED
        row_end = table.row_end if table is not None else data
        _quantize_cols_kernel[grid](
            x, data, scales, row_start, row_end, n_rows, n_cols, x.stride(0),
            GROUPED=table is not None, BLOCK_COLS=block_cols, RCEIL=mode is ScaleMode.RCEIL,
        )
    return MXTensor(data=data.view(torch.float8_e4m3fn), scales=scales, axis="cols")


def scale_row_of_each_row(mx: MXTensor) -> torch.Tensor:
    """int32 [rows of the 2-D data view]: which scale row each data row reads."""
    n_cols = mx.data.shape[-1]
    n_rows = mx.data.numel() // max(n_cols, 1)
    row_ids = torch.arange(n_rows, device=mx.data.device)
    if mx.axis == "rows":
        return row_ids.to(torch.int32)
    if mx.offsets is None:
        return (row_ids // MX_BLOCK).to(torch.int32)
    offsets = mx.offsets.to(torch.int64)
    table = group_block_table(offsets, n_rows)
    group = torch.searchsorted(offsets[1:], row_ids, right=True).clamp(max=offsets.numel() - 2)
    return (table.block_base.to(torch.int64)[group] + (row_ids - offsets[group]) // MX_BLOCK).to(torch.int32)


def dequantize_mxfp8(mx: MXTensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton dequantization to fp32 or bf16; bit-identical to ``dequantize_mxfp8_reference``."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_mxfp8 writes fp32 or bf16, got {dtype}.")
    if mx.axis not in ("rows", "cols"):
        raise ValueError(f"MXTensor.axis must be 'rows' or 'cols', got {mx.axis!r}.")
    if mx.data.dtype != torch.float8_e4m3fn or mx.scales.dtype != torch.uint8:
        raise ValueError(
            f"MXTensor needs float8_e4m3fn data and uint8 scales, got {mx.data.dtype} and {mx.scales.dtype}."
        )
    require_triton_device(mx.data, name="mx.data")
    data = mx.data.contiguous().view(torch.uint8)
    n_cols = data.shape[-1]
    data_2d = data.view(-1, n_cols)
    scales_2d = mx.scales.contiguous().view(-1, mx.scales.shape[-1])
    out = torch.empty(data_2d.shape, dtype=dtype, device=data.device)
    if data_2d.numel():
        block_rows, block_cols = 32, 64
        grid = (triton.cdiv(data_2d.shape[0], block_rows), triton.cdiv(n_cols, block_cols))
        _dequantize_kernel[grid](
            data_2d, scales_2d, scale_row_of_each_row(mx), out, data_2d.shape[0], n_cols, scales_2d.stride(0),
            COLS_PER_SCALE=MX_BLOCK if mx.axis == "rows" else 1, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        )
    return out.view(mx.data.shape)
