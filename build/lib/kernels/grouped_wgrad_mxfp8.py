"""Triton grouped weight-gradient GEMM with MXFP8 operands: ``dW[e] = A[rows of e].T @ dOut[rows of e]``.

The reduction runs over the tokens of one expert, so both operands are quantized 32x1 along the token
axis, with blocks restarting at every expert boundary (``quantize_mxfp8_cols(..., offsets=...)``); the
last block of an expert may be partial, and an expert with no tokens gets an all-zero gradient. Scale
row ``block_base[e] + j`` belongs to token block ``j`` of expert ``e``.

The reference is ``kernels.grouped_gemm_reference.mx_grouped_wgrad_emulated``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.grouped_gemm_mxfp8 import _decode_scale, _scaled_slice_product, dot_mode_for
from kernels.mx_format import MX_BLOCK, MXTensor, check_offsets, group_block_table
from kernels.quantize_mxfp8 import require_triton_device


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # uint8 [T, K] E4M3 bits of the activations, column-quantized per expert
    a_scales_ptr,  # [n_blocks, K] scales of a (uint8 E8M0 codes or fp32), contiguous
    g_ptr,  # uint8 [T, N] E4M3 bits of the output gradient, column-quantized per expert
    g_scales_ptr,  # [n_blocks, N] scales of the output gradient (same kind as a's), contiguous
    out_ptr,  # fp32/bf16 [E, K, N] weight gradient, contiguous
    offsets_ptr,  # int32 [E+1] token offsets of the experts
    block_base_ptr,  # int32 [E+1] first scale row of each expert
    n_k,  # K
    n_n,  # N
    stride_a_row,  # elements between token rows of a
    stride_g_row,  # elements between token rows of the output gradient
    BLOCK_K: tl.constexpr,  # rows of dW per program
    BLOCK_N: tl.constexpr,  # columns of dW per program
    TOKEN_BLOCK: tl.constexpr,  # tokens sharing one scale: 32 (MX) or 128 (Hopper recipe)
    SCALES_E8M0: tl.constexpr,  # True: uint8 E8M0 scales; False: fp32 scales
    DOT_MODE: tl.constexpr,  # how each scaled slice of TOKEN_BLOCK tokens is multiplied
):
    expert = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < n_k
    n_mask = ns < n_n
    token_start = tl.load(offsets_ptr + expert)
    token_end = tl.load(offsets_ptr + expert + 1)
    first_block = tl.load(block_base_ptr + expert)
    # One slice per scale block (32 tokens for MX, 128 for the Hopper recipe); an expert's last one may be partial.
    slice_offsets = tl.arange(0, TOKEN_BLOCK)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for block in range(tl.cdiv(token_end - token_start, TOKEN_BLOCK)):
        tokens = token_start + block * TOKEN_BLOCK + slice_offsets
        token_mask = tokens < token_end
        a_bits = tl.load(
            a_ptr + tokens[None, :] * stride_a_row + ks[:, None], mask=token_mask[None, :] & k_mask[:, None], other=0
        )
        g_bits = tl.load(
            g_ptr + tokens[:, None] * stride_g_row + ns[None, :], mask=token_mask[:, None] & n_mask[None, :], other=0
        )
        scale_row = first_block + block
        a_scale = _decode_scale(tl.load(a_scales_ptr + scale_row * n_k + ks, mask=k_mask, other=1), SCALES_E8M0)
        g_scale = _decode_scale(tl.load(g_scales_ptr + scale_row * n_n + ns, mask=n_mask, other=1), SCALES_E8M0)
        acc += _scaled_slice_product(a_bits, g_bits, a_scale, g_scale, DOT_MODE)
    out_rows = expert.to(tl.int64) * n_k + ks
    tl.store(
        out_ptr + out_rows[:, None] * n_n + ns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=k_mask[:, None] & n_mask[None, :],
    )


def mx_grouped_wgrad_triton(
    a: MXTensor,
    grad_out: MXTensor,
    offsets: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    block_k: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """a: [T, K], grad_out: [T, N], both column-quantized per expert -> dW [E, K, N]."""
    for name, operand in (("a", a), ("grad_out", grad_out)):
        if operand.axis != "cols" or operand.offsets is None:
            raise ValueError(
                f"wgrad needs {name} quantized 32x1 along tokens per expert: "
                f"quantize_mxfp8_cols({name}, offsets=offsets); got axis={operand.axis!r} "
                f"with{'out' if operand.offsets is None else ''} offsets."
            )
        if operand.data.dtype != torch.float8_e4m3fn or operand.scales.dtype != torch.uint8:
            raise ValueError(f"{name} needs float8_e4m3fn data and uint8 scales.")
        if operand.data.dim() != 2 or operand.data.stride(-1) != 1 or not operand.scales.is_contiguous():
            raise ValueError(f"{name} must be 2-D [T, features] with a contiguous last dimension and scales.")
        require_triton_device(operand.data, name=f"{name}.data")
    if offsets.device.type == "cpu":
        for name, operand in (("a", a), ("grad_out", grad_out)):
            if not torch.equal(operand.offsets.to(torch.int32).cpu(), offsets.to(torch.int32)):
                raise ValueError(f"{name} was quantized with different group offsets than the ones passed here.")
    return grouped_wgrad_launch(
        a_data=a.data, a_scales=a.scales, g_data=grad_out.data, g_scales=grad_out.scales, offsets=offsets,
        token_block=MX_BLOCK, out_dtype=out_dtype, block_k=block_k, block_n=block_n,
    )


def grouped_wgrad_launch(
    *,
    a_data: torch.Tensor,
    a_scales: torch.Tensor,
    g_data: torch.Tensor,
    g_scales: torch.Tensor,
    offsets: torch.Tensor,
    token_block: int,
    out_dtype: torch.dtype = torch.float32,
    block_k: int = 128,  # 128 x 64 tiles: the fastest of a sweep on an H100 (docs/notebook/kernels.md)
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Shared launcher: scales are [T // token_block + E, features], block rows restarting per expert."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be fp32 or bf16, got {out_dtype}.")
    if token_block not in (32, 128):
        raise ValueError(f"token_block must be 32 (MX) or 128 (Hopper recipe): one kernel slice each; got {token_block}.")
    if a_scales.dtype != g_scales.dtype or a_scales.dtype not in (torch.uint8, torch.float32):
        raise ValueError(f"both scales must be uint8 E8M0 or both fp32, got {a_scales.dtype} and {g_scales.dtype}.")
    total_rows, n_k = a_data.shape
    if g_data.shape[0] != total_rows:
        raise ValueError(f"a has {total_rows} token rows but grad_out has {g_data.shape[0]}.")
    n_n = g_data.shape[1]
    check_offsets(offsets, total_rows)
    n_experts = offsets.numel() - 1
    out = torch.empty(n_experts, n_k, n_n, dtype=out_dtype, device=a_data.device)
    if n_k == 0 or n_n == 0:
        return out
    table = group_block_table(offsets, total_rows, block_rows=token_block)
    grid = (n_experts, triton.cdiv(n_k, block_k), triton.cdiv(n_n, block_n))
    _grouped_wgrad_kernel[grid](
        a_data.view(torch.uint8), a_scales, g_data.view(torch.uint8), g_scales, out,
        offsets.to(torch.int32), table.block_base, n_k, n_n, a_data.stride(0), g_data.stride(0),
        BLOCK_K=block_k, BLOCK_N=block_n, TOKEN_BLOCK=token_block, SCALES_E8M0=a_scales.dtype == torch.uint8,
        DOT_MODE=dot_mode_for(a_data.device), num_warps=num_warps, num_stages=num_stages,
    )
    return out
