"""Backends under test: the local namespace backend always, Docker when its engine and image exist."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from sandboxes.base import RepoSource, SandboxBackend, SandboxLimits, Snapshot

os.environ.setdefault("OMP_NUM_THREADS", "1")

TEST_LIMITS = SandboxLimits(cpu_seconds=20, memory_mb=512, max_processes=64, disk_mb=64,
                            command_timeout_s=20, lifetime_s=300)
"""Small limits so attacks hit them quickly; generous enough for python3 and a shell pipeline."""


def _docker_skip_reason() -> str | None:
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed"
    image = os.environ.get("SANDBOX_IMAGE", "flowstate-sandbox:latest")
    try:
        from django.conf import settings

        image = getattr(settings, "SANDBOX_IMAGE", image)
    except ImportError:
        pass
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the engine means "skip docker"
        return f"no reachable Docker engine ({type(exc).__name__})"
    try:
        client.images.get(image)
    except Exception:  # noqa: BLE001 - image missing or engine error
        return f"Docker image {image} is not built (run manage.py build_sandbox_image)"
    return None


def _traversable_tempdir(prefix: str) -> Path:
    # Sandbox init processes run as an unprivileged host uid and must reach the state directory.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o711)
    return path


@pytest.fixture(scope="session", params=[
    "local", pytest.param("docker", marks=pytest.mark.docker), pytest.param("docker-runsc", marks=pytest.mark.docker),
])
def sandbox_backend(request) -> SandboxBackend:
    """A backend instance with its own state directory; docker params skip with the reason.

    ``docker-runsc`` is the Docker backend under gVisor (``make gvisor`` installs and registers it):
    it skips with the backend's own refusal when the engine has no ``runsc`` runtime or the runtime
    fails the backend's start-up self-test (e.g. Debian bookworm's runsc rejects coreutils' ``statx``).
    A test that cannot hold under gVisor skips there with the measured reason (``under_gvisor``).
    """
    root = _traversable_tempdir(f"flowstate-{request.param}-")
    if request.param == "local":
        from sandboxes.local_backend import LocalBackend, LocalBackendConfig

        backend = LocalBackend(LocalBackendConfig(root=root, warm_pool_size=2))
    else:
        reason = _docker_skip_reason()
        if reason:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(reason)
        from sandboxes.base import BackendUnavailable
        from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

        runtime = "runsc" if request.param == "docker-runsc" else "runc"
        try:
            backend = DockerBackend(DockerBackendConfig(root=root, runtime=runtime))
        except BackendUnavailable as exc:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip(f"docker backend on {runtime}: {exc}")
    yield backend
    backend.close()
    backend.reap_orphans()
    from sandboxes.safe_tree import discard_tree

    discard_tree(root, what="test backend state")  # attack tests leave trees deeper than rmtree can recurse


@pytest.fixture
def make_snapshot(sandbox_backend, tmp_path) -> Callable[..., Snapshot]:
    """Build a snapshot of a directory holding ``files`` ({relative path: text})."""

    def build(files: dict[str, str], setup_commands: tuple[str, ...] = ()) -> Snapshot:
        repo = tmp_path / f"repo-{len(list(tmp_path.iterdir()))}"
        repo.mkdir()
        for relative, text in files.items():
            target = repo / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        return sandbox_backend.snapshot_create(source=RepoSource(kind="path", location=str(repo)),
                                               setup_commands=setup_commands)

    return build


@pytest.fixture
def sandbox(sandbox_backend, make_snapshot):
    """A live sandbox over a small Python repository, destroyed afterwards."""
    snapshot = make_snapshot({
        "app/calc.py": "import os\n\n\ndef add(a, b):\n    return a + b\n",
        "README.md": "calc\n",
    })
    box = sandbox_backend.sandbox_create(snapshot=snapshot, limits=TEST_LIMITS)
    yield box
    box.destroy()


def under_gvisor(backend: SandboxBackend) -> bool:
    """Whether ``backend`` runs its sandboxes under gVisor (the ``docker-runsc`` parameter)."""
    return bool(getattr(backend, "gvisor", False))


def host_is_healthy() -> None:
    """Assert the host still has headroom after an attack: memory, process table, disk, fork()."""
    import subprocess

    import psutil

    assert psutil.virtual_memory().available > 512 * 1024 * 1024, "host memory nearly exhausted"
    assert len(psutil.pids()) < 20_000, "host process table is filling up"
    assert shutil.disk_usage("/tmp").free > 512 * 1024 * 1024, "host disk nearly full"
    assert subprocess.run(["true"], check=False, timeout=10).returncode == 0, "host cannot start processes"
