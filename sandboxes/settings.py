"""The deployment settings of the sandbox layer, read in one place.

The process that owns the configuration hands it over once with ``configure()``: the web app does so
from Django settings when its apps are ready, and again whenever a test overrides one of them
(``webapp.core.sandbox_settings``). A process that never configures (a Ray worker, the RL driver,
a script) gets the same settings from the environment (``SandboxSettings.from_environment``). No
other module of ``sandboxes`` reads Django settings or these environment variables itself.
This module must not import Django.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from sandboxes import paths

BACKEND_NAMES = ("local", "docker")
DEFAULT_IMAGE = "flowstate-sandbox:latest"
DEFAULT_DOCKER_RUNTIME = "runc"
ARCHIVE_MAX_DEPTH = 64
"""Default of ``SandboxSettings.archive_max_depth``."""
ARCHIVE_DEPTH_RANGE = (1, 1024)
"""Accepted values of ``FLOWSTATE_ARCHIVE_MAX_DEPTH``: a deeper cap would let archives build trees
near the depth at which recursive tools (Python's os.walk, shutil.rmtree) fail."""
RUNTIME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a Docker OCI runtime name may look like (``docker info`` lists the registered ones)."""
SEMANTIC_SETTING_NAMES = (
    "SEMANTIC_INDEX_ROOT", "SEMANTIC_VECTOR_STORE", "SEMANTIC_BACKGROUND_INDEXING", "SEMANTIC_ENCODER_BACKEND",
    "SEMANTIC_ENCODER", "SEMANTIC_MAX_SEQ_LENGTH",
)
"""The semantic search settings (``sandboxes.semantic.config.SemanticSearchConfig.from_environment``)."""


def _environment_root() -> Path:
    return Path(os.environ.get("SANDBOX_ROOT") or paths.default_sandbox_root(Path("var"))).absolute()


def _environment_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class SandboxSettings:
    """What a deployment decides for every sandbox backend of a process."""

    backend: str = "local"
    """Backend ``sandboxes.get_backend()`` returns when no name is given: ``local`` or ``docker``
    (``SANDBOX_BACKEND``)."""
    root: Path = field(default_factory=_environment_root)
    """State directory of the sandboxes (snapshots, mount points, registry); the Docker backend uses
    its ``docker`` sub-directory (``SANDBOX_ROOT``; default ``var/sandboxes``, see ``sandboxes.paths``)."""
    image: str = DEFAULT_IMAGE
    """Container image of the Docker backend's sandboxes (``SANDBOX_IMAGE``)."""
    docker_runtime: str = DEFAULT_DOCKER_RUNTIME
    """OCI runtime of the Docker backend's containers (``SANDBOX_DOCKER_RUNTIME``): ``runc`` (the
    default), or ``runsc`` (gVisor) once registered with the engine; the backend refuses to start
    when the engine lacks it. docs/SECURITY.md says which to choose."""
    git_allowed_hosts: tuple[str, ...] = ()
    """Git hosts whose internal (loopback, private) addresses may be cloned from, lower case
    (``GIT_ALLOWED_HOSTS``); ``FLOWSTATE_GIT_ALLOWED_HOSTS`` in the environment adds more."""
    semantic: dict[str, str] = field(default_factory=dict)
    """Semantic search settings by name (``SEMANTIC_SETTING_NAMES``), as text; a name missing here is
    taken from the environment."""
    archive_max_depth: int = ARCHIVE_MAX_DEPTH
    """Most path components in a member of an uploaded or snapshot archive (``a/b/c.py`` has 3):
    refused at submission and again at extraction (``FLOWSTATE_ARCHIVE_MAX_DEPTH``, 1 to 1024;
    default 64)."""
    database: dict | None = None
    """Connection settings of the platform database in Django's ``DATABASES["default"]`` form
    (``ENGINE``, ``NAME``, ``USER``, ``PASSWORD``, ``HOST``, ``PORT``), read each time a pgvector
    store connects (``database_dsn``); ``None``: unknown (a process without the web app's settings)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown sandbox backend {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        if not isinstance(self.docker_runtime, str) or not RUNTIME_NAME.fullmatch(self.docker_runtime):
            raise ValueError(f"SANDBOX_DOCKER_RUNTIME={self.docker_runtime!r} is not a runtime name (e.g. runc, runsc)")
        low, high = ARCHIVE_DEPTH_RANGE
        if isinstance(self.archive_max_depth, bool) or not isinstance(self.archive_max_depth, int) \
                or not low <= self.archive_max_depth <= high:
            raise ValueError(f"FLOWSTATE_ARCHIVE_MAX_DEPTH={self.archive_max_depth!r} must be an integer from {low} "
                             f"to {high}")
        unknown = sorted(set(self.semantic) - set(SEMANTIC_SETTING_NAMES))
        if unknown:
            raise ValueError(f"SandboxSettings.semantic has unknown names {unknown}; use {SEMANTIC_SETTING_NAMES}")

    @classmethod
    def from_environment(cls) -> SandboxSettings:
        """The settings of a process that was given none: ``SANDBOX_*`` and friends from the environment."""
        return cls(
            backend=os.environ.get("SANDBOX_BACKEND", "") or "local",
            root=_environment_root(),
            image=os.environ.get("SANDBOX_IMAGE") or DEFAULT_IMAGE,
            docker_runtime=os.environ.get("SANDBOX_DOCKER_RUNTIME") or DEFAULT_DOCKER_RUNTIME,
            archive_max_depth=_environment_int("FLOWSTATE_ARCHIVE_MAX_DEPTH", ARCHIVE_MAX_DEPTH),
            semantic={name: os.environ[name] for name in SEMANTIC_SETTING_NAMES if os.environ.get(name)},
        )

    def semantic_setting(self, name: str) -> str | None:
        """One semantic search setting: the configured value, else the environment's, else None."""
        if name not in SEMANTIC_SETTING_NAMES:
            raise KeyError(f"{name} is not a semantic search setting; use one of {SEMANTIC_SETTING_NAMES}")
        value = self.semantic.get(name)
        return value if value is not None else (os.environ.get(name) or None)

    def database_dsn(self) -> str | None:
        """libpq DSN of ``database`` when it is PostgreSQL, else None."""
        database = self.database or {}
        if database.get("ENGINE") != "django.db.backends.postgresql":
            return None
        from psycopg.conninfo import make_conninfo

        parts = {
            "dbname": database.get("NAME") or None,
            "user": database.get("USER") or None,
            "password": database.get("PASSWORD") or None,
            "host": database.get("HOST") or None,
            "port": str(database["PORT"]) if database.get("PORT") else None,
        }
        return make_conninfo(**{key: value for key, value in parts.items() if value})

    def git_hosts_allowed(self) -> frozenset[str]:
        """``git_allowed_hosts`` plus the environment's ``FLOWSTATE_GIT_ALLOWED_HOSTS``, lower case."""
        hosts = [*self.git_allowed_hosts, *os.environ.get("FLOWSTATE_GIT_ALLOWED_HOSTS", "").split(",")]
        return frozenset(host.strip().lower() for host in hosts if host.strip())


_configured: SandboxSettings | None = None
_lock = threading.Lock()


def configure(settings: SandboxSettings | None) -> None:
    """Use ``settings`` for this process from now on (``None``: back to the environment)."""
    global _configured
    if settings is not None and not isinstance(settings, SandboxSettings):
        raise TypeError("configure() needs a SandboxSettings")
    with _lock:
        _configured = settings


def current() -> SandboxSettings:
    """The configured settings, or (none given) the environment's as they are now."""
    configured = _configured
    return configured if configured is not None else SandboxSettings.from_environment()
