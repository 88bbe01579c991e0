"""Turning a CodingTask into sandbox snapshots, cached so that a GRPO group forks one snapshot."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from sandboxes.base import RepoSource, Sandbox, SandboxBackend, SandboxLimits, Snapshot
from training.tasks.base import CodingTask

DEFAULT_TASK_LIMITS = SandboxLimits(
    cpu_seconds=120, memory_mb=1024, max_processes=64, disk_mb=256, command_timeout_s=60.0, lifetime_s=1800.0
)

_snapshot_cache: dict[tuple[int, str, bool], Snapshot] = {}
_cache_lock = threading.Lock()


def task_setup_limits(task: CodingTask) -> SandboxLimits | None:
    """Limits of the task's setup phase: the network on when its setup commands download; None: the
    backend's default setup limits."""
    if not task.setup_network:
        return None
    return SandboxLimits(cpu_seconds=1200, memory_mb=2048, max_processes=128, disk_mb=2048,
                         command_timeout_s=600.0, lifetime_s=1800.0, network=True)


def task_snapshot_get_or_create(
    *, backend: SandboxBackend, task: CodingTask, solved: bool = False
) -> Snapshot:
    """The snapshot of the task's repository (buggy, or with the reference fix when `solved`)."""
    key = (id(backend), task.task_id, solved)
    with _cache_lock:
        cached = _snapshot_cache.get(key)
    if cached is not None:
        return cached
    files = task.solved_files() if solved else task.files
    with tempfile.TemporaryDirectory(prefix=f"flowstate-task-{task.task_id}-") as directory:
        root = Path(directory)
        for relative, text in files.items():
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(root)),
                                           setup_commands=task.setup_commands, setup_limits=task_setup_limits(task))
    with _cache_lock:
        _snapshot_cache.setdefault(key, snapshot)
        return _snapshot_cache[key]


def task_sandboxes_create(
    *,
    backend: SandboxBackend,
    task: CodingTask,
    count: int = 1,
    limits: SandboxLimits = DEFAULT_TASK_LIMITS,
    solved: bool = False,
) -> list[Sandbox]:
    """`count` fresh sandboxes on the task's repository (one per rollout of a group)."""
    snapshot = task_snapshot_get_or_create(backend=backend, task=task, solved=solved)
    if count == 1:
        return [backend.sandbox_create(snapshot=snapshot, limits=limits)]
    return backend.sandbox_fork(snapshot=snapshot, count=count, limits=limits)


def task_snapshot_put(*, backend: SandboxBackend, task: CodingTask, snapshot: Snapshot, solved: bool = False) -> None:
    """Use ``snapshot`` as the task's (e.g. one built from a repository's prepared environment with the
    task's buggy file, so its setup does not run again); ``task_snapshot_get_or_create`` then returns it."""
    with _cache_lock:
        _snapshot_cache[(id(backend), task.task_id, solved)] = snapshot
