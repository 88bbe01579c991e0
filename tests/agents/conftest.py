"""Fixtures of the cloud-agents tests: the demo repository and a state dir of its own."""

from __future__ import annotations

import pytest

from training.agent.demo_repo import write_demo_repository


@pytest.fixture(scope="session")
def demo_repo_path(tmp_path_factory):
    return write_demo_repository(tmp_path_factory.mktemp("agents-demo") / "stats-demo")


@pytest.fixture
def demo_repository(db, owner, team, demo_repo_path):
    from webapp.agents.models import Repository
    from webapp.agents.services import repository_create

    return repository_create(owner=owner, team=team, name="stats-demo", kind=Repository.Kind.PATH,
                             location=str(demo_repo_path), allow_server_path=True)


@pytest.fixture
def local_sandbox(demo_repo_path):
    from sandboxes import get_backend
    from sandboxes.base import RepoSource, SandboxLimits

    backend = get_backend("local")
    snapshot = backend.snapshot_create(source=RepoSource(kind="path", location=str(demo_repo_path)))
    sandbox = backend.sandbox_create(snapshot=snapshot, limits=SandboxLimits())
    yield sandbox
    sandbox.destroy()


@pytest.fixture(autouse=True)
def _no_heartbeat_in_test_transactions(request, settings):
    # In a test wrapped in one uncommitted transaction, a heartbeat thread's UPDATE would wait on the
    # test's row lock until teardown. Runs in child processes (worker fixtures) keep the real setting.
    if "transactional_db" not in request.fixturenames:
        settings.AGENT_HEARTBEAT_S = 3600
        settings.AGENT_STALE_AFTER_S = 7200


@pytest.fixture
def fresh_limit_keys():
    """Per-user limit counters of earlier tests (a reused user id) must not leak into this one."""
    from webapp.accounts.limits import redis_client

    client = redis_client()
    for key in client.scan_iter("flowstate:limit:*"):
        client.delete(key)
