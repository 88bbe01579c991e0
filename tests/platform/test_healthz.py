"""/healthz reports every dependency as JSON, including ones that are down."""

import pytest

pytestmark = pytest.mark.django_db


def test_healthz_reports_each_dependency(client, settings):
    response = client.get("/healthz")
    assert response.status_code == 200  # the database answers
    report = response.json()
    assert set(report["checks"]) == {"database", "redis", "celery", "ray", "sandbox_backend"}
    assert report["checks"]["database"]["ok"] is True
    assert report["checks"]["redis"]["ok"] is True  # the real Redis the suite runs against
    for check in report["checks"].values():
        assert isinstance(check["detail"], str) and check["latency_ms"] >= 0


def test_healthz_says_what_is_down(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    settings.RAY_ADDRESS = "127.0.0.1:1"
    report = client.get("/healthz").json()
    assert report["ok"] is False
    assert report["checks"]["redis"]["ok"] is False and "Error" in report["checks"]["redis"]["detail"]
    assert report["checks"]["ray"]["ok"] is False


@pytest.mark.django_db(transaction=True)
def test_healthz_sees_a_real_worker(client, celery_worker_process):
    celery = client.get("/healthz").json()["checks"]["celery"]
    assert celery["ok"] is True and celery["workers"]
