"""SANDBOX_DOCKER_RUNTIME: the Docker backend's OCI runtime is configured, checked at start, and used."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from sandboxes.base import BackendUnavailable, RepoSource, SandboxLimits
from sandboxes.settings import SandboxSettings

LIMITS = SandboxLimits(command_timeout_s=20, lifetime_s=120, memory_mb=256, max_processes=64, disk_mb=64)


@pytest.mark.parametrize("name", ["", "run c", "../runc", "runc;rm", "-runc", "x" * 65])
def test_runtime_names_that_are_not_names_are_refused(name):
    with pytest.raises(ValueError, match="SANDBOX_DOCKER_RUNTIME"):
        SandboxSettings(docker_runtime=name)


def test_runtime_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SANDBOX_DOCKER_RUNTIME", "runsc")
    assert SandboxSettings.from_environment().docker_runtime == "runsc"
    monkeypatch.delenv("SANDBOX_DOCKER_RUNTIME")
    assert SandboxSettings.from_environment().docker_runtime == "runc"


def test_django_setting_reaches_the_sandbox_layer(settings):
    from sandboxes.settings import current

    settings.SANDBOX_DOCKER_RUNTIME = "runsc"
    assert current().docker_runtime == "runsc"


@pytest.fixture
def state_root(request) -> Path:
    root = Path(tempfile.mkdtemp(prefix="flowstate-runtime-", dir="/tmp"))
    root.chmod(0o711)
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    return root


def _backend(root: Path, runtime: str | None):
    from sandboxes.docker_backend import DockerBackend, DockerBackendConfig

    return DockerBackend(DockerBackendConfig(root=root, runtime=runtime))


@pytest.mark.docker
def test_a_runtime_the_engine_lacks_is_refused_at_start(state_root):
    try:
        _backend(state_root, "runc").close()
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    with pytest.raises(BackendUnavailable, match=r"no OCI runtime 'flowstate-no-such-runtime'.*registered: .*runc"):
        _backend(state_root, "flowstate-no-such-runtime")
    assert list((state_root / "sandboxes").iterdir()) == []


@pytest.mark.docker
def test_sandbox_containers_run_on_the_configured_runtime(state_root, tmp_path):
    try:
        backend = _backend(state_root, None)  # None: the configured SANDBOX_DOCKER_RUNTIME, runc by default
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    assert backend.runtime == "runc"
    (tmp_path / "a.txt").write_text("a\n")
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(tmp_path)))
    try:
        with backend.sandbox_create(snapshot=snapshot, limits=LIMITS) as sandbox:
            host_config = backend._client.api.inspect_container(sandbox.container_id)["HostConfig"]
            assert host_config["Runtime"] == "runc"
            assert host_config["PidsLimit"] == LIMITS.max_processes
    finally:
        backend.close()


@pytest.mark.docker
def test_the_start_up_self_test_passes_on_a_working_runtime(state_root):
    from sandboxes.docker_runtime import runtime_self_test

    try:
        backend = _backend(state_root, "runc")
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    try:
        runtime_self_test(backend)  # raises BackendUnavailable with the output when the sandbox misbehaves
        assert list((state_root / "sandboxes").iterdir()) == []
        assert not backend._client.api.containers(all=True, filters={"label": f"flowstate.root={backend.root}"})
    finally:
        backend.close()
