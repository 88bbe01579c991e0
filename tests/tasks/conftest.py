"""Sandboxes for task tests: the real local backend when it is installed, plus a plain-directory one.

The directory sandbox runs commands for real with /bin/sh in a temporary directory (no isolation),
so reward and validation logic is exercised end to end even where namespaces are unavailable.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandboxes.base import (
    DirEntry,
    ExecResult,
    RepoSource,
    Sandbox,
    SandboxBackend,
    SandboxGone,
    SandboxLimits,
    Snapshot,
)


class DirectorySandbox(Sandbox):
    def __init__(self, root: Path, snapshot: Snapshot, limits: SandboxLimits) -> None:
        self.root, self.snapshot, self.limits, self.id = root, snapshot, limits, root.name

    def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        if not self.root.exists():
            raise SandboxGone(self.id)
        started = time.monotonic()
        try:
            done = subprocess.run(
                check=False,
                args=["/bin/sh", "-c", command],
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=timeout_s or self.limits.command_timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            return ExecResult(
                -9, str(exc.stdout or ""), str(exc.stderr or ""), True, time.monotonic() - started
            )
        return ExecResult(done.returncode, done.stdout, done.stderr, False, time.monotonic() - started)

    def read_bytes(self, path: str) -> bytes:
        return (self.root / path).read_bytes()

    def write_bytes(self, path: str, data: bytes) -> None:
        if not self.root.exists():
            raise SandboxGone(self.id)
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def list_dir(self, path: str) -> list[DirEntry]:
        return [
            DirEntry(p.name, "dir" if p.is_dir() else "file", p.stat().st_size)
            for p in sorted((self.root / path).iterdir())
        ]

    def diff(self) -> str:
        return ""

    def reset(self) -> None:
        shutil.rmtree(self.root)
        shutil.copytree(self.snapshot.location, self.root)

    def destroy(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class DirectoryBackend(SandboxBackend):
    name = "directory"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.counter = 0

    def snapshot_create(self, *, source: RepoSource, image=None, setup_commands=(), setup_limits=None) -> Snapshot:
        self.counter += 1
        location = self.base / f"snapshot-{self.counter}"
        shutil.copytree(source.location, location)
        return Snapshot(
            id=location.name,
            backend=self.name,
            source=source,
            image=None,
            setup_commands=tuple(setup_commands),
            location=str(location),
        )

    def sandbox_create(self, *, snapshot: Snapshot, limits: SandboxLimits) -> Sandbox:
        self.counter += 1
        root = self.base / f"sandbox-{self.counter}"
        shutil.copytree(snapshot.location, root)
        return DirectorySandbox(root, snapshot, limits)

    def sandbox_fork(self, *, snapshot: Snapshot, count: int, limits: SandboxLimits) -> list[Sandbox]:
        return [self.sandbox_create(snapshot=snapshot, limits=limits) for _ in range(count)]

    def snapshot_delete(self, *, snapshot: Snapshot) -> None:
        shutil.rmtree(snapshot.location, ignore_errors=True)

    def reap_orphans(self) -> int:
        return 0

    def snapshots_in_use(self) -> set[str]:
        return set()  # its sandboxes are plain directories that die with the test


def _local_backend():
    try:
        from sandboxes import get_backend

        return get_backend("local")
    except ImportError:
        return None


@pytest.fixture(params=["local", "directory"])
def task_backend(request, tmp_path):
    if request.param == "local":
        backend = _local_backend()
        if backend is None:
            pytest.skip("sandboxes.local_backend is not installed in this checkout yet")
        return backend
    return DirectoryBackend(tmp_path)
