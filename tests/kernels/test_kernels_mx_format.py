"""The PyTorch MXFP8 reference against independent definitions (float64 math, torch's FP8 cast)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.mx_format import (
    E8M0_NAN,
    MX_BLOCK,
    ScaleMode,
    dequantize_mxfp8_reference,
    e8m0_codes_from_amax,
    encode_e4m3_saturating,
    group_block_table,
    quantize_mxfp8_cols_reference,
    quantize_mxfp8_rows_reference,
    scale_from_codes,
)


def test_encoder_saturates_and_keeps_the_sign_of_zero():
    values = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e4, 3e38, -500.0, -448.5, 1.0625, 1.1875])
    decoded = encode_e4m3_saturating(values).view(torch.float8_e4m3fn).float()
    # 1.0625 and 1.1875 are exact ties between E4M3 neighbours: round half to even.
    assert decoded.tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0, 1.0, 1.25]
    assert encode_e4m3_saturating(torch.tensor([-0.0, -1e-5, 0.0])).tolist() == [0x80, 0x80, 0x00]


@pytest.mark.parametrize("mode", [ScaleMode.RCEIL, ScaleMode.FLOOR])
def test_scale_codes_match_float64_definition(mode):
    generator = torch.Generator().manual_seed(1)
    amax = torch.exp(torch.empty(50000).uniform_(-85, 85, generator=generator)).to(torch.float32)
    amax = torch.cat([amax, torch.tensor([448.0, 448.0 * 2**-20, 1.0, 1.75, 1.7500001, 2.0**-126, 1e-45])])
    codes = e8m0_codes_from_amax(amax, torch.zeros_like(amax, dtype=torch.bool), mode)
    expected = []
    for value in amax.double().tolist():
        if mode is ScaleMode.RCEIL:
            exponent = math.ceil(math.log2(value / 448.0))
        else:
            exponent = math.floor(math.log2(value)) - 8
        expected.append(min(max(exponent + 127, 0), 254))
    assert codes.tolist() == expected


def test_scale_mode_examples_and_parse_errors():
    block = torch.full((1, MX_BLOCK), 0.5)
    block[0, 0] = 1.9
    rceil = quantize_mxfp8_rows_reference(block, scale_mode="rceil")
    floor = quantize_mxfp8_rows_reference(block, scale_mode="floor")
    assert rceil.scales.item() == 127 - 7  # 1.9 / 448 rounded up to 2**-7
    assert floor.scales.item() == 127 - 8  # floor(log2 1.9) - 8
    assert dequantize_mxfp8_reference(rceil)[0, 0].item() == pytest.approx(1.875)
    assert dequantize_mxfp8_reference(floor)[0, 0].item() == 448 * 2**-8  # saturated
    with pytest.raises(ValueError, match="scale_mode='nearest' is unknown"):
        quantize_mxfp8_rows_reference(block, scale_mode="nearest")


def test_special_blocks_zero_nan_inf_tiny_huge():
    x = torch.randn(6, 2 * MX_BLOCK)
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 40] = float("-inf")
    x[3] = torch.linspace(-1, 1, 2 * MX_BLOCK) * 1e-40  # fp32 subnormals
    x[4] = torch.linspace(-1, 1, 2 * MX_BLOCK) * 3e38
    mx = quantize_mxfp8_rows_reference(x)
    out = dequantize_mxfp8_reference(mx)
    assert mx.scales[0].tolist() == [0, 0] and torch.equal(out[0], torch.zeros(2 * MX_BLOCK))
    assert mx.scales[1].tolist() == [E8M0_NAN, mx.scales[1, 1].item()] and mx.scales[1, 1] != E8M0_NAN
    assert torch.isnan(out[1, :MX_BLOCK]).all() and torch.isfinite(out[1, MX_BLOCK:]).all()
    assert mx.scales[2, 1] == E8M0_NAN and torch.isnan(out[2, MX_BLOCK:]).all()
    assert torch.isfinite(out[2, :MX_BLOCK]).all()
    assert mx.scales[3].tolist() == [0, 0]  # below 448 * 2**-127: the smallest scale
    assert (out[3] - x[3]).abs().max() <= 2.0**-127 * 2**-9  # half an E4M3 subnormal step
    assert torch.isfinite(out[4]).all()
    assert ((out[4] - x[4]).abs() <= x[4].abs() * 2**-4).all()


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_error_bound_of_every_element(mode):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=generator) * torch.exp(3 * torch.randn(64, 1, generator=generator))
    mx = quantize_mxfp8_rows_reference(x, scale_mode=mode)
    out = dequantize_mxfp8_reference(mx)
    block_scale = scale_from_codes(mx.scales).repeat_interleave(MX_BLOCK, dim=1)
    saturation_slack = (x.abs() - 448 * block_scale).clamp(min=0)
    bound = torch.maximum(x.abs() * 2**-4, block_scale * 2**-10) + saturation_slack
    assert ((out - x).abs() <= bound).all()
    if mode == "rceil":
        assert saturation_slack.max() == 0  # RCEIL never saturates
    assert mx.data.view(torch.uint8).dtype == torch.uint8 and mx.data.dtype == torch.float8_e4m3fn


def test_column_blocks_equal_row_blocks_of_the_transpose():
    x = torch.randn(96, 40)
    cols = quantize_mxfp8_cols_reference(x)
    rows_of_t = quantize_mxfp8_rows_reference(x.t().contiguous())
    assert torch.equal(cols.data.view(torch.uint8), rows_of_t.data.view(torch.uint8).t())
    assert torch.equal(cols.scales, rows_of_t.scales.t())
    assert torch.equal(dequantize_mxfp8_reference(cols), dequantize_mxfp8_reference(rows_of_t).t())


def test_grouped_column_blocks_restart_at_each_group():
    offsets = torch.tensor([0, 0, 45, 64, 64, 100], dtype=torch.int32)
    x = torch.randn(100, 8)
    mx = quantize_mxfp8_cols_reference(x, offsets=offsets)
    table = group_block_table(offsets, 100)
    assert table.block_base.tolist() == [0, 0, 2, 3, 3, 5]
    assert mx.scales.shape == (100 // 32 + 5, 8)
    bounds = offsets.tolist()
    for group in range(5):
        part = x[bounds[group] : bounds[group + 1]]
        alone = quantize_mxfp8_cols_reference(part)
        base = table.block_base[group].item()
        assert torch.equal(mx.data.view(torch.uint8)[bounds[group] : bounds[group + 1]], alone.data.view(torch.uint8))
        assert torch.equal(mx.scales[base : base + alone.scales.shape[0]], alone.scales)
    assert torch.equal(dequantize_mxfp8_reference(mx)[45:64], dequantize_mxfp8_reference(quantize_mxfp8_cols_reference(x[45:64])))


def test_weight_layout_blocks_run_along_k_per_expert():
    w = torch.randn(3, 64, 48)
    mx = quantize_mxfp8_cols_reference(w)
    assert mx.scales.shape == (3, 2, 48)
    for expert in range(3):
        alone = quantize_mxfp8_cols_reference(w[expert])
        assert torch.equal(mx.scales[expert], alone.scales)


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8_rows_reference(torch.randn(4, 33))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        quantize_mxfp8_rows_reference(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="K % 32 == 0"):
        quantize_mxfp8_cols_reference(torch.randn(2, 40, 8))
    with pytest.raises(ValueError, match="must start at 0 and end at the number of rows"):
        quantize_mxfp8_cols_reference(torch.randn(10, 8), offsets=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        quantize_mxfp8_cols_reference(torch.randn(10, 8), offsets=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
