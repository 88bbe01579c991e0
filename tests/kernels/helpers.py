"""Shared inputs and markers of the kernel tests."""

from __future__ import annotations

import os

import pytest
import torch

requires_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before the kernels are imported.",
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

INPUT_KINDS = ("normal", "heavy_tailed", "tiny", "huge", "zeros", "nan", "inf", "mixed")


def make_input(kind: str, shape: tuple[int, ...], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inputs that stress every branch of the quantizer; generated on the CPU for reproducibility."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    if kind == "heavy_tailed":
        # Cauchy samples: a few values dwarf the rest of their block.
        x = torch.tan(torch.pi * (torch.rand(shape, generator=generator) - 0.5))
    elif kind == "tiny":
        x = x * 1e-38  # fp32 subnormal territory, below the smallest E8M0 scale times 448
    elif kind == "huge":
        x = x * 1e37
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind in ("nan", "inf", "mixed"):
        flat = x.view(-1)
        picks = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 200)]
        if kind == "nan":
            flat[picks] = float("nan")
        elif kind == "inf":
            flat[picks] = float("inf")
            flat[picks[::2]] = float("-inf")
        else:
            flat[picks[0::3]] = float("nan")
            flat[picks[1::3]] = float("-inf")
            flat[picks[2::3]] = 0.0
            x = x * torch.exp(4 * torch.randn(shape, generator=generator))  # wide dynamic range
            x.view(-1)[: flat.numel() // 8] = 0.0  # whole zero blocks
    elif kind != "normal":
        raise ValueError(f"unknown input kind {kind!r}; use one of {INPUT_KINDS}.")
    return x.to(dtype).to(DEVICE)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_mx(actual, expected) -> None:
    """Bit-exact comparison of two MXTensors (data bits and scale codes)."""
    assert actual.axis == expected.axis
    assert actual.data.shape == expected.data.shape
    assert actual.scales.shape == expected.scales.shape, (actual.scales.shape, expected.scales.shape)
    mismatched_data = (bits(actual.data) != bits(expected.data)).sum().item()
    mismatched_scales = (actual.scales != expected.scales).sum().item()
    assert mismatched_data == 0 and mismatched_scales == 0, (
        f"{mismatched_data} element codes and {mismatched_scales} scale codes differ"
    )
