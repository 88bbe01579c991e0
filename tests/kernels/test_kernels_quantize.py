"""Triton MXFP8 quantize/dequantize kernels: bit-exact against the PyTorch reference.

On a CPU these run under TRITON_INTERPRET=1 (set by conftest.py before the kernels are imported).
"""

from __future__ import annotations

import pytest
import torch

from kernels.mx_format import (
    MXTensor,
    dequantize_mxfp8_reference,
    quantize_mxfp8_cols_reference,
    quantize_mxfp8_rows_reference,
)
from tests.kernels.helpers import DEVICE, INPUT_KINDS, assert_same_mx, make_input, requires_triton

pytestmark = requires_triton

quantize = pytest.importorskip("kernels.quantize_mxfp8")


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_row_quantization_is_bit_exact(kind, mode):
    x = make_input(kind, (64, 96), seed=3)
    actual = quantize.quantize_mxfp8_rows(x, scale_mode=mode)
    expected = quantize_mxfp8_rows_reference(x, scale_mode=mode)
    assert_same_mx(actual, expected)
    assert torch.equal(
        quantize.dequantize_mxfp8(actual).nan_to_num(1234.5), dequantize_mxfp8_reference(expected).nan_to_num(1234.5)
    )


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_column_quantization_is_bit_exact_and_grouped(kind):
    x = make_input(kind, (100, 64), seed=4)
    assert_same_mx(quantize.quantize_mxfp8_cols(x), quantize_mxfp8_cols_reference(x))
    offsets = torch.tensor([0, 33, 33, 64, 90, 100], dtype=torch.int32, device=DEVICE)
    grouped = quantize.quantize_mxfp8_cols(x, offsets=offsets)
    expected = quantize_mxfp8_cols_reference(x, offsets=offsets)
    assert_same_mx(grouped, expected)
    assert torch.equal(
        quantize.dequantize_mxfp8(grouped).nan_to_num(7.0), dequantize_mxfp8_reference(expected).nan_to_num(7.0)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_sources_and_bf16_dequantization(dtype):
    x = make_input("mixed", (32, 64), seed=5, dtype=dtype)
    rows = quantize.quantize_mxfp8_rows(x)
    assert_same_mx(rows, quantize_mxfp8_rows_reference(x))
    w = make_input("heavy_tailed", (2, 64, 32), seed=6, dtype=dtype)
    cols = quantize.quantize_mxfp8_cols(w)
    assert_same_mx(cols, quantize_mxfp8_cols_reference(w))
    for mx in (rows, cols):
        actual = quantize.dequantize_mxfp8(mx, dtype=torch.bfloat16).float().nan_to_num(3.0)
        expected = dequantize_mxfp8_reference(mx, dtype=torch.bfloat16).float().nan_to_num(3.0)
        assert torch.equal(actual, expected)


def test_values_that_trip_a_direct_fp8_cast_are_handled():
    """Exact ties between E4M3 values, their neighbours, random and subnormal-range values, signed zeros,
    values past 448 and NaN: the Triton 3.9 interpreter's own fp32 -> float8e4nv cast rounds ties away
    from zero, does not saturate and drops NaN; the kernels round on the E4M3 grid in fp32 first, so
    they agree with the reference, which encodes with torch's float8_e4m3fn conversion."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    generator = torch.Generator().manual_seed(11)
    off_grid = torch.cat([
        (torch.rand(3000, generator=generator) * 2 - 1) * 448,
        (torch.rand(3000, generator=generator) * 2 - 1) * 0.03,  # E4M3 subnormal range (< 2**-6)
        torch.nextafter(ties, torch.full_like(ties, 1e9)),
        torch.nextafter(ties, torch.full_like(ties, -1e9)),
        torch.tensor([-0.0, -1e-5, 1e-5]),
    ])
    # FLOOR scales with a 448 anchor in every block stay at 2**0 even for the 449..500 values, so
    # they are rounded (and saturated) as they are.
    payload = torch.cat([ties, off_grid, torch.tensor([449.0, 470.0, 500.0, -465.0])])
    n_blocks = -(-payload.numel() // 31)
    padded = torch.zeros(n_blocks * 31)
    padded[: payload.numel()] = payload
    blocks = torch.cat([torch.full((n_blocks, 1), 448.0), padded.view(n_blocks, 31)], dim=1)
    x = blocks.view(1, -1).to(DEVICE)
    x_nan = x.clone()
    x_nan[0, 5] = float("nan")
    for source in (x, x_nan):
        actual = quantize.quantize_mxfp8_rows(source, scale_mode="floor")
        assert_same_mx(actual, quantize_mxfp8_rows_reference(source, scale_mode="floor"))
    kept = quantize.dequantize_mxfp8(quantize.quantize_mxfp8_rows(x, scale_mode="floor"))
    assert kept.abs().max().item() == 448.0  # saturated, never NaN or 480
    kept_ties = kept.view(n_blocks, 32)[:, 1:].reshape(-1)[: ties.numel()]
    assert torch.equal(kept_ties, ties.to(torch.float8_e4m3fn).float().to(DEVICE))  # torch: ties to even
    with_nan = quantize.dequantize_mxfp8(quantize.quantize_mxfp8_rows(x_nan, scale_mode="floor"))
    assert torch.isnan(with_nan[0, :32]).all() and not torch.isnan(with_nan[0, 32:]).any()


def test_strided_rows_are_read_without_copy():
    base = make_input("normal", (40, 128), seed=7)
    view = base[:, 32:96]  # row stride 128, last dim contiguous
    assert_same_mx(quantize.quantize_mxfp8_rows(view), quantize_mxfp8_rows_reference(view.contiguous()))
    assert_same_mx(quantize.quantize_mxfp8_cols(view), quantize_mxfp8_cols_reference(view.contiguous()))


def test_empty_and_3d_inputs():
    empty = torch.zeros(0, 64, device=DEVICE)
    assert quantize.quantize_mxfp8_rows(empty).data.shape == (0, 64)
    offsets = torch.tensor([0, 0, 0], dtype=torch.int32, device=DEVICE)
    assert quantize.quantize_mxfp8_cols(empty, offsets=offsets).data.shape == (0, 64)
    batched = make_input("normal", (3, 5, 64), seed=8)
    assert_same_mx(quantize.quantize_mxfp8_rows(batched), quantize_mxfp8_rows_reference(batched))


def test_launchers_reject_bad_inputs(monkeypatch):
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize.quantize_mxfp8_rows(torch.randn(4, 48, device=DEVICE))
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        quantize.quantize_mxfp8_rows(torch.ones(4, 32, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        quantize.quantize_mxfp8_rows(torch.randn(64, 32, device=DEVICE).t())
    with pytest.raises(ValueError, match="K % 32 == 0"):
        quantize.quantize_mxfp8_cols(torch.randn(2, 20, 32, device=DEVICE))
    with pytest.raises(ValueError, match="end at the number of rows"):
        quantize.quantize_mxfp8_cols(
            torch.randn(8, 32, device=DEVICE), offsets=torch.tensor([0, 3, 7], dtype=torch.int32)
        )
    bad = MXTensor(data=torch.zeros(2, 32, dtype=torch.uint8), scales=torch.zeros(2, 1, dtype=torch.uint8), axis="rows")
    with pytest.raises(ValueError, match="float8_e4m3fn data"):
        quantize.dequantize_mxfp8(bad)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
            quantize.quantize_mxfp8_rows(torch.randn(4, 32))
