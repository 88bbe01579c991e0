"""The sandbox contract shared by every backend (local namespaces, Docker, Ray fleet).

Product tasks and RL rollouts talk only to these classes, so an agent sees byte-identical tool
results whichever backend runs it. Paths given to ``Sandbox`` file methods are always relative to
the workspace root (``/workspace`` inside the sandbox); backends must refuse anything that would
resolve outside it (``..``, absolute paths, symlinks or hard links leading out) with
``PathOutsideWorkspace``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Self

WORKSPACE_DIR = "/workspace"
"""Where the workspace is mounted inside every sandbox, whatever the backend."""


class SandboxError(Exception):
    """Base class for every error a sandbox backend raises on purpose."""


class PathOutsideWorkspace(SandboxError):
    """A file path resolves outside the workspace (``..``, absolute, symlink or hard link out)."""


class SandboxLimitExceeded(SandboxError):
    """A resource limit (disk quota, output size, lifetime) was hit."""


class SandboxGone(SandboxError):
    """The sandbox was destroyed, reaped or its lifetime expired; create a new one."""


class SnapshotError(SandboxError):
    """A snapshot could not be built (bad source, failed setup command)."""


class ArchiveRejected(SnapshotError):
    """An archive member is unsafe (absolute path, ``..``, link out, device) or too large/numerous."""


class BackendUnavailable(SandboxError):
    """The backend cannot run on this machine (missing kernel feature, engine or image)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to one sandbox and to every command run in it."""

    cpu_seconds: int = 600
    """CPU seconds one process may consume (RLIMIT_CPU); the process is killed past it."""
    memory_mb: int = 2048
    """Memory in MiB: RLIMIT_AS per process in the local backend (which also caps the whole sandbox at
    memory_mb + disk_mb with a memory cgroup where the host allows), a cgroup limit in Docker."""
    max_processes: int = 256
    """Processes/threads the sandbox user may run at once (fork-bomb guard)."""
    disk_mb: int = 1024
    """Bytes the sandbox may write on top of its snapshot (workspace changes plus /tmp), in MiB."""
    command_timeout_s: float = 120.0
    """Default wall-clock limit for one ``exec``; the whole command process group is killed past it."""
    lifetime_s: float = 3600.0
    """Wall-clock lifetime of the sandbox; after it every process is killed and the sandbox is gone."""
    network: bool = False
    """Allow outbound network. Off: the sandbox has only its own loopback interface."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "max_processes", "disk_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(
                f"SandboxLimits.memory_mb={self.memory_mb} is too small to start a shell; use at least 64"
            )
        if self.max_processes < 4:
            raise ValueError(
                f"SandboxLimits.max_processes={self.max_processes} cannot run a shell pipeline; use at least 4"
            )
        for name in ("command_timeout_s", "lifetime_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number of seconds, got {value!r}")
        if self.command_timeout_s > self.lifetime_s:
            raise ValueError(
                f"SandboxLimits.command_timeout_s={self.command_timeout_s} exceeds lifetime_s={self.lifetime_s}; "
                "raise lifetime_s or lower command_timeout_s"
            )


@dataclass(frozen=True)
class RepoSource:
    """Where the files of a snapshot come from."""

    kind: Literal["git", "path", "archive"]
    """``git``: a URL/path ``git clone`` can reach; ``path``: a local directory; ``archive``: .tar.gz/.tgz/.tar/.zip."""
    location: str
    """The git URL, directory path or archive path."""
    ref: str | None = None
    """For ``git`` only: branch, tag or commit to check out (default: the remote HEAD)."""

    def __post_init__(self) -> None:
        if self.kind not in ("git", "path", "archive"):
            raise ValueError(f"RepoSource.kind must be 'git', 'path' or 'archive', got {self.kind!r}")
        if not isinstance(self.location, str) or not self.location.strip():
            raise ValueError("RepoSource.location must be a non-empty string")
        if self.ref is not None and self.kind != "git":
            raise ValueError(f"RepoSource.ref only applies to kind='git', not {self.kind!r}")


