"""MoE expert feed-forward (SwiGLU) over tokens sorted by expert, in fp32, bf16 or MXFP8.

``grouped_swiglu(x, offsets, w_gate, w_up, w_down, *, precision)`` is the entry point the model's
``MoEFeedForward`` calls. For expert ``e`` with rows ``x[offsets[e]:offsets[e+1]]``::

    out = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]

precision="fp32": fp32 grouped matmuls. precision="bf16": bf16 compute. precision="mxfp8": every GEMM
takes MXFP8 operands with fp32 accumulation, through a custom autograd.Function whose backward
quantizes along the reduction axis of each backward GEMM *from the high-precision tensors*:

=========  ===============================  ===========================================
GEMM       left operand                     right operand
=========  ===============================  ===========================================
forward    activations, 1x32 along K        weights, 32x1 along K, stored K-major [E, N, K]
dgrad      output grad, 1x32 along N        weights [E, K, N], 1x32 along N (transposed)
wgrad      activations, 32x1 along tokens   output grad, 32x1 along tokens (per expert)
=========  ===============================  ===========================================

The forward weight is quantized from a transposed copy ([E, N, K], 1x32 along K: the same blocks and
bits as 32x1 along K of [E, K, N]) and multiplied as ``x @ w_t[e].T``: FP8 tensor cores on Hopper take
only K-major operands, and with N-major weights the kernel ran at a fraction of the speed
(docs/notebook/kernels.md).

Where the GEMMs run ("backend"): "reference" dequantizes the MXFP8 operands and multiplies in fp32
with PyTorch (identical quantization bits, so CPU training has the same numerics as the GPU);
"triton" runs the Triton kernels (on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` for tests);
"auto" (default) picks triton on CUDA GPUs with FP8 support (sm_89+) and reference elsewhere. The environment variable
``FLOWSTATE_MXFP8_BACKEND`` overrides "auto".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kernels import grouped_gemm_reference as gemm_ref
from kernels.mx_format import (
    MX_BLOCK,
    MXTensor,
    ScaleMode,
    check_offsets,
    quantize_mxfp8_cols_reference,
    quantize_mxfp8_rows_reference,
)

Precision = Literal["fp32", "bf16", "mxfp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "mxfp8")
Backend = Literal["auto", "reference", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")
BACKEND_ENV_VAR = "FLOWSTATE_MXFP8_BACKEND"


@dataclass(frozen=True)
class GroupedSwiGLUConfig:
    """How ``grouped_swiglu`` computes the expert feed-forward."""

    precision: Precision = "fp32"
    """Numeric format of the expert GEMMs: "fp32", "bf16" or "mxfp8" (OCP MX, E4M3 + E8M0 per 32)."""

    scale_mode: ScaleMode | str = ScaleMode.RCEIL
    """MXFP8 only: "rceil" (amax/448 rounded up to a power of two, never saturates) or "floor" (OCP)."""

    backend: Backend | None = None
    """MXFP8 only: "reference", "triton" or "auto"; None reads FLOWSTATE_MXFP8_BACKEND (default auto)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is unknown; use one of {PRECISIONS}.")
        object.__setattr__(self, "scale_mode", ScaleMode.parse(self.scale_mode))
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; use one of {BACKENDS}.")

    def resolved_backend(self, device: torch.device) -> str:
        """The backend that will actually run on ``device``, with a clear error if it cannot."""
        backend = self.backend or os.environ.get(BACKEND_ENV_VAR, "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV_VAR}={backend!r} is unknown; use one of {BACKENDS}.")
        if backend == "auto":
            if device.type != "cuda" or not _triton_importable():
                return "reference"
            from kernels.grouped_gemm_mxfp8 import cuda_supports_fp8_kernels

            return "triton" if cuda_supports_fp8_kernels(device) else "reference"
        if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' on a CPU tensor needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported, or use backend='reference' (same numerics)."
            )
        return backend


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class MXFP8Ops:
    """The four MXFP8 primitives the expert layer needs, from one backend."""

    quantize_rows: Callable[..., MXTensor]
    quantize_cols: Callable[..., MXTensor]
    grouped_mm_nt: Callable[[MXTensor, MXTensor, torch.Tensor], torch.Tensor]
    """``a[rows of e] @ b[e].T`` with both operands 1x32 along the reduction: the forward (b = the
    K-major weight copy) and dgrad (b = the weight itself) GEMMs."""
    grouped_wgrad: Callable[[MXTensor, MXTensor, torch.Tensor], torch.Tensor]


REFERENCE_OPS = MXFP8Ops(
    quantize_rows=quantize_mxfp8_rows_reference,
    quantize_cols=quantize_mxfp8_cols_reference,
    grouped_mm_nt=gemm_ref.mx_grouped_mm_dgrad_emulated,
    grouped_wgrad=gemm_ref.mx_grouped_wgrad_emulated,
)


