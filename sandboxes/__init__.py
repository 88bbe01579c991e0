"""Sandboxes that run agent commands and tools, shared by cloud agents and RL training.

``get_backend()`` picks the backend named by the sandbox settings (``sandboxes.settings``: handed
over by the web app from ``settings.SANDBOX_BACKEND``, else the ``SANDBOX_BACKEND`` environment
variable), defaulting to the local namespace backend, and builds it from those settings once.
"""

from __future__ import annotations

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

_backends: dict[str, SandboxBackend] = {}
_backends_lock = threading.Lock()


def get_backend(name: str | None = None, *, runtime: str | None = None) -> SandboxBackend:
    """Return the process-wide backend instance called ``name`` (default: the configured one).

    ``runtime``: the Docker backend's OCI runtime (isolation tier) for these sandboxes, one instance
    per runtime; ``None`` or the configured ``SANDBOX_DOCKER_RUNTIME``: the default instance.
    """
    from sandboxes.settings import BACKEND_NAMES, current

    configured = current()
    chosen = name or configured.backend
    names = (*BACKEND_NAMES, "fleet")  # fleet: a client of the fleet's hosts, which run local or docker
    if chosen not in names:
        raise ValueError(f"unknown sandbox backend {chosen!r}; choose one of {', '.join(names)}")
    if runtime == configured.docker_runtime:
        runtime = None
    if runtime is not None and chosen != "docker":
        raise ValueError(f"the sandbox runtime {runtime!r} needs the docker backend; these sandboxes run on {chosen}")
    key = chosen if runtime is None else f"{chosen}:{runtime}"
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            if chosen == "local":
                from sandboxes.local_backend import LocalBackend, LocalBackendConfig

                backend = LocalBackend(LocalBackendConfig(root=configured.root))
            elif chosen == "fleet":  # product sandboxes on the Ray fleet's host actors
                from sandboxes.fleet.backend import FleetBackend

                backend = FleetBackend()
            else:
                from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

                backend = DockerBackend(DockerBackendConfig(image=configured.image, root=configured.root / "docker",
                                                            runtime=runtime))
            _backends[key] = backend
        return backend
