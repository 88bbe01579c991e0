"""Plain-PyTorch grouped GEMMs over experts: the references the Triton grouped GEMMs are tested against.

Rows of the token matrix are sorted by expert; ``offsets`` (int [E+1], offsets[0] = 0, offsets[E] = T)
delimits each expert's rows. Groups may be empty. The "emulated MXFP8" GEMMs dequantize their MXFP8
operands to fp32 and multiply in fp32: that is exactly what an MXFP8 tensor-core GEMM with fp32
accumulation computes, up to fp32 summation order.
"""

from __future__ import annotations

import torch

from kernels.mx_format import MXTensor, dequantize_mxfp8_reference


def _group_bounds(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    bounds = offsets.tolist()
    return [(expert, bounds[expert], bounds[expert + 1]) for expert in range(len(bounds) - 1)]


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e]; a: [T, K], b: [E, K, N] -> [T, N] in a's dtype."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    for expert, start, end in _group_bounds(offsets):
        if end > start:
            out[start:end] = a[start:end] @ b[expert]
    return out


def grouped_mm_transposed_reference(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ b[e].T; a: [T, N], b: [E, K, N] -> [T, K] (the dgrad shape)."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    for expert, start, end in _group_bounds(offsets):
        if end > start:
            out[start:end] = a[start:end] @ b[expert].transpose(0, 1)
    return out


def grouped_wgrad_reference(a: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dW[e] = a[rows of e].T @ grad_out[rows of e]; a: [T, K], grad_out: [T, N] -> [E, K, N]."""
    n_experts = offsets.numel() - 1
    out = a.new_zeros(n_experts, a.shape[1], grad_out.shape[1])
    for expert, start, end in _group_bounds(offsets):
        if end > start:
            out[expert] = a[start:end].transpose(0, 1) @ grad_out[start:end]
    return out


def mx_grouped_mm_emulated(a: MXTensor, b: MXTensor, offsets: torch.Tensor) -> torch.Tensor:
    """Forward: a row-wise [T, K], b column-wise [E, K, N] (blocks along K) -> fp32 [T, N]."""
    return grouped_mm_reference(dequantize_mxfp8_reference(a), dequantize_mxfp8_reference(b), offsets)


def mx_grouped_mm_dgrad_emulated(grad_out: MXTensor, b: MXTensor, offsets: torch.Tensor) -> torch.Tensor:
    """dgrad: grad_out row-wise [T, N], b row-wise [E, K, N] (blocks along N) -> fp32 [T, K]."""
    return grouped_mm_transposed_reference(
        dequantize_mxfp8_reference(grad_out), dequantize_mxfp8_reference(b), offsets
    )


def mx_grouped_wgrad_emulated(a: MXTensor, grad_out: MXTensor, offsets: torch.Tensor) -> torch.Tensor:
    """wgrad: a and grad_out column-wise grouped (blocks along tokens) -> fp32 [E, K, N]."""
    return grouped_wgrad_reference(dequantize_mxfp8_reference(a), dequantize_mxfp8_reference(grad_out), offsets)
