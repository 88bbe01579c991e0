"""Per-sandbox CPU and memory, the same way for every backend: by PID namespace.

Each sandbox (local or Docker) has its own PID namespace, and every process of the sandbox,
including commands entered later with nsenter or docker exec, lives in it. One pass over the host's
processes groups them by namespace, so a heartbeat costs one scan however many sandboxes run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class SandboxUsage:
    cpu_percent: float
    """CPU use since the previous sample, percent of one core (200 = two cores busy)."""
    memory_mb: float
    """Resident memory of the sandbox's processes, MiB."""


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


class SandboxUsageSampler:
    """Turns successive scans into CPU percentages; not thread-safe (one heartbeat thread uses it)."""

    def __init__(self) -> None:
        self._previous: dict[str, tuple[float, float]] = {}

    def sample(self, init_pids: dict[str, int]) -> dict[str, SandboxUsage]:
        """Usage of each sandbox, given the host pid of a process inside it (its init)."""
        by_namespace: dict[str, str] = {}
        for sandbox_id, pid in init_pids.items():
            namespace = _pid_namespace(pid)
            if namespace is not None:
                by_namespace[namespace] = sandbox_id
        cpu_seconds = dict.fromkeys(by_namespace.values(), 0.0)
        rss = dict.fromkeys(by_namespace.values(), 0)
        if by_namespace:
            for process in psutil.process_iter():
                owner = by_namespace.get(_pid_namespace(process.pid) or "")
                if owner is None:
                    continue
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        cpu_seconds[owner] += times.user + times.system
                        rss[owner] += process.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        now = time.monotonic()
        usage: dict[str, SandboxUsage] = {}
        current: dict[str, tuple[float, float]] = {}
        for sandbox_id, seconds in cpu_seconds.items():
            current[sandbox_id] = (now, seconds)
            before = self._previous.get(sandbox_id)
            percent = 0.0
            if before is not None and now > before[0]:
                # Exited processes take their CPU time with them; never report a negative rate.
                percent = max(0.0, (seconds - before[1]) / (now - before[0]) * 100.0)
            usage[sandbox_id] = SandboxUsage(cpu_percent=round(percent, 1), memory_mb=round(rss[sandbox_id] / 2**20, 1))
        self._previous = current
        return usage
