"""What the local and Docker backends share: the snapshot store, the warm pool, sandbox liveness,
the workspace file methods and bounded command output.

A backend subclasses ``CoreBackend`` and ``CoreSandbox`` and adds only what differs: how a sandbox
is started (``_new_sandbox``), how a command enters it (``CoreSandbox._run``), how a snapshot's setup
commands run, and how sandboxes of dead owners are found (``reap_orphans``). Both keep a sandbox's
workspace as a host-side overlay reached through an ``O_PATH`` directory fd, so file tools and diffs
go through the same ``sandboxes.safe_fs`` code and are byte-identical on both.
"""

from __future__ import annotations

import abc
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, Protocol

from sandboxes import safe_fs, safe_tree
from sandboxes.archives import ArchiveLimits
from sandboxes.base import (
    WORKSPACE_DIR,
    DirEntry,
    ExecResult,
    RepoSource,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SandboxLimits,
    Snapshot,
    SnapshotError,
)
from sandboxes.diffing import workspace_diff
from sandboxes.materialize import materialize_source
from sandboxes.warm_pool import WarmPool

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
COMMAND_ENV = {
    "PATH": SANDBOX_PATH, "HOME": WORKSPACE_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
    "USER": "sandbox", "TERM": "dumb", "PYTHONDONTWRITEBYTECODE": "1",
}
"""The environment of every sandbox command, whatever the backend."""


class CappedOutput:
    """One output stream of a command, kept up to ``cap`` bytes; what is dropped is counted and noted."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = max(self.cap - len(self.data), 0)
        self.data += chunk[:room]
        self.dropped += max(len(chunk) - room, 0)

    def text(self) -> str:
        text = bytes(self.data).decode("utf-8", "replace")
        if self.dropped:
            text += f"\n[sandbox: {self.dropped} more bytes of output were dropped]\n"
        return text


def setup_result_check(command: str, result: ExecResult) -> None:
    """Refuse a snapshot whose setup command failed or timed out, with the end of its output."""
    if result.exit_code != 0 or result.timed_out:
        why = "timed out" if result.timed_out else f"exited with {result.exit_code}"
        tail = (result.stdout + result.stderr)[-2000:]
        raise SnapshotError(f"setup command {command!r} {why}: {tail}")


class CoreSandbox(Sandbox):
    """A sandbox with a lifetime clock and a host-side workspace fd; subclasses say how it runs."""

    def __init__(self, *, backend: CoreBackend, sandbox_id: str, snapshot: Snapshot, limits: SandboxLimits) -> None:
        self.id = sandbox_id
        self.snapshot = snapshot
        self.limits = limits
        self._backend = backend
        self._deadline = time.time() + limits.lifetime_s
        self._lock = threading.RLock()

    @property
    def deadline(self) -> float:
        return self._deadline

    # What a backend's sandbox provides --------------------------------------------------------

    @abc.abstractmethod
    def _handle(self) -> Any:
        """What runs the sandbox (a holder, a container id), or None once destroyed."""

    def _check_running(self, handle: Any) -> None:
        """Raise ``SandboxGone`` (after destroying) when ``handle`` no longer runs."""

    @abc.abstractmethod
    def _workspace_fd_of(self, handle: Any) -> int:
        """The ``O_PATH`` fd of the workspace directory while ``handle`` runs."""

    @abc.abstractmethod
    def _run(self, handle: Any, command: str, timeout_s: float) -> ExecResult:
        """Run one command in the sandbox for at most ``timeout_s`` seconds."""

    def _warm_usable(self) -> bool:
        """Whether a warm sandbox may still be handed out."""
        return self._handle() is not None

    def _restart_clock(self) -> None:
        """A claimed warm sandbox gets its whole lifetime from now."""
        self._deadline = time.time() + self.limits.lifetime_s

    # Shared behaviour ---------------------------------------------------------------------------

    def _live(self) -> Any:
        handle = self._handle()
        if handle is None:
            raise SandboxGone(f"sandbox {self.id} was destroyed")
        if time.time() >= self._deadline:
            self._gone(f"reached its {self.limits.lifetime_s:g}s lifetime and was destroyed")
        self._check_running(handle)
        return handle

    def _gone(self, why: str) -> NoReturn:
        """Destroy the sandbox and raise ``SandboxGone``: "sandbox <id> <why>"."""
        self.destroy()
        raise SandboxGone(f"sandbox {self.id} {why}") from None

    def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        if not isinstance(command, str) or not command.strip():
            raise ValueError("command must be a non-empty string")
        handle = self._live()
        limit = self.limits.command_timeout_s if timeout_s is None else float(timeout_s)
        if limit <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        limit = min(limit, max(self._deadline - time.time(), 0.001))
        return self._run(handle, command, limit)

    def read_bytes(self, path: str) -> bytes:
        return safe_fs.read_bytes(self._workspace_fd_of(self._live()), path)

    def write_bytes(self, path: str, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("write_bytes needs bytes")
        fd = self._workspace_fd_of(self._live())
        safe_fs.write_bytes(fd, path, bytes(data), owner=self._backend._agent_owner)

    def list_dir(self, path: str) -> list[DirEntry]:
        return safe_fs.list_dir(self._workspace_fd_of(self._live()), path)

    def diff(self) -> str:
        fd = self._workspace_fd_of(self._live())
        return workspace_diff(snapshot_dir=self.snapshot.location, workspace_fd=fd)


class CoreBackendConfig(Protocol):
    """What the core reads of a backend's config (LocalBackendConfig, DockerBackendConfig)."""

    @property
    def warm_pool_size(self) -> int: ...
    @property
    def warm_max_idle_s(self) -> float: ...
    @property
    def setup_limits(self) -> SandboxLimits: ...
    @property
    def archive_limits(self) -> ArchiveLimits: ...


