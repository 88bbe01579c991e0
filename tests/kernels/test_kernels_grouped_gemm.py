"""Triton grouped GEMMs (forward, dgrad, wgrad; MXFP8 and the Hopper recipe) against their references.

Tolerances: kernel versus the emulated GEMM on the same quantized operands >= 60 dB SQNR (only fp32
summation order differs); MXFP8 versus the bf16 reference >= 28 dB forward, >= 25 dB dgrad, >= 24 dB
wgrad. Measured values are printed (pytest -s).
"""

from __future__ import annotations

import pytest
import torch

from kernels import grouped_gemm_reference as ref
from kernels.mx_format import quantize_mxfp8_cols_reference, quantize_mxfp8_rows_reference
from kernels.numerics import sqnr_db
from tests.kernels.helpers import DEVICE, requires_triton

pytestmark = requires_triton

gemm = pytest.importorskip("kernels.grouped_gemm_mxfp8")
wgrad = pytest.importorskip("kernels.grouped_wgrad_mxfp8")
quantize = pytest.importorskip("kernels.quantize_mxfp8")
blockwise = pytest.importorskip("kernels.fp8_blockwise")

KERNEL_VS_EMULATED_DB = 60.0

OFFSET_CASES = {
    "mixed": [0, 70, 70, 200, 256],  # partial blocks and an empty expert in the middle
    "edges_empty": [0, 0, 128, 256, 256],  # first and last experts empty
    "one_expert": [0, 0, 256, 256, 256],
    "tiny_groups": [0, 1, 2, 3, 256],
}


