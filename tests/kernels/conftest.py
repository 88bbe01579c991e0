"""Kernel tests run the Triton kernels through the interpreter when no GPU is present.

TRITON_INTERPRET must be set before the kernel modules are imported (``@triton.jit`` decides then
whether to interpret), so it is set here, at collection time, and only when CUDA is unavailable.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
