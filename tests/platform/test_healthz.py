"""/healthz reports every dependency as JSON, including ones that are down (details: staff, see
test_healthz_details)."""

import pytest

pytestmark = pytest.mark.django_db


def test_healthz_reports_each_dependency(admin_client, settings):
    response = admin_client.get("/healthz")
    assert response.status_code == 200  # the database answers
    report = response.json()
    assert set(report["checks"]) == {"database", "redis", "celery", "ray", "sandbox_backend"}
    assert report["checks"]["database"]["ok"] is True
    assert report["checks"]["redis"]["ok"] is True  # the real Redis the suite runs against
    for check in report["checks"].values():
        assert isinstance(check["detail"], str) and check["latency_ms"] >= 0


def test_healthz_says_what_is_down(admin_client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    settings.RAY_ADDRESS = "127.0.0.1:1"
    report = admin_client.get("/healthz").json()
    assert report["ok"] is False
    assert report["checks"]["redis"]["ok"] is False and "Error" in report["checks"]["redis"]["detail"]
    assert report["checks"]["ray"]["ok"] is False


@pytest.mark.django_db(transaction=True)
def test_healthz_sees_a_real_worker(client, admin_client, celery_worker_process):
    celery = admin_client.get("/healthz").json()["checks"]["celery"]
    assert celery["ok"] is True and celery["workers"]
    response = client.get("/healthz")  # anonymous: up, but not which workers
    assert response.json()["checks"]["celery"] == {"ok": True}
    assert all(name not in response.content.decode() for name in celery["workers"])


@pytest.mark.docker
def test_healthz_reports_a_docker_runtime_that_is_configured_but_missing(admin_client, settings):
    import docker

    client = admin_client

    try:
        docker.from_env(timeout=5).ping()
    except Exception as exc:  # noqa: BLE001 - no engine: nothing to report on
        pytest.skip(f"no reachable Docker engine ({type(exc).__name__})")
    settings.SANDBOX_BACKEND = "docker"
    settings.SANDBOX_DOCKER_RUNTIME = "runc"
    check = client.get("/healthz").json()["checks"]["sandbox_backend"]
    assert check["runtime"] == "runc" and "docker (runc)" in check["detail"]
    assert "no OCI runtime" not in check["detail"]
    settings.SANDBOX_DOCKER_RUNTIME = "flowstate-no-such-runtime"
    check = client.get("/healthz").json()["checks"]["sandbox_backend"]
    assert check["ok"] is False
    assert "no OCI runtime 'flowstate-no-such-runtime'" in check["detail"] and "registered: " in check["detail"]
    # A tier tasks may choose (SANDBOX_RUNTIMES_ALLOWED) that the engine lacks fails the check too.
    settings.SANDBOX_DOCKER_RUNTIME = "runc"
    settings.SANDBOX_RUNTIMES_ALLOWED = ["runc", "flowstate-no-such-tier"]
    check = client.get("/healthz").json()["checks"]["sandbox_backend"]
    assert check["ok"] is False and check["runtimes"] == ["runc", "flowstate-no-such-tier"]
    assert "no OCI runtime 'flowstate-no-such-tier'" in check["detail"]