def offsets_tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def gaussian(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("case", sorted(OFFSET_CASES))
def test_forward_and_dgrad_match_emulated(case):
    offsets = offsets_tensor(OFFSET_CASES[case])
    x, w, grad = gaussian(256, 64, seed=1), gaussian(4, 64, 96, seed=2), gaussian(256, 96, seed=3)
    x_rows, w_cols = quantize.quantize_mxfp8_rows(x), quantize.quantize_mxfp8_cols(w)
    out = gemm.mx_grouped_mm_triton(x_rows, w_cols, offsets)
    assert sqnr_db(ref.mx_grouped_mm_emulated(x_rows, w_cols, offsets), out) >= KERNEL_VS_EMULATED_DB
    grad_rows, w_rows = quantize.quantize_mxfp8_rows(grad), quantize.quantize_mxfp8_rows(w)
    grad_x = gemm.mx_grouped_mm_dgrad_triton(grad_rows, w_rows, offsets)
    assert sqnr_db(ref.mx_grouped_mm_dgrad_emulated(grad_rows, w_rows, offsets), grad_x) >= KERNEL_VS_EMULATED_DB


@pytest.mark.parametrize("case", sorted(OFFSET_CASES))
def test_wgrad_matches_emulated_and_zeroes_empty_experts(case):
    values = OFFSET_CASES[case]
    offsets = offsets_tensor(values)
    x, grad = gaussian(256, 64, seed=4), gaussian(256, 96, seed=5)
    x_cols = quantize.quantize_mxfp8_cols(x, offsets=offsets)
    grad_cols = quantize.quantize_mxfp8_cols(grad, offsets=offsets)
    grad_w = wgrad.mx_grouped_wgrad_triton(x_cols, grad_cols, offsets)
    expected = ref.mx_grouped_wgrad_emulated(x_cols, grad_cols, offsets)
    assert sqnr_db(expected, grad_w) >= KERNEL_VS_EMULATED_DB
    for expert in range(4):
        if values[expert] == values[expert + 1]:
            assert torch.count_nonzero(grad_w[expert]) == 0


def test_bf16_output_is_the_rounded_fp32_result():
    offsets = offsets_tensor(OFFSET_CASES["mixed"])
    x_rows = quantize.quantize_mxfp8_rows(gaussian(256, 64, seed=6))
    w_cols = quantize.quantize_mxfp8_cols(gaussian(4, 64, 96, seed=7))
    out_fp32 = gemm.mx_grouped_mm_triton(x_rows, w_cols, offsets)
    out_bf16 = gemm.mx_grouped_mm_triton(x_rows, w_cols, offsets, out_dtype=torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16
    assert sqnr_db(out_fp32, out_bf16.float()) >= 45.0


def test_nan_block_poisons_only_its_rows():
    offsets = offsets_tensor(OFFSET_CASES["mixed"])
    x = gaussian(256, 64, seed=8)
    x[5, 40] = float("nan")
    out = gemm.mx_grouped_mm_triton(quantize.quantize_mxfp8_rows(x), quantize.quantize_mxfp8_cols(gaussian(4, 64, 96, seed=9)), offsets)
    assert torch.isnan(out[5]).all()
    assert torch.isfinite(out[torch.arange(256, device=DEVICE) != 5]).all()


def test_mxfp8_versus_bf16_reference_sqnr():
    """MXFP8 grouped GEMMs against the same GEMMs on bf16 inputs with fp32 accumulation."""
    offsets = offsets_tensor([0, 60, 60, 190, 256])
    x, w, grad = gaussian(256, 128, seed=10), gaussian(4, 128, 128, seed=11), gaussian(256, 128, seed=12)

    def bf16(t):
        return t.to(torch.bfloat16).float()

    forward = sqnr_db(
        ref.grouped_mm_reference(bf16(x), bf16(w), offsets),
        gemm.mx_grouped_mm_triton(quantize.quantize_mxfp8_rows(x), quantize.quantize_mxfp8_cols(w), offsets),
    )
    dgrad = sqnr_db(
        ref.grouped_mm_transposed_reference(bf16(grad), bf16(w), offsets),
        gemm.mx_grouped_mm_dgrad_triton(quantize.quantize_mxfp8_rows(grad), quantize.quantize_mxfp8_rows(w), offsets),
    )
    weight_grad = sqnr_db(
        ref.grouped_wgrad_reference(bf16(x), bf16(grad), offsets),
        wgrad.mx_grouped_wgrad_triton(
            quantize.quantize_mxfp8_cols(x, offsets=offsets), quantize.quantize_mxfp8_cols(grad, offsets=offsets), offsets
        ),
    )
    print(f"\nMXFP8 vs bf16 reference SQNR: forward {forward:.2f} dB, dgrad {dgrad:.2f} dB, wgrad {weight_grad:.2f} dB")
    assert forward >= 28.0
    assert dgrad >= 25.0
    assert weight_grad >= 24.0


def test_hopper_blockwise_recipe_forward_and_dgrad():
    offsets = offsets_tensor([0, 100, 100, 256])
    x, w, grad = gaussian(256, 128, seed=13), gaussian(3, 128, 256, seed=14), gaussian(256, 256, seed=15)
    x_q = blockwise.quantize_fp8_blockwise_activations(x)
    w_q = blockwise.quantize_fp8_blockwise_weights(w)
    assert x_q.scales.shape == (256, 1) and w_q.scales.shape == (3, 1, 2)
    assert blockwise.dequantize_fp8_blockwise(x_q).abs().amax(dim=1).sub(x.abs().amax(dim=1)).abs().max() < 1e-5
    out = blockwise.fp8_blockwise_grouped_mm(x_q, w_q, offsets)
    dq = blockwise.dequantize_fp8_blockwise
    assert sqnr_db(ref.grouped_mm_reference(dq(x_q), dq(w_q), offsets), out) >= KERNEL_VS_EMULATED_DB
    grad_q = blockwise.quantize_fp8_blockwise_activations(grad)
    grad_x = blockwise.fp8_blockwise_grouped_mm_dgrad(grad_q, w_q, offsets)
    assert sqnr_db(ref.grouped_mm_transposed_reference(dq(grad_q), dq(w_q), offsets), grad_x) >= KERNEL_VS_EMULATED_DB
    forward_db = sqnr_db(ref.grouped_mm_reference(x, w, offsets), out)
    dgrad_db = sqnr_db(ref.grouped_mm_transposed_reference(grad, w, offsets), grad_x)
    print(f"\nHopper 1x128/128x128 FP8 vs fp32: forward {forward_db:.2f} dB, dgrad {dgrad_db:.2f} dB")
    assert forward_db >= 27.0 and dgrad_db >= 25.0


def test_hopper_blockwise_wgrad_with_128_token_blocks_per_expert():
    offsets = offsets_tensor([0, 150, 150, 300, 400])  # partial 128-token blocks and an empty expert
    x, grad = gaussian(400, 64, seed=22), gaussian(400, 96, seed=23)
    x_q = blockwise.quantize_fp8_blockwise_tokens(x, offsets)
    grad_q = blockwise.quantize_fp8_blockwise_tokens(grad, offsets)
    assert x_q.scales.shape == (400 // 128 + 4, 64)
    dq = blockwise.dequantize_fp8_blockwise
    # Blocks restart at expert boundaries: quantizing one expert alone gives the same values.
    alone = blockwise.quantize_fp8_blockwise_tokens(x[150:300], offsets_tensor([0, 150]))
    assert torch.equal(dq(x_q)[150:300], dq(alone))
    grad_w = blockwise.fp8_blockwise_grouped_wgrad(x_q, grad_q, offsets)
    assert sqnr_db(ref.grouped_wgrad_reference(dq(x_q), dq(grad_q), offsets), grad_w) >= KERNEL_VS_EMULATED_DB
    assert torch.count_nonzero(grad_w[1]) == 0
    wgrad_db = sqnr_db(ref.grouped_wgrad_reference(x, grad, offsets), grad_w)
    print(f"\nHopper 128x1 token-block FP8 wgrad vs fp32: {wgrad_db:.2f} dB")
    assert wgrad_db >= 24.0


def test_hopper_blockwise_special_blocks():
    x = gaussian(4, 256, seed=16)
    x[0, :128] = 0.0
    x[1, 200] = float("inf")
    q = blockwise.quantize_fp8_blockwise_activations(x)
    assert q.scales[0, 0].item() == 1.0
    assert torch.isnan(q.scales[1, 1]) and torch.isfinite(q.scales[1, 0])
    assert torch.isnan(blockwise.dequantize_fp8_blockwise(q)[1, 128:]).all()
    with pytest.raises(ValueError, match="K % 128 == 0"):
        blockwise.quantize_fp8_blockwise_activations(gaussian(4, 96, seed=17))
    with pytest.raises(ValueError, match="multiples of 128"):
        blockwise.quantize_fp8_blockwise_weights(gaussian(2, 128, 96, seed=18))


def test_launchers_reject_mismatched_operands():
    offsets = offsets_tensor([0, 10, 32])
    x = gaussian(32, 64, seed=19)
    w = gaussian(2, 64, 32, seed=20)
    x_rows, w_cols, w_rows = quantize.quantize_mxfp8_rows(x), quantize.quantize_mxfp8_cols(w), quantize.quantize_mxfp8_rows(w)
    with pytest.raises(ValueError, match="quantized along rows"):
        gemm.mx_grouped_mm_triton(x_rows, w_rows, offsets)
    with pytest.raises(ValueError, match="offsets must be"):
        gemm.mx_grouped_mm_triton(x_rows, w_cols, offsets_tensor([0, 32]))
    with pytest.raises(ValueError, match="reduction sizes differ"):
        gemm.mx_grouped_mm_triton(quantize.quantize_mxfp8_rows(gaussian(32, 96, seed=21)), w_cols, offsets)
    with pytest.raises(ValueError, match="32x1 along tokens per expert"):
        wgrad.mx_grouped_wgrad_triton(quantize.quantize_mxfp8_cols(x), quantize.quantize_mxfp8_cols(x), offsets)
    with pytest.raises(ValueError, match="different group offsets"):
        wgrad.mx_grouped_wgrad_triton(
            quantize.quantize_mxfp8_cols(x, offsets=offsets),
            quantize.quantize_mxfp8_cols(x, offsets=offsets),
            torch.tensor([0, 20, 32], dtype=torch.int32),  # on the CPU: the launcher compares host offsets only
        )
    reference_rows = quantize_mxfp8_rows_reference(x)
    reference_cols = quantize_mxfp8_cols_reference(w)
    assert gemm.mx_grouped_mm_triton(reference_rows, reference_cols, offsets).shape == (32, 32)
