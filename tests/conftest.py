"""Shared fixtures: personas for permission tests, live servers and real worker processes.

Backends: `make test` exports DATABASE_URL / REDIS_URL for the real PostgreSQL and Redis when they
are reachable (see scripts/test_services.py); the header of the pytest run says which were used.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Kernel modules decide at import whether to interpret their @triton.jit functions, and any test
# module may import them first (through the model code), so the interpreter is chosen here, before
# any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from django.conf import settings

from webapp.server_command import asgi_server_command

ROOT = Path(__file__).resolve().parent.parent


def pytest_report_header(config):
    db = settings.DATABASES["default"]
    return [
        f"flowstate backends: database={db['ENGINE'].rsplit('.', 1)[-1]} ({db.get('HOST') or db.get('NAME')}), "
        f"redis={settings.REDIS_URL}, sandbox={settings.SANDBOX_BACKEND}"
    ]


@pytest.fixture(scope="module")
def policy_checkpoint(tmp_path_factory):
    """A tiny random policy checkpoint, built once per module that asks for it."""
    from training.checkpoint import create_random_checkpoint

    return str(create_random_checkpoint(tmp_path_factory.mktemp("policy"), "tiny", seed=0, max_seq_len=4096))


@pytest.fixture(autouse=True)
def registered_checkpoint(request, settings):
    """A launch may only name a registered checkpoint (docs/SECURITY.md): in a module that builds a
    `policy_checkpoint`, that checkpoint is the configured model, so experiments may start from it."""
    if "policy_checkpoint" in request.fixturenames:
        settings.MODEL_CHECKPOINT = request.getfixturevalue("policy_checkpoint")


@pytest.fixture
def team(db):
    from webapp.accounts.models import Team

    return Team.objects.create(name="ml-infra")


@pytest.fixture
def owner(db, team):
    from webapp.accounts.services import user_create

    user = user_create(username="owner", password="owner-pass-123", team_names=(team.name,))
    return user


@pytest.fixture
def teammate(db, team):
    from webapp.accounts.services import user_create

    return user_create(username="teammate", password="teammate-pass-123", team_names=(team.name,))


@pytest.fixture
def outsider(db):
    from webapp.accounts.services import user_create

    return user_create(username="outsider", password="outsider-pass-123")


@pytest.fixture
def api_client_for():
    """Build a DRF client authenticated with the user's API token."""
    from rest_framework.test import APIClient

    from webapp.accounts.services import api_token_get_or_create

    def build(user):
        client = APIClient()
        if user is not None:
            client.credentials(HTTP_AUTHORIZATION=f"Token {api_token_get_or_create(user=user)}")
        return client

    return build


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on port {port} after {timeout}s")


def _test_database_env() -> dict[str, str]:
    """Environment for a child process so it uses the test database pytest-django created."""
    from django.db import connection

    db = settings.DATABASES["default"]
    env = dict(os.environ)
    if db["ENGINE"].endswith("postgresql"):
        name = connection.settings_dict["NAME"]
        user = db.get("USER") or "postgres"
        password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
        env["DATABASE_URL"] = f"postgres://{user}{password}@{db.get('HOST') or '127.0.0.1'}:{db.get('PORT') or 5432}/{name}"
    else:
        env["DATABASE_URL"] = f"sqlite:///{connection.settings_dict['NAME']}"
    env["REDIS_URL"] = settings.REDIS_URL
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@pytest.fixture
def asgi_server(transactional_db):
    """The real ASGI application (HTTP + websockets) in a uvicorn child process."""
    port = _free_port()
    proc = subprocess.Popen(
        asgi_server_command(host="127.0.0.1", port=port, log_level="warning"),
        cwd=ROOT,
        env=_test_database_env(),
    )
    try:
        _wait_for_port(port, proc)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def celery_worker_process(transactional_db):
    """A real Celery worker child process on the real broker, using the test database."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "webapp", "worker", "--pool", "solo", "--loglevel", "warning", "--without-gossip", "--without-mingle", "-n", f"test-{os.getpid()}@%h",
         "-Q", ",".join(settings.FLOWSTATE_CELERY_QUEUES)],
        cwd=ROOT,
        env=_test_database_env(),
    )
    from webapp.celery import app

    deadline = time.monotonic() + 40
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"celery worker exited early with code {proc.returncode}")
            if app.control.ping(timeout=0.5):
                break
        else:
            raise TimeoutError("celery worker did not answer ping within 40s")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def pytest_configure(config):
    settings.STATE_DIR.mkdir(parents=True, exist_ok=True)
