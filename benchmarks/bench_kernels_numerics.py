"""Numerics of the MXFP8 kernels on the CPU (Triton interpreter), the figures BENCHMARKS.md records.

* Quantization: Triton kernels versus the PyTorch reference, mismatching codes out of all codes, for
  random, heavy-tailed, tiny, huge, zero, NaN, Inf and mixed inputs (rows, columns, grouped columns).
* GEMMs: Triton kernel versus the emulated MXFP8 GEMM (dequantize + fp32 matmul), and MXFP8 versus the
  bf16 reference (bf16 inputs, fp32 accumulation) for forward, dgrad and wgrad; the baseline in the
  same run is bf16 itself measured against fp32 (ratio = MXFP8 noise power / bf16 noise power, in dB).
* The SwiGLU expert layer (forward and every gradient) versus fp32, MXFP8 and bf16.
* The Hopper 1x128/128x128 recipe versus fp32.

    .venv/bin/python benchmarks/bench_kernels_numerics.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import grouped_gemm_reference as ref
from kernels.fp8_blockwise import (
    fp8_blockwise_grouped_mm,
    fp8_blockwise_grouped_wgrad,
    quantize_fp8_blockwise_activations,
    quantize_fp8_blockwise_tokens,
    quantize_fp8_blockwise_weights,
)
from kernels.grouped_gemm_mxfp8 import mx_grouped_mm_dgrad_triton, mx_grouped_mm_triton
from kernels.grouped_wgrad_mxfp8 import mx_grouped_wgrad_triton
from kernels.moe_experts import grouped_swiglu
from kernels.mx_format import quantize_mxfp8_cols_reference, quantize_mxfp8_rows_reference
from kernels.numerics import sqnr_db
from kernels.quantize_mxfp8 import quantize_mxfp8_cols, quantize_mxfp8_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sample(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    flat = x.view(-1)
    picks = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 200)]
    if kind == "heavy_tailed":
        x = torch.tan(torch.pi * (torch.rand(shape, generator=generator) - 0.5))
    elif kind == "tiny":
        x = x * 1e-38
    elif kind == "huge":
        x = x * 1e37
    elif kind == "zero":
        x = torch.zeros(shape)
    elif kind == "nan":
        flat[picks] = float("nan")
    elif kind == "inf":
        flat[picks] = float("inf")
    elif kind == "mixed":
        flat[picks[0::2]] = float("nan")
        flat[picks[1::2]] = float("-inf")
        x = x * torch.exp(4 * torch.randn(shape, generator=generator))
    return x.to(DEVICE)


def mismatches(actual, expected) -> tuple[int, int]:
    data = (actual.data.view(torch.uint8) != expected.data.view(torch.uint8)).sum().item()
    scales = (actual.scales != expected.scales).sum().item()
    return data + scales, actual.data.numel() + actual.scales.numel()


def quantization_report(rows: int, cols: int) -> None:
    print(f"\n[quantize] Triton vs reference, {rows}x{cols} per input, rceil and floor")
    offsets = torch.tensor([0, rows // 3, rows // 3, rows - 5, rows], dtype=torch.int32, device=DEVICE)
    for kind in ("normal", "heavy_tailed", "tiny", "huge", "zero", "nan", "inf", "mixed"):
        x = sample(kind, (rows, cols), seed=hash(kind) % 1000)
        bad = total = 0
        for mode in ("rceil", "floor"):
            for actual, expected in (
                (quantize_mxfp8_rows(x, scale_mode=mode), quantize_mxfp8_rows_reference(x, scale_mode=mode)),
                (quantize_mxfp8_cols(x, scale_mode=mode), quantize_mxfp8_cols_reference(x, scale_mode=mode)),
                (
                    quantize_mxfp8_cols(x, offsets=offsets, scale_mode=mode),
                    quantize_mxfp8_cols_reference(x, offsets=offsets, scale_mode=mode),
                ),
            ):
                b, t = mismatches(actual, expected)
                bad, total = bad + b, total + t
        print(f"  {kind:13s} mismatching codes: {bad} / {total}")


def gemm_report(tokens: int, k: int, n: int) -> None:
    offsets = torch.tensor([0, tokens // 4, tokens // 4, 3 * tokens // 4 + 7, tokens], dtype=torch.int32, device=DEVICE)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=generator).to(DEVICE)
    w = torch.randn(4, k, n, generator=generator).to(DEVICE)
    grad = torch.randn(tokens, n, generator=generator).to(DEVICE)

    def bf16(t):
        return t.to(torch.bfloat16).float()

    x_rows, w_cols = quantize_mxfp8_rows(x), quantize_mxfp8_cols(w)
    grad_rows, w_rows = quantize_mxfp8_rows(grad), quantize_mxfp8_rows(w)
    x_cols, grad_cols = quantize_mxfp8_cols(x, offsets=offsets), quantize_mxfp8_cols(grad, offsets=offsets)
    cases = {
        "forward": (
            mx_grouped_mm_triton(x_rows, w_cols, offsets),
            ref.mx_grouped_mm_emulated(x_rows, w_cols, offsets),
            ref.grouped_mm_reference(bf16(x), bf16(w), offsets),
            ref.grouped_mm_reference(x, w, offsets),
            28.0,
        ),
        "dgrad": (
            mx_grouped_mm_dgrad_triton(grad_rows, w_rows, offsets),
            ref.mx_grouped_mm_dgrad_emulated(grad_rows, w_rows, offsets),
            ref.grouped_mm_transposed_reference(bf16(grad), bf16(w), offsets),
            ref.grouped_mm_transposed_reference(grad, w, offsets),
            25.0,
        ),
        "wgrad": (
            mx_grouped_wgrad_triton(x_cols, grad_cols, offsets),
            ref.mx_grouped_wgrad_emulated(x_cols, grad_cols, offsets),
            ref.grouped_wgrad_reference(bf16(x), bf16(grad), offsets),
            ref.grouped_wgrad_reference(x, grad, offsets),
            24.0,
        ),
    }
    print(f"\n[grouped GEMM] T={tokens} K={k} N={n} E=4 (one empty expert), Gaussian data")
    for name, (kernel, emulated, bf16_ref, fp32_ref, goal) in cases.items():
        kernel_db = sqnr_db(emulated, kernel)
        mx_vs_bf16 = sqnr_db(bf16_ref, kernel)
        bf16_vs_fp32 = sqnr_db(fp32_ref, bf16_ref)
        print(
            f"  {name:7s} kernel vs emulated {kernel_db:6.1f} dB (goal >= 60) | MXFP8 vs bf16 ref {mx_vs_bf16:5.2f} dB "
            f"(goal >= {goal:.0f}) | baseline bf16 vs fp32 {bf16_vs_fp32:5.2f} dB -> MXFP8 noise is "
            f"{bf16_vs_fp32 - mx_vs_bf16:4.1f} dB above bf16's"
        )


def layer_report(tokens: int, d_model: int, d_ff: int) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d_model, generator=generator)
    weights = [
        torch.randn(4, d_model, d_ff, generator=generator) / d_model**0.5,
        torch.randn(4, d_model, d_ff, generator=generator) / d_model**0.5,
        torch.randn(4, d_ff, d_model, generator=generator) / d_ff**0.5,
    ]
    grad = torch.randn(tokens, d_model, generator=generator)
    offsets = torch.tensor([0, tokens // 2, tokens // 2, tokens - 40, tokens], dtype=torch.int32)

    def run(precision: str, backend: str | None = None):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (x, *weights)]
        out = grouped_swiglu(leaves[0], offsets.to(DEVICE), *leaves[1:], precision=precision, backend=backend)
        out.backward(grad.to(DEVICE))
        return [out.detach()] + [leaf.grad for leaf in leaves]

    fp32 = run("fp32")
    names = ("out", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down")
    print(f"\n[SwiGLU expert layer] T={tokens} d_model={d_model} d_ff={d_ff} E=4, SQNR vs fp32 (dB)")
    for label, result in (("bf16", run("bf16")), ("mxfp8 reference", run("mxfp8", "reference")), ("mxfp8 triton", run("mxfp8", "triton"))):
        figures = "  ".join(f"{name} {sqnr_db(e, a):5.2f}" for name, e, a in zip(names, fp32, result, strict=True))
        print(f"  {label:16s} {figures}")


def hopper_report(tokens: int, k: int, n: int) -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, k, generator=generator).to(DEVICE)
    w = torch.randn(3, k, n, generator=generator).to(DEVICE)
    offsets = torch.tensor([0, tokens // 3, tokens // 3, tokens], dtype=torch.int32, device=DEVICE)
    fp32_ref = ref.grouped_mm_reference(x, w, offsets)
    blockwise = fp8_blockwise_grouped_mm(quantize_fp8_blockwise_activations(x), quantize_fp8_blockwise_weights(w), offsets)
    mx = mx_grouped_mm_triton(quantize_mxfp8_rows(x), quantize_mxfp8_cols(w), offsets)
    grad = torch.randn(tokens, n, generator=generator).to(DEVICE)
    wgrad_fp32 = ref.grouped_wgrad_reference(x, grad, offsets)
    wgrad_blockwise = fp8_blockwise_grouped_wgrad(
        quantize_fp8_blockwise_tokens(x, offsets), quantize_fp8_blockwise_tokens(grad, offsets), offsets
    )
    wgrad_mx = mx_grouped_wgrad_triton(
        quantize_mxfp8_cols(x, offsets=offsets), quantize_mxfp8_cols(grad, offsets=offsets), offsets
    )
    print(f"\n[Hopper recipe] T={tokens} K={k} N={n}: SQNR vs fp32")
    print(
        f"  forward 1x128/128x128 fp32-scaled FP8 {sqnr_db(fp32_ref, blockwise):5.2f} dB | baseline MXFP8 "
        f"{sqnr_db(fp32_ref, mx):5.2f} dB"
    )
    print(
        f"  wgrad 128x1 token blocks per expert    {sqnr_db(wgrad_fp32, wgrad_blockwise):5.2f} dB | baseline MXFP8 "
        f"{sqnr_db(wgrad_fp32, wgrad_mx):5.2f} dB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    where = "CUDA" if DEVICE.type == "cuda" else "CPU, Triton interpreter (TRITON_INTERPRET=1)"
    print(f"device: {where}; torch {torch.__version__}")
    quantization_report(rows=96, cols=128)
    gemm_report(args.tokens, 128, 128)
    layer_report(args.tokens, 64, 128)
    hopper_report(args.tokens, 128, 256)


if __name__ == "__main__":
    main()
