"""fp32 matmul of a few rows by a weight read from memory, on the CPU: ``small_mm(x, w, out)``.

A decode step multiplies 1-8 rows by each expert's weights, and those weights come from memory, not from
cache: the step's working set (every expert of every layer, the output weight, the KV cache) is larger
than the L3. MKL's sgemm reads such a weight at about half the speed of a plain streaming read (256 x 512,
1-4 rows, one thread: 51-63 us against 22-25 us for ``w.sum()`` on the 2-core AMD EPYC), so this kernel
does the simplest thing that streams: for each row of ``w`` in memory order, every output row accumulates
``x[m, k] * w[k, :]`` (vectorised over the output columns). That runs at the streaming speed (23-30 us).
It sums over k in order, so results differ from MKL's blocked sums by rounding only.

The C++ is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 30 s, then cached
under TORCH_EXTENSIONS_DIR, per source and per CPU), with ``-march=native``. Where it cannot be built (no
compiler, not x86-64 Linux) or FLOWSTATE_CPU_KERNELS=0, ``small_mm`` is ``torch.mm(x, w, out=out)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import threading
from types import ModuleType

import torch

ENV_VAR = "FLOWSTATE_CPU_KERNELS"
MAX_ROWS = 8
"""Most rows the kernel takes; more go to torch.mm (MKL uses the weight well once rows share it)."""

_SOURCE = r"""
#include <torch/extension.h>

// out[m, :] = sum_k x[m, k] * w[k, :] for x [M, K], w [K, N], out [M, N], all contiguous fp32, M <= 8.
void small_mm_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* o = op + m * N;
    for (int64_t n = 0; n < N; ++n) o[n] = 0.0f;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* row = wp + k * N;
    for (int64_t m = 0; m < M; ++m) {
      const float a = xp[m * K + k];
      float* o = op + m * N;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) o[n] += a * row[n];
    }
  }
}
"""

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def _cpu_tag() -> str:
    """Distinguishes CPUs whose -march=native builds differ (a shared cache must not mix them)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _extension() -> ModuleType | None:
    """The compiled kernel, building it on first use; None where it is disabled or cannot be built."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get(ENV_VAR, "1") != "0" and platform.system() == "Linux" and platform.machine() == "x86_64":
            try:
                from torch.utils.cpp_extension import load_inline

                module = load_inline(
                    f"flowstate_small_mm_{_cpu_tag()}", cpp_sources=_SOURCE, functions=["small_mm_out"],
                    extra_cflags=["-O3", "-march=native"], verbose=False,
                )
            except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
                # no compiler, no headers: the fallback computes the same, only slower
                _log.warning("CPU small-matmul kernel unavailable, using torch.mm: %s", error)
        _state["module"] = module
        return module


def available() -> bool:
    """Whether small_mm runs the compiled kernel (builds it if needed)."""
    return _extension() is not None


def small_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w for fp32 CPU tensors x [M, K], w [K, N], out [M, N]; the kernel for contiguous operands
    and M <= MAX_ROWS, torch.mm otherwise. Returns out."""
    module = _extension()
    usable = (
        module is not None
        and x.shape[0] <= MAX_ROWS
        and x.dtype == w.dtype == out.dtype == torch.float32
        and x.is_contiguous() and w.is_contiguous() and out.is_contiguous()
        and x.device.type == "cpu"
        and x.shape[1] == w.shape[0] and out.shape == (x.shape[0], w.shape[1])
    )
    if usable:
        module.small_mm_out(x, w, out)
        return out
    return torch.mm(x, w, out=out)


if __name__ == "__main__":  # `python -m kernels.cpu_small_mm`: build ahead of first use (make static runs it)
    logging.basicConfig(level=logging.WARNING)
    print(f"kernels.cpu_small_mm: {'compiled kernel' if available() else 'torch.mm fallback'}")
