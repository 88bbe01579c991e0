"""The host's handle on one local sandbox: its init process (``sandboxes/_holder.py``), the
workspace fd the host reads and writes through, its network helper and its cgroup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from sandboxes import proc
from sandboxes.cgroups import SandboxCgroup


class HolderProcess:
    """A running sandbox init process and the workspace fd the host uses."""

    def __init__(self, pid: int, start_time: int | None, workspace_fd: int,
                 network: subprocess.Popen[bytes] | None = None, cgroup: SandboxCgroup | None = None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.workspace_fd = workspace_fd
        self.network = network
        self.cgroup = cgroup

    def alive(self) -> bool:
        if not proc.alive(self.pid, self.start_time):
            return False
        # A dying init drops its namespaces first, then waits for the rest of the sandbox to die.
        try:
            os.readlink(f"/proc/{self.pid}/ns/mnt")
        except OSError:
            return False
        return True

    def kill(self) -> None:
        if self.workspace_fd >= 0:
            os.close(self.workspace_fd)
            self.workspace_fd = -1
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.network is not None:
            self.network.kill()
            self.network.wait()
            self.network = None
        deadline = time.monotonic() + 5.0
        while self.alive() and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            time.sleep(0.005)
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
