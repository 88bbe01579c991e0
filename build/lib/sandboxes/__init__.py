"""Sandboxes that run agent commands and tools, shared by cloud agents and RL training.

``get_backend()`` picks the backend named by ``settings.SANDBOX_BACKEND`` (Django configured) or the
``SANDBOX_BACKEND`` environment variable, defaulting to the local namespace backend.
"""

from __future__ import annotations

import os
import threading

from sandboxes.base import (
    ArchiveRejected,
    BackendUnavailable,
    DirEntry,
    ExecResult,
    PathOutsideWorkspace,
    RepoSource,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SandboxLimitExceeded,
    SandboxLimits,
    Snapshot,
    SnapshotError,
)

__all__ = [
    "ArchiveRejected",
    "BackendUnavailable",
    "DirEntry",
    "ExecResult",
    "PathOutsideWorkspace",
    "RepoSource",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxGone",
    "SandboxLimitExceeded",
    "SandboxLimits",
    "Snapshot",
    "SnapshotError",
    "get_backend",
]

BACKEND_NAMES = ("local", "docker", "fleet")

_backends: dict[str, SandboxBackend] = {}
_backends_lock = threading.Lock()


def _configured_backend_name() -> str:
    try:
        from django.conf import settings

        if settings.configured:
            return str(getattr(settings, "SANDBOX_BACKEND", "local"))
    except ImportError:
        pass
    return os.environ.get("SANDBOX_BACKEND", "") or "local"


def get_backend(name: str | None = None) -> SandboxBackend:
    """Return the process-wide backend instance called ``name`` (default: the configured one)."""
    chosen = name or _configured_backend_name()
    if chosen not in BACKEND_NAMES:
        raise ValueError(f"unknown sandbox backend {chosen!r}; choose one of {', '.join(BACKEND_NAMES)}")
    with _backends_lock:
        backend = _backends.get(chosen)
        if backend is None:
            if chosen == "local":
                from sandboxes.local_backend import LocalBackend

                backend = LocalBackend()
            elif chosen == "fleet":  # product sandboxes on the Ray fleet's host actors
                from sandboxes.fleet.backend import FleetBackend

                backend = FleetBackend()
            else:
                from sandboxes.docker_backend import DockerBackend

                backend = DockerBackend()
            _backends[chosen] = backend
        return backend
