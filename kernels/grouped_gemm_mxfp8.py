"""Triton grouped GEMM over experts with MXFP8 operands and fp32 accumulation (forward and dgrad).

One kernel serves both GEMMs of the expert layer whose reduction runs along a weight dimension:

* forward: ``out[rows of e] = A[rows of e] @ W[e]``, A ``[T, K]`` quantized 1x32 along K, W ``[E, K, N]``
  quantized 32x1 along K;
* dgrad: ``dA[rows of e] = dOut[rows of e] @ W[e].T``, dOut ``[T, N]`` quantized 1x32 along N, W ``[E, K, N]``
  quantized 1x32 along N and read transposed through strides.

Every 32-wide slice of the reduction has its own pair of scales, so the kernel multiplies the partial
product of each slice by ``scale_a[row] * scale_b[col]`` before adding it to the fp32 accumulator. On
GPUs (sm_89+, FP8 tensor cores) the slice product is an FP8 ``tl.dot``; under the interpreter, whose FP8
dot is inexact, the operands are dequantized exactly to fp32 first.

The Hopper recipe (DeepSeek-V3 style fp32 block scales, 1x128 activations / 128x128 weights) runs
through the same kernel with ``SCALE_BLOCK_K=128`` and fp32 scales, see ``kernels.fp8_blockwise``.

The reference is ``kernels.grouped_gemm_reference`` (dequantize, then fp32 matmul per expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mx_format import MX_BLOCK, MXTensor, group_block_table
from kernels.quantize_mxfp8 import _scale_from_code, require_triton_device

DOT_FP32 = 0
"""Dequantize slices to fp32 and multiply with an IEEE fp32 dot (the interpreter, whose FP8 dot is inexact)."""
DOT_FP8 = 2
"""Multiply the FP8 slices on FP8 tensor cores and scale the fp32 partial product (sm_89+)."""

MIN_CUDA_CAPABILITY = (8, 9)
"""Triton has the E4M3 type only from Ada/Hopper on; older GPUs use the reference path (same numerics)."""


def dot_mode_for(device: torch.device) -> int:
    return DOT_FP8 if device.type == "cuda" else DOT_FP32


def cuda_supports_fp8_kernels(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CUDA_CAPABILITY


@triton.jit
def _decode_scale(
    raw,  # loaded scale values: uint8 E8M0 codes or fp32 scales
    SCALES_E8M0: tl.constexpr,  # True: decode E8M0 codes; False: already fp32
):
    if SCALES_E8M0:
        return _scale_from_code(raw.to(tl.int32))
    return raw.to(tl.float32)


@triton.jit
def _scaled_slice_product(
    a_bits,  # uint8 [BLOCK_M, SLICE] E4M3 bits of the left operand (SLICE: the reduction elements of one scale)
    b_bits,  # uint8 [SLICE, BLOCK_N] E4M3 bits of the right operand
    a_scale,  # fp32 [BLOCK_M] scale of each left row over this slice
    b_scale,  # fp32 [BLOCK_N] scale of each right column over this slice
    DOT_MODE: tl.constexpr,  # DOT_FP32 (0) or DOT_FP8 (2), see module constants
):
    a = a_bits.to(tl.float8e4nv, bitcast=True)
    b = b_bits.to(tl.float8e4nv, bitcast=True)
    if DOT_MODE == 2:
        return tl.dot(a, b, out_dtype=tl.float32) * (a_scale[:, None] * b_scale[None, :])
    else:
        a_hp = a.to(tl.float32) * a_scale[:, None]
        b_hp = b.to(tl.float32) * b_scale[None, :]
        return tl.dot(a_hp, b_hp, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # uint8 [T, K] E4M3 bits of the token operand, element (t, k) at t * stride_a_row + k
    a_scales_ptr,  # scales of a: (t, k // SCALE_BLOCK_K) at t * stride_as_row + k // SCALE_BLOCK_K
    b_ptr,  # uint8 E4M3 bits of the expert operand: (e, k, n) at e*stride_b_e + k*stride_b_k + n*stride_b_n
    b_scales_ptr,  # scales of b: (e, k // SCALE_BLOCK_K, n // SCALE_BLOCK_N) via the stride_bs_* strides
    out_ptr,  # fp32/bf16 [T, N] output, contiguous
    tile_row_start_ptr,  # int32 [n_tiles] first row of each row tile (tiles never straddle experts)
    tile_row_end_ptr,  # int32 [n_tiles] one past the last row of each tile (== start for padding tiles)
    tile_group_ptr,  # int32 [n_tiles] expert of each tile
    n_cols,  # N
    reduction,  # K, a multiple of SCALE_BLOCK_K
    stride_a_row,  # elements between rows of a
    stride_as_row,  # elements between rows of a's scales
    stride_b_e, stride_b_k, stride_b_n,  # element strides of b
    stride_bs_e, stride_bs_k, stride_bs_n,  # element strides of b's scales (per scale block)
    BLOCK_M: tl.constexpr,  # rows per tile (must equal the tile table's block size)
    BLOCK_N: tl.constexpr,  # output columns per program
    SCALE_BLOCK_K: tl.constexpr,  # reduction elements sharing one scale: 32 (MX) or 128 (Hopper recipe)
    SCALE_BLOCK_N: tl.constexpr,  # output columns sharing one b scale: 1 (MX) or 128 (Hopper weights)
    SCALES_E8M0: tl.constexpr,  # True: uint8 E8M0 scales; False: fp32 scales
    DOT_MODE: tl.constexpr,  # how each scaled slice is multiplied
):
    tile = tl.program_id(0)
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(tile_row_end_ptr + tile)
    expert = tl.load(tile_group_ptr + tile).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < row_end
    col_mask = cols < n_cols
    # One slice per scale block: 32 wide for MX; 128 for the Hopper recipe, whose FP8 dot then accumulates
    # four k32 tensor-core steps before the fp32 scaling (a quarter of MX's scaling work).
    slice_offsets = tl.arange(0, SCALE_BLOCK_K)
    b_base = b_ptr + expert * stride_b_e
    b_scale_base = b_scales_ptr + expert * stride_bs_e + (cols // SCALE_BLOCK_N) * stride_bs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, reduction, SCALE_BLOCK_K):
        ks = k0 + slice_offsets
        a_bits = tl.load(a_ptr + rows[:, None] * stride_a_row + ks[None, :], mask=row_mask[:, None], other=0)
        b_bits = tl.load(
            b_base + ks[:, None] * stride_b_k + cols[None, :] * stride_b_n, mask=col_mask[None, :], other=0
        )
        a_scale = _decode_scale(
            tl.load(a_scales_ptr + rows * stride_as_row + k0 // SCALE_BLOCK_K, mask=row_mask, other=1), SCALES_E8M0
        )
        b_scale = _decode_scale(
            tl.load(b_scale_base + (k0 // SCALE_BLOCK_K) * stride_bs_k, mask=col_mask, other=1), SCALES_E8M0
        )
        acc += _scaled_slice_product(a_bits, b_bits, a_scale, b_scale, DOT_MODE)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_operand(name: str, data: torch.Tensor, scales: torch.Tensor, dim: int, scale_dtype: torch.dtype) -> None:
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.data must be float8_e4m3fn, got {data.dtype}.")
    if scales.dtype != scale_dtype:
        raise ValueError(f"{name}.scales must be {scale_dtype}, got {scales.dtype}.")
    if data.dim() != dim:
        raise ValueError(f"{name}.data must be {dim}-D, got shape {tuple(data.shape)}.")
    require_triton_device(data, name=f"{name}.data")


def _tile_table(offsets: torch.Tensor, total_rows: int, block_m: int):
    return group_block_table(offsets, total_rows, block_rows=block_m)


def grouped_gemm_launch(
    *,
    a_data: torch.Tensor,
    a_scales: torch.Tensor,
    b_data: torch.Tensor,
    b_scales: torch.Tensor,
    b_transposed: bool,
    offsets: torch.Tensor,
    scale_block_k: int,
    scale_block_n: int,
    out_dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Shared launcher. b_data is [E, K, N] (``b_transposed``: [E, N, K], reduction along its last dim).

    block_m / block_n: output tile; num_warps / num_stages: Triton launch options (pipelining depth).
    Left at None they take the fastest tiles of a sweep on Hopper (docs/notebook/kernels.md), which
    differ by the layout of b: FP8 tensor cores (wgmma) take only K-major operands, so with b [E, K, N]
    (N contiguous) Triton falls back to slower instructions and prefers other tiles.
    """
    default_tile = (64, 128, 4) if b_transposed else (128, 64, 3)
    block_m = default_tile[0] if block_m is None else block_m
    block_n = default_tile[1] if block_n is None else block_n
    num_stages = default_tile[2] if num_stages is None else num_stages
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be fp32 or bf16, got {out_dtype}.")
    if a_data.stride(-1) != 1 or a_scales.stride(-1) != 1:
        raise ValueError("a's data and scales need a contiguous last dimension; call .contiguous().")
    if b_data.stride(-1) != 1:
        raise ValueError("b's data needs a contiguous last dimension; call .contiguous().")
    total_rows, reduction = a_data.shape
    n_experts = b_data.shape[0]
    if b_transposed:
        n_cols, b_reduction = b_data.shape[1], b_data.shape[2]
        stride_b_e, stride_b_k, stride_b_n = b_data.stride(0), b_data.stride(2), b_data.stride(1)
        stride_bs_e, stride_bs_k, stride_bs_n = b_scales.stride(0), b_scales.stride(2), b_scales.stride(1)
    else:
        b_reduction, n_cols = b_data.shape[1], b_data.shape[2]
        stride_b_e, stride_b_k, stride_b_n = b_data.stride()
        stride_bs_e, stride_bs_k, stride_bs_n = b_scales.stride()
    if b_reduction != reduction:
        raise ValueError(
            f"reduction sizes differ: the token operand has {reduction}, the expert operand {b_reduction}."
        )
    if reduction % scale_block_k:
        raise ValueError(f"the reduction size {reduction} must be a multiple of the scale block {scale_block_k}.")
    if offsets.shape != (n_experts + 1,):
        raise ValueError(f"offsets must be [E+1] = [{n_experts + 1}], got {tuple(offsets.shape)}.")
    if offsets.device != a_data.device or b_data.device != a_data.device:
        raise ValueError("a, b and offsets must be on the same device.")
    out = torch.empty(total_rows, n_cols, dtype=out_dtype, device=a_data.device)
    if total_rows == 0 or n_cols == 0:
        return out
    if reduction == 0:
        return out.zero_()
    table = _tile_table(offsets, total_rows, block_m)
    grid = (table.row_start.numel(), triton.cdiv(n_cols, block_n))
    _grouped_gemm_kernel[grid](
        a_data.view(torch.uint8), a_scales, b_data.view(torch.uint8), b_scales, out,
        table.row_start, table.row_end, table.group,
        n_cols, reduction, a_data.stride(0), a_scales.stride(0),
        stride_b_e, stride_b_k, stride_b_n, stride_bs_e, stride_bs_k, stride_bs_n,
        BLOCK_M=block_m, BLOCK_N=block_n, SCALE_BLOCK_K=scale_block_k, SCALE_BLOCK_N=scale_block_n,
        SCALES_E8M0=a_scales.dtype == torch.uint8, DOT_MODE=dot_mode_for(a_data.device),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def mx_grouped_mm_triton(
    a: MXTensor, b: MXTensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Forward: a row-wise [T, K], b column-wise [E, K, N] (blocks along K) -> [T, N]."""
    if a.axis != "rows" or b.axis != "cols":
        raise ValueError(
            f"forward grouped GEMM needs a quantized along rows (1x32 over K) and b along columns (32x1 over "
            f"K); got a.axis={a.axis!r}, b.axis={b.axis!r}."
        )
    _check_operand("a", a.data, a.scales, 2, torch.uint8)
    _check_operand("b", b.data, b.scales, 3, torch.uint8)
    return grouped_gemm_launch(
        a_data=a.data, a_scales=a.scales, b_data=b.data, b_scales=b.scales, b_transposed=False,
        offsets=offsets.to(torch.int32), scale_block_k=MX_BLOCK, scale_block_n=1, out_dtype=out_dtype,
    )


def mx_grouped_mm_dgrad_triton(
    grad_out: MXTensor, b: MXTensor, offsets: torch.Tensor, *, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """dgrad: grad_out row-wise [T, N], b row-wise [E, K, N] (blocks along N) -> [T, K] = grad_out @ b[e].T."""
    if grad_out.axis != "rows" or b.axis != "rows":
        raise ValueError(
            "dgrad grouped GEMM needs grad_out and the weight both quantized along rows (1x32 over N, the "
            f"reduction); got grad_out.axis={grad_out.axis!r}, b.axis={b.axis!r}."
        )
    _check_operand("grad_out", grad_out.data, grad_out.scales, 2, torch.uint8)
    _check_operand("b", b.data, b.scales, 3, torch.uint8)
    return grouped_gemm_launch(
        a_data=grad_out.data, a_scales=grad_out.scales, b_data=b.data, b_scales=b.scales, b_transposed=True,
        offsets=offsets.to(torch.int32), scale_block_k=MX_BLOCK, scale_block_n=1, out_dtype=out_dtype,
    )
