"""``AGENT_SANDBOX_BACKEND=fleet`` without a cluster: the errors say what to set (no Ray started)."""

from __future__ import annotations

import pytest

from sandboxes import get_backend
from sandboxes.base import RepoSource, SandboxError, SandboxLimits
from sandboxes.fleet.backend import FleetBackend


def test_fleet_backend_needs_a_ray_address(monkeypatch, tmp_path):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process already joined a Ray cluster")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    backend = FleetBackend()
    # A snapshot is only a recipe until a host is picked: creating it needs no cluster.
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(tmp_path)))
    assert snapshot.per_host == {} and snapshot.source.location == str(tmp_path)
    with pytest.raises(SandboxError, match="SANDBOX_BACKEND=fleet needs RAY_ADDRESS"):
        backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits())
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        FleetBackend(attempts=0)


def test_fleet_is_a_backend_name_and_a_bad_agent_backend_stops_startup():
    from tests.platform.test_settings import _manage

    assert isinstance(get_backend("fleet"), FleetBackend)
    result = _manage("check", AGENT_SANDBOX_BACKEND="flet")
    assert result.returncode != 0
    assert "AGENT_SANDBOX_BACKEND='flet' is not one of ['', 'local', 'docker', 'fleet']" in result.stderr
