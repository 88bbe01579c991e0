"""Error measures shared by the kernel tests and benchmarks."""

from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum ref^2 / sum (ref - approx)^2).

    ``inf`` when the two agree exactly; raises on shape mismatch or a non-finite input, since a NaN
    would otherwise read as a (meaningless) number.
    """
    if reference.shape != approximation.shape:
        raise ValueError(f"shapes differ: {tuple(reference.shape)} vs {tuple(approximation.shape)}.")
    reference = reference.detach().to(torch.float64)
    approximation = approximation.detach().to(torch.float64)
    if not (torch.isfinite(reference).all() and torch.isfinite(approximation).all()):
        raise ValueError("sqnr_db needs finite tensors; a NaN/Inf slipped into the computation.")
    noise = (reference - approximation).square().sum().item()
    signal = reference.square().sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
