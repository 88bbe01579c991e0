"""Which device a Ray actor of an RL run computes on, and whether the cluster can place the GPUs a run asks for.

A run's learner and inference actors ask Ray for GPUs through AsyncRLConfig.learner_gpus / inference_gpus.
Ray then sets CUDA_VISIBLE_DEVICES in the actor's process to the GPUs it assigned, so the actor's first
visible CUDA device is its own. An actor that Ray gave GPUs but whose torch sees no CUDA (a CPU build of
torch on a GPU node, or GPUs declared to Ray that the node does not have) fails at once with a message that
says so, rather than training on the CPU while holding a GPU. With no GPUs asked for, everything runs on
the CPU exactly as before.

On a CUDA device the policy keeps fp32 master weights and computes its expert matmuls in bf16 unless the run
names another precision ("mxfp8" runs the Triton kernels of kernels/), as benchmarks/bench_gpu_rl.py does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import time: the web process validates launch configs with gpu_request_problem
    import torch

GPU_PRECISION = "bf16"
"""Expert-matmul precision of a policy on a CUDA device when the run names none (fp32 master weights)."""

MAX_GPUS_PER_ACTOR = 8
"""Most GPUs one actor may ask for (one node's worth)."""


class DeviceError(RuntimeError):
    """An actor was given GPUs it cannot use, or a run asks for GPUs its Ray cluster does not have."""


def gpu_request_problem(name: str, value: object) -> str | None:
    """Why `value` is not a valid GPU count for one actor (None when it is): a finite number in
    [0, MAX_GPUS_PER_ACTOR], a fraction of one GPU or a whole number of them (Ray's rule)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} must be a number of GPUs, got {value!r}"
    if not math.isfinite(value) or not 0 <= value <= MAX_GPUS_PER_ACTOR:
        return f"{name} must be between 0 and {MAX_GPUS_PER_ACTOR} (0: CPU only), got {value!r}"
    if value > 1 and value != int(value):
        return f"{name} above 1 must be a whole number of GPUs (Ray shares only one GPU by fractions), got {value!r}"
    return None


def actor_device(*, gpus: float, role: str) -> torch.device:
    """The device of an actor that asked Ray for `gpus` GPUs (CPU for 0); DeviceError if it cannot use them."""
    import torch

    if gpus == 0:
        return torch.device("cpu")
    import ray

    assigned = ray.get_gpu_ids() if ray.is_initialized() else []
    if not torch.cuda.is_available():
        raise DeviceError(
            f"the {role} asked for {gpus:g} GPU(s) and Ray assigned it {assigned or 'none'}, but torch in its "
            f"process sees no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            f"install a CUDA build of torch on that node, or set the {role}'s GPUs to 0"
        )
    return torch.device("cuda", 0)


def policy_precision(device: torch.device, precision: str | None) -> str | None:
    """The expert precision a policy on `device` runs with: the run's own, else bf16 on CUDA, else the checkpoint's."""
    if precision is None and device.type == "cuda":
        return GPU_PRECISION
    return precision


def cluster_gpus_check(*, needed: float, available: float, detail: str) -> None:
    """DeviceError unless the cluster's GPUs cover `needed` (Ray would otherwise leave the actors pending
    forever, the run waiting on them without a word)."""
    if needed > available + 1e-9:
        raise DeviceError(
            f"this run asks Ray for {needed:g} GPU(s) ({detail}) but the cluster has {available:g}; lower "
            "learner_gpus / inference_gpus, or join a cluster with GPU nodes (ray_address)"
        )