def mxfp8_ops(backend: str) -> MXFP8Ops:
    if backend == "reference":
        return REFERENCE_OPS
    from kernels.grouped_gemm_mxfp8 import mx_grouped_mm_dgrad_triton
    from kernels.grouped_wgrad_mxfp8 import mx_grouped_wgrad_triton
    from kernels.quantize_mxfp8 import quantize_mxfp8_cols, quantize_mxfp8_rows

    return MXFP8Ops(
        quantize_rows=quantize_mxfp8_rows,
        quantize_cols=quantize_mxfp8_cols,
        grouped_mm_nt=mx_grouped_mm_dgrad_triton,
        grouped_wgrad=mx_grouped_wgrad_triton,
    )


def _quantize_k_major(ops: MXFP8Ops, weight: torch.Tensor, scale_mode: ScaleMode) -> MXTensor:
    """[E, K, N] weight -> MXFP8 [E, N, K] with 1x32 blocks along K, for ``x @ w_t[e].T``."""
    return ops.quantize_rows(weight.transpose(1, 2).contiguous(), scale_mode=scale_mode)


class MXFP8GroupedSwiGLU(torch.autograd.Function):
    """SwiGLU experts with MXFP8 GEMMs; gate and up projections share one GEMM ([E, D, 2F])."""

    @staticmethod
    def forward(ctx, x, offsets, w_gate, w_up, w_down, ops: MXFP8Ops, scale_mode: ScaleMode):
        # Under the model's bf16 autocast the emulated GEMMs would silently run in bf16; MXFP8 GEMMs
        # accumulate and return fp32, so autocast is switched off inside the layer.
        with torch.autocast(device_type=x.device.type, enabled=False):
            return MXFP8GroupedSwiGLU._forward(ctx, x, offsets, w_gate, w_up, w_down, ops, scale_mode)

    @staticmethod
    def _forward(ctx, x, offsets, w_gate, w_up, w_down, ops: MXFP8Ops, scale_mode: ScaleMode):
        d_ff = w_gate.shape[2]
        w_gate_up = torch.cat([w_gate, w_up], dim=2)
        x_rows = ops.quantize_rows(x, scale_mode=scale_mode)
        gate_up = ops.grouped_mm_nt(x_rows, _quantize_k_major(ops, w_gate_up, scale_mode), offsets)
        gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
        hidden = F.silu(gate) * up
        hidden_rows = ops.quantize_rows(hidden, scale_mode=scale_mode)
        out = ops.grouped_mm_nt(hidden_rows, _quantize_k_major(ops, w_down, scale_mode), offsets)
        ctx.save_for_backward(x, offsets, w_gate_up, w_down, gate_up)
        ctx.ops, ctx.scale_mode, ctx.weight_dtypes = ops, scale_mode, (w_gate.dtype, w_up.dtype, w_down.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return MXFP8GroupedSwiGLU._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, offsets, w_gate_up, w_down, gate_up = ctx.saved_tensors
        ops, mode = ctx.ops, ctx.scale_mode
        d_ff = w_down.shape[1]
        gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
        sig = torch.sigmoid(gate)
        silu_gate = gate * sig
        hidden = silu_gate * up
        grad_out = grad_out.to(torch.float32)

        grad_hidden = ops.grouped_mm_nt(
            ops.quantize_rows(grad_out, scale_mode=mode), ops.quantize_rows(w_down, scale_mode=mode), offsets
        )
        grad_w_down = None
        if ctx.needs_input_grad[4]:
            grad_w_down = ops.grouped_wgrad(
                ops.quantize_cols(hidden, offsets=offsets, scale_mode=mode),
                ops.quantize_cols(grad_out, offsets=offsets, scale_mode=mode),
                offsets,
            ).to(ctx.weight_dtypes[2])

        grad_gate = grad_hidden * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = grad_hidden * silu_gate
        grad_gate_up = torch.cat([grad_gate, grad_up], dim=1)

        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ops.grouped_mm_nt(
                ops.quantize_rows(grad_gate_up, scale_mode=mode),
                ops.quantize_rows(w_gate_up, scale_mode=mode),
                offsets,
            ).to(x.dtype)
        grad_w_gate = grad_w_up = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            grad_w_gate_up = ops.grouped_wgrad(
                ops.quantize_cols(x, offsets=offsets, scale_mode=mode),
                ops.quantize_cols(grad_gate_up, offsets=offsets, scale_mode=mode),
                offsets,
            )
            grad_w_gate = grad_w_gate_up[:, :, :d_ff].to(ctx.weight_dtypes[0])
            grad_w_up = grad_w_gate_up[:, :, d_ff:].to(ctx.weight_dtypes[1])
        return grad_x, None, grad_w_gate, grad_w_up, grad_w_down, None, None


# The unquantized precisions and the dtype their GEMMs run in.
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def swiglu_every_expert(x, w_gate, w_up, w_down, *, precision: str) -> torch.Tensor:
    """Every expert on every row, without dispatch: [E, T, d_model] in x's dtype (fp32/bf16 only).

    For tiny generation batches, where the sort / gather / per-expert loop of ``grouped_swiglu`` cost
    more than the extra rows; the caller mixes the E outputs with its top-k weights.
    """
    compute_dtype = _COMPUTE_DTYPES[precision]
    rows = x.to(compute_dtype).unsqueeze(0).expand(w_gate.shape[0], *x.shape)
    gate = torch.bmm(rows, w_gate.to(compute_dtype))
    up = torch.bmm(rows, w_up.to(compute_dtype))
    return torch.bmm(F.silu(gate) * up, w_down.to(compute_dtype)).to(x.dtype)


# torch._grouped_mm runs every group in one call (no Python loop); its CPU backward fails on empty
# groups in torch 2.13, so it serves only passes that build no autograd graph. A module switch so that
# benchmarks/bench_expert_paths.py can measure both paths in one process.
USE_GROUPED_MM_WITHOUT_AUTOGRAD = True


def _grouped_mm_usable(*tensors: torch.Tensor) -> bool:
    return USE_GROUPED_MM_WITHOUT_AUTOGRAD and not (
        torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
    )


def _grouped_swiglu_dense(x, offsets, w_gate, w_up, w_down, compute_dtype: torch.dtype) -> torch.Tensor:
    if _grouped_mm_usable(x, w_gate, w_up, w_down):
        rows = x.to(compute_dtype)
        ends = offsets[1:].to(torch.int32)
        gate = torch._grouped_mm(rows, w_gate.to(compute_dtype), offs=ends)
        up = torch._grouped_mm(rows, w_up.to(compute_dtype), offs=ends)
        return torch._grouped_mm(F.silu(gate) * up, w_down.to(compute_dtype), offs=ends).to(x.dtype)
    bounds = offsets.tolist()
    pieces = []
    for expert in range(w_gate.shape[0]):
        rows = x[bounds[expert] : bounds[expert + 1]].to(compute_dtype)
        if rows.shape[0] == 0:
            continue
        gate = rows @ w_gate[expert].to(compute_dtype)
        up = rows @ w_up[expert].to(compute_dtype)
        pieces.append(((F.silu(gate) * up) @ w_down[expert].to(compute_dtype)).to(x.dtype))
    if not pieces:
        # Keep the graph connected so an all-empty batch still yields (zero) weight gradients.
        return x.new_zeros(x.shape) + 0.0 * (x.sum() + w_gate.sum() + w_up.sum() + w_down.sum()).to(x.dtype)
    return torch.cat(pieces)


def _check_shapes(x, offsets, w_gate, w_up, w_down, precision: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, d_model], got shape {tuple(x.shape)}.")
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape:
        raise ValueError(
            f"w_gate and w_up must both be [E, d_model, d_ff]; got {tuple(w_gate.shape)} and {tuple(w_up.shape)}."
        )
    n_experts, d_model, d_ff = w_gate.shape
    if w_down.shape != (n_experts, d_ff, d_model):
        raise ValueError(f"w_down must be [E, d_ff, d_model] = {(n_experts, d_ff, d_model)}, got {tuple(w_down.shape)}.")
    if x.shape[1] != d_model:
        raise ValueError(f"x has d_model={x.shape[1]} but the expert weights have d_model={d_model}.")
    if offsets.shape != (n_experts + 1,):
        raise ValueError(f"offsets must be [E+1] = [{n_experts + 1}] cumulative row counts, got {tuple(offsets.shape)}.")
    check_offsets(offsets, x.shape[0])
    if precision == "mxfp8" and (d_model % MX_BLOCK or d_ff % MX_BLOCK):
        raise ValueError(
            f"precision='mxfp8' needs d_model and d_ff to be multiples of {MX_BLOCK} (one scale per {MX_BLOCK} "
            f"values); got d_model={d_model}, d_ff={d_ff}."
        )


def grouped_swiglu(
    x: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    precision: str,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
    backend: str | None = None,
) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert; returns [T, d_model] in x's dtype.

    x: [T, d_model]; offsets: int32 [E+1] cumulative row offsets (empty groups allowed);
    w_gate, w_up: [E, d_model, d_ff]; w_down: [E, d_ff, d_model]; precision: "fp32" | "bf16" | "mxfp8".
    """
    config = GroupedSwiGLUConfig(precision=precision, scale_mode=scale_mode, backend=backend)
    _check_shapes(x, offsets, w_gate, w_up, w_down, config.precision)
    if config.precision in _COMPUTE_DTYPES:
        return _grouped_swiglu_dense(x, offsets, w_gate, w_up, w_down, _COMPUTE_DTYPES[config.precision])
    ops = mxfp8_ops(config.resolved_backend(x.device))
    return MXFP8GroupedSwiGLU.apply(
        x, offsets.to(torch.int32), w_gate, w_up, w_down, ops, config.scale_mode
    )
