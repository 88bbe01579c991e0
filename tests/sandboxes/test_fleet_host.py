"""A sandbox host's own logic without Ray: slots, queueing, expiry and the heartbeat it reports."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from sandboxes.base import RepoSource, SandboxError, SandboxLimits
from sandboxes.fleet.host import SandboxHost, SandboxHostConfig


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    return tmp_path


@pytest.fixture
def sandbox_root(monkeypatch, settings):
    # Local sandbox init processes run as an unprivileged uid: the state root must be traversable.
    root = Path(tempfile.mkdtemp(prefix="flowstate-host-", dir="/tmp"))
    root.chmod(0o711)
    settings.SANDBOX_ROOT = root
    import sandboxes

    monkeypatch.setattr(sandboxes, "_backends", {})
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def test_expired_sandbox_frees_its_slot_for_a_waiting_request(repo, sandbox_root):
    host = SandboxHost(SandboxHostConfig(host_name="unit-host", slots=1, heartbeat_sink=None, reap_interval_s=0.2))
    try:
        snapshot = await host.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        short = SandboxLimits(command_timeout_s=1, lifetime_s=1.5, memory_mb=256)
        forgotten = await host.create(snapshot=snapshot, limits=short, purpose="training", tenant="exp")
        waiting = asyncio.create_task(host.create(snapshot=snapshot, limits=short, purpose="product", tenant="u"))
        await asyncio.sleep(0.3)
        beat = host.heartbeat()
        assert (beat.slots_used, beat.queue.product_waiting) == (1, 1)
        assert (beat.backend, beat.runtime) == ("local", "")  # namespaces: no OCI runtime
        assert [(s.sandbox_id, s.state, s.purpose) for s in beat.sandboxes] == [(forgotten, "idle", "training")]
        # Nobody destroys the first sandbox: once its lifetime is over the host reaps it.
        admitted = await asyncio.wait_for(waiting, timeout=10)
        assert host.expired_total == 1
        assert [s.sandbox_id for s in host.heartbeat().sandboxes] == [admitted]
        with pytest.raises(SandboxError, match="not on host unit-host"):
            await host.exec(forgotten, "true")
        assert (await host.exec(admitted, "cat a.txt")).stdout == "a\n"
    finally:
        assert await host.shutdown() == 1
    assert host.heartbeat().slots_used == 0


@pytest.mark.docker
async def test_docker_host_heartbeat_names_its_runtime(sandbox_root, settings):
    from sandboxes.base import BackendUnavailable

    settings.SANDBOX_DOCKER_RUNTIME = "runc"
    try:
        host = SandboxHost(SandboxHostConfig(host_name="docker-host", backend="docker", slots=1, heartbeat_sink=None))
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    try:
        beat = host.heartbeat()
        assert (beat.backend, beat.runtime) == ("docker", "runc")
    finally:
        await host.shutdown()


def test_host_config_rejects_bad_values():
    with pytest.raises(ValueError, match="within 0.05..2 s"):
        SandboxHostConfig(host_name="h", slots=1, heartbeat_interval_s=5)
    with pytest.raises(ValueError, match="'local' or 'docker'"):
        SandboxHostConfig(host_name="h", slots=1, backend="k8s")
    with pytest.raises(ValueError, match="module.function"):
        SandboxHostConfig(host_name="h", slots=1, heartbeat_sink="nodots")
    with pytest.raises(ValueError, match="retention_s and gc_interval_s must be positive"):
        SandboxHostConfig(host_name="h", slots=1, retention_s=0)


async def test_host_runs_the_retention_pass(repo, sandbox_root):
    import os
    import time

    host = SandboxHost(SandboxHostConfig(host_name="gc-host", slots=1, heartbeat_sink=None, reap_interval_s=0.1,
                                         gc_interval_s=0.1, retention_s=3600))
    try:
        old = await host.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        kept = await host.snapshot_create(source=RepoSource(kind="path", location=str(repo)))
        aged = time.time() - 7200
        os.utime(Path(old.location).parent, (aged, aged))
        box = await host.create(snapshot=kept, limits=SandboxLimits(memory_mb=256), purpose="product", tenant="u")
        os.utime(Path(kept.location).parent, (aged, aged))
        deadline = time.monotonic() + 15
        while Path(old.location).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not Path(old.location).exists()
        assert Path(kept.location).is_dir()  # a live sandbox was created from it
        assert (await host.exec(box, "cat a.txt")).stdout == "a\n"
    finally:
        await host.shutdown()
