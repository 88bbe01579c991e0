"""Compile every Triton kernel of this package for a GPU architecture, without a GPU.

Triton can lower a kernel all the way to PTX and a cubin for a target it is not running on, so a CPU-only
machine can still prove that the GPU path compiles and uses the intended instructions (FP8 tensor-core
``wgmma ... e4m3`` on Hopper, ``mma ... e4m3`` on Ada, the saturating ``cvt.rn.satfinite.e4m3x2.f32`` conversion). Run

    python -m kernels.compile_check --arch 90

It must run in a process where TRITON_INTERPRET is unset: under the interpreter ``@triton.jit`` returns
interpreted functions, which cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of a kernel to compile."""

    name: str
    """Label used in the report."""

    module: str
    """Module holding the @triton.jit function."""

    function: str
    """Name of the @triton.jit function."""

    signature: dict[str, str]
    """Triton type of each runtime argument ("*u8", "i32", ...), in order; constexprs listed as "constexpr"."""

    constexprs: dict[str, object] = field(default_factory=dict)
    """Values of the constexpr arguments."""


def _gemm_signature(out_type: str, scale_type: str) -> dict[str, str]:
    signature = {
        "a_ptr": "*u8", "a_scales_ptr": scale_type, "b_ptr": "*u8", "b_scales_ptr": scale_type, "out_ptr": out_type,
        "tile_row_start_ptr": "*i32", "tile_row_end_ptr": "*i32", "tile_group_ptr": "*i32",
    }
    for name in (
        "n_cols", "reduction", "stride_a_row", "stride_as_row", "stride_b_e", "stride_b_k", "stride_b_n",
        "stride_bs_e", "stride_bs_k", "stride_bs_n",
    ):
        signature[name] = "i32"
    return signature


def _wgrad_signature(scale_type: str) -> dict[str, str]:
    signature = {
        "a_ptr": "*u8", "a_scales_ptr": scale_type, "g_ptr": "*u8", "g_scales_ptr": scale_type, "out_ptr": "*fp32",
        "offsets_ptr": "*i32", "block_base_ptr": "*i32", "n_k": "i32", "n_n": "i32", "stride_a_row": "i32",
        "stride_g_row": "i32",
    }
    signature.update(dict.fromkeys(("BLOCK_K", "BLOCK_N", "TOKEN_BLOCK", "SCALES_E8M0", "DOT_MODE"), "constexpr"))
    return signature


def kernel_variants(dot_mode: int) -> list[KernelVariant]:
    constexpr = "constexpr"
    gemm_flags = {"BLOCK_M": 64, "BLOCK_N": 64, "DOT_MODE": dot_mode}
    return [
        KernelVariant(
            "quantize_rows", "kernels.quantize_mxfp8", "_quantize_rows_kernel",
            {"x_ptr": "*bf16", "data_ptr": "*u8", "scales_ptr": "*u8", "n_rows": "i32", "n_cols": "i32",
             "stride_x_row": "i32", "BLOCK_ROWS": constexpr, "RCEIL": constexpr},
            {"BLOCK_ROWS": 32, "RCEIL": True},
        ),
        KernelVariant(
            "quantize_cols_grouped", "kernels.quantize_mxfp8", "_quantize_cols_kernel",
            {"x_ptr": "*fp32", "data_ptr": "*u8", "scales_ptr": "*u8", "block_row_start_ptr": "*i32",
             "block_row_end_ptr": "*i32", "n_rows": "i32", "n_cols": "i32", "stride_x_row": "i32",
             "GROUPED": constexpr, "BLOCK_COLS": constexpr, "RCEIL": constexpr},
            {"GROUPED": True, "BLOCK_COLS": 64, "RCEIL": False},
        ),
        KernelVariant(
            "dequantize", "kernels.quantize_mxfp8", "_dequantize_kernel",
            {"data_ptr": "*u8", "scales_ptr": "*u8", "scale_row_of_row_ptr": "*i32", "out_ptr": "*bf16",
             "n_rows": "i32", "n_cols": "i32", "stride_scales_row": "i32", "COLS_PER_SCALE": constexpr,
             "BLOCK_ROWS": constexpr, "BLOCK_COLS": constexpr},
            {"COLS_PER_SCALE": 32, "BLOCK_ROWS": 32, "BLOCK_COLS": 64},
        ),
        KernelVariant(
            "grouped_gemm_mxfp8", "kernels.grouped_gemm_mxfp8", "_grouped_gemm_kernel",
            {**_gemm_signature("*bf16", "*u8"), **dict.fromkeys(
                ("BLOCK_M", "BLOCK_N", "SCALE_BLOCK_K", "SCALE_BLOCK_N", "SCALES_E8M0", "DOT_MODE"), constexpr)},
            {**gemm_flags, "SCALE_BLOCK_K": 32, "SCALE_BLOCK_N": 1, "SCALES_E8M0": True},
        ),
        KernelVariant(
            "grouped_gemm_hopper_blockwise", "kernels.grouped_gemm_mxfp8", "_grouped_gemm_kernel",
            {**_gemm_signature("*fp32", "*fp32"), **dict.fromkeys(
                ("BLOCK_M", "BLOCK_N", "SCALE_BLOCK_K", "SCALE_BLOCK_N", "SCALES_E8M0", "DOT_MODE"), constexpr)},
            {**gemm_flags, "SCALE_BLOCK_K": 128, "SCALE_BLOCK_N": 128, "SCALES_E8M0": False},
        ),
        KernelVariant(
            "grouped_wgrad_mxfp8", "kernels.grouped_wgrad_mxfp8", "_grouped_wgrad_kernel",
            _wgrad_signature("*u8"),
            {"BLOCK_K": 64, "BLOCK_N": 64, "TOKEN_BLOCK": 32, "SCALES_E8M0": True, "DOT_MODE": dot_mode},
        ),
        KernelVariant(
            "grouped_wgrad_hopper_blockwise", "kernels.grouped_wgrad_mxfp8", "_grouped_wgrad_kernel",
            _wgrad_signature("*fp32"),
            {"BLOCK_K": 64, "BLOCK_N": 64, "TOKEN_BLOCK": 128, "SCALES_E8M0": False, "DOT_MODE": dot_mode},
        ),
    ]


def compile_all(arch: int) -> dict[str, dict[str, object]]:
    """Compile each variant for sm_<arch>; return per kernel the stages produced and notable instructions."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset (interpreted kernels cannot be compiled).")
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.grouped_gemm_mxfp8 import DOT_FP8

    if arch < 89:
        raise ValueError(f"sm_{arch} has no E4M3 type in Triton; the FP8 kernels target sm_89 and newer.")
    dot_mode = DOT_FP8
    report: dict[str, dict[str, object]] = {}
    for variant in kernel_variants(dot_mode):
        function = getattr(importlib.import_module(variant.module), variant.function)
        source = ASTSource(fn=function, signature=variant.signature, constexprs=variant.constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        ptx = compiled.asm["ptx"]
        report[variant.name] = {
            "stages": sorted(compiled.asm),
            "mma": sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[a-z0-9.]*", ptx))),
            "fp8_converts": sorted(set(re.findall(r"cvt\.[a-z.]*e4m3[a-z0-9.]*", ptx))),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", type=int, action="append", help="compute capability as an integer, repeatable: 89 = Ada, 90 = Hopper"
    )
    args = parser.parse_args(argv)
    print(json.dumps({f"sm_{arch}": compile_all(arch) for arch in args.arch or [90]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
