"""Speed of the MXFP8 Triton kernels against bf16 torch grouped matmul on the same shapes (GPU).

Sections (each prints the figure, the bf16/PyTorch baseline measured in the same run, and the ratio):

1. quantize: Triton 1x32 row quantization of a bf16 activation vs the PyTorch reference quantizer (GB/s).
2. grouped GEMM forward: MXFP8 Triton kernel (operands pre-quantized) vs ``torch._grouped_mm`` in bf16,
   with the weight N-major (as quantized) and K-major (as the layer runs it), and the Hopper recipe.
3. grouped wgrad: MXFP8 Triton kernel vs ``torch._grouped_mm`` (grouped along the reduction) in bf16.
4. MoE SwiGLU expert layer, forward + backward, quantization included: ``grouped_swiglu(precision="mxfp8")``
   on the Triton path vs the same layer in bf16 on ``torch._grouped_mm``. Goal on an H100: >= 1.5x.

Every section also checks the fast path against its reference (SQNR), so a wrong kernel cannot post a
speed. Without a GPU the script runs its smoke path: tiny shapes through the Triton interpreter; those
timings exercise the code and are NOT performance figures.

    .venv/bin/python benchmarks/bench_kernels_gpu.py                      # H100: default shapes
    .venv/bin/python benchmarks/bench_kernels_gpu.py --tokens 8192 --d-model 1024 --d-ff 512 --experts 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from kernels import grouped_gemm_reference as ref
from kernels.fp8_blockwise import (
    fp8_blockwise_grouped_mm_dgrad,
    quantize_fp8_blockwise_activations,
    quantize_fp8_blockwise_weights,
)
from kernels.grouped_gemm_mxfp8 import mx_grouped_mm_dgrad_triton, mx_grouped_mm_triton
from kernels.grouped_wgrad_mxfp8 import mx_grouped_wgrad_triton
from kernels.moe_experts import grouped_swiglu
from kernels.mx_format import quantize_mxfp8_rows_reference
from kernels.numerics import sqnr_db
from kernels.quantize_mxfp8 import quantize_mxfp8_cols, quantize_mxfp8_rows

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def time_ms(fn: Callable[[], object], *, repeats: int) -> float:
    if ON_GPU:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def routed_offsets(tokens: int, experts: int, seed: int) -> torch.Tensor:
    """Skewed expert loads (one expert left empty) summing to ``tokens``."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=generator) + 0.25
    weights[experts // 2] = 0.0
    counts = torch.multinomial(weights, tokens, replacement=True, generator=generator).bincount(minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    return offsets.to(DEVICE)


def bf16_swiglu_grouped_mm(x, offsets, w_gate_up, w_down):
    ends = offsets[1:]
    gate_up = torch._grouped_mm(x, w_gate_up, offs=ends)
    gate, up = gate_up.chunk(2, dim=1)
    return torch._grouped_mm((F.silu(gate) * up).contiguous(), w_down, offs=ends)


def report(name: str, fast_ms: float, base_ms: float, unit_work: float, unit: str, check: str) -> None:
    """unit_work is bytes for "GB/s" and flops for "TFLOP/s"; per millisecond it becomes the unit by /1e9."""
    if unit == "GB/s":
        unit_work = unit_work * 1e3  # bytes per ms -> GB/s needs /1e6
    print(
        f"  {name:30s} mxfp8 {fast_ms:9.3f} ms ({unit_work / fast_ms / 1e9:.3g} {unit}) | baseline "
        f"{base_ms:9.3f} ms ({unit_work / base_ms / 1e9:.3g} {unit}) | speedup {base_ms / fast_ms:5.2f}x | {check}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None, help="routed rows (tokens x top_k); GPU 16384, CPU 128")
    parser.add_argument("--d-model", type=int, default=None, help="GPU 2048, CPU 128")
    parser.add_argument("--d-ff", type=int, default=None, help="expert hidden width; GPU 1408, CPU 128")
    parser.add_argument("--experts", type=int, default=None, help="GPU 16, CPU 4")
    args = parser.parse_args()
    defaults = (16384, 2048, 1408, 16) if ON_GPU else (128, 128, 128, 4)  # 128: the Hopper recipe's block
    tokens, d_model, d_ff, experts = (
        value if value is not None else default
        for value, default in zip((args.tokens, args.d_model, args.d_ff, args.experts), defaults, strict=True)
    )
    repeats = 1  # CPU smoke path: one run each (the GPU path uses triton.testing.do_bench)
    if ON_GPU:
        print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        torch.set_num_threads(1)
        print("device: CPU, no GPU -> SMOKE PATH: tiny shapes through the Triton interpreter; timings below are")
        print("        not performance figures, they only show every kernel and both baselines run.")
    print(f"shapes: routed tokens {tokens}, d_model {d_model}, d_ff {d_ff}, experts {experts}; torch {torch.__version__}")

    offsets = routed_offsets(tokens, experts, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d_model, generator=generator).to(DEVICE, torch.bfloat16)
    w_gate = (torch.randn(experts, d_model, d_ff, generator=generator) / d_model**0.5).to(DEVICE)
    w_up = (torch.randn(experts, d_model, d_ff, generator=generator) / d_model**0.5).to(DEVICE)
    w_down = (torch.randn(experts, d_ff, d_model, generator=generator) / d_ff**0.5).to(DEVICE)
    grad = torch.randn(tokens, d_model, generator=generator).to(DEVICE, torch.bfloat16)

    w_gate_up = torch.cat([w_gate, w_up], dim=2)
    _bench_quantize(x, repeats)
    flops = _bench_forward(x, w_gate_up, offsets, repeats)
    _bench_wgrad(x, offsets, d_ff, flops, generator, repeats)
    _bench_layer(x, offsets, (w_gate, w_up, w_down), w_gate_up, grad, repeats)


def _bench_quantize(x: torch.Tensor, repeats: int) -> None:
    """1. Triton 1x32 row quantization against the PyTorch reference."""
    fast = time_ms(lambda: quantize_mxfp8_rows(x), repeats=repeats)
    base = time_ms(lambda: quantize_mxfp8_rows_reference(x), repeats=repeats)
    same = quantize_mxfp8_rows(x).data.view(torch.uint8).equal(quantize_mxfp8_rows_reference(x).data.view(torch.uint8))
    moved = x.numel() * (2 + 1) + x.numel() // 32
    report("quantize rows (bf16 -> MXFP8)", fast, base, moved, "GB/s", f"bit-exact vs reference: {same}")


def _bench_forward(x, w_gate_up, offsets, repeats: int) -> float:
    """2. The grouped GEMM forward three ways against bf16 torch._grouped_mm; returns its flops."""
    tokens, d_model, d_ff = x.shape[0], x.shape[1], w_gate_up.shape[2] // 2
    # 2. grouped GEMM forward, operands quantized outside the timed region
    x_rows, w_cols = quantize_mxfp8_rows(x), quantize_mxfp8_cols(w_gate_up)
    w_gate_up_bf16 = w_gate_up.to(torch.bfloat16)
    fast = time_ms(lambda: mx_grouped_mm_triton(x_rows, w_cols, offsets, out_dtype=torch.bfloat16), repeats=repeats)
    base = time_ms(lambda: torch._grouped_mm(x, w_gate_up_bf16, offs=offsets[1:]), repeats=repeats)
    check = sqnr_db(ref.mx_grouped_mm_emulated(x_rows, w_cols, offsets), mx_grouped_mm_triton(x_rows, w_cols, offsets))
    flops = 2.0 * tokens * d_model * 2 * d_ff
    report("grouped GEMM fwd (gate+up)", fast, base, flops, "TFLOP/s",
           f"vs emulated {check:.0f} dB")

    # 2b. the forward as the layer runs it: the weight quantized from a K-major copy [E, N, K] (FP8 tensor
    # cores take only K-major operands), multiplied as x @ w_t[e].T by the dgrad launcher
    w_t_rows = quantize_mxfp8_rows(w_gate_up.transpose(1, 2).contiguous())
    fast = time_ms(lambda: mx_grouped_mm_dgrad_triton(x_rows, w_t_rows, offsets, out_dtype=torch.bfloat16),
                   repeats=repeats)
    check = sqnr_db(mx_grouped_mm_triton(x_rows, w_cols, offsets), mx_grouped_mm_dgrad_triton(x_rows, w_t_rows, offsets))
    report("grouped GEMM fwd, K-major w", fast, base, flops, "TFLOP/s", f"vs N-major kernel {check:.0f} dB")

    # 2c. the Hopper recipe (1x128 activations, 128x128 weights, fp32 scales), K-major weight copy
    x_blocks = quantize_fp8_blockwise_activations(x)
    w_t_blocks = quantize_fp8_blockwise_weights(w_gate_up.transpose(1, 2).contiguous())
    fast = time_ms(lambda: fp8_blockwise_grouped_mm_dgrad(x_blocks, w_t_blocks, offsets, out_dtype=torch.bfloat16),
                   repeats=repeats)
    exact = torch.cat([x[a:b].float() @ w_gate_up[e] for e, (a, b) in enumerate(zip(
        offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))])
    check = sqnr_db(exact, fp8_blockwise_grouped_mm_dgrad(x_blocks, w_t_blocks, offsets))
    report("Hopper-recipe fwd, K-major w", fast, base, flops, "TFLOP/s", f"vs fp32 {check:.1f} dB")
    return flops


def _bench_wgrad(x, offsets, d_ff: int, flops: float, generator, repeats: int) -> None:
    """3. The grouped weight gradient against bf16 torch._grouped_mm along the reduction."""
    tokens = x.shape[0]
    dy = torch.randn(tokens, 2 * d_ff, generator=generator).to(DEVICE, torch.bfloat16)
    x_cols = quantize_mxfp8_cols(x, offsets=offsets)
    dy_cols = quantize_mxfp8_cols(dy, offsets=offsets)
    fast = time_ms(lambda: mx_grouped_wgrad_triton(x_cols, dy_cols, offsets), repeats=repeats)
    x_t = x.t()
    base = time_ms(lambda: torch._grouped_mm(x_t, dy, offs=offsets[1:]), repeats=repeats)
    check = sqnr_db(ref.mx_grouped_wgrad_emulated(x_cols, dy_cols, offsets), mx_grouped_wgrad_triton(x_cols, dy_cols, offsets))
    report("grouped wgrad (gate+up)", fast, base, flops, "TFLOP/s",
           f"vs emulated {check:.0f} dB")


def _bench_layer(x, offsets, weights, w_gate_up, grad, repeats: int) -> None:
    """4. The MoE SwiGLU expert layer, forward + backward, MXFP8 on Triton against bf16 (gate and up fused)."""
    w_gate, w_up, w_down = weights
    tokens, d_model, d_ff = x.shape[0], x.shape[1], w_gate.shape[2]
    leaves = [t.detach().clone().requires_grad_() for t in (x, *weights)]

    def mxfp8_layer():
        out = grouped_swiglu(leaves[0], offsets, *leaves[1:], precision="mxfp8", backend="triton")
        out.backward(grad)

    bf16_leaves = [
        t.detach().to(torch.bfloat16).contiguous().requires_grad_()
        for t in (x, w_gate_up, w_down)
    ]

    def bf16_layer():
        out = bf16_swiglu_grouped_mm(bf16_leaves[0], offsets, bf16_leaves[1], bf16_leaves[2])
        out.backward(grad)

    fast = time_ms(mxfp8_layer, repeats=repeats)
    base = time_ms(bf16_layer, repeats=repeats)
    with torch.no_grad():
        reference_out = grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="mxfp8", backend="reference")
        triton_out = grouped_swiglu(x, offsets, w_gate, w_up, w_down, precision="mxfp8", backend="triton")
    check = sqnr_db(reference_out.float(), triton_out.float())
    layer_flops = 3 * (2.0 * tokens * d_model * 3 * d_ff)  # forward + 2x for backward
    report("MoE SwiGLU layer fwd+bwd", fast, base, layer_flops, "TFLOP/s",
           f"vs reference path {check:.0f} dB")
    if ON_GPU:
        verdict = "met" if base / fast >= 1.5 else "NOT met"
        print(f"goal: MoE layer fwd+bwd >= 1.5x bf16 grouped matmul -> {base / fast:.2f}x, {verdict}")


if __name__ == "__main__":
    main()
