"""The CPU features that decide how an encoder's low-precision kernels compute, read once per process.

An int8 matrix product is exact in int32 on CPUs with VNNI or AMX, while AVX2 and AVX-512 without VNNI sum
pairs of u8 x s8 products in saturating 16-bit lanes; bfloat16 kernels exist only where the CPU has them. So
int8 and bfloat16 vectors made on CPUs of different classes need not agree, and an index records the class
that built it (``sandboxes.semantic.index``).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

RELEVANT_FLAGS = (
    "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_int8", "amx_bf16",
)
"""The ``/proc/cpuinfo`` flags an index records: those that select the int8, bfloat16 and f32 kernels."""


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The relevant flags of the first processor in ``cpuinfo`` (the text of ``/proc/cpuinfo``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split()) & frozenset(RELEVANT_FLAGS)
    return frozenset()


def isa_class(flags: frozenset[str], *, machine: str = "x86_64") -> str:
    """The kernel family ``flags`` select: the int8 product's instructions, then ``-bf16`` where bfloat16 is native."""
    if machine.lower() not in ("x86_64", "amd64"):
        return machine.lower()  # not x86: OpenVINO and ONNX Runtime use other kernels altogether
    if "amx_int8" in flags:
        family = "amx"
    elif "avx512_vnni" in flags:
        family = "avx512-vnni"
    elif "avx512bw" in flags:
        family = "avx512"
    elif "avx_vnni" in flags:
        family = "avx2-vnni"
    elif "avx2" in flags:
        family = "avx2"
    else:
        family = "x86-64"
    return f"{family}-bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else family


@functools.cache
def this_cpu() -> tuple[str, tuple[str, ...]]:
    """(ISA class, relevant flags) of this machine's CPU; without ``/proc/cpuinfo`` the class is the machine type."""
    source = Path("/proc/cpuinfo")
    flags = cpu_flags(source.read_text(errors="replace")) if source.is_file() else frozenset()
    machine = platform.machine() or "unknown"
    if not flags and machine.lower() in ("x86_64", "amd64"):
        machine = f"{machine.lower()}-unlisted"  # flags unknown: never taken for a known class
    return isa_class(flags, machine=machine), tuple(sorted(flags))