@dataclass(frozen=True)
class Snapshot:
    """An immutable workspace image that sandboxes are created or forked from."""

    id: str
    """Stable identifier, unique per backend."""
    backend: str
    """Name of the backend that built it (``local``, ``docker``)."""
    source: RepoSource
    """What the files were taken from."""
    image: str | None
    """Container image for backends that use one; ``None`` for the local backend."""
    setup_commands: tuple[str, ...]
    """Commands run once, in order, in a sandbox over the files before they were frozen."""
    location: str
    """Backend-specific handle: the frozen directory (local) or the committed image tag (docker)."""
    created_at: float = field(default_factory=time.time)
    """Unix time the snapshot was finished."""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command run inside a sandbox."""

    exit_code: int
    """Process exit status; negative when killed by a signal (``-9`` after a timeout)."""
    stdout: str
    """Standard output, decoded as UTF-8 with replacement characters."""
    stderr: str
    """Standard error, decoded as UTF-8 with replacement characters."""
    timed_out: bool
    """True when the command hit its wall-clock limit and was killed."""
    duration_s: float
    """Wall-clock seconds the command ran."""


@dataclass(frozen=True)
class DirEntry:
    """One entry of ``Sandbox.list_dir``."""

    name: str
    """File name inside the listed directory."""
    kind: Literal["file", "dir", "symlink", "other"]
    """Entry type, not following symlinks."""
    size: int
    """Size in bytes (0 for directories)."""


class Sandbox(abc.ABC):
    """One isolated, resource-limited workspace with its own processes."""

    id: str
    snapshot: Snapshot
    limits: SandboxLimits

    @abc.abstractmethod
    def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c`` in the workspace as the unprivileged sandbox user.

        ``timeout_s`` defaults to ``limits.command_timeout_s``; past it the command and all its
        children are killed and ``timed_out`` is set. Raises ``SandboxGone`` if the sandbox is dead.
        """

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """Return the contents of a regular file in the workspace."""

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace a regular file in the workspace, creating parent directories."""

    @abc.abstractmethod
    def list_dir(self, path: str) -> list[DirEntry]:
        """List a workspace directory, sorted by name."""

    @abc.abstractmethod
    def diff(self) -> str:
        """Unified diff (git style, sorted by path, ``.git/`` excluded) of the workspace vs the snapshot."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Discard every change and process, returning the workspace to the snapshot state."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Kill every process and delete the sandbox's state. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()


class SandboxBackend(abc.ABC):
    """Creates snapshots and the sandboxes that run on them."""

    name: str
    root: Path
    """State root: snapshots, sandboxes and the registry of this backend live under it."""

    @abc.abstractmethod
    def snapshot_create(
        self, *, source: RepoSource, image: str | None = None, setup_commands: tuple[str, ...] | list[str] = (),
        setup_limits: SandboxLimits | None = None,
    ) -> Snapshot:
        """Materialise ``source``, run ``setup_commands`` once over it, and freeze the result.

        ``setup_limits`` replaces the backend's setup limits for this snapshot (e.g. a setup phase with
        the network on and its own time and disk budget); the sandboxes made from it get their own."""

    @abc.abstractmethod
    def snapshot_delete(self, *, snapshot: Snapshot) -> None:
        """Delete a snapshot's files; sandboxes still running on it must be destroyed first."""

    @abc.abstractmethod
    def sandbox_create(self, *, snapshot: Snapshot, limits: SandboxLimits) -> Sandbox:
        """Start one sandbox whose workspace is a private copy-on-write view of ``snapshot``."""

    @abc.abstractmethod
    def sandbox_fork(self, *, snapshot: Snapshot, count: int, limits: SandboxLimits) -> Sequence[Sandbox]:
        """Start ``count`` independent sandboxes on ``snapshot`` (e.g. one per RL rollout)."""

    @abc.abstractmethod
    def reap_orphans(self) -> int:
        """Destroy sandboxes whose owning process died or whose lifetime expired; return how many."""

    @abc.abstractmethod
    def snapshots_in_use(self) -> set[str]:
        """Ids of snapshots that a live sandbox of this state root was created from."""

    def gc(self, *, max_age_s: float) -> dict[str, int]:
        """Reap dead/expired sandboxes, then delete snapshots older than ``max_age_s`` that none uses."""
        from sandboxes.retention import snapshots_gc

        reaped = self.reap_orphans()
        removed = snapshots_gc(snapshots_dir=self.root / "snapshots", max_age_s=max_age_s,
                               in_use=self.snapshots_in_use())
        return {"sandboxes": reaped, "snapshots": len(removed)}
