"""/healthz tells anyone whether each component is up, and only operators what it is and where.

An anonymous caller probing for the deployment's layout (the Redis socket path, the Ray address, error
texts naming files or hosts, worker names) gets ok/down per component; staff and a scraper holding the
METRICS_TOKEN bearer (the /metrics rule) get the details.
"""

from __future__ import annotations

import socket

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

SOCKET_PATH = "/tmp/flowstate-private-layout/redis.sock"


@pytest.fixture
def revealing_setup(settings):
    """A deployment whose details are worth hiding: a Redis socket path (down) and a Ray address (up)."""
    settings.REDIS_URL = f"unix://{SOCKET_PATH}"
    settings.METRICS_TOKEN = "scrape-token-123"
    with socket.socket() as ray:
        ray.bind(("127.0.0.1", 0))
        ray.listen()
        settings.RAY_ADDRESS = f"127.0.0.1:{ray.getsockname()[1]}"
        yield settings.RAY_ADDRESS


def _only_ok_and_down(response) -> None:
    report = response.json()
    assert set(report) == {"ok", "down", "checks"}
    assert set(report["checks"]) == {"database", "redis", "celery", "ray", "sandbox_backend"}
    assert all(check == {"ok": check["ok"]} and isinstance(check["ok"], bool) for check in report["checks"].values())
    assert report["checks"]["redis"] == {"ok": False} and "redis" in report["down"]
    assert report["checks"]["ray"] == {"ok": True}


def test_anonymous_callers_get_ok_or_down_only(client, revealing_setup):
    response = client.get("/healthz")
    assert response.status_code == 200
    _only_ok_and_down(response)
    body = response.content.decode()
    assert SOCKET_PATH not in body and revealing_setup not in body and "Error" not in body


def test_signed_in_users_and_wrong_tokens_get_no_details(client, owner, revealing_setup):
    page = Client()
    page.force_login(owner)
    responses = [client.get("/healthz", HTTP_AUTHORIZATION="Bearer wrong-token"),
                 client.get("/healthz", HTTP_AUTHORIZATION="Token scrape-token-123"), page.get("/healthz")]
    for response in responses:
        _only_ok_and_down(response)
        body = response.content.decode()
        assert SOCKET_PATH not in body and revealing_setup not in body


def test_staff_and_the_metrics_token_see_the_details(client, admin_client, revealing_setup):
    for response in (admin_client.get("/healthz"),
                     client.get("/healthz", HTTP_AUTHORIZATION="Bearer scrape-token-123")):
        report = response.json()
        assert SOCKET_PATH in report["checks"]["redis"]["detail"]
        assert report["checks"]["ray"]["detail"] == revealing_setup
        assert report["checks"]["database"]["latency_ms"] >= 0
