"""Per-sandbox memory and process-count cgroups (cgroup v1), nested under this process's own cgroups.

rlimits bound each process; a cgroup bounds the sandbox as a whole (every process plus the tmpfs
pages it writes). Nesting under our own cgroup keeps sandboxes inside whatever accounting the
server itself runs under. Only the v1 ``memory`` and ``pids`` hierarchies are used; on hosts
without them (cgroup v2 only, or no write access) ``SandboxCgroup.create`` returns None and the
backend relies on rlimits alone.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids")


def _own_path(controller: str) -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUP_ROOT / controller / path.lstrip("/")
    return None


def cgroups_available() -> bool:
    """True when this process may create v1 memory and pids cgroups below its own."""
    if os.geteuid() != 0:
        return False
    for controller in CONTROLLERS:
        parent = _own_path(controller)
        if parent is None or not (parent / "cgroup.procs").exists() or not os.access(parent, os.W_OK):
            return False
    return True


class SandboxCgroup:
    """The memory and pids cgroups of one sandbox."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths

    @classmethod
    def create(cls, *, name: str, memory_bytes: int, max_processes: int) -> SandboxCgroup | None:
        if not cgroups_available():
            return None
        paths: dict[str, Path] = {}
        try:
            for controller in CONTROLLERS:
                own = _own_path(controller)
                if own is None:
                    raise OSError(f"this process is in no {controller} cgroup")
                path = own / f"flowstate-{name}"
                path.mkdir(exist_ok=True)
                paths[controller] = path
            (paths["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (paths["memory"] / "memory.swappiness").write_text("0")
            (paths["pids"] / "pids.max").write_text(str(max_processes))
        except OSError:
            cls(paths).remove()
            return None
        return cls(paths)

    def add(self, pid: int) -> None:
        for path in self.paths.values():
            (path / "cgroup.procs").write_text(str(pid))

    def command_prefix(self) -> list[str]:
        """argv prefix that joins the cgroups, then execs the rest (so every child starts inside)."""
        joins = " && ".join(f"echo $$ > {shlex.quote(str(p / 'cgroup.procs'))}" for p in self.paths.values())
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "cgroup-enter"]

    def memory_failures(self) -> int:
        try:
            return int((self.paths["memory"] / "memory.failcnt").read_text())
        except (OSError, ValueError, KeyError):
            return 0

    def remove(self) -> None:
        """Remove the cgroup directories, waiting briefly for exiting processes to leave them."""
        deadline = time.monotonic() + 5.0
        for path in self.paths.values():
            while path.exists():
                try:
                    path.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