class CoreBackend(SandboxBackend):
    """Snapshot store, sandbox creation and the warm pool over a backend's ``_new_sandbox``.

    Subclasses set ``root``, ``config`` (with ``warm_pool_size``, ``warm_max_idle_s``,
    ``setup_limits`` and ``archive_limits``) and ``_agent_owner`` (the host uid/gid of the sandbox
    user, owner of the snapshot's files), then call ``_warm_pool_start``.
    """

    snapshot_prefix = "snap-"
    """Prefix of this backend's snapshot ids."""
    remember_claimed_pairs = False
    """Whether a (snapshot, limits) pair is kept warm once claimed, not only once prewarmed."""
    fork_workers = 1
    """Sandboxes ``sandbox_fork`` starts concurrently."""
    root: Path
    config: CoreBackendConfig
    _agent_owner: tuple[int, int]

    def _warm_pool_start(self) -> None:
        self._pool = WarmPool(
            start=lambda snapshot, limits, extra: self._new_sandbox(snapshot=snapshot, limits=limits,
                                                                    extra_lifetime_s=extra),
            size=self.config.warm_pool_size, max_idle_s=self.config.warm_max_idle_s,
            remember_claimed=self.remember_claimed_pairs, thread_name=f"{self.name}-warm-pool",
        )

    # What a backend provides ----------------------------------------------------------------------

    @abc.abstractmethod
    def _new_sandbox(self, *, snapshot: Snapshot, limits: SandboxLimits, extra_lifetime_s: float = 0.0) -> CoreSandbox:
        """Start one sandbox on ``snapshot`` that lives ``limits.lifetime_s + extra_lifetime_s``."""

    def _snapshot_image(self, image: str | None) -> str | None:
        """The image a new snapshot records (checked to exist where the backend uses images)."""
        return image

    @abc.abstractmethod
    def _snapshot_setup(self, snapshot: Snapshot, tree: Path, commands: tuple[str, ...],
                        limits: SandboxLimits) -> None:
        """Run the setup commands over ``tree`` (the snapshot's files before they are frozen)."""

    # Snapshots ----------------------------------------------------------------------------------

    def snapshot_create(self, *, source: RepoSource, image: str | None = None,
                        setup_commands: tuple[str, ...] | list[str] = (),
                        setup_limits: SandboxLimits | None = None) -> Snapshot:
        if not isinstance(source, RepoSource):
            raise TypeError("source must be a RepoSource")
        commands = tuple(setup_commands)
        for command in commands:
            if not isinstance(command, str) or not command.strip():
                raise ValueError(f"setup commands must be non-empty strings, got {command!r}")
        chosen_image = self._snapshot_image(image)
        snapshot_id = self.snapshot_prefix + secrets.token_hex(8)
        staging = self.root / "snapshots" / f".{snapshot_id}.partial"
        final = self.root / "snapshots" / snapshot_id
        tree = staging / "tree"
        staging.mkdir(parents=True)
        try:
            self._materialize(source, tree)
            self._chown_tree(tree)
            snapshot = Snapshot(id=snapshot_id, backend=self.name, source=source, image=chosen_image,
                                setup_commands=commands, location=str(final / "tree"))
            if commands:
                self._snapshot_setup(snapshot, tree, commands, setup_limits or self.config.setup_limits)
            (staging / "snapshot.json").write_text(json.dumps({
                "id": snapshot_id, "source": [source.kind, source.location, source.ref], "image": chosen_image,
                "setup_commands": list(commands), "created_at": snapshot.created_at,
            }))
            staging.rename(final)
        except BaseException:
            # Never raises (a failure is logged): the error being handled is the one to report.
            safe_tree.discard_tree(staging, what="half-built snapshot")
            raise
        return snapshot

    def snapshot_delete(self, *, snapshot: Snapshot) -> None:
        """Delete a snapshot's files; sandboxes still running on it must be destroyed first."""
        self._pool.drop_snapshot(snapshot.id)
        safe_tree.discard_tree(self.root / "snapshots" / snapshot.id, what="snapshot")

    def _materialize(self, source: RepoSource, tree: Path) -> None:
        materialize_source(source=source, tree=tree, run_as=self._agent_owner if os.geteuid() == 0 else None,
                           archive_limits=self.config.archive_limits)

    def _chown_tree(self, tree: Path) -> None:
        """Give the materialized tree to the sandbox user (iteratively: the tree may be of any depth)."""
        if os.geteuid() != 0:
            return
        safe_tree.chown_tree(tree, self._agent_owner)
        os.chmod(tree, 0o755)

    def _check_snapshot(self, snapshot: Snapshot) -> None:
        if not isinstance(snapshot, Snapshot) or snapshot.backend != self.name:
            raise SandboxError(f"snapshot {getattr(snapshot, 'id', snapshot)!r} was not made by the {self.name} backend")
        if not Path(snapshot.location).is_dir():
            raise SandboxError(f"snapshot {snapshot.id} no longer exists at {snapshot.location}")

    # Sandboxes ----------------------------------------------------------------------------------

    def sandbox_create(self, *, snapshot: Snapshot, limits: SandboxLimits) -> CoreSandbox:
        self._check_snapshot(snapshot)
        if not isinstance(limits, SandboxLimits):
            raise TypeError("limits must be a SandboxLimits")
        claimed = self._pool.claim(snapshot=snapshot, limits=limits)
        if claimed is not None:
            return claimed
        return self._new_sandbox(snapshot=snapshot, limits=limits)

    def sandbox_fork(self, *, snapshot: Snapshot, count: int, limits: SandboxLimits) -> Sequence[CoreSandbox]:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        self._check_snapshot(snapshot)
        workers = min(count, self.fork_workers)
        if workers == 1:
            created: list[CoreSandbox] = []
            try:
                for _ in range(count):
                    created.append(self.sandbox_create(snapshot=snapshot, limits=limits))
            except BaseException:
                for sandbox in created:
                    sandbox.destroy()
                raise
            return created
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-fork") as pool:
            futures = [pool.submit(self.sandbox_create, snapshot=snapshot, limits=limits) for _ in range(count)]
        started, errors = [], []
        for future in futures:
            try:
                started.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - every started sandbox must be undone below
                errors.append(exc)
        if errors:
            for sandbox in started:
                sandbox.destroy()
            raise errors[0]
        return started

    # Warm pool ----------------------------------------------------------------------------------

    def prewarm(self, *, snapshot: Snapshot, limits: SandboxLimits, wait: bool = False,
                count: int | None = None) -> None:
        """Keep ``count`` (default ``config.warm_pool_size``) started sandboxes ready for (snapshot, limits).

        A background thread refills the pool after each claim; ``wait`` fills it before returning.
        """
        self._check_snapshot(snapshot)
        self._pool.want(snapshot=snapshot, limits=limits, count=count, wait=wait)

    def warm_count(self, *, snapshot: Snapshot, limits: SandboxLimits) -> int:
        return self._pool.count(snapshot=snapshot, limits=limits)

    def close(self) -> None:
        """Stop the warm pool and destroy its idle sandboxes (claimed sandboxes are left alone)."""
        self._pool.close()
