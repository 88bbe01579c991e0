"""Health probes for /healthz. Each returns a dict with at least ``ok`` and a human ``detail``."""

from __future__ import annotations

import shutil
import socket
import time
from urllib.parse import urlparse

from django.conf import settings
from django.db import connection


def _timed(probe):
    started = time.perf_counter()
    try:
        result = probe()
    except Exception as exc:  # a probe reports any failure instead of raising
        result = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
    result["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


def probe_database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"ok": True, "detail": connection.vendor}


def probe_redis() -> dict:
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    client.ping()
    return {"ok": True, "detail": settings.REDIS_URL.split("@")[-1]}


def probe_celery() -> dict:
    from webapp.celery import app

    replies = app.control.ping(timeout=1.0) or []
    workers = sorted(name for reply in replies for name in reply)
    return {"ok": bool(workers), "detail": f"{len(workers)} worker(s)", "workers": workers}


def ray_address() -> str | None:
    if settings.RAY_ADDRESS:
        return settings.RAY_ADDRESS
    recorded = settings.STATE_DIR / "ray_address"
    return recorded.read_text().strip() if recorded.exists() else None


def probe_ray() -> dict:
    address = ray_address()
    if not address:
        return {"ok": False, "detail": "no Ray instance recorded (make run starts one; or set RAY_ADDRESS)"}
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    with socket.create_connection((parsed.hostname, parsed.port or 6379), timeout=1):
        pass
    return {"ok": True, "detail": address}


def probe_sandbox_backend() -> dict:
    backend = settings.SANDBOX_BACKEND
    if backend == "docker":
        import docker

        client = docker.from_env(timeout=2)
        client.ping()
        has_image = bool(client.images.list(name=settings.SANDBOX_IMAGE))
        return {"ok": has_image, "detail": f"docker; image {settings.SANDBOX_IMAGE} {'present' if has_image else 'missing: run manage.py build_sandbox_image'}"}
    found = shutil.which("unshare")
    return {"ok": bool(found), "detail": "local namespaces" if found else "util-linux 'unshare' not found"}


def health_report() -> dict:
    checks = {
        "database": _timed(probe_database),
        "redis": _timed(probe_redis),
        "celery": _timed(probe_celery),
        "ray": _timed(probe_ray),
        "sandbox_backend": _timed(probe_sandbox_backend),
    }
    return {"ok": all(check["ok"] for check in checks.values()), "checks": checks}
