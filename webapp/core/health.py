"""Health probes for /healthz. Each returns a dict with at least ``ok`` and a human ``detail``.

The probes run at once, each in its own daemon thread, and the report waits at most
``HEALTHZ_PROBE_TIMEOUT_S`` for them: a dependency that stalls (a stopped Redis, a database holding a
lock) is reported as not answering instead of hanging the request. Each probe also sets its own
socket timeouts, so its thread ends soon after; while one is still waiting, later requests report it
without starting another (a stalled dependency never piles up threads).

Details (addresses, socket paths, worker names, error texts) are for operators: ``public_report`` is
what anyone else sees, each component's ok/down only.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

from django.conf import settings
from django.db import connections

from sandboxes.docker_runtime import runtime_missing

_in_flight: dict[str, tuple[threading.Thread, float]] = {}
_in_flight_lock = threading.Lock()


def _timed(probe: Callable[[], dict]) -> dict:
    started = time.perf_counter()
    try:
        result = probe()
    except Exception as exc:  # noqa: BLE001 - a health probe reports any failure instead of raising
        result = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
    result["latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


def probe_database() -> dict:
    # Runs in its own thread, so on its own connection: closed here, never left to the request's.
    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM django_migrations LIMIT 1")  # a table: a lock on it stalls this too
            cursor.fetchone()
        return {"ok": True, "detail": connection.vendor}
    finally:
        connection.close()


def probe_redis() -> dict:
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    client.ping()
    return {"ok": True, "detail": settings.REDIS_URL.split("@")[-1]}


def probe_celery() -> dict:
    from webapp.celery import app

    options = {"socket_timeout": 1, "socket_connect_timeout": 1, "max_retries": 0}
    with app.connection_for_write(settings.CELERY_BROKER_URL, connect_timeout=1, transport_options=options) as conn:
        replies = app.control.ping(timeout=1.0, connection=conn) or []
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
        runtime = settings.SANDBOX_DOCKER_RUNTIME
        # The default runtime and every tier a task may choose must be registered with the engine.
        runtimes = list(dict.fromkeys([runtime, *settings.SANDBOX_RUNTIMES_ALLOWED]))
        missing = "; ".join(problem for name in runtimes if (problem := runtime_missing(client, name)))
        image = f"image {settings.SANDBOX_IMAGE} {'present' if has_image else 'missing: run manage.py build_sandbox_image'}"
        return {"ok": has_image and not missing, "runtime": runtime, "runtimes": runtimes,
                "detail": f"docker ({', '.join(runtimes)}); {image}" + (f"; {missing}" if missing else "")}
    found = shutil.which("unshare")
    return {"ok": bool(found), "detail": "local namespaces" if found else "util-linux 'unshare' not found"}


PROBES: dict[str, Callable[[], dict]] = {
    "database": probe_database,
    "redis": probe_redis,
    "celery": probe_celery,
    "ray": probe_ray,
    "sandbox_backend": probe_sandbox_backend,
}


def _start(name: str, probe: Callable[[], dict], box: dict) -> threading.Thread | dict:
    """`probe` started in a daemon thread filling `box`; a report instead when the last one still waits."""
    with _in_flight_lock:
        previous = _in_flight.get(name)
        if previous is not None and previous[0].is_alive():
            waited = time.monotonic() - previous[1]
            return {"ok": False, "detail": f"no answer: the previous probe has been waiting {waited:.1f} s",
                    "latency_ms": round(waited * 1000, 1)}
        thread = threading.Thread(target=lambda: box.update(_timed(probe)), name=f"healthz-{name}", daemon=True)
        _in_flight[name] = (thread, time.monotonic())
        thread.start()
    return thread


def health_report(*, timeout_s: float | None = None) -> dict:
    """Every dependency's state within `timeout_s` (HEALTHZ_PROBE_TIMEOUT_S), stalled ones named."""
    timeout_s = settings.HEALTHZ_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    boxes: dict[str, dict] = {name: {} for name in PROBES}
    started = {name: _start(name, probe, boxes[name]) for name, probe in PROBES.items()}
    deadline = time.monotonic() + timeout_s
    checks: dict[str, dict] = {}
    for name, thread in started.items():
        if isinstance(thread, dict):
            checks[name] = thread
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        checks[name] = dict(boxes[name]) if not thread.is_alive() else {
            "ok": False, "detail": f"no answer within {timeout_s:g} s (stalled)",
            "latency_ms": round(timeout_s * 1000, 1)}
    down = sorted(name for name, check in checks.items() if not check["ok"])
    return {"ok": not down, "down": down, "checks": checks}


def public_report(report: dict) -> dict:
    """``report`` without details: overall ok, the names of the components down, and each one's ok."""
    return {"ok": report["ok"], "down": list(report["down"]),
            "checks": {name: {"ok": bool(check["ok"])} for name, check in report["checks"].items()}}
