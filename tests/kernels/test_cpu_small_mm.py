"""kernels.cpu_small_mm: the few-rows CPU matmul equals torch.mm up to rounding, and falls back to it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_small_mm


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(256, 256), (64, 96), (256, 512), (33, 17)])
def test_small_mm_equals_torch_mm(rows, shape):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[0], generator=generator)
    w = torch.randn(*shape, generator=generator)
    buffer = torch.full((rows + 2, shape[1]), float("nan"))
    out = buffer[1 : rows + 1]  # a contiguous block of a larger buffer, as fused_moe passes
    assert cpu_small_mm.small_mm(x, w, out) is out
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()


def test_the_kernel_builds_here():
    """CI's machines have a compiler; without one small_mm still works (torch.mm), which this would hide."""
    assert cpu_small_mm.available()


def test_operands_the_kernel_does_not_take_go_to_torch_mm():
    x, w = torch.randn(12, 32), torch.randn(32, 16)
    out = torch.empty(12, 16)
    torch.testing.assert_close(cpu_small_mm.small_mm(x, w, out), x @ w)  # more than MAX_ROWS rows
    transposed = torch.randn(16, 32).t()
    out = torch.empty(2, 16)
    torch.testing.assert_close(cpu_small_mm.small_mm(x[:2], transposed, out), x[:2] @ transposed)
    x64, w64 = x[:2].double(), w.double()
    out64 = torch.empty(2, 16, dtype=torch.float64)
    torch.testing.assert_close(cpu_small_mm.small_mm(x64, w64, out64), x64 @ w64)
